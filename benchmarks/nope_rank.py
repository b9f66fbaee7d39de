"""The quality cost of the NoPE-width reduction (``--qk-nope-head-dim``, issue 34 item 3) on real weights.

With one shared rope head the query's NoPE width is ``d + 2r(G-2)``; each head's NoPE score has rank at most
``min(head_dim, kv_lora_rank)``, so reducing to that is exact and only narrower widths cost anything. Rows:
SmolLM2-135M (G = 3: 112 wide at 24 pairs) and its exact MHA expansion (G = 9, each K/V head repeated: 400 wide),
converted training-free (shared rope head, ``--rope-pairs 24``, ``--kv-lora-rank`` fixed, no ``o_proj`` refit so the
reduction's cost is not repaired) with the natural width and forced narrower; perplexity ratio to the source on
Wikipedia evaluation windows (``benchmarks/protocol.py``), and the mean share of the weighted NoPE score energy the
reduction kept (layer 0..L-1, all heads; 1.0 = exact).

    .venv/bin/python benchmarks/nope_rank.py [--calib-tokens 2048] [--wiki 2] [--widths none,64,32,16] [--mha]

Measured (2-core machine shared with other jobs, ~3-4 min a conversion; ``--calib-tokens 1024 --wiki 2``, one width a
run): SmolLM2-135M, query NoPE width 112 kept: wiki perplexity x4.0510 of the source, mean held-out attention error
0.5890; ``--qk-nope-head-dim 32`` (half of head_dim 64, lossy): x4.1072, 0.5917. Widths >= 64 = head_dim are exact
(tests/convert/test_nope_oracle.py); the MHA expansion (``--mha``) and 16 were not run for time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import protocol
import torch

from mla_convert.convert.options.options import ConvertOptions, geometry
from mla_convert.convert.pipeline.build import convert_windows
from mla_convert.metrics import evaluate
from mla_convert.sources.checkpoint import load_source_model, open_source


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--wiki", type=int, default=2, help="Wikipedia evaluation windows of 512")
    ap.add_argument("--widths", default="none,64,32,16", help="comma-separated --qk-nope-head-dim values (none: keep)")
    ap.add_argument("--rank", type=int, default=96, help="--kv-lora-rank")
    ap.add_argument("--mha", action="store_true", help="also the MHA expansion (9 KV heads)")
    a = ap.parse_args()
    proto = protocol.load(a.calib_tokens, 1, {"wiki@512": a.wiki})
    sources = [("SmolLM2-135M (G=3)", proto.src, proto.model)]
    tmp = tempfile.TemporaryDirectory(prefix="nope-bench-")
    if a.mha:
        folder = mha_expansion(proto.src, proto.model, Path(tmp.name))
        src = open_source(str(folder))
        sources.append(("SmolLM2 MHA expansion (G=9)", src, load_source_model(src)))
    widths = [None if w == "none" else int(w) for w in a.widths.split(",")]
    print("| source | query NoPE width | --qk-nope-head-dim | wiki ppl x source | attn err (mean) | s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, src, model in sources:
        base = evaluate(model, proto.evals["wiki@512"]).perplexity
        for w in widths:
            opts = ConvertOptions(rope_mode="shared", rope_strategy="high", rope_pairs=24, kv_lora_rank=a.rank,
                                  refit_o_proj="none", qk_nope_head_dim=w, dtype="float32", device="cpu",
                                  calib_tokens=a.calib_tokens)
            natural = geometry(opts, src).query_nope_width
            t0 = time.perf_counter()
            conv = convert_windows(src, opts, proto.calibration, proto.held_out)
            ppl = evaluate(conv.model, proto.evals["wiki@512"]).perplexity
            errs = [r.attn_rel_error for r in conv.layers if r.attn_rel_error is not None]
            err = sum(errs) / len(errs) if errs else float("nan")
            print(f"| {name} | {natural} | {w if w is not None else '-'} | {ppl / base:.4f} | {err:.4f} | "
                  f"{time.perf_counter() - t0:.0f} |", flush=True)
    tmp.cleanup()


if __name__ == "__main__":
    main()
