"""The CLI starts thin: `--help` and option errors import neither torch nor transformers (speed and memory are
measured by benchmarks/cli_startup.py; this checks the structure that makes them small)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "triton", "safetensors", "accelerate", "datasets")


def imported_modules(*args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """Top-level modules a fresh ``python -m mla_convert ARGS`` imports (``-X importtime``)."""
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mla_convert", *args], capture_output=True, text=True
    )
    names = set()
    for line in res.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names, res


@pytest.mark.parametrize(
    "args", [("--help",), ("factor", "--help"), ("adapt", "--help"), ("validate", "--help")]
)
def test_help_imports_nothing_heavy(args: tuple[str, ...]) -> None:
    names, res = imported_modules(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Usage" in res.stdout
    assert not names & set(HEAVY), sorted(names & set(HEAVY))


def test_bad_option_fails_before_any_heavy_import() -> None:
    names, res = imported_modules("factor", "smollm2-135m", "out/never", "--rope-mode", "bogus")
    assert res.returncode == 2
    assert "--rope-mode: 'bogus' is not one of per-head, shared" in res.stderr
    assert not names & set(HEAVY), sorted(names & set(HEAVY))
