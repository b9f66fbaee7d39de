"""Fixtures of the engine tests in this folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def engine_python(engine: str, var: str, script: str) -> str:
    """The python of an engine's venv named by ``MLA_<var>_PYTHON`` (built by ``script``); skips without one, fails
    under ``MLA_REQUIRE_<var>=1`` (CI)."""
    python = os.environ.get(f"MLA_{var}_PYTHON", "")
    if not python or not Path(python).is_file():
        if os.environ.get(f"MLA_REQUIRE_{var}") == "1":
            pytest.fail(f"MLA_REQUIRE_{var}=1 but MLA_{var}_PYTHON names no python: run bash {script}")
        pytest.skip(f"no {engine} venv (MLA_{var}_PYTHON): bash {script} builds one")
    return python


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The python of the vLLM CPU venv (``scripts/vllm_env.sh``)."""
    return engine_python("vLLM", "VLLM", "scripts/vllm_env.sh")


@pytest.fixture(scope="module")
def llamacpp_python() -> str:
    """The python of the llama.cpp venv (``scripts/llamacpp_env.sh``)."""
    return engine_python("llama.cpp", "LLAMACPP", "scripts/llamacpp_env.sh")
