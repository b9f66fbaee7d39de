"""Quality at equal *served* cache (issue 27 item 3): what the engine allocates per token per layer, not what the
MLA checkpoint holds.

vLLM (GPU FlashMLA, CPU AMX_MLA) allocates ``512 + 64`` values per token per layer whatever the conversion, and
transformers' DeepSeek-V3 cache pads per-layer ranks to the largest. Rows, SmolLM2-135M, training-free, the
protocol of ``benchmarks/protocol.py`` (``factor``'s default calibration; Wikipedia and news evaluation windows,
never calibrated on):

- the default conversion (per-layer ranks for a 120-value budget) and its ``transformers`` / ``vllm`` served caches;
- the same served ``transformers`` cache spent as one uniform rank (no padding);
- ``factor --target vllm``: the conversion shaped to fill vLLM's row (:mod:`mla_convert.engines.vllm.shape`);
- llama.cpp's row (one ``kv_lora_rank`` for every layer plus the rope head's slots, K only) at the default's asked
  size, 120: per-layer ranks whose padded width is 120 against one rank at 120, and the d_c / rope splits of one
  rank (``--target llama.cpp`` takes its default from these rows: ``measured_splits.json``'s ``llamacpp``).

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

from mla_convert.convert.layer import steps
from mla_convert.convert.layer.factorize import allocate_ranks
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.pipeline.build import convert_windows
from mla_convert.engines.deepseek_v3.spec import rope_slots
from mla_convert.engines.vllm.shape import shape_for_engine
from mla_convert.engines.vllm.spec import ENGINE_ROWS
from mla_convert.metrics import evaluate

RESULTS = Path(__file__).parent / "results"


#: SmolLM2-135M's query heads and head_dim (the arithmetic column).
HEADS, HEAD_DIM = 9, 64
#: The size the llama.cpp rows are asked for: the default's 120 values per token per layer (31.25 % of 384).
LLAMACPP_ROW = 120


def served(ranks: list[int], rope: int, slots: int) -> dict[str, int]:
    """Cache values per token per layer: the MLA checkpoint (mean over layers), transformers and llama.cpp (the export:
    the largest rank plus the ``slots`` of its one plain rope table, :func:`rope_slots`) and vLLM (its fixed row)."""
    vllm = sum(ENGINE_ROWS["vllm"])
    padded = max(ranks) + 2 * slots
    return {
        "mla": round(sum(ranks) / len(ranks) + rope),
        "transformers": padded,
        "llama.cpp": padded,
        "vllm": vllm,
    }


def capped_allocation(cap: int):  # type: ignore[no-untyped-def]
    """``allocate_ranks`` with its total lowered until no layer's rank is over ``cap``: per-layer ranks whose padded
    width is ``cap`` (the greedy allocation of the largest total that fits)."""

    def allocate(spectra: list, total: int, floor: int = 1) -> list[int]:  # type: ignore[type-arg]
        lo, hi = floor * len(spectra), total
        while lo < hi:  # the largest total whose greedy allocation stays under the cap
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if max(allocate_ranks(spectra, mid, floor)) <= cap else (lo, mid - 1)
        return allocate_ranks(spectra, lo, floor)

    return allocate


def llamacpp_plans(default: ConvertOptions) -> list[tuple[str, ConvertOptions, int | None]]:
    """The llama.cpp rows at :data:`LLAMACPP_ROW`: (name, options, per-layer rank cap or None)."""
    row = LLAMACPP_ROW
    high = default.model_copy(update={"rope_strategy": "high"})

    def one(rank: int, pairs: int, strategy: str = "high") -> ConvertOptions:
        return default.model_copy(update={"rope_strategy": strategy, "rope_pairs": pairs, "kv_lora_rank": rank,
                                          "cache_budget": None, "cache_fraction": None})  # fmt: skip

    return [
        (f"llama.cpp row {row}: one rank 72, high r=24", one(72, 24), None),
        (f"llama.cpp row {row}: per-layer ranks (budget 120) capped at 72, high r=24",
         high.model_copy(update={"rope_pairs": 24, "cache_budget": 120.0, "cache_fraction": None}), 72),
        (f"llama.cpp row {row}: one rank 64, high r=28", one(64, 28), None),
        (f"llama.cpp row {row}: one rank 96, high r=12", one(96, 12), None),
        (f"llama.cpp row {row}: one rank 56, 2-norm r=24", one(56, 24, "2-norm"), None),
    ]  # fmt: skip


def pinned_slots() -> int:
    """Rope slots of the pinned reference conversion's kept frequencies (the default's 2-norm r=24 selection, the
    same calibration): for the rows measured before the llama.cpp column was recorded."""
    pin = json.loads(
        (Path(__file__).resolve().parents[1] / "manifests" / "smollm2-135m-reference.json").read_text()
    )
    return len(rope_slots(pin["rope"]["inv_freq"]).inv_freq)


def collect_block() -> str:
    """The ``engine-shape`` block from the table the last run stored (``results/engine_shape.md``, written from
    ``engine_shape.jsonl`` and the protocol's calibration counts)."""
    return (RESULTS / "engine_shape.md").read_text().strip("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wiki", type=int, default=16, help="Wikipedia evaluation windows of 512")
    ap.add_argument("--news", type=int, default=8, help="news evaluation windows of 512")
    ap.add_argument("--calib-tokens", type=int, default=None, help="calibration budget (default: factor's)")
    ap.add_argument("--readme", action="store_true")
    ap.add_argument(
        "--only", action="append", default=[], help="measure only rows whose name contains this (repeatable)"
    )
    ap.add_argument(
        "--collect", action="store_true", help="measure nothing: the block again from results/engine_shape.md"
    )
    ap.add_argument(
        "--from-log", action="store_true", help="measure nothing: the table (and with --readme the block and the choice) "
        "from results/engine_shape.jsonl",
    )  # fmt: skip
    a = ap.parse_args()
    log = RESULTS / "engine_shape.jsonl"
    if a.from_log:
        publish([json.loads(x) for x in log.read_text().splitlines()], a.readme)
        return
    if a.collect:
        text = collect_block()
        print(text)
        if a.readme:
            from blocks import replace_block

            replace_block("engine-shape", text)
        return
    proto = protocol.load(a.calib_tokens, 8, {"wiki@512": a.wiki, "news@512": a.news})
    key = [int(proto.calibration.numel()), a.wiki, a.news]  # a row is reused only under the same protocol
    scored = {
        **proto.evals,
        "dev@512": proto.dev,
    }  # dev: the adaptation split, which chooses (never reported alone)
    base = {k: evaluate(proto.model, ids).perplexity for k, ids in scored.items()}
    done = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    default = ConvertOptions(dtype="float32", device="cpu")
    plans: list[tuple[str, ConvertOptions | None, int | None]] = [
        ("default (--cache-budget 120, per-layer ranks)", default, None),
        ("one rank at the default's transformers cache", None, None),  # filled from the default's ranks
        (
            "--target vllm (one rope head of 32, one rank)",
            shape_for_engine(default, proto.src, "vllm")[0],
            None,
        ),
        *llamacpp_plans(default),
    ]
    widest: int | None = None  # the default's largest rank
    for name, opts, cap in plans:
        done = (
            [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        )  # another run's rows too
        if a.only and not any(o in name for o in a.only):
            continue
        prior = next((r for r in done if r["conversion"] == name and protocol_of(r) == key), None)
        if prior is None:
            if opts is None:
                if widest is None:
                    continue
                opts = default.model_copy(update={"cache_budget": None, "kv_lora_rank": widest})
            t0 = time.perf_counter()
            steps.allocate_ranks = capped_allocation(cap) if cap else allocate_ranks  # type: ignore[attr-defined]
            conv = convert_windows(proto.src, opts, proto.calibration, proto.held_out)
            steps.allocate_ranks = allocate_ranks  # type: ignore[attr-defined]
            ranks = [int(r) for r in conv.config.kv_lora_rank]
            rope = conv.config.num_rope_heads * conv.config.qk_rope_head_dim
            slots = len(rope_slots(conv.config.rope_inv_freq).inv_freq)
            prior = {
                "conversion": name, "eval": [a.wiki, a.news], "protocol": key, "ranks": [min(ranks), max(ranks)],
                "cache": served(ranks, rope, slots), "rope_slots": slots,
                **{f"{k} ratio": evaluate(conv.model, ids).perplexity / base[k] for k, ids in scored.items()},
                "seconds": round(time.perf_counter() - t0),
            }  # fmt: skip
            print(prior, flush=True)
            done.append(prior)
            RESULTS.mkdir(parents=True, exist_ok=True)
            with log.open("a") as f:
                f.write(json.dumps(prior) + "\n")
        if name.startswith("default"):
            widest = int(prior["ranks"][1])
    publish(done, a.readme)


def publish(done: list[dict], readme: bool) -> None:  # type: ignore[type-arg]
    """Write ``results/engine_shape.md`` from the rows; with ``readme`` also the ``engine-shape`` block and the
    llama.cpp choice into ``measured_splits.json``."""
    lines = table(done)
    (RESULTS / "engine_shape.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if readme:
        from blocks import replace_block

        replace_block("engine-shape", "\n".join(lines))
        record_llamacpp(done)


def protocol_of(row: dict) -> list[int]:  # type: ignore[type-arg]
    """``[calibration tokens, wiki windows, news windows]`` a row was measured with (rows from before the key:
    ``factor``'s default 16384 tokens)."""
    return list(row.get("protocol") or [16384, *row["eval"]])


def table(done: list[dict]) -> list[str]:  # type: ignore[type-arg]
    """The ``engine-shape`` block: one row per measured conversion, and the llama.cpp choice."""
    lines = [
        "SmolLM2-135M-Instruct, training-free; calibration: `factor`'s spread of windows across the Wikipedia "
        "calibration split at each row's token budget. Perplexity ratio to the source on 8 x 512 dev tokens (the "
        "Wikipedia adaptation split, read by no conversion: they choose) and on the Wikipedia and news evaluation "
        "splits (windows of 512, never calibrated on, never choose; their count in brackets). Cache in values per "
        "token per layer: what the MLA checkpoint holds, and what each engine allocates: transformers and llama.cpp "
        "pad per-layer ranks to the largest and hold the rope head's slots of one plain table (2-norm's 24 pairs "
        "span 32 slots, 64 values; `high`'s r pairs r slots); vLLM allocates 512 + 64. Rows measured before the slots "
        "were recorded take them from the pinned reference manifest's kept frequencies (the same 2-norm selection) "
        "and have no dev column. Compare rows of the same calibration budget. Arithmetic: the multiply-adds llama.cpp's "
        f"absorbed attention does per cached token per layer, H (2 d_c + d_R) with d_c the padded rank (the source's "
        f"2 H d = {2 * HEADS * HEAD_DIM}; docs/math.md). Written by `python benchmarks/engine_shape.py --readme`.",
        "",
        "| conversion | calibration tokens | latent ranks | cache MLA | served: transformers, llama.cpp | served: vLLM "
        "| llama.cpp multiply-adds / cached token | dev x source | wikipedia x source | news x source |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in done:
        c, lo, hi = r["cache"], *r["ranks"]
        calib, wiki, news = protocol_of(r)
        padded = c.get("llama.cpp") or (c["transformers"] if r["conversion"].startswith("--target vllm")
                                        else hi + 2 * pinned_slots())  # fmt: skip
        dev = f"{r['dev@512 ratio']:.2f}" if "dev@512 ratio" in r else "-"
        macs = HEADS * (hi + padded)  # H (2 d_c + d_R), d_R = padded - d_c
        lines.append(
            f"| {r['conversion']} | {calib} | {lo if lo == hi else f'{lo}-{hi}'} | {c['mla']} | {padded} | "
            f"{c['vllm']} | {macs} | {dev} | {r['wiki@512 ratio']:.2f} ({wiki}) | {r['news@512 ratio']:.2f} ({news}) |"
        )
    choice = llamacpp_choice(done)
    if choice:
        lines += ["", f"- `--target llama.cpp`'s default, chosen on dev: {choice['evidence']}."]
    return lines


def llamacpp_choice(done: list[dict]) -> dict | None:  # type: ignore[type-arg]
    """``--target llama.cpp``'s default from the llama.cpp rows (those of the protocol most of them share): the
    one-rank split with the lowest dev ratio (its rope share of the row), with the evidence (every llama.cpp row's
    dev and wiki ratios); None before any."""
    rows = [
        r
        for r in done
        if r["conversion"].startswith(f"llama.cpp row {LLAMACPP_ROW}") and "dev@512 ratio" in r
    ]
    if not rows:
        return None
    keys = [protocol_of(r) for r in rows]
    common = max(keys, key=keys.count)
    rows = [r for r in rows if protocol_of(r) == common]
    one = [r for r in rows if ": one rank" in r["conversion"] and "high" in r["conversion"]]
    if not one:
        return None
    best = min(one, key=lambda r: r["dev@512 ratio"])
    rank = int(best["ranks"][0])
    pairs = (LLAMACPP_ROW - rank) // 2
    rows += [r for r in done if r["conversion"].startswith("default") and protocol_of(r) == common]
    others = "; ".join(f"{r['conversion'].split(': ', 1)[-1]} (served {r['cache']['llama.cpp']}) x{r['dev@512 ratio']:.2f} / "
        f"x{r['wiki@512 ratio']:.2f}"
                       for r in rows if r is not best)  # fmt: skip
    evidence = (f"benchmarks/engine_shape.py on SmolLM2-135M-Instruct at llama.cpp's row {LLAMACPP_ROW} "
                f"({common[0]} calibration tokens), dev / wiki ratio: one rank {rank} + high r={pairs} "
                f"x{best['dev@512 ratio']:.2f} / x{best['wiki@512 ratio']:.2f}{'; ' + others if others else ''}")  # fmt: skip
    return {
        "served_row": LLAMACPP_ROW, "cache_fraction": LLAMACPP_ROW / 384, "rope_strategy": "high",
        "rope_pairs": pairs, "kv_lora_rank": rank, "rope_share": round(2 * pairs / LLAMACPP_ROW, 4),
        "dev_ratio": round(best["dev@512 ratio"], 3), "wiki_ratio": round(best["wiki@512 ratio"], 3),
        "calib_tokens": common[0], "evidence": evidence,
    }  # fmt: skip


def record_llamacpp(done: list[dict]) -> None:  # type: ignore[type-arg]
    """Write :func:`llamacpp_choice` into ``measured_splits.json`` (key ``llamacpp``; the other keys stay)."""
    choice = llamacpp_choice(done)
    if choice is None:
        return
    path = Path(__file__).resolve().parents[1] / "mla_convert" / "convert" / "measured_splits.json"
    data = json.loads(path.read_text())
    data["llamacpp"] = choice
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
