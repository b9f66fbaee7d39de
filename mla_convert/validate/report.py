"""``validation.json`` and ``validation.md``: the ladder's record, written into the checkpoint and its
manifest's addenda (docs/formats.md)."""

from __future__ import annotations

import json
from pathlib import Path

from mla_convert.validate.result import ValidationResult, format_value
from mla_convert.validate.spec import spec_of


def table_cell(text: str) -> str:
    """``text`` safe inside a markdown table cell (``|`` escaped, e.g. in ``KL(source || converted)``)."""
    return text.replace("|", "\\|")


def validation_markdown(res: ValidationResult) -> str:
    """``validation.md``: per rung, what it compares and its tolerances (from :data:`~.spec.RUNGS`), the data
    it ran on, then one table of checks with value, tolerance and verdict."""
    env = res.environment
    lines = [
        f"# Validation of `{Path(res.checkpoint).name}`: {'PASSED' if res.passed else 'FAILED'}",
        "",
        f"Backend: {env['kernel_backend']} (triton {env['triton']}, torch {env['torch']}); settings: "
        + ", ".join(f"{k}={v}" for k, v in res.settings.items()),
        "Relative error = max|a - b| / max|b| over all compared entries; tolerances are float32 figures.",
        "",
    ]
    for r in res.rungs:
        verdict = f"skipped ({r.skipped})" if r.skipped else ("pass" if r.passed else "FAIL")
        lines += [f"## {r.number}. {r.name}: {verdict}", ""]
        spec = spec_of(r.number)
        if spec is not None and spec.name == r.name:
            lines += [f"Compares: {spec.compares}.", f"Tolerances: {spec.tolerances}.", ""]
        lines += [f"Data: {r.data}; {r.seconds:.1f} s.", ""]
        if r.checks:
            lines += ["| check | value | tolerance | result |", "|---|---|---|---|"]
            for c in r.checks:
                verdict = "" if c.passed is None else ("pass" if c.passed else "FAIL")
                row = (c.name, format_value(c.value), c.tolerance, verdict)
                lines.append("| " + " | ".join(table_cell(x) for x in row) + " |")
            lines.append("")
    return "\n".join(lines)


def write_validation(ckpt: Path, res: ValidationResult) -> None:
    """Write ``validation.json`` and ``validation.md`` into ``ckpt`` (atomically) and record them in the
    manifest's addenda (:func:`mla_convert.artifacts.manifest.write_addendum`), so ``manifest verify``
    covers them.

    Raises:
        ManifestError: the checkpoint's manifest covers a file of that name, or its addenda do not read.
    """
    from mla_convert.artifacts.manifest import write_addendum

    body = {
        "validation.json": json.dumps(res.as_dict(), indent=2) + "\n",
        "validation.md": validation_markdown(res) + "\n",
    }
    write_addendum(ckpt, "validation", body)
