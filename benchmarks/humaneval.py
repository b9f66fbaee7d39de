"""HumanEval pass@1 of sources and conversions (issue 50): each row one ``mla-convert eval MODEL --task humaneval`` run.

    .venv/bin/python benchmarks/humaneval.py --name NAME --model MODEL [--engine llama.cpp|transformers] [--limit N]
        [--dtype float32|bfloat16]
    .venv/bin/python benchmarks/humaneval.py --collect

A run writes its per-problem rows and summary to ``benchmarks/results/humaneval/NAME/`` (resumable: an interrupted
run continues where it stopped) and merges the summary into ``benchmarks/results/humaneval.json``; ``--collect``
writes the table between ``docs/results.md``'s ``<!-- humaneval:start -->`` / ``<!-- humaneval:end -->`` markers.
Rows on the first N problems compare only with rows on the same N (the table says which).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "humaneval.json"
RUNS = ROOT / "benchmarks" / "results" / "humaneval"
DOC = ROOT / "docs" / "results.md"


def run(name: str, model: str, engine: str, limit: int | None, dtype: str | None = None) -> dict[str, Any]:
    """One ``eval --task humaneval`` run into ``RUNS/name``; returns its summary."""
    out = RUNS / name
    cmd = [sys.executable, "-m", "mla_convert", "eval", model, "--task", "humaneval", "--engine", engine, "--out", str(out)]
    if limit:
        cmd += ["--limit", str(limit)]
    if dtype:
        cmd += ["--dtype", dtype]
    subprocess.run(cmd, check=True)
    summary = json.loads((out / "humaneval.json").read_text())
    summary["command"] = "mla-convert " + " ".join(cmd[3:]).replace(str(ROOT) + "/", "")
    return summary


def table(results: dict[str, Any]) -> str:
    """The markdown table of every row."""
    lines = [
        "HumanEval pass@1, greedy, raw prompt (no chat template), completions cut at the stop sequences of Chen et al. "
        "2021; each program in its own sandboxed subprocess (`mla_convert/tasks/execute.py`). Written by "
        "`python benchmarks/humaneval.py --collect` from the runs `benchmarks/humaneval.py --name NAME --model MODEL` "
        "made. For scale: the Qwen2.5-Coder technical report (Hui et al. 2024) gives 70.7 % for Qwen2.5-Coder-1.5B-Instruct "
        "(the prompt inside its chat template, full-precision weights) and 43.9 % for the 1.5B base model; the rows here "
        "read the raw prompt, and the source row runs the Q4_K_M GGUF the second model ships as.",
        "",
        "| row | engine | problems | pass@1 | passed | command |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['ran']['engine']} | {r['problems']} | {100 * r['pass@1']:.1f} % | {r['passed']} | "
            f"`{r['command']}` |"
        )
    return "\n".join(lines)


def block() -> str:
    """The docs/results.md block (between its markers), from the stored results (``benchmarks/collect.py``)."""
    return table(json.loads(RESULTS.read_text()))


def collect() -> None:
    """Write the table between the markers of docs/results.md."""
    from blocks import replace_block

    print(f"humaneval: {replace_block('humaneval', block())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", help="the row's name")
    ap.add_argument("--model", help="a source (name, folder, .gguf) or a converted folder")
    ap.add_argument("--engine", default="auto", choices=("auto", "transformers", "llama.cpp"))
    ap.add_argument("--limit", type=int, default=None, help="only the first N problems")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="transformers: the weights' dtype")
    ap.add_argument("--collect", action="store_true", help="write the docs/results.md table; run nothing")
    args = ap.parse_args()
    if args.collect:
        collect()
        return
    if not args.name or not args.model:
        ap.error("--name and --model are needed to run (or --collect)")
    summary = run(args.name, args.model, args.engine, args.limit, args.dtype)
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results[args.name] = summary
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{args.name}: pass@1 {summary['pass@1']:.4f} ({summary['passed']}/{summary['problems']})")


if __name__ == "__main__":
    main()
