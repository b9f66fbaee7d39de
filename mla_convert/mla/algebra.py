"""The MLA algebra as pure functions: one definition used by the model, the conversion, validation and tests.

Notation (docs/math.md): ``H`` query heads, ``G`` KV heads (latent groups), ``R`` rope heads (``G % R == 0``),
``d_c`` latent width (``kv_lora_rank``), ``d_N`` NoPE width (``qk_nope_head_dim``), ``d_R`` rope head width
(``qk_rope_head_dim``, 2 x kept pairs), ``d_V`` value width (``v_head_dim``). Query head ``h`` reads KV head
``h // (H / G)`` and rope head ``h // (H / R)``. RoPE uses the rotate_half layout of HF Llama: pair ``p`` of a
rope head is dims ``(p, p + d_R / 2)``. Scores are scaled by the *source* model's softmax scale
(:func:`source_softmax_scale`), never by one derived from the latent width.

The absorbed form (DeepSeek-V2, arXiv:2405.04434, §2.1.2) never builds per-head keys or values:

    q_abs[h]  = W_UK[g(h)]^T q_nope[h]                                      [d_c]
    score[h,t,s] = q_abs[h,t] . c_kv[s] + q_rope[h,t] . k_rope[r(h), s]       (then x scale, + mask)
    out[h,t]  = W_UV[g(h)] (sum_s p[h,t,s] c_kv[s])                           [d_V]

The naive form (:func:`expand_kv`) builds ``k = [W_UK c_kv | k_rope]`` and ``v = W_UV c_kv`` per KV head; it is
the reference the absorbed form must equal, never the product.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from mla_convert.sources.geometry import head_dim_of, source_softmax_scale


def head_to_group(num_heads: int, num_groups: int, device: torch.device | None = None) -> torch.Tensor:
    """``[H]`` int64: the KV head (or rope head) each query head reads, ``h // (H / num_groups)``.

    Raises:
        ValueError: ``num_groups`` does not divide ``num_heads``.
    """
    if num_groups < 1 or num_heads % num_groups:
        raise ValueError(f"{num_groups} groups do not divide {num_heads} query heads")
    return torch.arange(num_heads, device=device) // (num_heads // num_groups)


def cache_width(kv_lora_rank: int, num_rope_heads: int, qk_rope_head_dim: int) -> int:
    """Values cached per token per layer: one latent row ``[c_kv | k_rope]``, ``d_c + R * d_R``."""
    return kv_lora_rank + num_rope_heads * qk_rope_head_dim


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE pairs in rotate_half layout (pair p = dims ``(p, p + P)``).

    Args:
        x: ``[..., 2P]`` rope dims.
        cos, sin: ``[..., P]`` broadcastable to ``x[..., :P]``: cos/sin of position x inverse frequency.

    Returns:
        ``[..., 2P]``: ``(x1 cos - x2 sin, x2 cos + x1 sin)``, the HF Llama rotation.
    """
    p = x.shape[-1] // 2
    x1, x2 = x[..., :p], x[..., p:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of absolute positions times per-pair inverse frequencies.

    Args:
        position_ids: ``[B, T]`` absolute token positions.
        inv_freq: ``[R, P]`` radians per token.

    Returns:
        ``(cos, sin)``, each ``[B, T, R, P]`` float32 (computed in float32 like HF's rotary embedding).
    """
    angles = position_ids[:, :, None, None].float() * inv_freq[None, None].float()
    return angles.cos(), angles.sin()


def causal_mask(
    batch: int,
    new_tokens: int,
    past: int = 0,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Additive mask ``[B, 1, T, past + T]``: key ``j`` is visible to new token ``t`` iff ``j <= past + t``
    and ``attention_mask[b, j] == 1`` (2-D padding mask ``[B, past + T]``, optional); hidden keys get the
    dtype's most negative value."""
    total = past + new_tokens
    q_pos = torch.arange(past, total, device=device)[:, None]
    allowed = (torch.arange(total, device=device)[None, :] <= q_pos)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -total:].bool()
    allowed = allowed.expand(batch, 1, new_tokens, total)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def split_up_weights(
    kv_b_weight: torch.Tensor, num_kv_heads: int, qk_nope_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK [G, d_N, d_c]`` and ``W_UV [G, d_V, d_c]`` as views of ``kv_b_proj.weight [G (d_N + d_V), d_c]``."""
    w = kv_b_weight.view(num_kv_heads, -1, kv_b_weight.shape[-1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_abs [B, T, H, d_c] = W_UK[g(h)]^T q_nope[h]`` for ``q_nope [B, T, H, d_N]``, ``w_uk [G, d_N, d_c]``."""
    b, t, h, _ = q_nope.shape
    g = w_uk.shape[0]
    return torch.einsum("btgnd,gdc->btgnc", q_nope.reshape(b, t, g, h // g, -1), w_uk).reshape(b, t, h, -1)


def latent_scores(
    q_abs: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, num_rope_heads: int
) -> torch.Tensor:
    """Unscaled scores ``[B, H, T, S]`` of absorbed queries against latent rows.

    Args:
        q_abs: ``[B, T, H, d_c]``; q_rope: rotated ``[B, T, H, d_R]``.
        c_kv: ``[B, S, d_c]``; k_rope: rotated ``[B, S, R * d_R]``.
        num_rope_heads: ``R``.
    """
    b, t, h, _ = q_abs.shape
    s, r, d_r = c_kv.shape[1], num_rope_heads, q_rope.shape[-1]
    scores = torch.einsum("bthc,bsc->bhts", q_abs, c_kv)
    if d_r:
        kr = k_rope.reshape(b, s, r, d_r)
        rope_scores = torch.einsum("btrnd,bsrd->brnts", q_rope.reshape(b, t, r, h // r, -1), kr)
        scores = scores + rope_scores.reshape(b, h, t, s)
    return scores


def attention_probs(scores: torch.Tensor, softmax_scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """``softmax(scores * scale + mask)`` over the last dim, computed in float32, returned in the scores' dtype."""
    scaled = scores * softmax_scale
    if mask is not None:
        scaled = scaled + mask
    return torch.softmax(scaled.float(), dim=-1).to(scores.dtype)


def attend_latent(probs: torch.Tensor, c_kv: torch.Tensor) -> torch.Tensor:
    """The attended latent ``sum_s p[b,h,t,s] c_kv[b,s]``: ``probs [B, H, T, S]``, ``c_kv [B, S, d_c]`` ->
    ``[B, T, H, d_c]`` (what :func:`latent_output` expands, and what the decode kernel returns)."""
    return torch.einsum("bhts,bsc->bthc", probs, c_kv)


def attend_latent_fused(
    q_abs: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv: torch.Tensor,
    k_rope: torch.Tensor,
    num_rope_heads: int,
    softmax_scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """``attend_latent(attention_probs(latent_scores(...), scale, mask), c_kv)`` without the einsum form's copies.

    A prefill (``T > 1``) is one ``scaled_dot_product_attention`` call: query ``[q_abs | q_rope]``, key
    ``[c_kv | k_rope]`` and value ``c_kv``, each latent row read by all heads of its rope head through an
    expanded view, so no ``[B, H, T, S]`` score tensor is materialised (1.9-3.5x faster than the einsum form for
    5 windows of 512 tokens on a 2-core CPU, within 3e-6 of it: ``benchmarks/prefill.py``). A
    decode step (``T == 1``) forms the query rows of all heads as one ``[H, .]`` matrix per request: the scores
    are one product with the latent rows (plus one per rope head) and the latent sum one more, the cache rows
    read through transposed views; the softmax is taken in float32 and returned in the scores' dtype, as
    :func:`attention_probs`. Same function as the three-einsum form, which the ladder and the oracles keep.

    Args:
        q_abs: ``[B, T, H, d_c]``; q_rope: rotated ``[B, T, H, d_R]``.
        c_kv: ``[B, S, d_c]``; k_rope: rotated ``[B, S, R * d_R]``; query head ``h`` reads rope head
            ``h // (H / R)`` (:func:`head_to_group`).
        num_rope_heads: ``R``; softmax_scale: the source's scale; mask: additive ``[B, 1, T, S]`` or None.

    Returns:
        ``[B, T, H, d_c]``, as :func:`attend_latent`.
    """
    b, t, h, d_c = q_abs.shape
    s, r, d_r = c_kv.shape[1], num_rope_heads, q_rope.shape[-1]
    if t > 1:  # prefill: the R latent keys expanded to the H query heads as views, one SDPA call
        q = torch.cat([q_abs, q_rope], dim=-1) if d_r else q_abs
        if d_r:
            keys = torch.cat([c_kv[:, :, None].expand(b, s, r, d_c), k_rope.reshape(b, s, r, d_r)], dim=-1)
            k = keys.transpose(1, 2)[:, :, None].expand(b, r, h // r, s, d_c + d_r).reshape(b, h, s, d_c + d_r)
        else:
            k = c_kv[:, None].expand(b, h, s, d_c)
        v = c_kv[:, None].expand(b, h, s, d_c)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=softmax_scale)
        return out.transpose(1, 2)
    scores = torch.matmul(q_abs.reshape(b, t * h, d_c), c_kv.transpose(1, 2))  # [B, T*H, S]
    if d_r and r == 1:
        scores = torch.baddbmm(scores, q_rope.reshape(b, t * h, d_r), k_rope.transpose(1, 2))
    elif d_r:  # rows grouped by rope head: [B, R, T*H/R, d_R] against [B, R, d_R, S]
        qr = q_rope.reshape(b, t, r, h // r, d_r).transpose(1, 2).reshape(b, r, t * (h // r), d_r)
        kr = k_rope.reshape(b, s, r, d_r).permute(0, 2, 3, 1)
        rope = torch.matmul(qr, kr).reshape(b, r, t, h // r, s).transpose(1, 2).reshape(b, t * h, s)
        scores = scores + rope
    scaled = scores.view(b, t, h, s) * softmax_scale
    if mask is not None:
        scaled = scaled + mask.transpose(1, 2)  # [B, 1, T, S] -> [B, T, 1, S]: one row of the mask per token
    probs = torch.softmax(scaled.float(), dim=-1).to(scores.dtype)
    return torch.matmul(probs.view(b, t * h, s), c_kv).view(b, t, h, d_c)


def latent_output(latent_out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Per-head values from the attended latent: ``[B, T, H, d_c] -> [B, T, H * d_V]`` (``o_proj``'s input)."""
    b, t, h, _ = latent_out.shape
    g = w_uv.shape[0]
    out = torch.einsum("btgnc,gvc->btgnv", latent_out.reshape(b, t, g, h // g, -1), w_uv)
    return out.reshape(b, t, -1)


def expand_kv(
    c_kv: torch.Tensor, k_rope: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive (reference) expansion of latent rows into per-KV-head keys and values.

    Args:
        c_kv: ``[B, S, d_c]``; k_rope: rotated ``[B, S, R, d_R]``; w_uk ``[G, d_N, d_c]``; w_uv ``[G, d_V, d_c]``.

    Returns:
        ``keys [B, G, S, d_N + d_R]`` (each KV head takes its rope head's ``k_rope``) and ``values [B, G, S, d_V]``.
    """
    g, r = w_uk.shape[0], k_rope.shape[2]
    k_nope = torch.einsum("bsc,gnc->bgsn", c_kv, w_uk)
    values = torch.einsum("bsc,gvc->bgsv", c_kv, w_uv)
    k_rope_g = k_rope.repeat_interleave(g // r, dim=2).transpose(1, 2)  # [B, G, S, d_R]
    return torch.cat([k_nope, k_rope_g], dim=-1), values


def naive_scores(q_nope: torch.Tensor, q_rope: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Unscaled scores ``[B, H, T, S]`` of full queries ``[q_nope | q_rope]`` (``[B, T, H, *]``) against expanded
    keys ``[B, G, S, d_N + d_R]`` (query head ``h`` reads KV head ``h // (H / G)``)."""
    h, g = q_nope.shape[2], keys.shape[1]
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # [B, H, T, d]
    return q @ keys.repeat_interleave(h // g, dim=1).transpose(-1, -2)


def naive_output(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, S]`` probabilities x values ``[B, G, S, d_V]`` -> ``[B, T, H * d_V]`` (``o_proj``'s input)."""
    b, h, t, _ = probs.shape
    out = probs @ values.repeat_interleave(h // values.shape[1], dim=1)
    return out.transpose(1, 2).reshape(b, t, -1)


def transformers_inv_freq(params: Mapping[str, Any], n: int) -> torch.Tensor:
    """The ``[n]`` inverse frequencies transformers and vLLM compute from ``params`` (``default``, float32)."""
    if not n:
        return torch.zeros(0)
    shape = torch.arange(0, 2 * n, 2, dtype=torch.int64).float() / (2 * n)
    base = torch.tensor(params["rope_theta"], dtype=torch.float32)
    if params["rope_type"] == "default":
        return 1.0 / (base**shape)
    return 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * base**shape)


__all__ = [
    "absorb_query",
    "apply_rope",
    "attend_latent",
    "attention_probs",
    "cache_width",
    "causal_mask",
    "expand_kv",
    "head_dim_of",
    "head_to_group",
    "latent_output",
    "latent_scores",
    "naive_output",
    "naive_scores",
    "rope_angles",
    "source_softmax_scale",
    "transformers_inv_freq",
    "split_up_weights",
]
