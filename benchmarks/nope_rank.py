"""What the query's NoPE-width bound costs and saves (``--qk-nope-head-dim``; issue 34 item 3, issue 51 item 2).

With one shared rope head the query's NoPE width is ``d + 2r(G-2)`` (``G`` KV heads); each head's NoPE score has
rank at most ``min(head_dim, kv_lora_rank)``, so reducing it to ``head_dim`` is exact (tests/convert/test_nope_oracle.py)
and only narrower widths cost quality. A default conversion of a source with 4 or more KV heads bounds it at
``head_dim`` (``mla_convert.convert.options.resolve.bound_nope_width``). Rows: SmolLM2-135M (``G = 3``: 112 wide at
24 pairs, not bounded by default), its exact MHA expansion (``G = 9``, each K/V head repeated: 400 wide, the shape
the bound is for) and Qwen2.5-Coder-1.5B-Instruct (``G = 2``: 128 = head_dim, nothing to bound), each converted
training-free at 31.25 % of its cache (one shared rope head, ``--rope-pairs 24``, ``--rope-strategy high``, one
``--kv-lora-rank`` for every layer, no ``o_proj`` refit so a reduction's cost is not repaired) with the natural
width, ``head_dim`` and ``head_dim / 2``. Columns: Wikipedia perplexity as a multiple of the source's (evaluation
windows, ``benchmarks/protocol.py``), the mean held-out attention error, and the weights ledger of the converted
config (``mla_convert.convert.estimate.weights``, bfloat16): attention and whole-model parameters against the
source's, and the break-even in cached tokens.

    .venv/bin/python benchmarks/nope_rank.py [--sources smollm2,smollm2-mha,qwen] [--calib-tokens 1024] [--wiki 2]
    .venv/bin/python benchmarks/nope_rank.py --collect     # the table from benchmarks/results/nope_rank.json

Rows are merged into ``benchmarks/results/nope_rank.json`` as each finishes (a stopped run keeps its rows).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import protocol
import torch

from mla_convert.convert.estimate.weights import weights_ledger
from mla_convert.convert.options.options import ConvertOptions, geometry, source_width
from mla_convert.convert.options.resolve import resolve_options
from mla_convert.convert.pipeline.build import convert_windows
from mla_convert.metrics import evaluate
from mla_convert.sources.checkpoint import load_source_model, open_source

RESULTS = Path(__file__).resolve().parent / "results" / "nope_rank.json"
#: source key -> (bundled source, label)
SOURCES = {
    "smollm2": ("smollm2-135m", "SmolLM2-135M"),
    "smollm2-mha": ("smollm2-135m", "SmolLM2-135M MHA expansion"),
    "qwen": ("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B"),
}
PAIRS = 24
FRACTION = 0.3125


def mha_expansion(src: Any, model: Any, out: Path) -> Path:
    """SmolLM2's exact MHA expansion (tests/conftest.py ``mha_folder``): each K/V head repeated to 9 KV heads."""
    from transformers import AutoModelForCausalLM

    cfg = model.config.__class__.from_dict(model.config.to_dict())
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    cfg.num_key_value_heads = cfg.num_attention_heads
    mha = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = model.state_dict()
    d = src.head_dim
    for i in range(cfg.num_hidden_layers):
        for p in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{p}.weight"
            w = state[key].view(-1, d, state[key].shape[1])
            state[key] = w.repeat_interleave(rep, dim=0).reshape(-1, w.shape[-1])
    mha.load_state_dict(state, strict=False)
    mha.tie_weights()
    mha.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((src.path / f).read_bytes())
    return out


def measure(key: str, calib_tokens: int, wiki: int, tmp: Path) -> list[dict[str, Any]]:
    """Convert source ``key`` of :data:`SOURCES` at each width; one row per width (merged into :data:`RESULTS`)."""
    name, label = SOURCES[key]
    proto = protocol.load(calib_tokens, 1, {"wiki@512": wiki}, source=name)
    src, model = proto.src, proto.model
    if key == "smollm2-mha":
        src = open_source(str(mha_expansion(src, model, tmp)))
        model = load_source_model(src)
    base = evaluate(model, proto.evals["wiki@512"]).perplexity
    rows = []
    natural = geometry(ConvertOptions(rope_mode="shared", rope_strategy="high", rope_pairs=PAIRS), src).query_nope_width
    for width in (None, src.head_dim, src.head_dim // 2):
        if width is not None and width >= natural:
            continue  # nothing to bound (a reduction to the natural width only replicates the value rows per head)
        opts = ConvertOptions(rope_mode="shared", rope_strategy="high", rope_pairs=PAIRS, refit_o_proj="none",
                              kv_lora_rank=1, qk_nope_head_dim=width, dtype="float32", device="cpu",
                              calib_tokens=calib_tokens)
        geo = geometry(opts, src)
        rank = round(FRACTION * source_width(src)) - geo.rope_width
        opts = opts.model_copy(update={"kv_lora_rank": rank})
        # the width as given: None keeps the natural width (the default bound of 4 or more KV heads not applied)
        given = {k for k in opts.model_fields_set if getattr(opts, k) is not None} | {"qk_nope_head_dim"}
        resolution = resolve_options(opts, src, given=given)
        t0 = time.perf_counter()
        conv = convert_windows(src, opts, proto.calibration, proto.held_out, resolution=resolution)
        ppl = evaluate(conv.model, proto.evals["wiki@512"]).perplexity
        errs = [r.attn_rel_error for r in conv.layers if r.attn_rel_error is not None]
        ledger = weights_ledger(conv.config, src).as_dict()["places"]["mla"]
        row = {
            "source": label, "kv_heads": src.num_kv_heads, "head_dim": src.head_dim, "pairs": PAIRS,
            "kv_lora_rank": rank, "query_nope_width": geo.query_nope_width, "qk_nope_head_dim": width,
            "wiki_ppl_ratio": ppl / base, "attn_rel_error": sum(errs) / len(errs) if errs else None,
            "attention_ratio": ledger["attention_ratio"], "model_ratio": ledger["model_ratio"],
            "break_even_tokens": ledger["break_even_tokens"], "seconds": time.perf_counter() - t0,
            "calib_tokens": calib_tokens, "wiki_windows": wiki,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
        stored = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
        stored[f"{key}/{width if width is not None else 'none'}"] = row
        RESULTS.write_text(json.dumps(stored, indent=1) + "\n")
        del conv  # one converted model at a time (a 1.5B in float32 is 6 GB)
        gc.collect()
    return rows


def shape_rows(name: str = "llama8b") -> list[dict[str, Any]]:
    """The weights ledger of a default conversion of a real model's shape (``benchmarks/scale_sources.py``'s
    ``name``; config only, no weights: the estimate ``inspect`` prints), unbounded and bounded at each RoPE pairs
    candidate the default's search measures."""
    from scale_sources import SHAPES, make_config

    from mla_convert.convert.estimate.weights import estimate_ledger
    from mla_convert.sources.checkpoint import SourceModel, _rope_tables
    from mla_convert.sources.families import families

    cfg = make_config(SHAPES[name])
    inv_freq, scaling = _rope_tables(cfg)
    src = SourceModel(Path("."), f"{name} shape", [], cfg, families()[cfg.model_type], {}, inv_freq, scaling,
                      None)  # type: ignore[arg-type]  # config only: estimate_ledger reads no tensor
    res = resolve_options(ConvertOptions(), src)
    rows = []
    for pairs in res.rope_candidates or (res.options.rope_pairs,):
        for width in (None, res.options.qk_nope_head_dim):
            opts = res.options.model_copy(update={"rope_pairs": pairs, "qk_nope_head_dim": width})
            mla = estimate_ledger(src, opts).as_dict()["places"]["mla"]
            rows.append({"shape": SHAPES[name].description, "pairs": pairs, "qk_nope_head_dim": width,
                         "query_nope_width": geometry(opts, src).query_nope_width,
                         "attention_ratio": mla["attention_ratio"], "model_ratio": mla["model_ratio"],
                         "break_even_tokens": mla["break_even_tokens"]})
    return rows


def shape_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`shape_rows`."""
    out = ["| shape | RoPE pairs | query NoPE width | --qk-nope-head-dim | attention x | model x | break-even (tokens) |",
           "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        be = "never" if r["break_even_tokens"] is None else f"{r['break_even_tokens']:,}"
        w = "- (kept)" if r["qk_nope_head_dim"] is None else f"{r['qk_nope_head_dim']} (the default bound)"
        out.append(f"| {r['shape']} | {r['pairs']} | {r['query_nope_width']} | {w} | {r['attention_ratio']:.2f} | "
                   f"{r['model_ratio']:.3f} | {be} |")
    return "\n".join(out)


def table(results: dict[str, dict[str, Any]]) -> str:
    """The markdown table of stored rows (docs/results.md ``nope-bound``)."""
    out = [
        "| source (KV heads) | query NoPE width | --qk-nope-head-dim | wiki ppl x source | attn err | "
        "attention x | model x | break-even (tokens) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results.values():
        w = r["qk_nope_head_dim"]
        given = "- (kept)" if w is None else (f"{w} (= head_dim, exact)" if w >= r["head_dim"] else f"{w} (lossy)")
        be = "never" if r["break_even_tokens"] is None else f"{r['break_even_tokens']:,}"
        err = "-" if r["attn_rel_error"] is None else f"{r['attn_rel_error']:.4f}"
        out.append(f"| {r['source']} ({r['kv_heads']}) | {r['query_nope_width']} | {given} | "
                   f"x{r['wiki_ppl_ratio']:.4f} | {err} | {r['attention_ratio']:.2f} | {r['model_ratio']:.3f} | {be} |")
    first = next(iter(results.values()), None)
    if first is not None:
        out += ["", f"{PAIRS} RoPE pairs on one shared rope head, one kv_lora_rank per layer at {FRACTION:.2%} of the "
                "source's cache, no o_proj refit, float32; Wikipedia evaluation windows "
                f"({first['wiki_windows']} x 512 tokens), {first['calib_tokens']} calibration tokens; weights in "
                "bfloat16. Written by `python benchmarks/nope_rank.py`."]
    return "\n".join(out)


def block() -> str:
    """The tables from :data:`RESULTS` and the 8B shape's ledger (``benchmarks/collect.py``)."""
    stored = json.loads(RESULTS.read_text())
    order = {key: i for i, key in enumerate(SOURCES)}
    rows = dict(sorted(stored.items(), key=lambda kv: (order[kv[0].split("/")[0]], -(kv[1]["qk_nope_head_dim"] or 1e9))))
    return "\n".join([
        table(rows), "",
        "The default conversion of Llama-3-8B's shape at 31.25 % (the weights ledger estimated before conversion, as "
        "`mla-convert inspect` prints it, at each RoPE pairs candidate its search measures; bfloat16):", "",
        shape_table(shape_rows()),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", default="smollm2,smollm2-mha,qwen", help=f"comma-separated, of {', '.join(SOURCES)}")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--wiki", type=int, default=2, help="Wikipedia evaluation windows of 512")
    ap.add_argument("--collect", action="store_true", help="print the table of stored rows and exit")
    a = ap.parse_args()
    if a.collect:
        print(block())
        return
    with tempfile.TemporaryDirectory(prefix="nope-bench-") as tmp:
        for key in a.sources.split(","):
            measure(key, a.calib_tokens, a.wiki, Path(tmp))
    print(block())


if __name__ == "__main__":
    main()
