"""The parts of the first GPU run (``benchmarks/gpu_check.py``): each part's command, how it runs (logged, killed
at its time limit with its process group) and what is read back from its output into the record.

Each ``part_*`` function fills a :class:`Part` in place: ``command``, ``seconds``, ``log``, ``status`` (``ok`` or
``failed``), ``error``, ``summary`` and ``record``. :func:`cli_with_peak` is the in-process wrapper of
``mla-convert`` that measures the peak GPU memory of the factor, validate and adapt parts.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: What the ``tests`` part runs on CUDA: the kernel, runtime and model tests, the conversion on the GPU (its
#: decompositions there, equal to the CPU's) and ``factor``'s default on a GPU (the fitted reconstruction on by default
#: there: ``default_reconstruction``).
TEST_DIRS = (
    "tests/kernels", "tests/runtime", "tests/mla", "tests/convert/test_on_device.py",
    "tests/convert/test_reconstruct.py::test_factor_on_a_gpu_fits_by_default",
)
ADAPT_STEPS, ADAPT_SEQ, ADAPT_BATCH = 20, 512, 4


@dataclass
class Part:
    """One part's outcome: ``status`` (ok / failed / skipped / no CUDA device), ``error`` (why, one line),
    ``summary`` (the answer, one line), ``record`` (the measured figures), ``seconds`` (wall time)."""

    name: str
    title: str
    limit_s: float
    command: list[str] = field(default_factory=list)
    status: str = "not run"
    error: str | None = None
    summary: str = ""
    seconds: float | None = None
    log: str | None = None
    record: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- running
def child_env() -> dict[str, str]:
    """This environment without ``TRITON_INTERPRET`` (the kernels must run natively), unbuffered output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_logged(cmd: list[str], log: Path, limit_s: float, tag: str) -> tuple[int | None, float]:
    """Run ``cmd`` in the repository root, its output to ``log`` and to this terminal (prefixed ``[tag]``),
    killed with its process group after ``limit_s`` seconds.

    Returns:
        the exit status (None when it was killed at the limit) and the seconds it ran.
    """
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", start_new_session=True,
        )  # fmt: skip
        assert proc.stdout is not None
        stream = proc.stdout

        def pump() -> None:
            for line in stream:
                fh.write(line)
                fh.flush()
                print(f"[{tag}] {line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
        reader.join(timeout=10)
    return rc, time.perf_counter() - t0


def tail(log: Path, chars: int = 1500) -> str:
    """The last ``chars`` characters of ``log`` ('' when it is missing)."""
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def last_error_line(log: Path) -> str:
    """The last line of ``log`` that names an error, or its last non-empty line."""
    lines = [ln.strip() for ln in tail(log, 6000).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"error|Error|Exception|FAILED|Traceback", ln):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def cli_command(record: Path, *argv: str) -> list[str]:
    """``argv`` of ``mla-convert`` run in-process by this script's wrapper, which records wall time and peak
    GPU memory into ``record``."""
    return [
        sys.executable,
        str(Path(__file__).resolve().with_name("gpu_check.py")),
        "--cli-peak",
        str(record),
        "--",
        *argv,
    ]


def cli_with_peak(record: Path, argv: list[str]) -> int:
    """Run ``mla-convert ARGV`` in this process; write its exit status, wall time and peak GPU memory
    (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, MiB; None when torch never came or no
    GPU) to ``record``; return the exit status."""
    sys.argv = ["mla-convert", *argv]  # the CLI's own start: torch comes with the command that needs it
    t0 = time.perf_counter()
    code = 0
    error = None
    try:
        from mla_convert.cli import main

        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:  # a crash: its traceback goes to the log, its line to the record
        traceback.print_exc()
        code, error = 1, f"{type(exc).__name__}: {exc}"
    wall = time.perf_counter() - t0
    torch = sys.modules.get("torch")
    rec: dict[str, Any] = {"argv": argv, "rc": code, "error": error, "wall_s": wall}
    rec["peak_gpu_allocated_mib"] = rec["peak_gpu_reserved_mib"] = None
    if torch is not None and torch.cuda.is_available():
        rec["peak_gpu_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        rec["peak_gpu_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    record.write_text(json.dumps(rec, indent=2) + "\n")
    return code


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------------------------------- the parts
RESULT_LINE = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] (\S+?):\d+: (.*)$")
DURATION_LINE = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")
SUMMARY_LINE = re.compile(r"^=+ (.*\d+ (?:passed|failed|error|errors|skipped).*) =+$")


def parse_pytest(text: str) -> dict[str, Any]:
    """Counts, failures, GPU-only cases (``*_gpu`` tests), skip reasons and slowest phases of a ``pytest -v
    -rfEs --durations=N`` log (complete or cut short)."""
    outcomes: dict[str, str] = {}
    skips: dict[str, int] = {}
    slowest: list[dict[str, Any]] = []
    summary = None
    for line in text.splitlines():
        if m := RESULT_LINE.match(line):
            outcomes[m.group(1)] = m.group(2).lower()
        elif m := SKIP_LINE.match(line):
            skips[m.group(3)] = skips.get(m.group(3), 0) + int(m.group(1))
        elif m := DURATION_LINE.match(line):
            slowest.append({"seconds": float(m.group(1)), "phase": m.group(2), "test": m.group(3)})
        elif m := SUMMARY_LINE.match(line.strip()):
            summary = m.group(1)
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    gpu = {k: v for k, v in outcomes.items() if k.split("::")[-1].split("[")[0].endswith("_gpu")}
    gpu_counts: dict[str, int] = {}
    for outcome in gpu.values():
        gpu_counts[outcome] = gpu_counts.get(outcome, 0) + 1
    return {
        "counts": counts,
        "gpu_only": gpu_counts,
        "failures": [k for k, v in outcomes.items() if v in ("failed", "error")][:30],
        "skip_reasons": skips,
        "slowest": slowest[:10],
        "summary_line": summary,
    }


def part_command(name: str, work: Path) -> list[str]:
    """The command part ``name`` runs, its files under ``work``."""
    ckpt = work / "smollm2-mla"
    if name == "tests":
        return [
            sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "--durations=10", *TEST_DIRS,
        ]  # fmt: skip
    if name == "decode":
        decode = ROOT / "benchmarks" / "decode.py"
        return [sys.executable, str(decode), "--gpu", "--json", str(work / "decode_gpu.json")] + [
            "--out", str(work / "decode_gpu.md"),
        ]  # fmt: skip
    if name == "factor":
        return cli_command(
            work / "factor_peak.json", "factor", "smollm2-135m", str(ckpt), "--device", "cuda", "--overwrite"
        )
    if name == "validate":
        return cli_command(work / "validate_peak.json", "validate", str(ckpt))
    if name == "adapt":
        return cli_command(work / "adapt_peak.json", *adapt_argv(ckpt, work / "smollm2-mla-adapted"))
    if name == "factor8b":
        src, out = work / "scale-cache" / SHAPE_8B, work / f"{SHAPE_8B}-mla"
        return cli_command(work / "factor8b_peak.json", "factor", str(src), str(out), "--device", "cuda", "--overwrite")
    raise ValueError(f"no part {name!r}")


#: The generated source of the ``factor8b`` part (benchmarks/scale_sources.py): Llama-3.1-8B's shapes, 2 layers.
SHAPE_8B = "llama8b-2l"


def part_factor8b(part: Part, work: Path) -> None:
    """The 8B-shaped default conversion on CUDA: the source generated into ``work/scale-cache`` (its own time,
    inside the part's limit), then ``factor`` at default options; the record keeps the report's run (stage and
    per-layer seconds, peak host memory by phase), the weights ledger and the search's choice."""
    gen_log, log = work / "factor8b_source.log", work / "factor8b.log"
    out, peak = work / f"{SHAPE_8B}-mla", work / "factor8b_peak.json"
    gen = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--generate-only", SHAPE_8B, "--no-checks"]
    before = os.environ.get("MLA_SCALE_CACHE")
    os.environ["MLA_SCALE_CACHE"] = str(work / "scale-cache")
    try:
        rc, gen_s = run_logged(gen, gen_log, part.limit_s, "factor8b source")
    finally:
        if before is None:
            os.environ.pop("MLA_SCALE_CACHE", None)
        else:
            os.environ["MLA_SCALE_CACHE"] = before
    part.command = part_command("factor8b", work)
    part.log = str(log)
    if rc != 0:
        part.seconds = gen_s
        part.status, part.error = "failed", f"generating the source: {last_error_line(gen_log) if rc else 'timed out'}"
        return
    rc, fac_s = run_logged(part.command, log, max(1.0, part.limit_s - gen_s), "factor8b")
    part.seconds = gen_s + fac_s
    rec = read_json(peak)
    report = read_json(out / "report.json")
    rec["source_s"] = gen_s
    for key in ("run", "weights", "options"):
        if report.get(key):
            rec[f"report_{key}"] = report[key]
    part.record = rec
    settle(part, rc, report, log, f"timed out after {part.limit_s:.0f} s (source {gen_s:.0f} s)")
    bits = [f"source {gen_s:.0f} s"]
    if rec.get("wall_s") is not None:
        bits.append(f"factor {rec['wall_s']:.0f} s")
    if rec.get("peak_gpu_allocated_mib") is not None:
        bits.append(f"peak GPU memory {rec['peak_gpu_allocated_mib']:.0f} MiB allocated")
    peak_mb = (report.get("run") or {}).get("peak_rss_mb")
    if peak_mb:
        bits.append(f"peak host RSS {peak_mb / 1000:.1f} GB")
    options = report.get("options") or {}
    if options:
        bits.append(f"chose {options.get('rope_pairs')} pairs, {options.get('rope_strategy')}, refit {options.get('refit_o_proj')}")
    part.summary = "; ".join(bits)


def part_tests(part: Part, work: Path) -> None:
    log = work / "tests.log"
    part.command = part_command("tests", work)
    rc, part.seconds = run_logged(part.command, log, part.limit_s, "tests")
    part.log = str(log)
    rec = parse_pytest(log.read_text(errors="replace"))
    part.record = rec
    c, g = rec["counts"], rec["gpu_only"]
    part.summary = (
        f"{c.get('passed', 0)} passed, {c.get('failed', 0) + c.get('error', 0)} failed, {c.get('skipped', 0)} "
        f"skipped; GPU-only cases {g.get('passed', 0)} passed, {g.get('failed', 0) + g.get('error', 0)} failed, "
        f"{g.get('skipped', 0)} skipped"
    )
    if rc is None:
        part.status, part.error = "failed", f"timed out after {part.limit_s:.0f} s ({part.summary} so far)"
    elif rc == 0:
        part.status = "ok"
    else:
        first = rec["failures"][0] if rec["failures"] else last_error_line(log)
        part.status, part.error = "failed", f"pytest exit {rc}: {first}"


def part_decode(part: Part, work: Path) -> None:
    log, rows = work / "decode.log", work / "decode_gpu.json"
    md = work / "decode_gpu.md"
    part.command = part_command("decode", work)
    rc, part.seconds = run_logged(part.command, log, part.limit_s, "decode")
    part.log = str(log)
    rec = read_json(rows)
    part.record = rec
    if md.exists():
        part.record["markdown"] = md.read_text()
    if rc is None:
        part.status, part.error = "failed", f"timed out after {part.limit_s:.0f} s"
    elif rc != 0 or not rec.get("rows"):
        part.status, part.error = "failed", f"exit {rc}: {last_error_line(log)}"
    else:
        part.status = "ok"
    if rec.get("rows"):
        head = [
            r for r in rec["rows"] if (r["batch"], r["context"], r["heads"], r["d_c"]) == (1, 32768, 128, 512)
        ]
        cells = "; ".join(
            f"{r['rows']} {r['cold_us']:.0f} us, {r['gbps']:.0f} GB/s, {r['tflops']:.0f} TFLOP/s "
            f"({r['pct_roofline']:.0f} % roofline)"
            for r in head
        )
        worst = max(r["max_err_vs_fp64"] for r in rec["rows"])
        part.summary = (
            f"copy {rec['copy_gbps']:.0f} GB/s, matmul {rec['matmul_tflops']:.0f} TFLOP/s; 1 x 32k, H 128, "
            f"512 + 64: {cells}; max err vs fp64 {worst:.1e}; {len(rec['rows'])} rows"
        )


def settle(part: Part, rc: int | None, report: dict[str, Any], log: Path, timed_out: str) -> None:
    """A ``factor`` part's status from its exit status (None: killed at its limit, ``timed_out`` says so) and its
    report: ``ok``, or ``failed`` with the record's error or the log's last error line."""
    if rc is None:
        part.status, part.error = "failed", timed_out
    elif rc != 0 or not report:
        part.status, part.error = "failed", f"exit {rc}: {part.record.get('error') or last_error_line(log)}"
    else:
        part.status = "ok"


def part_factor(part: Part, work: Path) -> None:
    out, peak, log = work / "smollm2-mla", work / "factor_peak.json", work / "factor.log"
    part.command = part_command("factor", work)
    rc, part.seconds = run_logged(part.command, log, part.limit_s, "factor")
    part.log = str(log)
    rec = read_json(peak)
    report = read_json(out / "report.json")
    ev = report.get("model", {}).get("eval", {})
    if ev:
        rec["eval"] = {k: ev.get(k) for k in ("perplexity", "reference_perplexity", "kl", "top1", "tokens")}
    if report.get("run"):
        rec["report_run"] = report["run"]
    rec["checkpoint"] = str(out)
    part.record = rec
    settle(part, rc, report, log, f"timed out after {part.limit_s:.0f} s")
    bits = [f"{rec['wall_s']:.0f} s"] if rec.get("wall_s") is not None else []
    if rec.get("peak_gpu_allocated_mib") is not None:
        bits.append(f"peak GPU memory {rec['peak_gpu_allocated_mib']:.0f} MiB allocated")
    if ev.get("perplexity") and ev.get("reference_perplexity"):
        bits.append(
            f"perplexity ratio {ev['perplexity'] / ev['reference_perplexity']:.3f}, KL {ev['kl']:.4f}"
        )
    part.summary = "; ".join(bits)


def part_validate(part: Part, work: Path) -> None:
    ckpt, peak, log = work / "smollm2-mla", work / "validate_peak.json", work / "validate.log"
    part.command = part_command("validate", work)
    rc, part.seconds = run_logged(part.command, log, part.limit_s, "validate")
    part.log = str(log)
    rec = read_json(peak)
    res = read_json(ckpt / "validation.json")
    backend = res.get("environment", {}).get("kernel_backend")
    rec.update(
        passed=res.get("passed"),
        failed_rungs=res.get("failed_rungs"),
        kernel_backend=backend,
        rungs=[
            {k: r.get(k) for k in ("number", "name", "passed", "seconds", "skipped")}
            for r in res.get("rungs", [])
        ],
    )
    part.record = rec
    if rc is None:
        part.status, part.error = "failed", f"timed out after {part.limit_s:.0f} s"
    elif not res:
        part.status, part.error = "failed", f"exit {rc}, no validation.json: {last_error_line(log)}"
    elif rc != 0:
        part.status, part.error = (
            "failed",
            f"exit {rc}: failed rungs {', '.join(res.get('failed_rungs') or [])}",
        )
    elif backend != "triton-cuda":
        part.status, part.error = "failed", f"the kernel ran on {backend}, not natively on CUDA"
    else:
        part.status = "ok"
    if rec["rungs"]:
        ok = sum(1 for r in rec["rungs"] if r["passed"])
        part.summary = f"{ok}/{len(rec['rungs'])} rungs passed on {backend}"
        if rec.get("wall_s") is not None:
            part.summary += f"; {rec['wall_s']:.0f} s"


def adapt_argv(ckpt: Path, out: Path) -> list[str]:
    """``mla-convert adapt`` options that make exactly :data:`ADAPT_STEPS` optimizer steps in bf16."""
    return [
        "adapt", str(ckpt), str(out), "--tokens", str(ADAPT_STEPS * ADAPT_SEQ * ADAPT_BATCH),
        "--seq-len", str(ADAPT_SEQ), "--batch-size", str(ADAPT_BATCH), "--grad-accum", "1",
        "--mixed-precision", "bf16", "--eval-windows", "4", "--chat-prompts", "0", "--checkpoint-every", "0",
        "--overwrite",
    ]  # fmt: skip


def part_adapt(part: Part, work: Path) -> None:
    out, peak, log = work / "smollm2-mla-adapted", work / "adapt_peak.json", work / "adapt.log"
    part.command = part_command("adapt", work)
    rc, part.seconds = run_logged(part.command, log, part.limit_s, "adapt")
    part.log = str(log)
    rec = read_json(peak)
    report = read_json(out / "adapt_report.json")
    train: list[dict[str, Any]] = []
    try:
        for line in (out / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") == "train":
                train.append(row)
    except (OSError, ValueError):
        pass
    norms = [r.get("grad_norm") for r in train]
    rec.update(
        steps=report.get("steps"),
        tokens_per_s=report.get("tokens_per_s"),
        loss_first=train[0]["loss"] if train else None,
        loss_last=train[-1]["loss"] if train else None,
        grad_norms=norms,
        perplexity_before=report.get("before", {}).get("perplexity"),
        perplexity_after=report.get("after", {}).get("perplexity"),
    )
    part.record = rec
    bad = [i + 1 for i, n in enumerate(norms) if n is None or not math.isfinite(n) or n <= 0]
    if rc is None:
        part.status, part.error = (
            "failed",
            f"timed out after {part.limit_s:.0f} s ({len(train)} steps logged)",
        )
    elif rc != 0 or not report:
        part.status, part.error = "failed", f"exit {rc}: {rec.get('error') or last_error_line(log)}"
    elif report.get("steps") != ADAPT_STEPS or len(train) != ADAPT_STEPS:
        part.status = "failed"
        part.error = f"{report.get('steps')} steps planned, {len(train)} logged; {ADAPT_STEPS} asked for"
    elif bad:
        part.status, part.error = "failed", f"gradient norm 0, missing or not finite at steps {bad[:10]}"
    else:
        part.status = "ok"
    if train:
        part.summary = (
            f"{len(train)} steps, {rec['tokens_per_s'] or 0:.0f} tokens/s, loss {rec['loss_first']:.3f} -> "
            f"{rec['loss_last']:.3f}"
        )
        if rec.get("peak_gpu_allocated_mib") is not None:
            part.summary += f", peak GPU memory {rec['peak_gpu_allocated_mib']:.0f} MiB"


RUNNERS = {
    "tests": part_tests,
    "decode": part_decode,
    "factor": part_factor,
    "validate": part_validate,
    "adapt": part_adapt,
    "factor8b": part_factor8b,
}
