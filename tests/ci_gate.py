"""Under CI, tests that must run: a pytest plugin (registered by ``tests/conftest.py`` with its
:data:`~conftest.REQUIRED_UNDER_CI`) that prints the run's skips grouped by reason and, where ``CI`` is set, fails
the run when a required test skipped or did not run.

Two rules, both only where ``CI`` is set (:func:`ci_is_set`):

* **No required test skips.** A selected test that matches a required pattern, or that uses an engine fixture
  (``vllm_python``, ...: a new engine test is required without being listed), fails the run if it skipped, whatever
  the reason (a missing engine venv, an environment variable, a ``skipif``).
* **Every required pattern passed a test** in a full-suite run (the suite's folder, or a folder above it, among the
  arguments: what ``scripts/test.sh`` and CI run). A pattern whose tests were deselected, not collected or whose file
  was renamed fails the run. A targeted run (``pytest tests/foo.py``) checks only the rule above, so a local run of
  a few files under ``CI=true`` does not fail for the tests it did not select.

The exit status becomes :attr:`pytest.ExitCode.TESTS_FAILED` and the terminal summary names every test at fault.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

#: ``item.user_properties`` key that marks a selected test as required (travels with pytest-xdist's reports).
REQUIRED_KEY = "required_under_ci"


def ci_is_set(env: Mapping[str, str] = os.environ) -> bool:
    """``CI`` names a CI run (any value but empty, ``0``, ``false``, ``no``, ``off``)."""
    return env.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def matches(nodeid: str, pattern: str) -> bool:
    """``pattern`` (a test file, or a node id in it) selects ``nodeid`` (its parametrizations included)."""
    return nodeid == pattern or nodeid.startswith((pattern + "::", pattern + "["))


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped report gives (``pytest.skip``'s message, or the ``skipif`` reason)."""
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr)


class CIGate:
    """The plugin. ``required``: node-id patterns relative to the rootdir; ``engine_fixtures``: fixtures that make a
    test required; ``suite``: the suite's folder (a run of it, or of a folder above it, is a full-suite run)."""

    def __init__(self, required: Iterable[str], engine_fixtures: Iterable[str], suite: Path, enabled: bool):
        self.required = tuple(required)
        self.engine_fixtures = frozenset(engine_fixtures)
        self.suite = suite.resolve()
        self.enabled = enabled
        self.skipped: dict[str, pytest.TestReport] = {}
        self.passed: set[str] = set()
        self.required_ids: set[str] = set()
        self.faults: list[str] = []

    def full_suite(self, config: pytest.Config) -> bool:
        """The run's arguments name the suite's folder or a folder above it."""
        base = config.invocation_params.dir
        for arg in config.args:
            path = (base / arg.split("::", 1)[0]).resolve()
            if path == self.suite or path in self.suite.parents:
                return True
        return False

    def is_required(self, item: pytest.Item) -> bool:
        return any(matches(item.nodeid, p) for p in self.required) or bool(
            self.engine_fixtures.intersection(getattr(item, "fixturenames", ()))
        )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:  # the selected tests (after -k, -m, --deselect)
            if self.is_required(item):
                item.user_properties.append((REQUIRED_KEY, True))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        marked = any(tuple(p) == (REQUIRED_KEY, True) for p in report.user_properties)  # xdist: lists
        if marked or any(matches(report.nodeid, p) for p in self.required):
            self.required_ids.add(report.nodeid)
        if report.skipped:
            self.skipped.setdefault(report.nodeid, report)
        elif report.when == "call" and report.passed:
            self.passed.add(report.nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = session.config
        if not self.enabled or hasattr(config, "workerinput") or config.option.collectonly:
            return  # (pytest-xdist's controller decides; --collect-only runs nothing)
        for nodeid in sorted(self.required_ids & set(self.skipped)):
            self.faults.append(f"{nodeid} skipped: {skip_reason(self.skipped[nodeid])}")
        if self.full_suite(config):
            for pattern in self.required:
                if not any(matches(n, pattern) for n in self.passed):
                    self.faults.append(
                        f"{pattern}: no test of it passed (not collected, deselected or renamed)"
                    )
        if self.faults and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.skipped:
            by_reason: dict[str, list[str]] = defaultdict(list)
            for nodeid, report in self.skipped.items():
                by_reason[skip_reason(report)].append(nodeid)
            terminalreporter.section(f"skips by reason ({len(self.skipped)})")
            for reason, ids in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
                terminalreporter.write_line(f"{len(ids)} x {reason}")
                for nodeid in sorted(ids):
                    terminalreporter.write_line(f"    {nodeid}")
        if self.faults:
            terminalreporter.section("CI: required tests did not run", red=True, bold=True)
            terminalreporter.write_line(
                "CI is set: every engine test and every pattern of REQUIRED_UNDER_CI (tests/conftest.py) must run "
                "and pass; skip variables (MLA_SKIP_*) are refused under CI"
            )
            for fault in self.faults:
                terminalreporter.write_line(f"FAILED (required under CI) {fault}", red=True)
