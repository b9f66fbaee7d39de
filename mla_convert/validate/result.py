"""What the ladder records: checks, rungs, the whole result, and its one input error. Light (no torch)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from mla_convert.errors import UserError
from mla_convert.validate.spec import RungSpec


class ValidationError(UserError):
    """The ladder cannot run on this input (options the checkpoint's text cannot satisfy, a corrupt record); one line."""


@dataclass
class Check:
    """One measured quantity against its tolerance (``passed`` is None for a figure recorded for information)."""

    name: str
    value: float | str
    tolerance: str = ""
    passed: bool | None = None


@dataclass
class Rung:
    """One rung of the ladder: its checks, the data it ran on, and wall time (seconds); ``cells``: the rows of
    a rung that measures a grid (rung 6's kernel matrix: one dict per cell), empty otherwise."""

    number: int
    name: str
    data: str
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None
    cells: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, spec: RungSpec, data: str) -> Rung:
        """An empty rung for the documented ``spec`` that ran on ``data``."""
        return cls(spec.number, spec.name, data)

    @property
    def passed(self) -> bool:
        return self.skipped is None and all(c.passed is not False for c in self.checks)

    def check(self, name: str, value: float, tol: float, kind: str = "<=") -> None:
        """Add a check ``value <= tol`` (``kind="=="`` for exact equality); a NaN or infinite value fails."""
        ok = value == tol if kind == "==" else (math.isfinite(value) and value <= tol)
        self.checks.append(Check(name, float(value), f"{kind} {tol:g}", ok))

    def record(self, name: str, value: float | str) -> None:
        """Add a figure for information (no tolerance, cannot fail)."""
        self.checks.append(Check(name, value))


@dataclass
class ValidationResult:
    """All rungs plus provenance; ``passed`` is True when no rung failed (skipped rungs do not fail).

    ``dtype``: the dtype the checkpoint's weights are stored in (``checkpoint``), how they were loaded, and
    the tolerance set of the checks run in that dtype (``tolerance_set``, ``tolerances``); see
    :func:`~mla_convert.validate.ladder.dtype_record`. Empty for a result built without it.
    """

    checkpoint: str
    rungs: list[Rung]
    settings: dict[str, Any]
    environment: dict[str, Any]
    dtype: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.passed or r.skipped for r in self.rungs)

    @property
    def partial(self) -> str | None:
        """What the ladder could not measure (e.g. no source), or None."""
        missing = [
            f"rung {r.number}: {c.value}"
            for r in self.rungs
            for c in r.checks
            if isinstance(c.value, str) and c.value.startswith("not measured")
        ]
        return "; ".join(missing) or None

    @property
    def failed(self) -> list[Rung]:
        return [r for r in self.rungs if not r.passed and not r.skipped]

    def as_dict(self) -> dict[str, Any]:
        """``validation.json`` (docs/formats.md)."""
        return {
            "checkpoint": self.checkpoint,
            "passed": self.passed,
            "not_measured": self.partial,
            "failed_rungs": [f"{r.number}:{r.name}" for r in self.failed],
            "settings": self.settings,
            "dtype": self.dtype,
            "environment": self.environment,
            "rungs": [dict(asdict(r), passed=r.passed) for r in self.rungs],
        }


def format_value(value: float | str) -> str:
    """Integers as integers, other floats to 4 significant digits, text as is."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    return str(value)
