"""The sandboxed executor on all 164 HumanEval problems: every canonical solution passes, a wrong body fails, and a
program cannot reach the network, outlive its timeout, or leave files behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from mla_convert.sources.humaneval import HUMAN_EVAL_PROBLEMS, humaneval_problems
from mla_convert.tasks.execute import run_program, run_programs


@pytest.fixture(scope="module")
def problems():
    return humaneval_problems()


def test_the_pinned_data_has_the_164_problems(problems):
    assert len(problems) == HUMAN_EVAL_PROBLEMS
    assert [p.task_id for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert problems[0].entry_point == "has_close_elements"


def test_every_canonical_solution_passes_and_a_wrong_body_fails(problems):
    right = run_programs([p.program(p.canonical_solution) for p in problems])
    assert [p.task_id for p, o in zip(problems, right, strict=True) if not o.passed] == []
    wrong = run_programs([p.program("    return None\n") for p in problems])
    assert [p.task_id for p, o in zip(problems, wrong, strict=True) if o.passed] == []
    assert all(o.status == "failed" and o.detail for o in wrong)  # an AssertionError or a TypeError, named


def test_the_network_is_off():
    out = run_program("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=5)\n")
    assert out.status == "failed" and "network is disabled" in out.detail
    out = run_program("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=5)\n")
    assert out.status == "failed" and "network is disabled" in out.detail


def test_a_program_that_never_ends_is_killed():
    out = run_program(
        "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])\nwhile True: pass\n",
        timeout_s=1.5,
    )
    assert out.status == "timeout" and out.seconds < 10


def test_a_program_runs_in_a_throwaway_folder(tmp_path):
    out = run_program(
        f"import os\nopen('left.txt', 'w').write('x')\nassert os.getcwd() != {str(Path.cwd())!r}\n"
    )
    assert out.passed
    assert not Path("left.txt").exists()


def test_a_program_cannot_take_all_memory():
    out = run_program("x = bytearray(16 * 1024**3)\n")
    assert out.status == "failed" and "MemoryError" in out.detail
