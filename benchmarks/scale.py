"""Time and memory of ``mla-convert factor`` on real model shapes: Llama-3.1-8B, Qwen2-0.5B, SmolLM2-135M (issue 12).

The 8B and 0.5B sources are random-weight bfloat16 checkpoints of the real shapes, generated once into a
cache folder (``$MLA_SCALE_CACHE``, default ``benchmarks/results/scale-cache/``; see
``benchmarks/scale_sources.py``); ``smollm2`` is the bundled real model. Each conversion runs as its own
process, ``.venv/bin/mla-convert factor SOURCE OUT --overwrite FLAGS``, and is measured from outside: wall
seconds, the child's peak resident memory (``ru_maxrss`` from ``os.wait4``, children of the child included),
bytes written to OUT (all files, and ``*.safetensors``), and OUT/report.json's stage timings
(``run.timings``; mean seconds per layer by stage from ``run.per_layer`` when the report has it).
``ru_maxrss`` also counts file pages a process keeps mapped: ``safe_open`` handles held open while every
tensor is read once put the whole source in it (measured here: 18 GB for the 8B source, 0.25 GB of it
anonymous), so the table also gives the largest anonymous and file-mapped parts, sampled from ``/proc``.

    .venv/bin/python benchmarks/scale.py [--models llama8b,qwen05b,smollm2] [--out-root DIR] [--keep] [--readme]
    .venv/bin/python benchmarks/scale.py --generate-only llama8b      # make (or finish) one cached source
    .venv/bin/python benchmarks/scale.py --collect --readme           # table again from scale.json
    .venv/bin/python benchmarks/scale.py --models tiny --flags 'tiny=--calib-tokens 128 --window 64'

Per-model options are :data:`MODELS` (``--flags NAME=ARGS`` replaces them for one run). Results are merged
by model into ``benchmarks/results/scale.json`` and tabled in ``benchmarks/results/scale.md``; ``--readme``
writes the table between the ``<!-- scale:start -->`` / ``<!-- scale:end -->`` markers (docs/results.md). OUT folders
go to a temporary folder (or ``--out-root``) and are deleted after measuring unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from scale_sources import GB, SHAPES, cache_root, generate_only, read_marker

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "scale.json"
TABLE = ROOT / "benchmarks" / "results" / "scale.md"
BUILTIN = {"smollm2": "smollm2-135m"}


@dataclass(frozen=True)
class Bench:
    """One row: where its source comes from, the ``factor`` options and the targets.

    Attributes:
        flags: ``mla-convert factor`` options after SOURCE OUT.
        targets: ``peak_rss_gb`` and/or ``wall_s`` upper limits the row is checked against.
    """

    flags: tuple[str, ...]
    targets: dict[str, float] = field(default_factory=dict)
    #: longer than one sitting: measured in resumed segments by ``benchmarks/scale_resume.py`` (not by this script)
    resumable: bool = False


MODELS: dict[str, Bench] = {
    # the default options on the whole 8B shape: about 5 h here (issue 51, item 4), so in segments (scale_resume.py)
    "llama8b": Bench(("--dtype", "bfloat16", "--device", "cpu"), {"peak_rss_gb": 5.0, "wall_s": 7200.0}, True),
    # the default options (16,384 calibration tokens, the search) on 2 of the 8B's layers: its per-layer stage costs
    "llama8b-2l": Bench(("--dtype", "bfloat16", "--device", "cpu"), {"peak_rss_gb": 5.0}),
    "qwen05b": Bench(
        ("--calib-tokens", "1024", "--window", "256", "--eval-windows", "2", "--dtype", "bfloat16")
    ),
    "smollm2": Bench(("--dtype", "bfloat16"), {"wall_s": 60.0, "peak_rss_gb": 1.5}),
    "tiny": Bench(("--calib-tokens", "128", "--window", "64", "--eval-windows", "1", "--dtype", "bfloat16")),
}
#: Seconds between the records :func:`run_measured` hands its ``on_poll``.
RECORD_S = 30.0
TARGET_TEXT = {"peak_rss_gb": ("peak", "GB"), "wall_s": ("wall", "s")}


def mla_convert_cmd() -> list[str]:
    """The CLI: ``.venv/bin/mla-convert`` of this checkout, else ``mla-convert`` on PATH."""
    venv = ROOT / ".venv" / "bin" / "mla-convert"
    found = str(venv) if venv.exists() else shutil.which("mla-convert")
    if found is None:
        raise SystemExit("error: mla-convert not found; install the project (pip install -e .) first")
    return [found]


def source_of(name: str, log_dir: Path) -> tuple[str, dict[str, Any] | None]:
    """SOURCE argument for ``name`` and, for generated shapes, the cache folder's marker (made if needed,
    in a child process so its memory is its own)."""
    if name in BUILTIN:
        return BUILTIN[name], None
    folder = cache_root() / name
    marker = read_marker(folder)
    if marker is None:
        print(
            f"{name}: generating the source into {folder} (log {log_dir / f'generate-{name}.log'})",
            flush=True,
        )
        cmd = [sys.executable, str(Path(__file__).resolve()), "--generate-only", name]
        m = run_measured(cmd, log_dir / f"generate-{name}.log")
        marker = read_marker(folder)
        if m.rc != 0 or marker is None:
            raise SystemExit(
                f"error: generating {name} failed (rc {m.rc}); see {log_dir / f'generate-{name}.log'}"
            )
        print(
            f"{name}: generated and checked in {m.wall_s:.0f} s, peak RSS {m.peak_rss_gb:.2f} GB", flush=True
        )
    return str(folder), marker


@dataclass
class Measured:
    """What :func:`run_measured` saw of one child process.

    Attributes:
        peak_rss_gb: ``ru_maxrss`` from ``os.wait4`` (the largest of the child and its descendants), which
            counts file pages a process has mapped (e.g. safetensors handles kept open) as well as its own.
        peak_anon_gb, peak_file_gb: the largest ``RssAnon`` / ``RssFile`` + ``RssShmem`` of the process tree
            (summed over its processes) sampled every ``poll_s`` from ``/proc/PID/status``; 0 where there is
            no ``/proc``.
    """

    rc: int
    wall_s: float
    peak_rss_gb: float
    peak_anon_gb: float = 0.0
    peak_file_gb: float = 0.0


def _tree_rss_kib(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile + RssShmem) in KiB summed over ``pid`` and its descendants (psutil when installed)."""
    pids = [pid]
    try:
        import psutil

        pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - psutil missing or the process just ended
        pass
    anon = file = 0
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        fields = {k: int(v.split()[0]) for k, v in (x.split(":", 1) for x in status) if k.startswith("Rss")}
        anon += fields.get("RssAnon", 0)
        file += fields.get("RssFile", 0) + fields.get("RssShmem", 0)
    return anon, file


def run_measured(
    cmd: list[str], log: Path, poll_s: float = 0.2, on_poll: Callable[[Measured], None] | None = None
) -> Measured:
    """Run ``cmd`` (cwd: the repository) with stdout+stderr to ``log`` and measure it (:class:`Measured`);
    ``on_poll`` is handed the measurement so far (``rc`` -1, ``peak_rss_gb`` 0) at the start and every
    :data:`RECORD_S`, so a run killed from outside leaves a record (:mod:`scale_resume`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    peaks = [0, 0]
    stop = threading.Event()
    kib = 1024 / GB  # ru_maxrss and /proc figures are KiB on Linux
    with log.open("w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

        def poll() -> None:
            told = float("-inf")
            while not stop.is_set():
                anon, file = _tree_rss_kib(proc.pid)
                peaks[0], peaks[1] = max(peaks[0], anon), max(peaks[1], file)
                if on_poll is not None and time.perf_counter() - told >= RECORD_S:
                    told = time.perf_counter()
                    on_poll(Measured(-1, told - t0, 0.0, peaks[0] * kib, peaks[1] * kib))
                stop.wait(poll_s)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        stop.set()
        watcher.join()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4; tell Popen
    return Measured(proc.returncode, wall, usage.ru_maxrss * kib, peaks[0] * kib, peaks[1] * kib)


def folder_bytes(folder: Path, pattern: str = "*") -> int:
    """Sum of the sizes of the files under ``folder`` matching ``pattern`` (recursive)."""
    return sum(p.stat().st_size for p in folder.rglob(pattern) if p.is_file()) if folder.exists() else 0


def source_bytes(source: str) -> int:
    """Bytes of the ``*.safetensors`` the conversion reads (the bundled model: its cached float32 folder)."""
    path = Path(source)
    if not path.exists():
        from mla_convert.sources.checkpoint import open_source

        path = open_source(source).path
    return folder_bytes(path, "*.safetensors")


def per_layer_means(per_layer: Any) -> dict[str, float]:
    """Mean seconds per layer by stage from ``report["run"]["per_layer"]``: a list of per-layer dicts
    (numeric values; ``layer``/``index`` keys skipped) or a dict stage -> list of seconds."""
    if isinstance(per_layer, dict):
        return {k: mean(v) for k, v in per_layer.items() if isinstance(v, list) and v}
    if isinstance(per_layer, list) and per_layer and all(isinstance(r, dict) for r in per_layer):
        keys = [
            k for k, v in per_layer[0].items() if isinstance(v, int | float) and k not in ("layer", "index")
        ]
        return {k: mean(float(r.get(k, 0.0)) for r in per_layer) for k in keys}
    return {}


def machine() -> dict[str, Any]:
    """CPU count, memory, GPU name (if torch sees one), OMP_NUM_THREADS, platform."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / GB, 1)
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    info["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    return info


def measure(name: str, out_root: Path, flags: tuple[str, ...], keep: bool) -> dict[str, Any]:
    """Convert model ``name`` in a child process and return its result row (see the module doc)."""
    source, marker = source_of(name, out_root)
    out = out_root / f"{name}-mla"
    cmd = [*mla_convert_cmd(), "factor", source, str(out), "--overwrite", *flags]
    src_bytes = source_bytes(source)
    free = shutil.disk_usage(out_root).free
    if free < 1.5 * src_bytes:
        print(
            f"warning: {free / GB:.0f} GB free under {out_root}; the output may need ~{src_bytes / GB:.0f} GB"
        )
    log = out_root / f"{name}.log"
    print(f"{name}: {shlex.join(cmd)}\n{name}: log {log}", flush=True)
    row = result_row(name, source, marker, out, flags, cmd, run_measured(cmd, log), log)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return row


def result_row(
    name: str, source: str, marker: dict[str, Any] | None, out: Path, flags: tuple[str, ...], cmd: list[str],
    m: Measured, log: Path,
) -> dict[str, Any]:
    """The result row of model ``name``'s conversion ``cmd`` into ``out``, measured as ``m`` (see the module doc)."""
    shape = SHAPES.get(name)
    src_bytes = source_bytes(source)
    rc = m.rc
    row: dict[str, Any] = {
        "model": name,
        "description": shape.description if shape else "SmolLM2-135M-Instruct (bundled, real weights)",
        "shape": shape.summary() if shape else "30 L, d 576, 9/3 heads x 64, ff 1536, vocab 49152",
        "source": source if shape is None else f"$MLA_SCALE_CACHE/{name}",
        "source_bytes": src_bytes,
        "flags": list(flags),
        "command": shlex.join(["mla-convert", *cmd[1:]]),
        "rc": rc,
        "wall_s": m.wall_s,
        "peak_rss_gb": m.peak_rss_gb,
        "peak_anon_gb": m.peak_anon_gb,
        "peak_file_gb": m.peak_file_gb,
        "bytes_written": folder_bytes(out),
        "safetensors_written": folder_bytes(out, "*.safetensors"),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "generation": marker,
    }
    report_path = out / "report.json"
    if rc == 0 and report_path.exists():
        run = json.loads(report_path.read_text()).get("run", {})
        row["report_run"] = {k: v for k, v in run.items() if k != "per_layer"}
        row["per_layer_mean_s"] = per_layer_means(run.get("per_layer"))
    else:
        tail = log.read_text().splitlines()[-15:]
        print(f"{name}: FAILED (rc {rc}); last lines of {log}:\n" + "\n".join(tail), flush=True)
        row["log_tail"] = tail
    row["targets"] = dict(MODELS[name].targets)
    row["targets_met"] = targets_met(row)
    return row


def peak_gb(row: dict[str, Any]) -> float:
    """The run's peak resident memory (GB): the larger of the child's ``ru_maxrss`` and the peak ``factor``
    reports itself (``run.peak_rss_mb``, the largest per-phase ``VmHWM``). ``factor`` resets ``VmHWM`` at each
    phase (``/proc/self/clear_refs``) to measure phases apart, and that reset lowers ``ru_maxrss`` too, which then
    holds only the last phase's peak."""
    own = row.get("report_run", {}).get("peak_rss_mb")
    return max(row["peak_rss_gb"], own * 2**20 / GB if own else 0.0)


def peak_phase(row: dict[str, Any]) -> str:
    """`` at calibrate`` (the phase of the peak) when ``factor`` reported its phases."""
    phases = row.get("report_run", {}).get("peak_rss_mb_by_phase") or {}
    return f" at {max(phases, key=phases.get)}" if phases else ""


def targets_met(row: dict[str, Any]) -> dict[str, bool]:
    """Each target of the row against the measured value (peak from :func:`peak_gb`)."""
    value = {"peak_rss_gb": peak_gb(row), "wall_s": row["wall_s"]}
    return {k: value[k] < v for k, v in row["targets"].items()} if row["rc"] == 0 else {}


def _stage(key: str) -> str:
    return key.removesuffix("_s")


def _split(row: dict[str, Any]) -> str:
    """`` (anon 1.20, file 3.10)`` when the sampled split was recorded."""
    if not row.get("peak_anon_gb"):
        return ""
    return f" (anon {row['peak_anon_gb']:.2f}, file {row['peak_file_gb']:.2f})"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown table of result rows (model order of :data:`MODELS`)."""
    lines = [
        "| model | shape | source bytes | peak RSS GB | wall s | s/layer by stage | bytes written | target |",
        "|---|---|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        if r["rc"] != 0:
            lines.append(
                f"| {r['model']} | {r['shape']} | {r['source_bytes'] / GB:.2f} GB | | | | | "
                f"**failed** (rc {r['rc']}) |"
            )
            continue
        per = "; ".join(f"{_stage(k)} {v:.2f}" for k, v in r.get("per_layer_mean_s", {}).items())
        if not per:
            t = r.get("report_run", {}).get("timings", {})
            per = "whole run: " + "; ".join(f"{_stage(k)} {v:.1f}" for k, v in t.items()) if t else ""
        target = ", ".join(
            f"{TARGET_TEXT[k][0]} < {v:g} {TARGET_TEXT[k][1]}: {'met' if targets_met(r).get(k) else '**missed**'}"
            for k, v in r["targets"].items()
        )
        written = f"{r['bytes_written'] / GB:.2f} GB ({r['safetensors_written'] / GB:.2f} safetensors)"
        stops = len(r.get("segments", ()))
        wall = f"{r['wall_s']:.0f}" + (f" in {stops} resumed segments" if stops > 1 else "")
        lines.append(
            f"| {r['model']} ({r['description']}) | {r['shape']} | {r['source_bytes'] / GB:.2f} GB | "
            f"{peak_gb(r):.2f}{peak_phase(r)}{_split(r)} | {wall} | {per} | {written} | {target} |"
        )
    return lines


def generation_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per generated source: how long it took and its peak memory (from the cache markers)."""
    out = []
    for r in rows:
        g = r.get("generation")
        if g:
            peak = f", peak RSS {g['peak_rss_gb']:.2f} GB" if "peak_rss_gb" in g else ""
            out.append(
                f"- `{r['model']}` source: {g['safetensors_bytes'] / GB:.2f} GB bfloat16 in {g['files']} shard(s), "
                f"generated in {g['generate_s']:.0f} s{peak} (`python benchmarks/scale.py --generate-only "
                f"{r['model']}`)."
            )
    return out


def block(rows: list[dict[str, Any]], command: str) -> str:
    """The block of docs/results.md: caption with the machine and the command, the table, per-model options, generation."""
    m = rows[0]["machine"] if rows else machine()
    where = f"{m['cpus']} CPU cores, {m.get('memory_gb', '?')} GB RAM" + (
        f", {m['gpu']}" if m.get("gpu") else ""
    )
    lines = [
        f"`mla-convert factor` on random-weight bfloat16 checkpoints of real shapes (generated by "
        f"`benchmarks/scale_sources.py`) and on the bundled SmolLM2-135M, one process per model; peak RSS is "
        f"the larger of the child's `ru_maxrss` and the peak `factor` reports itself (its largest per-phase "
        f"`VmHWM`; the phase is named), in brackets the largest anonymous and file-mapped parts sampled from "
        f"`/proc` every 0.2 s (each at its own moment); bytes written are OUT's files. Wall times on a machine "
        f"busy with other work. {where}. Written by `{command}`.",
        "",
        *table(rows),
        "",
        "Options per model: "
        + "; ".join(f"`{r['model']}` `{' '.join(r['flags']) or '(defaults)'}`" for r in rows)
        + ".",
    ]
    gen = generation_lines(rows)
    return "\n".join([*lines, *([""] + gen if gen else [])])


def collect_block(names: tuple[str, ...] = ("llama8b", "llama8b-2l", "qwen05b", "smollm2")) -> str:
    """The block ``--collect --models NAMES --readme`` writes, from ``scale.json`` alone."""
    rows = [load_results()["rows"][n] for n in MODELS if n in names]
    return block(rows, f"python benchmarks/scale.py --collect --models {','.join(names)} --readme")


def load_results() -> dict[str, Any]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", default="llama8b,qwen05b,smollm2", help=f"comma-separated: {', '.join(MODELS)}"
    )
    ap.add_argument(
        "--out-root", type=Path, help="where OUT folders and logs go (default: a new temp folder)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the OUT folders")
    ap.add_argument("--readme", action="store_true", help="write the table into docs/results.md")
    ap.add_argument(
        "--flags", action="append", default=[], metavar="NAME=ARGS", help="replace a model's factor options"
    )
    ap.add_argument("--generate-only", metavar="NAME", help="only make (or finish) the cached source NAME")
    ap.add_argument("--no-checks", action="store_true", help="with --generate-only: skip the forward checks")
    ap.add_argument("--collect", action="store_true", help="no runs: table scale.json's rows for --models")
    args = ap.parse_args()
    if args.generate_only:
        generate_only(args.generate_only, not args.no_checks)
        return
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"error: unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if not args.collect and (long := [n for n in names if MODELS[n].resumable]):
        raise SystemExit(f"error: {', '.join(long)} runs for hours: python benchmarks/scale_resume.py {long[0]}")
    overrides = dict(f.split("=", 1) for f in args.flags)
    results = load_results()
    if not args.collect:
        made = args.out_root is None
        out_root = Path(tempfile.mkdtemp(prefix="mla-scale-")) if made else args.out_root
        out_root.mkdir(parents=True, exist_ok=True)
        for n in names:
            flags = tuple(shlex.split(overrides[n])) if n in overrides else MODELS[n].flags
            row = measure(n, out_root, flags, args.keep)
            results["rows"][n] = row
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(
                json.dumps(results, indent=2) + "\n"
            )  # after each model: a crash keeps the rest
            print("\n".join(table([row])), flush=True)
        failed = any(results["rows"][n]["rc"] != 0 for n in names)
        if made and not args.keep and not failed:
            shutil.rmtree(out_root, ignore_errors=True)
        else:
            print(f"logs{' and outputs' if args.keep else ''} in {out_root}")
    rows = [results["rows"][n] for n in MODELS if n in names and n in results["rows"]]
    if not rows:
        raise SystemExit(f"error: {RESULTS} has no rows for {names}; run without --collect first")
    command = (
        "python benchmarks/scale.py " + ("--collect " if args.collect else "") + f"--models {','.join(names)}"
    )
    text = block(rows, command + " --readme")
    TABLE.write_text(text + "\n")
    print(text)
    if args.readme:
        from blocks import replace_block

        replace_block("scale", text)
    if any(r["rc"] != 0 for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
