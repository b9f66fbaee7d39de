"""``manifest verify``: check a conversion manifest against the files it covers."""

from __future__ import annotations

from pathlib import Path

import typer

from mla_convert.cli.render import (
    console,
    fail,
    user_errors,
)


def manifest_verify(
    out: Path = typer.Argument(..., help="An mla-convert output folder."),
    strict: bool = typer.Option(False, help="Also fail when OUT holds files the manifest does not cover."),
) -> None:
    """Check the manifest's schema, re-hash the files it and its addenda (validate's files) list, recompute
    the canonical id, and name the files neither covers.

    Exit code 2 (one error: line) when anything differs (a changed or missing file, a wrong canonical id or
    addenda chain; with --strict also files the manifest does not cover) or OUT holds no valid manifest.

    Example: mla-convert manifest verify out/smollm2-mla --strict
    """
    from mla_convert.artifacts.manifest import verify

    with user_errors():
        res = verify(out)
    console.print(f"ok: {res['files']} files match; canonical id {res['canonical_id']}", highlight=False)
    if res["addenda"]:
        added = ", ".join(f"{a['stage']} ({a['files']} files, {a['time']})" for a in res["addenda"])
        console.print(f"addenda (chained to the manifest): {added}", highlight=False)
    if res["uncovered"]:
        console.print(
            f"not covered by the manifest (not verified): {', '.join(res['uncovered'])}", highlight=False
        )
        if strict:
            fail(f"{len(res['uncovered'])} file(s) in {out} not covered by the manifest (--strict)")
