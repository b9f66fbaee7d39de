"""Adaptation benchmark: held-out perplexity before and after 100k / 500k training tokens at 18.75 % cache.

    python benchmarks/adapt.py                       # run the grid (hours on a 2-core CPU) and print the table
    python benchmarks/adapt.py --only distill:all    # one setting
    python benchmarks/adapt.py --collect             # only tabulate what benchmarks/runs/ holds (also partial runs)
    python benchmarks/adapt.py --collect --readme    # ... and write the table into README.md

Each setting is an ``mla-convert adapt`` job on the SmolLM2-135M conversion at 72 values/token/layer
(18.75 % of the source's 384; shared rope head with 20 pairs = the best measured training-free setting
at that size), trained on the Wikipedia adaptation split and evaluated at the start, at every 100k tokens
and at the end on the Wikipedia evaluation split and on the news corpus (a domain not used for
adaptation). Runs live in ``benchmarks/runs/<objective>-<trainable>/`` (git-ignored) and are resumable:
re-running the script continues stopped runs (``--resume``) instead of starting over.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "runs"
RESULTS = ROOT / "benchmarks" / "results" / "adapt.md"
GRID = [(o, t) for o in ("lm", "distill", "mix") for t in ("attention", "all")]
FACTOR = ["--cache-budget", "72", "--rope-pairs", "20"]


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "mla_convert", *args], check=True)


def ensure_base(base: Path) -> None:
    if not (base / "mla_manifest.json").is_file():
        cli("--quiet", "factor", "smollm2-135m", str(base), *FACTOR, "--overwrite")


def run_setting(base: Path, objective: str, trainable: str, tokens: int, seq_len: int, batch: int) -> None:
    name = f"{objective}-{trainable}"
    out = RUNS / name
    if (out / "adapt_report.json").is_file():
        return
    steps_100k = max(1, 100_000 // (seq_len * batch))
    args = [
        "adapt", str(base), str(out), "--tokens", str(tokens), "--seq-len", str(seq_len),
        "--batch-size", str(batch), "--objective", objective, "--trainable", trainable,
        "--eval-every", str(steps_100k), "--eval-windows", "8", "--also-eval", "news",
        "--checkpoint-every", "10", "--lr", "1e-4" if trainable == "attention" else "5e-5",
    ]  # fmt: skip
    work = RUNS / f".{name}.adapt"
    if any(work.glob("step-*")):
        args.append("--resume")
    cli(*args)


def load_metrics(name: str) -> list[dict]:
    for f in (RUNS / name / "metrics.jsonl", RUNS / f".{name}.adapt" / "metrics.jsonl"):
        if f.is_file():
            return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return []


def at(evals: list[dict], tokens: int) -> dict | None:
    """The evaluation at the first step that reached ``tokens`` (within one step)."""
    hits = [e for e in evals if e["tokens"] >= tokens * 0.98]
    return hits[0] if hits else None


def table() -> str:
    rows = [
        "| objective | trainable | wiki ppl before | @100k | @500k | news ppl before | @100k | @500k | tokens/s | wall (min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    src = None
    for objective, trainable in GRID:
        m = load_metrics(f"{objective}-{trainable}")
        evals = [e for e in m if e["kind"] == "eval"]
        train = [e for e in m if e["kind"] == "train"]
        if not evals:
            continue
        src = src or (evals[0]["source_perplexity"], evals[0].get("other_source_perplexity"))
        cells = []
        for key in ("perplexity", "other_perplexity"):
            for tok in (0, 100_000, 500_000):
                e = at(evals, tok)
                cells.append(f"{e[key]:.2f}" if e and e.get(key) else "–")
        rate = train[-1]["tokens_per_s"] if train else 0
        wall = train[-1]["elapsed_s"] / 60 if train else 0
        rows.append(f"| {objective} | {trainable} | " + " | ".join(cells) + f" | {rate:.0f} | {wall:.0f} |")
    cpu = "unknown CPU"
    info = Path("/proc/cpuinfo")
    if info.exists():
        found = re.search(r"model name\s*:\s*(.*)", info.read_text())
        cpu = found.group(1).strip() if found else cpu
    head = (
        f"SmolLM2-135M at 72 values/token/layer (18.75 % of 384), shared rope head with 20 pairs. "
        f"Source perplexity: wiki {src[0]:.2f}, news {src[1]:.2f} (8 x 512 evaluation-split tokens each). "
        if src and src[1]
        else ""
    )
    head += (
        f"Machine: {cpu}, torch {torch.__version__}, Python {platform.python_version()}. Trained on the Wikipedia "
        "adaptation split, 4 x 512-token sequences per step (2048 tokens), AdamW lr 1e-4 (attention) / 5e-5 (all), "
        "cosine; '@100k' is the first evaluation at >= 98 % of 100k tokens (step 48 = 98,304). '–' = not reached "
        "yet. tokens/s and wall (minutes) are the last invocation's average, so they include any other load."
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="objective:trainable, e.g. distill:all")
    ap.add_argument("--tokens", type=int, default=500_000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--collect", action="store_true", help="only tabulate existing runs")
    ap.add_argument("--readme", action="store_true", help="write the table into README.md")
    args = ap.parse_args()
    RUNS.mkdir(parents=True, exist_ok=True)
    base = RUNS / "base-72"
    if not args.collect:
        ensure_base(base)
        grid = [tuple(args.only.split(":"))] if args.only else GRID
        for objective, trainable in grid:
            run_setting(base, objective, trainable, args.tokens, args.seq_len, args.batch_size)
    text = table()
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("# Adaptation benchmark\n\n" + text)
    if args.readme:
        readme = ROOT / "README.md"
        body = readme.read_text()
        new = re.sub(
            r"<!-- adapt:start -->.*<!-- adapt:end -->",
            lambda _m: "<!-- adapt:start -->\n" + text + "<!-- adapt:end -->",
            body,
            flags=re.S,
        )
        readme.write_text(new)


if __name__ == "__main__":
    main()
