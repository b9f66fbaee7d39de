"""Absorbed-prefill attention speed: the product's SDPA form against the three-einsum reference form.

Times :func:`mla_convert.mla.algebra.attend_latent_fused` (one ``scaled_dot_product_attention`` call for a
prefill) and the reference ``latent_scores -> attention_probs -> attend_latent`` on random float32 inputs of the
conversion's chunk shape (5 windows of 512 tokens, 9 query heads), for a shared rope head, three rope heads and
no rope part, and prints the time per call and the largest difference.

    .venv/bin/python benchmarks/prefill.py [--windows 5] [--tokens 512] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from mla_convert.mla import algebra


def timed(fn: Callable[[], torch.Tensor], repeat: int) -> tuple[float, torch.Tensor]:
    """Mean seconds per call of ``fn`` (after one warm-up call) and its last output."""
    out = fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return (time.perf_counter() - t0) / repeat, out


def reference(
    q_abs: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, r: int, mask: torch.Tensor
) -> torch.Tensor:
    """The three-einsum form: ``latent_scores -> attention_probs -> attend_latent`` (scale 0.125)."""
    scores = algebra.latent_scores(q_abs, q_rope, c_kv, k_rope, r)
    return algebra.attend_latent(algebra.attention_probs(scores, 0.125, mask), c_kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    b, t, h = args.windows, args.tokens, args.heads
    g = torch.Generator().manual_seed(0)
    mask = algebra.causal_mask(b, t)
    print(f"{b} windows x {t} tokens, {h} heads, float32, {torch.get_num_threads()} threads")
    print("| rope heads | d_R | kv_lora_rank | einsum form ms | SDPA form ms | speed-up | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r, d_r, d_c in ((1, 48, 93), (3, 16, 60), (1, 0, 120)):
        q_abs, q_rope = torch.randn(b, t, h, d_c, generator=g), torch.randn(b, t, h, d_r, generator=g)
        c_kv, k_rope = torch.randn(b, t, d_c, generator=g), torch.randn(b, t, r * d_r, generator=g)

        inputs = (q_abs, q_rope, c_kv, k_rope, r)
        t_ref, ref = timed(partial(reference, *inputs, mask), args.repeat)
        t_new, out = timed(partial(algebra.attend_latent_fused, *inputs, 0.125, mask), args.repeat)
        diff = float((out - ref).abs().max())
        print(f"| {r} | {d_r} | {d_c} | {t_ref * 1e3:.1f} | {t_new * 1e3:.1f} | {t_ref / t_new:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
