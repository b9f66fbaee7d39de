"""Triton split-KV decode attention over a paged MLA latent cache (docs/formats.md §The decode kernel).

One query token per request. Program ``(b, head block, split)`` walks its share of request ``b``'s
tokens in tiles of ``BLOCK_N`` rows; each tile of ``[c_kv | k_rope]`` rows is loaded once for a block of
up to 16 query heads and serves both the scores (``q_abs . c_kv + q_rope . k_rope``) and the value
accumulation (``p @ c_kv``), with an online softmax in float32. Partial results of the splits are merged
exactly through their log-sum-exp by a second kernel (never averaged); empty splits carry ``lse = -inf``
and weigh nothing, and a length-0 request yields zeros and ``lse = -inf`` without NaN. Page and row
addresses are int64. On a machine without a GPU the kernels run in the Triton interpreter
(``TRITON_INTERPRET=1``, set by :mod:`mla_convert.kernels` before this module is imported).

Numerics: float32 inputs use IEEE float32 dot products (no TF32); float16/bfloat16 inputs use their
native dot with float32 accumulation, and the probabilities are rounded to the cache dtype for the
value product, as in FlashAttention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_decode_inputs

BLOCK_H = 16  # query heads per program (tl.dot needs >= 16 rows)


@triton.jit
def _split_kernel(
    q_abs_ptr, q_rope_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, head_to_rope_ptr,
    part_out_ptr, part_lse_ptr,
    softmax_scale,
    stride_qab, stride_qah, stride_qrb, stride_qrh,
    stride_cp, stride_cs, stride_btb,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    num_heads, d_c, d_r, rope_width, page_size,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr, HAS_ROPE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = ((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, BLOCK_DC)
    mask_c = offs_c < d_c
    b64 = b.to(tl.int64)
    q_ptrs = q_abs_ptr + b64 * stride_qab + offs_h[:, None].to(tl.int64) * stride_qah + offs_c[None, :]
    q_abs = tl.load(q_ptrs, mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    if HAS_ROPE:
        # each head's rope query is placed at its rope head's columns of the row, zeros elsewhere
        rope_head = tl.load(head_to_rope_ptr + offs_h, mask=mask_h, other=0)
        local = offs_r[None, :] - rope_head[:, None] * d_r
        mask_qr = mask_h[:, None] & (local >= 0) & (local < d_r)
        qr_ptrs = q_rope_ptr + b64 * stride_qrb + offs_h[:, None].to(tl.int64) * stride_qrh + local
        q_rope = tl.load(qr_ptrs, mask=mask_qr, other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(block_table_ptr + b64 * stride_btb + offs_n // page_size, mask=mask_n, other=0)
        row = page.to(tl.int64) * stride_cp + (offs_n % page_size).to(tl.int64) * stride_cs
        tile = tl.load(
            cache_ptr + row[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0
        )
        if IEEE:
            scores = tl.dot(q_abs, tl.trans(tile), input_precision="ieee")
        else:
            scores = tl.dot(q_abs, tl.trans(tile))
        if HAS_ROPE:
            mask_r = mask_n[:, None] & (offs_r < rope_width)[None, :]
            k_rope = tl.load(cache_ptr + row[:, None] + d_c + offs_r[None, :], mask=mask_r, other=0.0)
            if IEEE:
                scores += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
            else:
                scores += tl.dot(q_rope, tl.trans(k_rope))
        scores = tl.where(mask_n[None, :], scores * softmax_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, tile, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tile.dtype), tile)
        m_i = m_new

    # an empty split is known from its range, not from l_i, so a NaN read is passed on, never hidden
    filled = (tl.zeros([BLOCK_H], dtype=tl.int32) + end) > start
    out = acc / tl.where(filled, l_i, 1.0)[:, None]
    lse = tl.where(filled, m_i + tl.log(tl.where(filled, l_i, 1.0)), float("-inf"))
    base = b64 * stride_pob + split.to(tl.int64) * stride_pos + offs_h[:, None].to(tl.int64) * stride_poh
    tl.store(part_out_ptr + base + offs_c[None, :], out, mask=mask_h[:, None] & mask_c[None, :])
    tl.store(part_lse_ptr + b64 * stride_plb + offs_h * stride_plh + split, lse, mask=mask_h)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    stride_ob, stride_oh, stride_lb,
    num_heads, d_c,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hb = tl.program_id(1)
    b64 = b.to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, BLOCK_DC)
    mask = mask_h[:, None] & (offs_c < d_c)[None, :]
    lse_ptrs = part_lse_ptr + b64 * stride_plb + offs_h * stride_plh
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(lse_ptrs + s, mask=mask_h, other=float("-inf")))
    nan_seen = tl.zeros([BLOCK_H], dtype=tl.int32)
    for s in range(NUM_SPLITS):
        lse_s = tl.load(lse_ptrs + s, mask=mask_h, other=float("-inf"))
        nan_seen = nan_seen | (lse_s != lse_s).to(tl.int32)
    m = tl.where(nan_seen > 0, float("nan"), m)
    any_rows = (m > float("-inf")) | (nan_seen > 0)
    m_safe = tl.where(any_rows, m, 0.0)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse_s = tl.load(lse_ptrs + s, mask=mask_h, other=float("-inf"))
        used = lse_s != float("-inf")  # empty splits are skipped, never merged; NaN is passed on
        w = tl.where(used, tl.exp(lse_s - m_safe), 0.0)
        base = b64 * stride_pob + s * stride_pos + offs_h[:, None].to(tl.int64) * stride_poh
        part = tl.load(part_out_ptr + base + offs_c[None, :], mask=mask & used[:, None], other=0.0)
        acc += w[:, None] * part
        den += w
    out = acc / tl.where(any_rows, den, 1.0)[:, None]
    lse = tl.where(any_rows, m_safe + tl.log(tl.where(any_rows, den, 1.0)), float("-inf"))
    o_ptrs = out_ptr + b64 * stride_ob + offs_h[:, None].to(tl.int64) * stride_oh + offs_c[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + b64 * stride_lb + offs_h, lse, mask=mask_h)


def default_num_splits(max_seq_len: int, block_n: int = 64, max_splits: int = 16) -> int:
    """Splits of the KV range: one per 256 tokens up to ``max_splits`` (at least one tile each)."""
    return max(1, min(max_splits, -(-max_seq_len // 256), -(-max_seq_len // block_n)))


def latent_decode(
    q_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    head_to_rope: torch.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query token per request over a paged ``[c_kv | k_rope]`` cache.

    Args:
        q_abs: ``[B, H, d_c]`` absorbed content queries; float32, float16 or bfloat16 (GPU only).
        q_rope: ``[B, H, d_R]`` rotated rope queries, same dtype (``d_R`` may be 0).
        kv_cache: ``[num_pages, page_size, d_c + R * d_R]`` one layer's rows, same dtype, last dim
            contiguous; page size 1..128; any ``d_c`` and rope width (masked to a power of two).
        block_table: ``[B, max_pages]`` int32 page ids of each request, in token order.
        seq_lens: ``[B]`` int32 committed tokens per request (0 gives zeros and ``lse = -inf``).
        head_to_rope: ``[H]`` int32 rope head of each query head (``h // (H / R)`` for converted models).
        softmax_scale: the source model's attention scale; required, never derived from widths.
        num_splits: programs per request along the KV range (default: one per 256 tokens, <= 16).
        block_n: rows per tile (default 64, 32 when ``d_c > 256``).

    Returns:
        ``latent_out [B, H, d_c]`` in ``q_abs.dtype`` and natural-log ``lse [B, H]`` float32.

    Raises:
        ValueError: inconsistent shapes/dtypes/devices (see :func:`check_decode_inputs`), or a
            non-contiguous cache row.
    """
    d_c, d_r, rope_width = check_decode_inputs(
        q_abs, q_rope, kv_cache, block_table, seq_lens, head_to_rope, softmax_scale
    )
    if kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not supported (float32, float16, bfloat16)")
    if q_abs.dtype != kv_cache.dtype or q_rope.dtype != kv_cache.dtype:
        raise ValueError(
            f"q_abs ({q_abs.dtype}), q_rope ({q_rope.dtype}) and kv_cache ({kv_cache.dtype}) must share a dtype"
        )
    if kv_cache.stride(2) != 1 or q_abs.stride(2) != 1 or (d_r and q_rope.stride(2) != 1):
        raise ValueError("kv_cache, q_abs and q_rope need a contiguous last dimension")
    b, h, _ = q_abs.shape
    device = q_abs.device
    block_n = block_n or (32 if d_c > 256 else 64)
    if num_splits is None:
        num_splits = default_num_splits(int(seq_lens.max()) if b else 0, block_n)
    block_dc = max(16, triton.next_power_of_2(d_c))
    block_r = max(16, triton.next_power_of_2(max(rope_width, 1)))
    part_out = torch.empty(b, h, num_splits, d_c, dtype=torch.float32, device=device)
    part_lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=device)
    out = torch.empty(b, h, d_c, dtype=q_abs.dtype, device=device)
    lse = torch.empty(b, h, dtype=torch.float32, device=device)
    if b == 0 or h == 0:
        return out, lse
    heads = head_to_rope.to(device=device, dtype=torch.int32).contiguous()
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()  # kernels assume unit strides
    q_rope_arg = q_rope if d_r else q_abs  # never read without rope
    grid = (b, triton.cdiv(h, BLOCK_H), num_splits)
    _split_kernel[grid](
        q_abs, q_rope_arg, kv_cache, block_table, seq_lens, heads,
        part_out, part_lse,
        float(softmax_scale),
        q_abs.stride(0), q_abs.stride(1), q_rope_arg.stride(0), q_rope_arg.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        h, d_c, max(d_r, 1), rope_width, kv_cache.shape[1],
        NUM_SPLITS=num_splits, BLOCK_H=BLOCK_H, BLOCK_N=block_n, BLOCK_DC=block_dc, BLOCK_R=block_r,
        HAS_ROPE=bool(d_r), IEEE=kv_cache.dtype == torch.float32,
    )  # fmt: skip
    _merge_kernel[(b, triton.cdiv(h, BLOCK_H))](
        part_out, part_lse, out, lse,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        h, d_c,
        NUM_SPLITS=num_splits, BLOCK_H=BLOCK_H, BLOCK_DC=block_dc,
    )  # fmt: skip
    return out, lse
