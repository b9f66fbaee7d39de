"""Fixtures of the engine tests in this folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The python of the vLLM CPU venv (``MLA_VLLM_PYTHON``, from ``scripts/vllm_env.sh``); skips without one, fails
    under ``MLA_REQUIRE_VLLM=1`` (CI)."""
    python = os.environ.get("MLA_VLLM_PYTHON", "")
    if not python or not Path(python).is_file():
        if os.environ.get("MLA_REQUIRE_VLLM") == "1":
            pytest.fail(
                "MLA_REQUIRE_VLLM=1 but MLA_VLLM_PYTHON names no python: run bash scripts/vllm_env.sh"
            )
        pytest.skip("no vLLM venv (MLA_VLLM_PYTHON): bash scripts/vllm_env.sh builds one")
    return python
