"""Calibration that spans the text (issue 27): which calibration windows the conversion sees, measured on
evaluation windows only (Wikipedia's evaluation split and the news corpus's, never calibrated on).

The old default took the first windows of the calibration stream: 16 x 512 tokens, all of them from one article
(the split's first). ``spread`` takes the same number of windows evenly across the whole calibration split (every
document in turn), ``spread-64`` four times as many; those rows keep the old default's held-out windows (the
refit's keep check), so only the statistics' text changes. ``default`` is today's ``factor``: 16384 tokens spread
across the split, held-out windows interleaved, the refit on 8192 of the tokens. Rows at 120 and 72 values per token per layer with
the split measured best for each (24 and 16 RoPE pairs).

    .venv/bin/python benchmarks/calibration.py [--eval 16] [--sizes 120:24,72:16] [--readme]

Each finished row is appended to ``benchmarks/results/calibration.jsonl`` (a rerun skips rows already there);
the table goes to ``benchmarks/results/calibration.md``. About 3 minutes per row on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.pipeline.build import convert_windows
from mla_convert.convert.pipeline.text import HELD_OUT_WINDOWS, calibration_windows
from mla_convert.metrics import evaluate
from mla_convert.sources.checkpoint import load_source_model, open_source
from mla_convert.text.corpora import load_documents
from mla_convert.text.windows import split_documents, token_windows

RESULTS = Path(__file__).parent / "results"
WINDOW, CALIB = 512, 16


def spread(stream: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` windows of ``stream`` ``[N, T]`` evenly spaced over all ``N`` (the middle of each stretch)."""
    idx = [int((i + 0.5) * stream.shape[0] / count) for i in range(count)]
    return stream[idx]


def documents_of(tok, docs, rows: torch.Tensor, every: torch.Tensor) -> int:
    """How many documents the windows ``rows`` (taken from ``every``, the whole split's windows) touch."""
    eos = int(tok.eos_token_id)
    flat = every.reshape(-1)
    doc_id = torch.cumsum((flat == eos).long(), 0).view(every.shape)
    picked = {tuple(r.tolist()) for r in rows}
    touched: set[int] = set()
    for r, d in zip(every, doc_id, strict=True):
        if tuple(r.tolist()) in picked:
            touched.update(int(x) for x in d.unique())
    return len(touched)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval", type=int, default=16, help="evaluation windows per text")
    ap.add_argument("--sizes", default="120:24,72:16")
    ap.add_argument("--readme", action="store_true", help="also replace the calibration block (docs/results.md)")
    ap.add_argument("--collect", action="store_true", help="measure nothing: table the rows already logged")
    a = ap.parse_args()
    if a.collect:
        log = RESULTS / "calibration.jsonl"
        publish([json.loads(x) for x in log.read_text().splitlines()], a.eval, a.readme)
        return
    torch.manual_seed(0)
    src = open_source("smollm2-135m")
    model = load_source_model(src)
    tok = AutoTokenizer.from_pretrained(str(src.path))
    wiki = split_documents(load_documents("wikipedia"))
    every = token_windows(tok, wiki["calibration"], WINDOW, None, bos=False)
    held = every[CALIB : CALIB + HELD_OUT_WINDOWS]
    rest = torch.cat([every[:CALIB], every[CALIB + HELD_OUT_WINDOWS :]])  # never the held-out windows
    picked = calibration_windows(tok, wiki["calibration"], WINDOW, ConvertOptions().calibration_windows())
    selections = {  # name -> (calibration, held-out windows)
        "first-16 (old default)": (every[:CALIB], held), "spread-16": (spread(rest, CALIB), held),
        "spread-64": (spread(rest, 64), held), "default: 16384 spread": (picked.calibration, picked.held_out),
    }  # fmt: skip
    evals = {
        "wikipedia": token_windows(tok, wiki["evaluation"], WINDOW, a.eval, bos=False),
        "news": token_windows(tok, split_documents(load_documents("news"))["evaluation"], WINDOW, a.eval, bos=False),
    }
    base = {name: evaluate(model, ids).perplexity for name, ids in evals.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = RESULTS / "calibration.jsonl"
    done = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    for spec in a.sizes.split(","):
        budget, pairs = (int(v) for v in spec.split(":"))
        for name, (calib, held_windows) in selections.items():
            old = name.replace("(old default)", "(default)")
            if any(r["budget"] == budget and r["selection"] in (name, old) and r["eval_windows"] == a.eval for r in done):
                continue
            t0 = time.perf_counter()
            opts = ConvertOptions(dtype="float32", cache_budget=budget, rope_pairs=pairs, device="cpu")
            mla = convert_windows(src, opts, calib, held_windows).model
            row = {
                "budget": budget, "rope_pairs": pairs, "selection": name, "eval_windows": a.eval,
                "calib_tokens": int(calib.numel()), "calib_documents": documents_of(tok, wiki["calibration"], calib, every),
                **{f"{t} ratio": evaluate(mla, ids).perplexity / base[t] for t, ids in evals.items()},
                "source ppl": base, "seconds": round(time.perf_counter() - t0),
            }
            print(row, flush=True)
            done.append(row)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
    publish(done, a.eval, a.readme)


def block(done: list[dict], eval_windows: int) -> str:
    """The calibration table of the logged rows measured on ``eval_windows`` windows per text."""
    lines = [
        f"SmolLM2-135M-Instruct, default options but the calibration windows; perplexity ratio to the source on "
        f"{eval_windows} x {WINDOW} tokens of each text's evaluation split (never calibrated on). Written by "
        "`python benchmarks/calibration.py --readme`.",
        "",
        "| cache | rope pairs | calibration | tokens | documents | wikipedia x source | news x source |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in done:
        if r["eval_windows"] == eval_windows:
            lines.append(f"| {r['budget']} | {r['rope_pairs']} | {r['selection'].replace('(default)', '(old default)')} | "
                         f"{r['calib_tokens']} | {r['calib_documents']} | {r['wikipedia ratio']:.2f} | {r['news ratio']:.2f} |")
    return "\n".join(lines)


def publish(done: list[dict], eval_windows: int, readme: bool) -> None:
    """Write ``calibration.md`` (and with ``readme`` its block) from the logged rows."""
    text = block(done, eval_windows)
    (RESULTS / "calibration.md").write_text(text + "\n")
    print(text)
    if readme:
        from blocks import replace_block

        replace_block("calibration", text)

if __name__ == "__main__":
    main()
