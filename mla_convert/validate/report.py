"""``validation.json`` and ``validation.md``: the ladder's record, written into the checkpoint and its
manifest's addenda (docs/formats.md)."""

from __future__ import annotations

import json
from pathlib import Path

from mla_convert.validate.result import ValidationResult, format_value
from mla_convert.validate.spec import spec_of, tol, tolerance_table


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
        "Relative error = max|a - b| / max|b| over all compared entries.",
        "",
        *dtype_lines(res),
        "",
    ]
    half = res.dtype.get("checkpoint", "float32") != "float32"
    for r in res.rungs:
        verdict = f"skipped ({r.skipped})" if r.skipped else ("pass" if r.passed else "FAIL")
        lines += [f"## {r.number}. {r.name}: {verdict}", ""]
        spec = spec_of(r.number)
        if spec is not None and spec.name == r.name:
            lines += [f"Compares: {spec.compares}.", f"Tolerances: {spec.tolerances}."]
            if half and spec.in_dtype:
                lines.append(f"In {res.dtype['checkpoint']}: {spec.in_dtype}.")
            lines.append("")
        lines += [f"Data: {r.data}; {r.seconds:.1f} s.", ""]
        if r.checks:
            lines += ["| check | value | tolerance | result |", "|---|---|---|---|"]
            for c in r.checks:
                verdict = "" if c.passed is None else ("pass" if c.passed else "FAIL")
                row = (c.name, format_value(c.value), c.tolerance, verdict)
                lines.append("| " + " | ".join(table_cell(x) for x in row) + " |")
            lines.append("")
        if r.cells:
            from mla_convert.validate.matrix import MATRIX_HEADER, matrix_rows

            lines += ["| " + " | ".join(MATRIX_HEADER) + " |", "|" + "---|" * len(MATRIX_HEADER)]
            lines += ["| " + " | ".join(table_cell(x) for x in row) + " |" for row in matrix_rows(r.cells)]
            lines.append("")
    return "\n".join(lines)


def dtype_lines(res: ValidationResult) -> list[str]:
    """``validation.md``'s dtype paragraph: the dtype the checkpoint holds and the tolerance set that applied
    (with the table of every set when it is not float32)."""
    d = res.dtype
    dtype = d.get("checkpoint", "float32")
    if dtype == "float32":
        return ["Checkpoint dtype: float32. Every check computes in float32; tolerance set: float32."]
    t = d.get("tolerances", {})
    return [
        f"Checkpoint dtype: {dtype}. Loaded as {d.get('loaded_as', 'float32')}: the checks without a dtype in "
        "their name compute in float32 and use the float32 tolerances; the checks named "
        f"`{dtype}: ...` compute in {dtype} and use the {d.get('tolerance_set', dtype)} tolerance set "
        f"(kernel rel. {tol(t.get('kernel', 0.0))}, kernel lse abs. {tol(t.get('kernel_lse', 0.0))} nats, "
        f"decode step logits rel. {tol(t.get('logits', 0.0))}, cache rows rel. {tol(t.get('rows', 0.0))}).",
        "",
        tolerance_table(),
    ]


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
