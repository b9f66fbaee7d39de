"""Adaptation benchmark: held-out perplexity before and after 100k / 500k / 1M training tokens at 31.25 % and
18.75 % of the KV cache.

    python benchmarks/adapt.py                       # run every setting (hours on a 2-core CPU), print the table
    python benchmarks/adapt.py --list                # the settings
    python benchmarks/adapt.py --only c72-mix-all    # one setting (comma-separated for several; lr / data variants too)
    python benchmarks/adapt.py --until 100000        # the 100k screen: stop each run (resumably) there
    python benchmarks/adapt.py --collect             # only tabulate what benchmarks/runs/ holds (also partial runs)
    python benchmarks/adapt.py --collect --readme    # ... and write the table into docs/results.md

Each setting is an ``mla-convert adapt`` job on a SmolLM2-135M conversion (120 values/token/layer = the
default conversion, 24 rope pairs; or 72 with 16 pairs = the best measured training-free setting at that
size), trained on a 1M-token schedule over the adaptation splits of Wikipedia and Shakespeare (``--data
wikipedia --data shakespeare``: ~1.3M tokens, so no row repeats within 1M) and evaluated at the start,
every 100k tokens and at the end on the Wikipedia evaluation split and the news corpus (never trained on).
Runs live in ``benchmarks/runs/<setting>/`` (git-ignored) and are resumable: re-running the script
continues stopped runs (``--resume``) instead of starting over.
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
#: cache values/token/layer -> factor flags (docs/results.md's training-free table chose the rope pairs)
FACTOR = {
    120: ["--cache-budget", "120", "--rope-pairs", "24"],
    72: ["--cache-budget", "72", "--rope-pairs", "16"],
}
#: the training mixtures: the two corpora by size (~1.3M tokens; Shakespeare is about half of every batch), or
#: Wikipedia weighted 2 : 1 (its 379k adaptation tokens then repeat within 1M: about 1.8 passes)
MIXTURES = {
    "wiki+shakespeare": ["--data", "wikipedia", "--data", "shakespeare"],
    "wiki x2 + shakespeare": ["--data", "wikipedia,weight=2", "--data", "shakespeare,weight=1"],
}
TARGETS = {120: (1.35, 1.20), 72: (1.8, 1.5)}  # x source perplexity after 500k / 1M tokens
# objective x trainable set at lr 3e-4 with bf16 autocast (2x faster than fp32 here; lr from the 40k-token
# probes of the pre-fix benchmark, benchmarks/results/adapt_pre_fix.md), per cache size.
SETTINGS = {
    f"c{c}-{o}-{t}": {"cache": c, "objective": o, "trainable": t, "lr": 3e-4, "data": "wiki+shakespeare"}
    for c in (120, 72)
    for o in ("mix", "distill", "lm")
    for t in ("all", "attention")
}
# at 72, lr 3e-4 with all parameters spiked (grad norm 181 at the end of warmup): a lower lr, and more Wikipedia
for _c in (120, 72):
    SETTINGS[f"c{_c}-mix-all-lr1e-4"] = {**SETTINGS[f"c{_c}-mix-all"], "lr": 1e-4}
    SETTINGS[f"c{_c}-mix-all-wiki2"] = {**SETTINGS[f"c{_c}-mix-all"], "data": "wiki x2 + shakespeare"}


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "mla_convert", *args], check=True)


def ensure_base(cache: int) -> Path:
    base = RUNS / f"base-{cache}"
    if not (base / "mla_manifest.json").is_file():
        cli("--quiet", "factor", "smollm2-135m", str(base), *FACTOR[cache], "--overwrite")
    return base


def run_setting(name: str, setting: dict, tokens: int, seq_len: int, batch: int, until: int | None) -> None:
    """Run (or continue) one setting; with ``until``, stop resumably once that many tokens are trained."""
    out = RUNS / name
    if (out / "adapt_report.json").is_file():
        return
    base = ensure_base(setting["cache"])
    steps_100k = max(1, 100_000 // (seq_len * batch))
    args = [
        "adapt", str(base), str(out), *MIXTURES[setting["data"]], "--tokens", str(tokens), "--seq-len", str(seq_len),
        "--batch-size", str(batch), "--eval-every", str(steps_100k), "--eval-windows", "8",
        "--also-eval", "news", "--checkpoint-every", "10", "--mixed-precision", "bf16",
    ]  # fmt: skip
    for key, value in setting.items():
        if key not in ("cache", "data"):
            args += ["--" + key.replace("_", "-"), str(value)]
    work = RUNS / f".{name}.adapt"
    done = 0
    if any(work.glob("step-*")):
        args.append("--resume")
        done = max(json.loads(p.read_text())["step"] for p in work.glob("step-*/state.json"))
    if until is not None:
        step_tokens = seq_len * batch
        steps = -(-until // step_tokens)  # the step that reaches `until`, then the next checkpoint
        steps = -(-steps // 10) * 10
        if steps <= done:
            return
        if steps * step_tokens < tokens:
            args += ["--stop-after", str(steps - done)]
    cli(*args)


def load_run(name: str, root: Path = RUNS) -> tuple[dict, list[dict]]:
    """(options, metrics) of a finished or stopped run."""
    options: dict = {}
    metrics: list[dict] = []
    for folder in (root / name, root / f".{name}.adapt"):
        if not options and (folder / "options.json").is_file():
            options = json.loads((folder / "options.json").read_text())
        if not options and (folder / "adapt_report.json").is_file():
            options = json.loads((folder / "adapt_report.json").read_text()).get("options", {})
        if not metrics and (folder / "metrics.jsonl").is_file():
            text = (folder / "metrics.jsonl").read_text()
            metrics = [json.loads(line) for line in text.splitlines() if line.strip()]
    return options, metrics


def at(evals: list[dict], tokens: int) -> dict | None:
    """The evaluation at the first step that reached ``tokens`` (within one step)."""
    hits = [e for e in evals if e["tokens"] >= tokens * 0.98]
    return hits[0] if hits else None


def run_names() -> list[str]:
    found = {
        p.name.removeprefix(".").removesuffix(".adapt")
        for p in RUNS.iterdir()
        if not p.name.startswith(("base-", "."))
    }
    found |= {p.name[1:].removesuffix(".adapt") for p in RUNS.glob(".*.adapt")}
    return sorted(found, key=lambda n: (list(SETTINGS).index(n) if n in SETTINGS else len(SETTINGS), n))


def recorded(results: Path, present: dict[str, int]) -> tuple[list[str], list[str]]:
    """Rows and evaluation lines of the table in ``results`` whose setting has no run folder here, or whose
    recorded run trained further than this machine's (``present``: setting -> tokens evaluated): they stay,
    marked †, so re-measuring one setting's start does not erase what was measured before."""
    if not results.exists():
        return [], []
    lines = results.read_text().splitlines()
    rows = [x for x in lines if x.startswith("| ") and x[2:3].isdigit()]
    curves = [x for x in lines if x.startswith("- `")]
    keep_rows, keep_curves = [], []
    for row, curve in zip(rows, curves, strict=False):
        name = curve.split("`")[1]
        reached = max((int(k) * 1000 for k in re.findall(r"\((\d+)k\)", curve)), default=0)
        if name in present and reached <= present[name]:
            continue
        cells = row.split(" | ", 1)
        keep_rows.append(cells[0] if cells[0].endswith("†") else cells[0] + " †")
        keep_rows[-1] += " | " + cells[1]
        keep_curves.append(curve if curve.startswith("- † ") else "- † " + curve[2:])
    return keep_rows, keep_curves


HEADER = "# Adaptation benchmark\n\n`python benchmarks/adapt.py --collect` wrote this table.\n\n"


def recorded_table() -> str:
    """The table the last ``--collect`` stored in ``results/adapt.md`` (what ``--readme`` put in the block)."""
    return RESULTS.read_text().removeprefix(HEADER)


def table() -> str:
    marks = (0, 100_000, 500_000, 1_000_000)
    rows = [
        "| cache | objective | trainable | lr | data | wiki before | @100k | @500k | @1M | news before | @100k | @500k "
        "| @1M | chat KL before -> latest | tokens/s | trained |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    curves = []
    src = None
    present: dict[str, int] = {}
    for name in run_names():
        o, m = load_run(name)
        evals = [e for e in m if e["kind"] == "eval"]
        train = [e for e in m if e["kind"] == "train"]
        if not evals or not o or name not in SETTINGS:
            continue
        present[name] = max(e["tokens"] for e in evals)
        src = src or (evals[0]["source_perplexity"], evals[0].get("other_source_perplexity"))
        cells = []
        for key, ref in (
            ("perplexity", "source_perplexity"),
            ("other_perplexity", "other_source_perplexity"),
        ):
            for tok in marks:
                e = at(evals, tok)
                cells.append(f"{e[key]:.2f} (x{e[key] / e[ref]:.2f})" if e and e.get(key) else "–")
        rate = train[-1]["tokens_per_s"] if train else 0
        cache = SETTINGS[name]["cache"]
        chat = "–"
        if evals[0].get("chat_kl") is not None:
            chat = f"{evals[0]['chat_kl']:.3f} -> {evals[-1]['chat_kl']:.3f} ({evals[-1]['tokens']:,})"
        rows.append(
            f"| {cache} ({cache / 384:.2%}) | {o['objective']} | {o['trainable']} | {o['lr']:g} | "
            f"{SETTINGS[name]['data']} | "
            + " | ".join(cells)
            + f" | {chat} | {rate:.0f} | {train[-1]['tokens'] if train else 0:,} |"
        )
        curves.append(
            f"- `{name}`: wiki "
            + " -> ".join(f"{e['perplexity']:.2f} ({e['tokens'] // 1000}k)" for e in evals)
            + "; news "
            + " -> ".join(f"{e['other_perplexity']:.2f}" for e in evals if e.get("other_perplexity"))
            + "; KL to the source "
            + " -> ".join(f"{e['kl']:.3f}" for e in evals)
        )
    old_rows, old_curves = recorded(RESULTS, present)
    rows += old_rows
    curves += old_curves
    cpu = "unknown CPU"
    info = Path("/proc/cpuinfo")
    if info.exists():
        found = re.search(r"model name\s*:\s*(.*)", info.read_text())
        cpu = found.group(1).strip() if found else cpu
    head = (
        f"SmolLM2-135M-Instruct converted at 120 values/token/layer (31.25 % of 384, 24 rope pairs) and 72 (18.75 %, "
        f"16 pairs). Source perplexity: wiki {src[0]:.2f}, news {src[1]:.2f} (8 x 512 evaluation-split tokens each); "
        "cells: perplexity (x source). "
        if src and src[1]
        else ""
    )
    head += (
        f"Targets (x source): 120 <= {TARGETS[120][0]} after 500k, <= {TARGETS[120][1]} after 1M; 72 <= "
        f"{TARGETS[72][0]} / <= {TARGETS[72][1]}. Machine: {cpu} (2 cores), torch {torch.__version__}, Python "
        f"{platform.python_version()}. Trained on the adaptation splits of Wikipedia and Shakespeare (data "
        "`wiki+shakespeare`: `--data wikipedia --data shakespeare`, by size; `wiki x2 + shakespeare`: weights 2 : 1; "
        "news is never trained on), 4 x 512-token sequences per step (2048 tokens), AdamW, "
        "bf16 autocast, 5 % warmup then cosine to 0.1x over a 1M-token schedule, so @100k and @500k are points "
        "of that schedule. '@100k' is the first evaluation at >= 98 % of 100k tokens (step 48 = 98,304). "
        "'–' = not reached. tokens/s is the last invocation's average (includes evaluations and any other load)."
    )
    if old_rows:
        head += (
            " † an earlier run's row, kept from this file: its run folder is not on this machine, and it adapted the "
            "conversion `factor` made by default on its day (see the git history of this file)."
        )
    head += (
        " Chat KL: KL(source || MLA) in nats per token on the source's greedy 32-token answers to 8 chat prompts "
        "(news-evaluation articles behind a summarize instruction; `--chat-prompts`)."
    )
    return (
        head
        + "\n\n"
        + "\n".join(rows)
        + "\n\nEvery evaluation (tokens trained):\n\n"
        + "\n".join(curves)
        + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated setting names, e.g. c72-mix-all (see --list)")
    ap.add_argument("--list", action="store_true", help="print the setting names and exit")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="the schedule's training tokens")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--until", type=int, help="stop each run (resumably) once it has trained this many tokens"
    )
    ap.add_argument("--collect", action="store_true", help="only tabulate existing runs")
    ap.add_argument("--readme", action="store_true", help="write the table into docs/results.md")
    args = ap.parse_args()
    if args.list:
        for name, setting in SETTINGS.items():
            print(name, setting)
        return
    RUNS.mkdir(parents=True, exist_ok=True)
    if not args.collect:
        names = args.only.split(",") if args.only else list(SETTINGS)
        unknown = [n for n in names if n not in SETTINGS]
        if unknown:
            ap.error(f"unknown setting(s) {', '.join(unknown)}; --list shows them")
        for name in names:
            run_setting(name, SETTINGS[name], args.tokens, args.seq_len, args.batch_size, args.until)
    text = table()
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(HEADER + text)
    if args.readme:
        from blocks import replace_block

        replace_block("adapt", text)

if __name__ == "__main__":
    main()
