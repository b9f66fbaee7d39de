"""What each attention bias a bias-free graph (llama.cpp's deepseek2) cannot hold costs a real biased conversion
(issue 50, Required 1): the conversion scored with each part of :data:`mla_convert.engines.bias_free.BIAS_PARTS`
zeroed, then all of them (the function ``export --format gguf --drop-attention-biases`` writes), on evaluation
splits no conversion reads; the source with its own q/k/v biases zeroed beside it, for scale.

    .venv/bin/python benchmarks/gguf_biases.py --model qwen2.5-coder-1.5b --ckpt OUT   # OUT: a factor output
    .venv/bin/python benchmarks/gguf_biases.py --collect     # the table (docs/results.md block gguf-biases)

Rows are merged into ``benchmarks/results/gguf_biases.json`` as each finishes.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "gguf_biases.json"
#: Evaluation windows of 512 tokens per domain (each corpus's evaluation split).
EVALS = {"wikipedia": 4, "news": 4, "python": 4}
#: Rows: the biases zeroed in the conversion (None: the conversion as written).
ROWS: dict[str, list[str] | None] = {
    "as converted": None,
    "without the query bias": ["query"],
    "without the rope key's bias": ["rope_key"],
    "without the output bias (value bias through attention)": ["output"],
    "without all three (--drop-attention-biases, the GGUF)": ["query", "rope_key", "output"],
}


@torch.no_grad()
def measure(model_name: str, ckpt: Path) -> None:
    """Score every row of :data:`ROWS` on ``ckpt`` (a conversion of ``model_name``) and the source with and without
    its biases; merge into :data:`RESULTS` and print the table."""
    from transformers import AutoTokenizer

    from mla_convert.engines.bias_free import attention_bias_parts, drop_attention_biases
    from mla_convert.metrics import evaluate
    from mla_convert.mla.checkpoint import load_checkpoint
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    src = open_source(model_name)
    tok = AutoTokenizer.from_pretrained(str(src.path))
    evals = {
        name: token_windows(tok, split_documents(load_documents(name))["evaluation"], 512, n, bos=adds_bos(tok))
        for name, n in EVALS.items()
    }
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    source = load_source_model(src).eval()
    rows: dict[str, Any] = {"source": {k: evaluate(source, v).perplexity for k, v in evals.items()}}
    for name, p in source.named_parameters():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")):
            p.zero_()
    rows["source without its q/k/v biases"] = {k: evaluate(source, v).perplexity for k, v in evals.items()}
    del source
    model = load_checkpoint(ckpt).eval()
    kept = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(".bias")}
    for row, parts in ROWS.items():
        started = time.perf_counter()
        dropped = drop_attention_biases(model, parts) if parts else []
        rows[row] = {**{k: evaluate(model, v).perplexity for k, v in evals.items()}, "dropped": dropped,
                     "seconds": round(time.perf_counter() - started, 1)}
        params = dict(model.named_parameters())
        for n, t in kept.items():
            params[n].data.copy_(t)
        print(row, rows[row], flush=True)
    results[model_name] = {
        "checkpoint": ckpt.name,
        "parts": attention_bias_parts(model.config),
        "rows": rows,
        "machine": f"{platform.platform()}, {torch.get_num_threads()} threads",
    }
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(block(), flush=True)


def block() -> str:
    """The ``gguf-biases`` block (docs/results.md) from the stored rows."""
    results = json.loads(RESULTS.read_text())
    lines = [
        "Perplexity with the attention biases a bias-free graph cannot hold zeroed (`mla_convert/engines/bias_free.py`), "
        "on evaluation splits no conversion reads (512-token windows: "
        + ", ".join(f"{k} {n}" for k, n in EVALS.items())
        + "; x: over the source's). The last conversion row is the function `export --format gguf "
        "--drop-attention-biases` writes. By `python benchmarks/gguf_biases.py --model MODEL --ckpt OUT`; table by "
        "`--collect`.",
        "",
        "| model | checkpoint | row | " + " | ".join(EVALS) + " |",
        "|---|---|---|" + "---:|" * len(EVALS),
    ]
    for model, r in results.items():
        base = r["rows"]["source"]
        for row, v in r["rows"].items():
            cells = [f"{v[k]:.2f} (x{v[k] / base[k]:.2f})" for k in EVALS]
            lines.append(f"| {model} | {r['checkpoint']} | {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ckpt", type=Path, help="the factor output of --model to score")
    ap.add_argument("--collect", action="store_true", help="measure nothing: the table into docs/results.md")
    args = ap.parse_args()
    if args.collect:
        from blocks import replace_block

        body = block()
        print(body)
        replace_block("gguf-biases", body)
        return
    if args.ckpt is None:
        raise SystemExit("error: --ckpt OUT (a factor output of --model) is required to measure")
    measure(args.model, args.ckpt)


if __name__ == "__main__":
    main()
