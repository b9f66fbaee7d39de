"""Fixtures shared by the conversion tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import copy_tokenizer, write_tiny_llama


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama of 3 layers with SmolLM2's tokenizer (one per test module)."""
    folder = tmp_path_factory.mktemp("tiny") / "src"
    write_tiny_llama(folder, num_hidden_layers=3)
    copy_tokenizer(folder)
    return folder
