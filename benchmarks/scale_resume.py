"""A :mod:`scale` row too long for one sitting, measured in segments that resume one another (issue 51, item 4).

At the defaults (16,384 calibration tokens and the search) ``mla-convert factor`` on all 32 of Llama-3.1-8B's layers
takes about 5 h on the 2-core reference CPU (docs/results.md: 193 s a layer outside the search, 70-150 s a layer per
search candidate), longer than a working session. This runs it as ``mla-convert factor SOURCE OUT --resume FLAGS``
in a fixed folder, ``$MLA_SCALE_CACHE/runs/NAME/``, so a stopped run (killed, the machine taken back) goes on from
its last finished layer (of pass 1, of the search's round under way, of pass 2 or 3) when the same command is given
again.

Each segment is measured as :func:`scale.run_measured` measures a run. Its record (start, wall seconds, the largest
anonymous and file-mapped memory sampled) is rewritten in ``segments.json`` every 30 s, so a killed segment still
counts. When the conversion finishes, its row goes into ``benchmarks/results/scale.json`` under NAME (replacing the
row there) with ``wall_s`` the sum of the segments' and ``segments`` their records: a resumed segment redoes the
layer its predecessor had not finished, so the sum is what the conversion cost, not a run without stops, and the
table says how many segments it took. OUT is then deleted (the source stays cached).

    .venv/bin/python benchmarks/scale_resume.py llama8b            # start, or go on where it stopped
    .venv/bin/python benchmarks/scale_resume.py llama8b --readme   # and, once finished, the table in docs/results.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from scale import (
    MODELS,
    RESULTS,
    Measured,
    collect_block,
    load_results,
    mla_convert_cmd,
    result_row,
    run_measured,
    source_of,
    table,
)
from scale_sources import cache_root

from mla_convert.convert.pipeline.workdir import work_dir


def _write(path: Path, segments: list[dict[str, Any]]) -> None:
    """``segments`` into ``path`` through a temporary name (a kill never leaves half a record)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(segments, indent=2) + "\n")
    os.replace(tmp, path)


def _record(m: Measured, started: str, resumed: bool) -> dict[str, Any]:
    """One segment's record: ``rc`` None while it runs (or where it was killed)."""
    return {
        "started": started,
        "resumed": resumed,
        "rc": None if m.rc == -1 else m.rc,
        "wall_s": m.wall_s,
        "peak_rss_gb": m.peak_rss_gb,
        "peak_anon_gb": m.peak_anon_gb,
        "peak_file_gb": m.peak_file_gb,
    }


def run_segment(name: str) -> dict[str, Any] | None:
    """Run (or resume) model ``name``'s conversion once; its result row when the conversion has finished, else None.

    Raises:
        SystemExit: ``name`` is not a resumable model of :data:`scale.MODELS`.
    """
    if name not in MODELS or not MODELS[name].resumable:
        resumable = [n for n, b in MODELS.items() if b.resumable]
        raise SystemExit(f"error: {name!r} is not a resumable scale row; choose from {', '.join(resumable)}")
    flags = MODELS[name].flags
    folder = cache_root() / "runs" / name
    folder.mkdir(parents=True, exist_ok=True)
    source, marker = source_of(name, folder)
    out, path = folder / "out", folder / "segments.json"
    segments: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    resumed = work_dir(out).exists()
    if not resumed:  # a fresh start: earlier segments belonged to another run
        segments = []
    cmd = [*mla_convert_cmd(), "factor", source, str(out), "--resume" if resumed else "--overwrite", *flags]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    log = folder / f"segment-{len(segments) + 1}.log"
    print(f"{name}: segment {len(segments) + 1}: {' '.join(cmd)}\n{name}: log {log}", flush=True)

    def on_poll(m: Measured) -> None:
        _write(path, [*segments, _record(m, started, resumed)])

    m = run_measured(cmd, log, on_poll=on_poll)
    segments.append(_record(m, started, resumed))
    _write(path, segments)
    if m.rc != 0:
        print(f"{name}: segment {len(segments)} ended with rc {m.rc}; see {log}", flush=True)
        return None
    total = Measured(
        0,
        sum(s["wall_s"] for s in segments),
        max(s["peak_rss_gb"] for s in segments),
        max(s["peak_anon_gb"] for s in segments),
        max(s["peak_file_gb"] for s in segments),
    )
    row = result_row(name, source, marker, out, flags, cmd, total, log)
    row["command"] = f"mla-convert factor $MLA_SCALE_CACHE/{name} OUT {' '.join(flags)} (--resume after each stop)"
    row["segments"] = segments
    shutil.rmtree(out, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="the resumable scale row (scale.MODELS), e.g. llama8b")
    ap.add_argument("--readme", action="store_true", help="once finished, the scale table into docs/results.md")
    args = ap.parse_args()
    row = run_segment(args.name)
    if row is None:
        sys.exit(f"{args.name}: not finished; give the same command to go on from the last finished layer")
    results = load_results()
    results["rows"][args.name] = row
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(table([row])), flush=True)
    if args.readme:
        from blocks import replace_block

        replace_block("scale", collect_block())


if __name__ == "__main__":
    main()
