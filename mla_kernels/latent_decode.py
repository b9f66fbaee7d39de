"""Triton split-KV attention over a paged MLA latent cache (docs/formats.md §The decode kernel).

``s_q`` new query tokens per request (one for decoding; several for speculative verification or chunked
prefill, causal inside the block). The query rows of a request, ``m = i * H + h`` for query token ``i`` and
head ``h``, are tiled ``BLOCK_M = 16`` at a time (``tl.dot`` needs 16 rows; the Triton interpreter takes a whole
request's rows per program, :func:`default_block_m`). Program ``(row block, split, b)``
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
tiles of ``d_c`` and ``d_R``, ``BLOCK_N``, the rope part (:func:`launch_key`) and the specialisation of its fixed
integers (``d_c``, ``d_R``, cache strides and row offsets, e.g. ``d_c = 18`` vs ``32``): :func:`plan_launch`
gives the arguments, :mod:`mla_convert.kernels.variants` their key, and :mod:`mla_convert.kernels.compile_check`
compiles the keys the product launches.

Numerics: float32 inputs use IEEE float32 dot products (no TF32); float16/bfloat16 inputs use their native dot
with float32 accumulation, and the probabilities are rounded to the cache dtype for the value product, as in
FlashAttention. On a machine without a GPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set
by :mod:`mla_convert.kernels` before this module is imported), which reads bfloat16 as 16-bit integers:
bfloat16 is refused there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .backend import kernel_backend
from .fp8 import Fp8Layout
from .reference import check_decode_inputs, check_decode_values

MERGE_WARPS = 4
BLOCK_M = 16  # query rows (query token x head) per program: tl.dot needs >= 16 rows
#: query rows per program in the Triton interpreter (see :func:`default_block_m`)
INTERPRETER_MAX_BLOCK_M = 1024
MIN_BLOCK_N = 16  # tl.dot needs >= 16 columns in fp16/bf16 when compiled for sm_80/sm_90
MAX_SPLITS = 32
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the fp32 partials of the splits stay below this fraction of the cache bytes a request reads
PARTIAL_BYTES_FRACTION = 0.25


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


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100/H200 SXM); 1 for the CPU interpreter,
    which runs programs one after another, so extra splits only add merge work there."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 1


def default_block_m(rows: int, backend: str) -> int:
    """Query rows per program for ``rows`` (``s_q x H``) query rows of a request.

    :data:`BLOCK_M` (16) where the kernel is compiled: ``tl.dot``'s minimum, and the ``[BLOCK_M, d_c]`` float32
    accumulator stays in registers. In the Triton interpreter (``backend == "triton-interpreter"``), which runs
    the programs of a grid one after another in Python at a fixed cost each, every row of the request up to
    :data:`INTERPRETER_MAX_BLOCK_M` (a power of two): a 61-token prefill of 9 heads is one program instead of
    35. Each query row's arithmetic is the same either way: a wider row block reads, for its earlier rows, tiles
    past their causal limit, which are fully masked and add exact zeros (``alpha = 1``, ``p = 0``).
    """
    if backend != "triton-interpreter":
        return BLOCK_M
    return max(BLOCK_M, min(INTERPRETER_MAX_BLOCK_M, triton.next_power_of_2(max(rows, 1))))


def default_block_n(d_c: int) -> int:
    """Cache rows per tile: 64, or 32 when ``d_c > 256`` (the ``[BLOCK_M, d_c]`` accumulator and the tile must
    fit the registers)."""
    return 32 if d_c > 256 else 64


def default_num_splits(
    batch: int,
    rows: int,
    max_seq_len: int,
    d_c: int,
    row_bytes: int,
    sm_count: int,
    block_n: int = 64,
    max_splits: int = MAX_SPLITS,
) -> int:
    """Programs per request along the cached rows, a power of two in ``1..max_splits``.

    Enough programs to give every multiprocessor one (``batch x row blocks x splits >= sm_count``), never
    more than one tile of ``block_n`` rows per split, and few enough that the float32 partials the splits
    write and the merge reads (``rows x d_c x 4`` bytes per split per request) stay under
    :data:`PARTIAL_BYTES_FRACTION` of the cache bytes a request reads (``max_seq_len x row_bytes``).

    Args:
        batch: requests; rows: query rows per request (``s_q x H``); max_seq_len: the longest request in tokens
            (a host-side bound: no device read); d_c: latent width; row_bytes: bytes of one cached row;
            sm_count: multiprocessors of the device (:func:`multiprocessor_count`).

    Examples (H200, 132 SMs, bf16, d_c = 512, d_R = 64, H = 128): 1 x 32k tokens -> 16 splits; 16 x 4k -> 2;
    64 x 4k -> 1.
    """
    ctas = batch * -(-rows // BLOCK_M)
    tiles = -(-max_seq_len // block_n)
    if ctas == 0 or tiles <= 1 or ctas >= sm_count:
        return 1
    want = -(-sm_count // ctas)
    cap = int(max_seq_len * row_bytes * PARTIAL_BYTES_FRACTION) // max(1, rows * d_c * 4)
    splits = max(1, min(want, tiles, cap, max_splits))
    return 1 << (splits.bit_length() - 1)


@dataclass(frozen=True)
class LaunchKey:
    """What makes a compiled variant of the kernels: everything else is a runtime argument.

    Attributes:
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (queries and cache).
        block_dc: power-of-two tile of the latent width (``>= 16``); block_r: of ``d_R`` (16 when no rope).
        block_n: cached rows per tile; has_rope: whether rows carry a rope part.
        num_warps: warps per split program (:func:`default_num_warps`).
        fp8_group: latent values per scale of an FP8 cache (:mod:`mla_convert.kernels.fp8`); 0 for a cache in
            the queries' dtype.
    """

    dtype: str
    block_dc: int
    block_r: int
    block_n: int
    has_rope: bool
    num_warps: int
    fp8_group: int = 0


def launch_key(
    dtype: torch.dtype, d_c: int, d_r: int, block_n: int | None = None, fp8_group: int = 0
) -> LaunchKey:
    """The compiled variant :func:`latent_decode` launches for queries of ``dtype`` and these widths (see
    :class:`LaunchKey`)."""
    return LaunchKey(
        str(dtype).replace("torch.", ""),
        max(16, triton.next_power_of_2(d_c)),
        max(16, triton.next_power_of_2(max(d_r, 1))),
        block_n or default_block_n(d_c),
        bool(d_r),
        default_num_warps(d_c),
        fp8_group,
    )


def default_num_warps(d_c: int) -> int:
    """Warps per split program: 8 when ``d_c > 64`` (the ``[16, d_c]`` float32 accumulator and a ``[BLOCK_N, d_c]``
    tile spread over 256 threads instead of 128), else 4. Compiled for sm_90, a 128-wide latent tile with a
    64-wide rope tile spilled 192 bytes per thread on 4 warps in float32 (88-160 with FP8 rows) and none on 8
    (``benchmarks/results/kernel_compile.md``)."""
    return 8 if d_c > 64 else 4


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
            view or integer dtype (copied to contiguous int32 first where it is not: :func:`plan_launch`).
        softmax_scale: the source model's attention scale; required, never derived from widths.
        num_splits: programs per request along the cached rows (default :func:`default_num_splits`).
        block_n: rows per tile, ``>= 16`` (default :func:`default_block_n`).
        max_seq_len: a host-side upper bound of ``seq_lens`` for choosing the splits (default: read from
            ``seq_lens`` on the CPU, ``max_pages x page_size`` on a GPU, where reading would synchronise).
        fp8: the layout of an FP8 cache: ``kv_cache`` is then uint8 ``[num_pages, page_size, >= row_bytes]``
            rows ``[E4M3 c_kv | float32 scales | bfloat16 k_rope]`` (:mod:`mla_convert.kernels.fp8`), dequantized
            in registers to the queries' dtype.
        block_m: query rows per program, a power of two ``>= 16`` (default :func:`default_block_m`: 16 on a
            GPU, a whole request's rows in the interpreter).

    Returns:
        ``latent_out`` shaped like ``q_abs`` in its dtype and natural-log ``lse`` (``[B, H]`` / ``[B, s_q, H]``)
        float32.

    Raises:
        ValueError: inconsistent shapes/dtypes/devices (:func:`check_decode_inputs`), out-of-range values on
            CPU tensors (:func:`check_decode_values`), a non-contiguous last dimension or misaligned FP8 rows
            (the strides each input needs: :func:`plan_launch`), ``block_n < 16``, CPU tensors on a host where
            Triton runs natively, or bfloat16 in the Triton interpreter.
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


@dataclass
class Launch:
    """The two kernel launches of one :func:`latent_decode` call, planned on the host (:func:`plan_launch`).

    Attributes:
        split_grid, merge_grid: ``(row blocks, splits, B)`` and ``(row blocks, B)``; split_args/merge_args and
            split_kwargs/merge_kwargs: the launch arguments (``kernel[grid](*args, **kwargs)``), whose
            specialisation key (:func:`mla_convert.kernels.variants.launch_specialization`) names the compiled
            variant; out: ``[B, s_q, H, d_c]`` and lse: ``[B, s_q, H]``, the outputs the launches fill; key: the
            :class:`LaunchKey`.
    """

    split_grid: tuple[int, int, int]
    split_args: tuple[Any, ...]
    split_kwargs: dict[str, Any]
    merge_grid: tuple[int, int]
    merge_args: tuple[Any, ...]
    merge_kwargs: dict[str, Any]
    out: torch.Tensor
    lse: torch.Tensor
    key: LaunchKey


def plan_launch(
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
    backend: str = "triton-cuda",
    sm_count: int = 1,
) -> Launch:
    """The launches :func:`latent_decode` makes for these inputs (same arguments; ``backend`` and ``sm_count`` as
    :func:`default_block_m` and :func:`default_num_splits` take them), without running them or reading a device
    value: :mod:`mla_convert.kernels.compile_check` plans the product's launches on CPU tensors this way.

    Strides the kernels assume: the last dimension of ``q_abs``, ``q_rope`` and ``kv_cache`` is contiguous
    (refused otherwise: copying the cache would cost its size); their other strides are passed, so any view
    (strided, expanded with stride 0) is read as it is. ``head_to_rope``, ``block_table`` and ``seq_lens`` are
    read with unit strides: one that is not contiguous, or a ``head_to_rope`` that is not int32, is copied first
    (``[H]``, ``[B, max_pages]`` and ``[B]`` integers: a few hundred bytes per call; inside a CUDA graph the copy is
    captured with the step). FP8 rows are read as float32 scales and bfloat16 rope values at byte offsets, so
    their page and row strides and the storage's address must be multiples of 4 bytes.

    Raises:
        ValueError: as :func:`latent_decode` (dtypes, a non-contiguous last dimension, misaligned FP8 rows,
            ``block_n``, ``block_m`` or ``num_splits`` out of range).
    """
    d_c, d_r, _ = check_decode_inputs(
        q_abs, q_rope, kv_cache, block_table, seq_lens, head_to_rope, softmax_scale, fp8
    )
    device = q_abs.device
    if fp8 is None and kv_cache.dtype not in DTYPES:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} is not supported (float32, float16, bfloat16; uint8 FP8 rows with fp8=)"
        )
    want = q_abs.dtype if fp8 is not None else kv_cache.dtype
    if q_abs.dtype not in DTYPES or q_abs.dtype != want or q_rope.dtype != want:
        raise ValueError(
            f"q_abs ({q_abs.dtype}), q_rope ({q_rope.dtype}) and kv_cache ({kv_cache.dtype}) must share a dtype "
            "(the queries of an FP8 cache: float32, float16 or bfloat16)"
        )
    if kv_cache.stride(2) != 1 or q_abs.stride(-1) != 1 or (d_r and q_rope.stride(-1) != 1):
        raise ValueError(
            "kv_cache, q_abs and q_rope need a contiguous last dimension (stride 1); got strides "
            f"{kv_cache.stride()}, {q_abs.stride()}, {q_rope.stride()}: pass .contiguous() queries, or cache "
            "rows whose values are adjacent"
        )
    if fp8 is not None and (kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4 or kv_cache.data_ptr() % 4):
        raise ValueError(
            f"FP8 rows are read as float32 scales at byte offsets: the page and row strides "
            f"({kv_cache.stride(0)}, {kv_cache.stride(1)} bytes) and the storage address must be multiples of 4 "
            "(use PagedLatentCache's rows, padded to 16 bytes)"
        )
    block_n = block_n or default_block_n(d_c)
    if block_n < MIN_BLOCK_N or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {MIN_BLOCK_N} (tl.dot's minimum); got {block_n}")
    if block_m is not None and (block_m < BLOCK_M or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two >= {BLOCK_M} (tl.dot's minimum); got {block_m}")
    if num_splits is not None and not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must lie in 1..1024; got {num_splits}")
    # the kernels read these with unit strides (a strided view would read other entries, an expanded one past
    # its storage): contiguous int32 copies where they are not (no copy, and no kernel, where they are)
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()
    head_to_rope = head_to_rope.to(torch.int32).contiguous()
    q4 = q_abs if q_abs.dim() == 4 else q_abs.unsqueeze(1)
    r4 = q_rope if q_rope.dim() == 4 else q_rope.unsqueeze(1)
    b, s_q, h, _ = q4.shape
    rows = s_q * h
    block_m = block_m or default_block_m(rows, backend)
    if max_seq_len is None:
        on_host = block_table.device.type == "cpu"
        max_seq_len = int(seq_lens.max()) if on_host and b else block_table.shape[1] * kv_cache.shape[1]
    key = launch_key(q_abs.dtype, d_c, d_r, block_n, fp8.group if fp8 is not None else 0)
    if num_splits is None:
        row_bytes = kv_cache.shape[2] * kv_cache.element_size()
        num_splits = default_num_splits(b, rows, max_seq_len, d_c, row_bytes, sm_count, block_n)
    part_out = torch.empty(b, rows, num_splits, d_c, dtype=torch.float32, device=device)
    part_lse = torch.empty(b, rows, num_splits, dtype=torch.float32, device=device)
    out = torch.empty(b, s_q, h, d_c, dtype=q_abs.dtype, device=device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=device)
    r_arg = r4 if d_r else q4  # never read without rope
    row_blocks = triton.cdiv(rows, block_m)
    split_args = (
        q4,
        r_arg,
        kv_cache,
        block_table,
        seq_lens,
        head_to_rope,
        part_out,
        part_lse,
        float(softmax_scale),
        q4.stride(0),
        q4.stride(1),
        q4.stride(2),
        r_arg.stride(0),
        r_arg.stride(1),
        r_arg.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        h,
        s_q,
        d_c,
        max(d_r, 1),
        kv_cache.shape[1],
        num_splits,
        fp8.rope_offset if fp8 else d_c,
        fp8.scale_offset if fp8 else d_c,
    )
    split_kwargs = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_DC=key.block_dc,
        BLOCK_R=key.block_r,
        HAS_ROPE=key.has_rope,
        IEEE=q_abs.dtype == torch.float32,
        FP8_GROUP=key.fp8_group,
        num_warps=key.num_warps,
    )
    merge_args = (
        part_out,
        part_lse,
        out,
        lse,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(2),
        lse.stride(0),
        rows,
        d_c,
        num_splits,
    )
    merge_kwargs = dict(BLOCK_M=block_m, BLOCK_DC=key.block_dc, num_warps=MERGE_WARPS)
    return Launch(
        (row_blocks if h else 0, num_splits, b),
        split_args,
        split_kwargs,
        (row_blocks if h else 0, b),
        merge_args,
        merge_kwargs,
        out,
        lse,
        key,
    )
