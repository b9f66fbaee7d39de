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
    names, res = imported_modules("factor", "smollm2-135m", "out/never", "--rope-strategy", "bogus")
    assert res.returncode == 2
    assert "--rope-strategy: 'bogus' is not one of high, 2-norm, rotation" in res.stderr
    assert not names & set(HEAVY), sorted(names & set(HEAVY))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("factor", "/nonexistent/model", "out/never"), "source '/nonexistent/model' not found"),
        (("factor", "smollm2-135m", "out/never", "--calib-tokens", "0"), "--calib-tokens 0 is too small"),
        (("factor", "smollm2-135m", "out/never", "--rope-pairs", "-1"), "--rope-pairs -1 is too small"),
        (("factor", "smollm2-135m", "out/never", "--max-shard-size", "2GiB"), "--max-shard-size '2GiB' is not a size"),
        (("factor", "smollm2-135m", "out/never", "--device", "gpu"), "--device 'gpu' is not one of"),
        (("factor", "smollm2-135m", "out/never", "--dtype", "fp8"), "fp8"),
        (("validate", "/nonexistent/ckpt"), "/nonexistent/ckpt does not exist"),
        (("generate", "/nonexistent/ckpt", "hi"), "/nonexistent/ckpt does not exist"),
        (("eval", "/nonexistent/ckpt"), "/nonexistent/ckpt does not exist"),
        (("adapt", "/nonexistent/ckpt", "out/never"), "/nonexistent/ckpt does not exist"),
        (("manifest", "verify", "/nonexistent/out"), "not found"),
        (("factor", "smollm2-135m", "out/never", "--rope-pair", "4"), "No such option: --rope-pair"),
        (("factor", "smollm2-135m"), "Missing argument 'out'"),
        (("bogus",), "No such command 'bogus'"),
    ],
)
def test_bad_input_is_one_line_before_any_heavy_import(args: tuple[str, ...], needle: str) -> None:
    names, res = imported_modules(*args)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if not line.startswith("import time:")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not names & set(HEAVY), sorted(names & set(HEAVY))
