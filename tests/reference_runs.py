"""The README's reference conversion (``tests/convert/test_reference.py`` pins it) and how to make one.

A plain module, not a conftest: test modules import it by name (``conftest`` is ambiguous, one per folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def run_reference(out: Path) -> dict:
    """``mla-convert factor smollm2-135m OUT --device cpu`` (default options) through the CLI, on up to 2 torch
    threads whatever the test process uses (as pinned: float sums may split by thread); returns its manifest."""
    from typer.testing import CliRunner

    from mla_convert.cli.commands import app

    cmd = ["--quiet", "factor", "smollm2-135m", str(out), "--device", "cpu"]  # cpu: GPU hosts too
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    try:
        res = CliRunner().invoke(app, cmd)
    finally:
        torch.set_num_threads(before)
    assert res.exit_code == 0, res.output + str(res.exception)
    return json.loads((out / "mla_manifest.json").read_text())
