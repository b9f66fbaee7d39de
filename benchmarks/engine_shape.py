"""Quality at equal *served* cache (issue 27 item 3): what the engine allocates per token per layer, not what the
MLA checkpoint holds.

vLLM (GPU FlashMLA, CPU AMX_MLA) allocates ``512 + 64`` values per token per layer whatever the conversion, and
transformers' DeepSeek-V3 cache pads per-layer ranks to the largest. Rows, SmolLM2-135M, training-free, the
protocol of ``benchmarks/protocol.py`` (``factor``'s default calibration; Wikipedia and news evaluation windows,
never calibrated on):

- the default conversion (per-layer ranks for a 120-value budget) and its ``transformers`` / ``vllm`` served caches;
- the same served ``transformers`` cache spent as one uniform rank (no padding);
- ``factor --target vllm``: the conversion shaped to fill vLLM's row (:mod:`mla_convert.convert.engine`).

    .venv/bin/python benchmarks/engine_shape.py [--wiki 16] [--news 8] [--readme]

Finished rows are appended to ``benchmarks/results/engine_shape.jsonl`` (a rerun skips them); the table goes to
``benchmarks/results/engine_shape.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import protocol

from mla_convert.convert.build import convert_windows
from mla_convert.convert.engine import ENGINE_ROWS, shape_for_engine
from mla_convert.convert.options import ConvertOptions
from mla_convert.metrics import evaluate

RESULTS = Path(__file__).parent / "results"


def served(ranks: list[int], rope: int) -> dict[str, int]:
    """Cache values per token per layer: the MLA checkpoint (mean over layers), transformers (padded to the largest
    rank) and vLLM (its fixed row)."""
    vllm = sum(ENGINE_ROWS["vllm"])
    return {"mla": round(sum(ranks) / len(ranks) + rope), "transformers": max(ranks) + rope, "vllm": vllm}


def collect_block() -> str:
    """The ``engine-shape`` block from the table the last run stored (``results/engine_shape.md``, written from
    ``engine_shape.jsonl`` and the protocol's calibration counts)."""
    return (RESULTS / "engine_shape.md").read_text().strip("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wiki", type=int, default=16, help="Wikipedia evaluation windows of 512")
    ap.add_argument("--news", type=int, default=8, help="news evaluation windows of 512")
    ap.add_argument("--readme", action="store_true")
    ap.add_argument("--collect", action="store_true", help="measure nothing: the block again from results/engine_shape.md")
    a = ap.parse_args()
    if a.collect:
        text = collect_block()
        print(text)
        if a.readme:
            from blocks import replace_block

            replace_block("engine-shape", text)
        return
    proto = protocol.load(None, 8, {"wiki@512": a.wiki, "news@512": a.news})
    base = {k: evaluate(proto.model, ids).perplexity for k, ids in proto.evals.items()}
    log = RESULTS / "engine_shape.jsonl"
    done = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    default = ConvertOptions(dtype="float32", device="cpu")
    plans: list[tuple[str, ConvertOptions | None]] = [
        ("default (--cache-budget 120, per-layer ranks)", default),
        ("one rank at the default's transformers cache", None),  # filled from the default's ranks
        ("--target vllm (one rope head of 32, one rank)", shape_for_engine(default, proto.src, "vllm")[0]),
    ]
    widest: int | None = None  # the default's largest rank
    for name, opts in plans:
        prior = next((r for r in done if r["conversion"] == name and r["eval"] == [a.wiki, a.news]), None)
        if prior is None:
            if opts is None:
                if widest is None:
                    continue
                opts = default.model_copy(update={"cache_budget": None, "kv_lora_rank": widest})
            t0 = time.perf_counter()
            conv = convert_windows(proto.src, opts, proto.calibration, proto.held_out)
            ranks = [int(r) for r in conv.config.kv_lora_rank]
            rope = conv.config.num_rope_heads * conv.config.qk_rope_head_dim
            prior = {
                "conversion": name, "eval": [a.wiki, a.news], "ranks": [min(ranks), max(ranks)],
                "cache": served(ranks, rope),
                **{f"{k} ratio": evaluate(conv.model, ids).perplexity / base[k] for k, ids in proto.evals.items()},
                "seconds": round(time.perf_counter() - t0),
            }  # fmt: skip
            print(prior, flush=True)
            done.append(prior)
            RESULTS.mkdir(parents=True, exist_ok=True)
            with log.open("a") as f:
                f.write(json.dumps(prior) + "\n")
        if name.startswith("default"):
            widest = int(prior["ranks"][1])
    lines = [
        f"SmolLM2-135M-Instruct, training-free, `factor`'s default calibration ({proto.calibration.numel()} tokens "
        f"from {proto.documents} documents); perplexity ratio to the source on {a.wiki} x 512 Wikipedia and "
        f"{a.news} x 512 news evaluation tokens (never calibrated on). Cache in values per token per layer: what the "
        "MLA checkpoint holds, and what each engine allocates (transformers pads per-layer ranks to the largest; vLLM "
        "allocates 512 + 64). Written by `python benchmarks/engine_shape.py --readme`.",
        "",
        "| conversion | latent ranks | cache MLA | served: transformers | served: vLLM | wikipedia x source | news x source |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in done:
        if r["eval"] == [a.wiki, a.news]:
            c, lo, hi = r["cache"], *r["ranks"]
            lines.append(f"| {r['conversion']} | {lo if lo == hi else f'{lo}-{hi}'} | {c['mla']} | {c['transformers']} | "
                         f"{c['vllm']} | {r['wiki@512 ratio']:.2f} | {r['news@512 ratio']:.2f} |")
    (RESULTS / "engine_shape.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if a.readme:
        from blocks import replace_block

        replace_block("engine-shape", "\n".join(lines))


if __name__ == "__main__":
    main()
