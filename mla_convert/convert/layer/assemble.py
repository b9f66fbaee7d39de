"""Assemble MLA tensors from source weights, RoPE plans and low-rank factors (exact bias handling).

Per layer (``H`` query heads, ``G`` KV heads, source head dim ``d``, docs/math.md §Biases):

* ``q_proj``: per head ``[q_nope_map @ W_q,h ; q_rope_map @ W_q,h]`` times ``attention_scaling²`` (HF
  multiplies cos and sin of both q and k by the RoPE attention factor; folding its square into the
  queries keeps every score identical while the MLA model rotates without it). Query bias maps the same.
* ``kv_a_proj_with_mqa``: ``[W_down ; key_rope @ W_k]``; a key bias survives only on rope rows.
* ``kv_b_proj``: per KV head ``[W_up rows of its NoPE keys ; W_up rows of its values]``.
* ``o_proj``: unchanged weight; the value bias moves past attention into an ``o_proj`` bias
  (probabilities sum to 1). A NoPE key bias adds the same amount to every score of a query and
  cancels in softmax, so it is dropped.
"""

from __future__ import annotations

import torch

from mla_convert.convert.layer.factorize import Factors
from mla_convert.convert.layer.rope import RopePlan
from mla_convert.mla.algebra import head_to_group


def pad_plan(plan: RopePlan, d_nope: int) -> RopePlan:
    """Pad a plan's NoPE width to ``d_nope`` with zero query rows that read a zero key row.

    Layers whose kept slots span fewer distinct frequencies have fewer NoPE dims; all layers of one
    checkpoint share ``qk_nope_head_dim``. Padding adds exact zeros to every score.
    """
    h, cur, d = plan.q_nope.shape
    if cur == d_nope:
        return plan
    g = plan.nope_index.shape[0]
    n = plan.key_nope.shape[0]
    key_nope = torch.cat([plan.key_nope, torch.zeros(1, plan.key_nope.shape[1], dtype=plan.key_nope.dtype)])
    pad_idx = torch.full((g, d_nope - cur), n, dtype=torch.long)
    q_nope = torch.cat([plan.q_nope, torch.zeros(h, d_nope - cur, d, dtype=plan.q_nope.dtype)], dim=1)
    return RopePlan(
        key_nope,
        torch.cat([plan.nope_index, pad_idx], 1),
        plan.key_rope,
        q_nope,
        plan.q_rope,
        plan.inv_freq,
        plan.origin,
        plan.kept,
        plan.rope_energy,
        plan.basis,
        plan.slots,
    )


def query_rows(
    w: dict[str, torch.Tensor], plan: RopePlan, head: int, attention_scaling: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query head's rows of the MLA query map, float64: ``[d_N + d_R, D]`` (its NoPE rows, then its rope rows)
    and its bias ``[d_N + d_R]`` (None without ``bq``), both times ``attention_scaling²``; the same values
    :func:`layer_tensors` writes for that head (the same products, scaled the same way)."""
    d = w["q"].shape[0] // plan.q_nope.shape[0]
    d_n, d_r = plan.q_nope.shape[1], plan.q_rope.shape[1]
    wq = w["q"][head * d : (head + 1) * d]
    rows = torch.empty(d_n + d_r, w["q"].shape[1], dtype=torch.float64)
    torch.matmul(plan.q_nope[head], wq, out=rows[:d_n])
    torch.matmul(plan.q_rope[head], wq, out=rows[d_n:])
    s2 = attention_scaling**2
    if s2 != 1.0:
        rows.mul_(s2)
    bias = None
    if "bq" in w:
        bq = w["bq"][head * d : (head + 1) * d]
        bias = torch.cat([plan.q_nope[head] @ bq, plan.q_rope[head] @ bq]) * s2
    return rows, bias


def layer_tensors(
    w: dict[str, torch.Tensor],
    plan: RopePlan,
    factors: Factors,
    num_heads: int,
    attention_scaling: float,
    query: bool = True,
) -> dict[str, torch.Tensor]:
    """The MLA attention tensors of one layer, float64, keyed by module name (``q_proj.weight``...).

    Args:
        w: float64 source ``q, k, v, o`` weights and optional biases ``bq, bk, bv, bo``.
        plan: RoPE plan (already padded to the checkpoint's ``qk_nope_head_dim``).
        factors: ``W_down [d_c, hidden]``, ``W_up [n + G*d_V, d_c]`` for this plan's NoPE rows.
        num_heads: ``H``.
        attention_scaling: the source's RoPE attention factor.
        query: False leaves ``q_proj`` out (a NoPE-width reduction takes it head by head: :func:`query_rows`).
    """
    h = num_heads
    g = plan.nope_index.shape[0]
    d_v = w["v"].shape[0] // g
    n = factors.up.shape[0] - g * d_v
    out: dict[str, torch.Tensor] = {}
    if query:
        # the query map is the largest float64 tensor of a layer (1 GB at 8B before a NoPE-width reduction): written
        # in place, head by head, never a second copy
        d_n, d_r = plan.q_nope.shape[1], plan.q_rope.shape[1]
        q_weight = torch.empty(h, d_n + d_r, w["q"].shape[1], dtype=torch.float64)
        q_bias = []
        for hi in range(h):
            rows, bias = query_rows(w, plan, hi, attention_scaling)
            q_weight[hi] = rows
            if bias is not None:
                q_bias.append(bias)
        out["q_proj.weight"] = q_weight.view(h * (d_n + d_r), -1)
        if q_bias:
            out["q_proj.bias"] = torch.cat(q_bias)
    out["kv_a_proj_with_mqa.weight"] = torch.cat([factors.down, plan.key_rope @ w["k"]])
    if "bk" in w:
        out["kv_a_proj_with_mqa.bias"] = torch.cat(
            [torch.zeros(factors.down.shape[0], dtype=torch.float64), plan.key_rope @ w["bk"]]
        )
    up_k = torch.cat([factors.up[:n], torch.zeros(1, factors.up.shape[1], dtype=torch.float64)])
    blocks = []
    for gi in range(g):
        blocks += [up_k[plan.nope_index[gi]], factors.up[n + gi * d_v : n + (gi + 1) * d_v]]
    out["kv_b_proj.weight"] = torch.cat(blocks)
    out["o_proj.weight"] = w["o"]
    if "bv" in w or "bo" in w:
        bias = w["bo"].clone() if "bo" in w else torch.zeros(w["o"].shape[0], dtype=torch.float64)
        if "bv" in w:
            kv_of = head_to_group(h, g).tolist()
            bv_heads = torch.cat([w["bv"][kv_of[hi] * d_v : (kv_of[hi] + 1) * d_v] for hi in range(h)])
            bias = bias + w["o"] @ bv_heads
        out["o_proj.bias"] = bias
    return out
