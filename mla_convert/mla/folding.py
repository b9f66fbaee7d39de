"""Inference folding of the MLA up-projections (:meth:`~mla_convert.mla.attention.MLAAttention.set_folding`).

On the absorbed and triton paths every query is absorbed into the latent (``q_abs = W_UK[g]^T q_nope``) and
the attended latent is up-projected (``W_UV[g] @ latent_out``) before ``o_proj``. Folding ``W_UK`` into the
NoPE rows of ``q_proj`` and ``W_UV`` into ``o_proj`` gives the same function with fewer per-token products
where the latent is narrow enough (:func:`folding_plan`); the folded weights are derived, never saved, and
rebuilt when the weights they came from change (:func:`folding_key`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from mla_convert.mla import algebra


class Foldable(Protocol):
    """What folding reads of an attention layer (:class:`~mla_convert.mla.attention.MLAAttention` has it all)."""

    q_proj: nn.Linear
    kv_b_proj: nn.Linear
    o_proj: nn.Linear
    kv_a_proj_with_mqa: nn.Linear
    num_heads: int
    num_kv_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def folding_plan(self) -> tuple[bool, bool]:
        """``(fold_q, fold_o)``: where folding pays (:func:`folding_plan`)."""
        ...

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [G, d_N, d_c]`` and ``W_UV [G, d_V, d_c]``."""
        ...


class FoldedWeights(NamedTuple):
    """Inference weights of one layer with the up-projections folded in (:meth:`MLAAttention.set_folding`):
    ``q_weight [H * (d_c + d_R), hidden]`` / ``q_bias`` give ``[q_abs | q_rope]`` per head, ``o_weight
    [hidden, H * d_c]`` maps the attended latent to the output; ``None`` where folding does not pay. ``key``
    identifies the weights they were made from (:func:`folding_key`)."""

    q_weight: torch.Tensor | None
    q_bias: torch.Tensor | None
    o_weight: torch.Tensor | None
    key: tuple[Any, ...]


def folding_plan(hidden: int, d_c: int, d_n: int, d_v: int) -> tuple[bool, bool]:
    """``(fold_q, fold_o)``: whether folding ``W_UK`` into ``q_proj`` (``H d_c`` instead of ``H d_N`` rows,
    minus the ``H d_N d_c`` absorption) and ``W_UV`` into ``o_proj`` (``H d_c`` instead of ``H d_V`` inputs,
    minus ``H d_V d_c``) lowers the multiply-adds per token (DeepSeek-V2 §2.1.2 absorbs the same products;
    at DeepSeek's widths, ``d_c`` 512 > ``d_N`` 128, it does not pay).

    Args:
        hidden: the model width (``q_proj`` inputs); ``d_c``: the layer's latent width; ``d_n`` / ``d_v``: the
            NoPE query/key and value widths per head.
    """
    return d_c * (hidden - d_n) <= hidden * d_n, d_c * (hidden - d_v) <= hidden * d_v


def folding_key(attn: Foldable) -> tuple[Any, ...]:
    """Identity of the weights folding reads (storage, in-place version, dtype, device of each): a new key means
    the folded weights are stale (a weight replaced, updated in place, cast or moved)."""
    params = [
        attn.q_proj.weight,
        attn.kv_b_proj.weight,
        attn.o_proj.weight,
        attn.kv_a_proj_with_mqa.weight,
    ]
    params += [p for p in (attn.q_proj.bias, attn.kv_a_proj_with_mqa.bias) if p is not None]
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)


@torch.no_grad()
def fold_weights(attn: Foldable, key: tuple[Any, ...]) -> FoldedWeights:
    """Fold ``W_UK [G, d_N, d_c]`` into the NoPE rows of ``q_proj`` (``W_UK[g(h)]^T W_q,nope[h]``) and ``W_UV [G,
    d_V, d_c]`` into ``o_proj`` (``W_o[:, h] W_UV[g(h)]``), in float64 on the CPU (float32 elsewhere), returned in
    the weights' dtype; each only where :meth:`MLAAttention.folding_plan` says it pays."""
    fold_q, fold_o = attn.folding_plan()
    w = attn.q_proj.weight
    work = torch.float64 if w.device.type == "cpu" else torch.float32
    h, g = attn.num_heads, attn.num_kv_heads
    d_n, d_r, d_v = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    w_uk, w_uv = (u.to(work) for u in attn.up_weights())
    kv_of = algebra.head_to_group(h, g, w.device)
    q_weight = q_bias = o_weight = None
    if fold_q:
        wq = w.to(work).view(h, d_n + d_r, -1)
        q_abs = torch.einsum("hnc,hnx->hcx", w_uk[kv_of], wq[:, :d_n])
        q_weight = torch.cat([q_abs, wq[:, d_n:]], dim=1).reshape(-1, w.shape[1]).to(w.dtype).contiguous()
        if attn.q_proj.bias is not None:
            bq = attn.q_proj.bias.to(work).view(h, d_n + d_r)
            b_abs = torch.einsum("hnc,hn->hc", w_uk[kv_of], bq[:, :d_n])
            q_bias = torch.cat([b_abs, bq[:, d_n:]], dim=1).reshape(-1).to(w.dtype).contiguous()
    if fold_o:
        wo = attn.o_proj.weight
        o_weight = (
            torch.einsum("ohv,hvc->ohc", wo.to(work).view(wo.shape[0], h, d_v), w_uv[kv_of])
            .reshape(wo.shape[0], -1)
            .to(wo.dtype)
            .contiguous()
        )
    return FoldedWeights(q_weight, q_bias, o_weight, key)
