"""Triton split-KV attention over a paged MLA latent cache (docs/formats.md §The decode kernel).

``s_q`` new query tokens per request (one for decoding; several for speculative verification or chunked
prefill, causal inside the block). The query rows of a request, ``m = i * H + h`` for query token ``i`` and
head ``h``, are tiled ``BLOCK_M = 16`` at a time (``tl.dot`` needs 16 rows; the Triton interpreter takes a whole
request's rows per program, :func:`~.launch.default_block_m`). Program ``(row block, split, b)``
walks its share of request ``b``'s rows in tiles of ``BLOCK_N``; each tile of ``[c_kv | k_rope]`` rows is loaded
once for the row block and serves both the scores (``q_abs . c_kv + q_rope . k_rope``) and the value
accumulation (``p @ c_kv``), with an online softmax in float32. The row block is the fastest grid axis, so the
programs that read the same cache rows (the row blocks of one request and split) run side by side and a row
comes from HBM about once. The rope scores are one ``d_R``-wide dot per rope head present in the row block,
never a dot over the whole ``R * d_R`` rope part of the row.

Partial results of the splits are merged exactly through their log-sum-exp by a second kernel (never
averaged); empty splits carry ``lse = -inf`` and weigh nothing, and a query row that sees no cached row (a
length-0 request) yields zeros and ``lse = -inf`` without NaN. Page and row addresses are int64.

Compiled variants: Triton specialises an integer argument equal to 1 (a constant) or divisible by 16 (an
alignment hint) unless told not to. Every argument that changes while a model decodes -- ``num_splits``,
``s_q``, ``num_heads``, the query strides (``s_q``, views), the block table's row stride (the table grows), the
partials' strides (the split count) and the page size -- is excluded (:data:`SPLIT_UNSPECIALIZED`,
:data:`MERGE_UNSPECIALIZED`), and so is the alignment of the queries and index tensors; so a growing context, a
new batch or a prefill never compiles a new kernel. A layer's variant is fixed by the dtype, the power-of-two
tiles of ``d_c`` and ``d_R``, ``BLOCK_N``, the rope part (:func:`~.launch.launch_key`) and the specialisation of
its fixed integers (``d_c``, ``d_R``, cache strides and row offsets, e.g. ``d_c = 18`` vs ``32``):
:func:`~.launch.plan_launch` gives the arguments, :mod:`mla_convert.kernels.variants` their key, and
:mod:`mla_convert.kernels.compile_check` compiles the keys the product launches.

Numerics: float32 inputs use IEEE float32 dot products (no TF32); float16/bfloat16 inputs use their native dot
with float32 accumulation, and the probabilities are rounded to the cache dtype for the value product, as in
FlashAttention. On a machine without a GPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set
by :mod:`mla_convert.kernels` before this module is imported), which reads bfloat16 as 16-bit integers:
bfloat16 is refused there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import kernel_backend
from .fp8 import Fp8Layout
from .launch import multiprocessor_count, plan_launch
from .reference import check_decode_inputs, check_decode_values

#: integer arguments that change while one model decodes (query strides with ``s_q`` and views, the block table's
#: width, the partials' strides with the split count): Triton specialises an integer equal to 1 or divisible by 16,
#: so each would compile new variants mid-generation; they are plain runtime integers (their loads are small).
#: The page size too: a caller's choice (1..128) that only divides row indices, so it picks no variant either
SPLIT_UNSPECIALIZED = (
    "stride_qab",
    "stride_qas",
    "stride_qah",
    "stride_qrb",
    "stride_qrs",
    "stride_qrh",
    "stride_btb",
    "stride_pob",
    "stride_pom",
    "stride_plb",
    "stride_plm",
    "num_heads",
    "s_q",
    "num_splits",
    "page_size",
)
MERGE_UNSPECIALIZED = (
    "stride_pob",
    "stride_pom",
    "stride_plb",
    "stride_plm",
    "stride_ob",
    "stride_lb",
    "rows",
    "num_splits",
)
#: pointers whose alignment is the caller's (views of a projection, index tensors): read with unspecialised
#: strides or as gathers, so their alignment buys nothing and must not pick a variant
SPLIT_UNALIGNED = ("q_abs_ptr", "q_rope_ptr", "block_table_ptr", "seq_lens_ptr", "head_to_rope_ptr")


@triton.jit(do_not_specialize=SPLIT_UNSPECIALIZED, do_not_specialize_on_alignment=SPLIT_UNALIGNED)
def _split_kernel(
    q_abs_ptr,
    q_rope_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    head_to_rope_ptr,
    part_out_ptr,
    part_lse_ptr,
    softmax_scale,
    stride_qab,
    stride_qas,
    stride_qah,
    stride_qrb,
    stride_qrs,
    stride_qrh,
    stride_cp,
    stride_cs,
    stride_btb,
    stride_pob,
    stride_pom,
    stride_pos,
    stride_plb,
    stride_plm,
    num_heads,
    s_q,
    d_c,
    d_r,
    page_size,
    num_splits,
    rope_off,
    scale_off,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    IEEE: tl.constexpr,
    FP8_GROUP: tl.constexpr,
):
    mb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = ((seq_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < s_q * num_heads
    qi = offs_m // num_heads  # query token of each row
    head = offs_m % num_heads
    limit = seq_len - s_q + qi  # last cached row each query row sees (causal inside the query block)
    # rows past the block's last visible row are never read
    hi = tl.minimum(
        end, seq_len - s_q + tl.minimum(mb * BLOCK_M + BLOCK_M - 1, s_q * num_heads - 1) // num_heads + 1
    )
    offs_c = tl.arange(0, BLOCK_DC)
    mask_c = offs_c < d_c
    b64 = b.to(tl.int64)
    q_row = b64 * stride_qab + qi.to(tl.int64) * stride_qas + head.to(tl.int64) * stride_qah
    q_abs = tl.load(
        q_abs_ptr + q_row[:, None] + offs_c[None, :], mask=mask_m[:, None] & mask_c[None, :], other=0.0
    )
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < d_r
    if HAS_ROPE:
        rope_head = tl.load(head_to_rope_ptr + head, mask=mask_m, other=0)
        r_lo = tl.min(tl.where(mask_m, rope_head, 2147483647), axis=0)
        r_hi = tl.max(tl.where(mask_m, rope_head, -1), axis=0)
        qr_row = b64 * stride_qrb + qi.to(tl.int64) * stride_qrs + head.to(tl.int64) * stride_qrh
        q_rope = tl.load(
            q_rope_ptr + qr_row[:, None] + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0
        )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DC], dtype=tl.float32)
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        page = tl.load(block_table_ptr + b64 * stride_btb + offs_n // page_size, mask=mask_n, other=0)
        row = page.to(tl.int64) * stride_cp + (offs_n % page_size).to(tl.int64) * stride_cs
        mask_nc = mask_n[:, None] & mask_c[None, :]
        if FP8_GROUP > 0:  # E4M3 bytes times their group's float32 scale (one load per group), in registers
            raw = tl.load(cache_ptr + row[:, None] + offs_c[None, :], mask=mask_nc, other=0)
            offs_g = tl.arange(0, BLOCK_DC // FP8_GROUP)
            scale_ptrs = (cache_ptr + row[:, None] + scale_off + offs_g[None, :] * 4).to(
                tl.pointer_type(tl.float32)
            )
            mask_ng = mask_n[:, None] & (offs_g[None, :] * FP8_GROUP < d_c)
            scales = tl.load(scale_ptrs, mask=mask_ng, other=0.0)  # [BLOCK_N, groups]
            grouped = tl.reshape(
                raw.to(tl.float8e4nv, bitcast=True).to(tl.float32),
                [BLOCK_N, BLOCK_DC // FP8_GROUP, FP8_GROUP],
            )
            tile = tl.reshape(grouped * scales[:, :, None], [BLOCK_N, BLOCK_DC]).to(q_abs.dtype)
        else:
            tile = tl.load(cache_ptr + row[:, None] + offs_c[None, :], mask=mask_nc, other=0.0)
        if IEEE:
            scores = tl.dot(q_abs, tl.trans(tile), input_precision="ieee")
        else:
            scores = tl.dot(q_abs, tl.trans(tile))
        if HAS_ROPE:
            for r in range(r_lo, r_hi + 1):  # one d_R-wide dot per rope head present in the row block
                mask_nr = mask_n[:, None] & mask_r[None, :]
                if FP8_GROUP > 0:  # bfloat16 bits at a byte offset: widen to float32 exactly
                    bits_ptrs = cache_ptr + row[:, None] + rope_off + (r * d_r + offs_r[None, :]) * 2
                    bits = tl.load(bits_ptrs.to(tl.pointer_type(tl.uint16)), mask=mask_nr, other=0)
                    k_rope = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(q_rope.dtype)
                else:
                    k_rope = tl.load(
                        cache_ptr + row[:, None] + rope_off + r * d_r + offs_r[None, :],
                        mask=mask_nr,
                        other=0.0,
                    )
                q_r = tl.where((rope_head == r)[:, None], q_rope, 0.0).to(k_rope.dtype)
                if IEEE:
                    scores += tl.dot(q_r, tl.trans(k_rope), input_precision="ieee")
                else:
                    scores += tl.dot(q_r, tl.trans(k_rope))
        visible = mask_n[None, :] & (offs_n[None, :] <= limit[:, None])
        scores = tl.where(visible, scores * softmax_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at zero
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, tile, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tile.dtype), tile)
        m_i = m_new

    # whether a row saw anything is known from its range, not from l_i, so a NaN read is passed on, never hidden
    filled = (start < hi) & (start <= limit)
    out = acc / tl.where(filled, l_i, 1.0)[:, None]
    lse = tl.where(filled, m_i + tl.log(tl.where(filled, l_i, 1.0)), float("-inf"))
    base = b64 * stride_pob + split.to(tl.int64) * stride_pos + offs_m[:, None].to(tl.int64) * stride_pom
    tl.store(part_out_ptr + base + offs_c[None, :], out, mask=mask_m[:, None] & mask_c[None, :])
    tl.store(part_lse_ptr + b64 * stride_plb + offs_m * stride_plm + split, lse, mask=mask_m)


@triton.jit(do_not_specialize=MERGE_UNSPECIALIZED)
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    stride_pob,
    stride_pom,
    stride_pos,
    stride_plb,
    stride_plm,
    stride_ob,
    stride_om,
    stride_lb,
    rows,
    d_c,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_DC: tl.constexpr,
):
    mb = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < rows
    offs_c = tl.arange(0, BLOCK_DC)
    mask = mask_m[:, None] & (offs_c < d_c)[None, :]
    lse_ptrs = part_lse_ptr + b64 * stride_plb + offs_m * stride_plm
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    nan_seen = tl.zeros([BLOCK_M], dtype=tl.int32)
    for s in range(num_splits):
        lse_s = tl.load(lse_ptrs + s, mask=mask_m, other=float("-inf"))
        m = tl.maximum(m, lse_s)
        nan_seen = nan_seen | (lse_s != lse_s).to(tl.int32)
    m = tl.where(nan_seen > 0, float("nan"), m)
    any_rows = (m > float("-inf")) | (nan_seen > 0)
    m_safe = tl.where(any_rows, m, 0.0)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DC], dtype=tl.float32)
    for s in range(num_splits):
        lse_s = tl.load(lse_ptrs + s, mask=mask_m, other=float("-inf"))
        used = lse_s != float("-inf")  # empty splits are skipped, never merged; NaN is passed on
        w = tl.where(used, tl.exp(lse_s - m_safe), 0.0)
        base = b64 * stride_pob + s * stride_pos + offs_m[:, None].to(tl.int64) * stride_pom
        part = tl.load(part_out_ptr + base + offs_c[None, :], mask=mask & used[:, None], other=0.0)
        acc += w[:, None] * part
        den += w
    out = acc / tl.where(any_rows, den, 1.0)[:, None]
    lse = tl.where(any_rows, m_safe + tl.log(tl.where(any_rows, den, 1.0)), float("-inf"))
    o_ptrs = out_ptr + b64 * stride_ob + offs_m[:, None].to(tl.int64) * stride_om + offs_c[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + b64 * stride_lb + offs_m, lse, mask=mask_m)


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
    max_seq_len: int | None = None,
    fp8: Fp8Layout | None = None,
    block_m: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``s_q`` new query tokens per request over a paged ``[c_kv | k_rope]`` cache.

    The host work here reads no device tensor (no synchronisation, so a decode step can be captured in a CUDA
    graph once ``num_splits`` is fixed); the value checks of :func:`check_decode_values` (page ids in
    ``[0, num_pages)``, lengths, rope heads) run only when the index tensors are on the CPU. On a GPU they are
    not checked: a page id outside the pool reads foreign memory.

    Args:
        q_abs: ``[B, H, d_c]`` (one token per request) or ``[B, s_q, H, d_c]`` absorbed content queries;
            float32, float16 or bfloat16 (bfloat16 only on a GPU).
        q_rope: ``[B, H, d_R]`` / ``[B, s_q, H, d_R]`` rotated rope queries, same dtype (``d_R`` may be 0).
        kv_cache: ``[num_pages, page_size, d_c + R * d_R]`` one layer's rows, same dtype and device, last dim
            contiguous (the row stride may be padded, e.g. to 16 elements for vector loads); page size 1..128.
        block_table: ``[B, max_pages]`` int32 page ids of each request, in token order.
        seq_lens: ``[B]`` int32 cached rows per request including the ``s_q`` new ones (0 gives zeros and
            ``lse = -inf``; otherwise ``>= s_q``). Query token ``i`` sees rows ``j <= seq_lens[b] - s_q + i``.
        head_to_rope: ``[H]`` int32 rope head of each query head (``h // (H / R)`` for converted models); any
            view or integer dtype (copied to contiguous int32 first where it is not:
            :func:`~.launch.plan_launch`).
        softmax_scale: the source model's attention scale; required, never derived from widths.
        num_splits: programs per request along the cached rows (default :func:`~.launch.default_num_splits`).
        block_n: rows per tile, ``>= 16`` (default :func:`~.launch.default_block_n`).
        max_seq_len: a host-side upper bound of ``seq_lens`` for choosing the splits (default: read from
            ``seq_lens`` on the CPU, ``max_pages x page_size`` on a GPU, where reading would synchronise).
        fp8: the layout of an FP8 cache: ``kv_cache`` is then uint8 ``[num_pages, page_size, >= row_bytes]``
            rows ``[E4M3 c_kv | float32 scales | bfloat16 k_rope]`` (:mod:`mla_convert.kernels.fp8`), dequantized
            in registers to the queries' dtype.
        block_m: query rows per program, a power of two ``>= 16`` (default :func:`~.launch.default_block_m`: 16
            on a GPU, a whole request's rows in the interpreter).

    Returns:
        ``latent_out`` shaped like ``q_abs`` in its dtype and natural-log ``lse`` (``[B, H]`` / ``[B, s_q, H]``)
        float32.

    Raises:
        ValueError: inconsistent shapes/dtypes/devices (:func:`check_decode_inputs`), out-of-range values on
            CPU tensors (:func:`check_decode_values`), a non-contiguous last dimension or misaligned FP8 rows
            (the strides each input needs: :func:`~.launch.plan_launch`), ``block_n < 16``, CPU tensors on a
            host where Triton runs natively, or bfloat16 in the Triton interpreter.
    """
    check_decode_inputs(q_abs, q_rope, kv_cache, block_table, seq_lens, head_to_rope, softmax_scale, fp8)
    device = q_abs.device
    backend = kernel_backend()
    if device.type == "cpu" and backend == "triton-cuda":
        raise ValueError(
            "the decode kernel runs natively on this CUDA host but its inputs are on the CPU; put the model "
            "and its paged cache on the GPU (--device cuda)"
        )
    if fp8 is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"an FP8 cache needs E4M3 support (sm_89 or newer); {torch.cuda.get_device_name(device)} is "
            f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}: use a bfloat16 cache"
        )
    if q_abs.dtype == torch.bfloat16 and backend == "triton-interpreter":
        raise ValueError(
            "bfloat16 cannot run in the Triton interpreter (it reads bfloat16 as 16-bit integers); use a "
            "float32 or float16 cache on the CPU (--dtype float32), or a CUDA GPU"
        )
    if block_table.device.type == "cpu":
        check_decode_values(q_abs, q_rope, kv_cache, block_table, seq_lens, head_to_rope, fp8)
    plan = plan_launch(
        q_abs,
        q_rope,
        kv_cache,
        block_table,
        seq_lens,
        head_to_rope,
        softmax_scale,
        num_splits,
        block_n,
        max_seq_len,
        fp8,
        block_m,
        backend,
        multiprocessor_count(device),
    )
    if plan.split_grid[0] and plan.split_grid[2]:
        _split_kernel[plan.split_grid](*plan.split_args, **plan.split_kwargs)
        _merge_kernel[plan.merge_grid](*plan.merge_args, **plan.merge_kwargs)
    if q_abs.dim() == 3:
        return plan.out[:, 0], plan.lse[:, 0]
    return plan.out, plan.lse
