"""The CI gate (``tests/ci_gate.py``) on a throwaway suite run by pytester: under ``CI`` a required test that skips,
or a required pattern with no passing test in a full-suite run, fails the run; a targeted run checks only the tests
it selected; without ``CI`` nothing fails; skips are printed by reason either way."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = f"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, {str(Path(__file__).parent)!r})
from ci_gate import CIGate, ci_is_set

REQUIRED = ("suite/test_engine.py", "suite/test_more.py::test_required")


@pytest.fixture
def engine_python():
    import os

    if os.environ.get("ENGINE") != "1":
        pytest.skip("no engine venv")
    return "python"


def pytest_configure(config):
    config.pluginmanager.register(CIGate(REQUIRED, ["engine_python"], Path(__file__).parent, ci_is_set()))
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """``suite/``: an engine file (required by pattern), a test required by node id, one required only by its engine
    fixture, and a plain test that skips."""
    for var in ("CI", "ENGINE", "PYTEST_XDIST_WORKER"):
        monkeypatch.delenv(var, raising=False)
    pytester.makeini("[pytest]\n")  # the rootdir: node ids start with suite/
    pytester.makepyfile(
        **{
            "suite/conftest": CONFTEST,
            "suite/test_engine": "def test_engine(engine_python):\n    assert engine_python\n",
            "suite/test_more": (
                "import pytest\n\n"
                "def test_required():\n    pass\n\n"
                "def test_other_engine(engine_python):\n    pass\n\n"
                "def test_plain():\n    pytest.skip('not here')\n"
            ),
        }
    )
    return pytester


def _run(suite: pytest.Pytester, *args: str) -> pytest.RunResult:
    return suite.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", *args)


def test_without_ci_skips_are_listed_by_reason(suite):
    res = _run(suite, "suite")
    assert res.ret == pytest.ExitCode.OK
    res.stdout.fnmatch_lines(
        ["*skips by reason (3)*", "2 x no engine venv", "*suite/test_engine.py::test_engine", "1 x not here"]
    )
    res.stdout.no_fnmatch_line("*required under CI*")


@pytest.mark.parametrize("ci", ["true", "1", "yes"])
def test_under_ci_an_engine_skip_fails_the_full_suite(suite, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    res = _run(suite, "suite")
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(
        [
            "*CI: required tests did not run*",
            "FAILED (required under CI) suite/test_engine.py::test_engine skipped: no engine venv",
            "FAILED (required under CI) suite/test_more.py::test_other_engine skipped: no engine venv",
            "FAILED (required under CI) suite/test_engine.py: no test of it passed*",
        ]
    )
    res.stdout.no_fnmatch_line("*test_plain skipped*")  # a skip of a test not required is only listed


@pytest.mark.parametrize("ci", ["", "0", "false"])
def test_ci_unset_or_false_checks_nothing(suite, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    assert _run(suite, "suite").ret == pytest.ExitCode.OK


def test_under_ci_every_engine_test_runs(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("ENGINE", "1")
    res = _run(suite, "suite")
    assert res.ret == pytest.ExitCode.OK, res.stdout.str()
    res.stdout.fnmatch_lines(["1 x not here"])


def test_under_ci_a_deselected_required_test_fails_the_full_suite(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("ENGINE", "1")
    res = _run(suite, "suite", "-k", "not test_required")
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(
        ["FAILED (required under CI) suite/test_more.py::test_required: no test of it passed*"]
    )
    res = _run(suite, "suite", "-k", "test_plain")  # nothing required selected at all
    assert res.ret == pytest.ExitCode.TESTS_FAILED


def test_under_ci_a_targeted_run_checks_only_what_it_selected(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert _run(suite, "suite/test_more.py::test_required").ret == pytest.ExitCode.OK
    assert _run(suite, "suite/test_more.py", "-k", "plain").ret == pytest.ExitCode.OK
    res = _run(suite, "suite/test_more.py")  # selects test_other_engine, which skips
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["FAILED (required under CI) suite/test_more.py::test_other_engine skipped*"])


def test_under_ci_collect_only_checks_nothing(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert _run(suite, "suite", "--collect-only").ret == pytest.ExitCode.OK
