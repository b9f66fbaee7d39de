"""The host side of a :func:`~.latent_decode.latent_decode` call: the tiles, splits and warps
its two kernels launch with, the key of the compiled variant (:class:`LaunchKey`), and the arguments of the two
launches (:func:`plan_launch`), planned without running them or reading a device value.

The kernels and the call that launches them are in :mod:`mla_convert.kernels.latent_decode`;
:mod:`mla_convert.kernels.compile_check` plans the product's launches here to compile exactly their variants.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton

from .fp8 import Fp8Layout
from .reference import check_decode_inputs

MERGE_WARPS = 4
BLOCK_M = 16  # query rows (query token x head) per program: tl.dot needs >= 16 rows
#: query rows per program in the Triton interpreter (see :func:`default_block_m`)
INTERPRETER_MAX_BLOCK_M = 1024
MIN_BLOCK_N = 16  # tl.dot needs >= 16 columns in fp16/bf16 when compiled for sm_80/sm_90
MAX_SPLITS = 32
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the fp32 partials of the splits stay below this fraction of the cache bytes a request reads
PARTIAL_BYTES_FRACTION = 0.25


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
    """The compiled variant :func:`~.latent_decode.latent_decode` launches for queries of ``dtype`` and these
    widths (see :class:`LaunchKey`)."""
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


@dataclass
class Launch:
    """The two kernel launches of one :func:`~.latent_decode.latent_decode` call, planned on the host
    (:func:`plan_launch`).

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
    """The launches :func:`~.latent_decode.latent_decode` makes for these inputs (same arguments; ``backend``
    and ``sm_count`` as :func:`default_block_m` and :func:`default_num_splits` take them), without running them
    or reading a device value: :mod:`mla_convert.kernels.compile_check` plans the product's launches on CPU
    tensors this way.

    Strides the kernels assume: the last dimension of ``q_abs``, ``q_rope`` and ``kv_cache`` is contiguous
    (refused otherwise: copying the cache would cost its size); their other strides are passed, so any view
    (strided, expanded with stride 0) is read as it is. ``head_to_rope``, ``block_table`` and ``seq_lens`` are
    read with unit strides: one that is not contiguous, or a ``head_to_rope`` that is not int32, is copied first
    (``[H]``, ``[B, max_pages]`` and ``[B]`` integers: a few hundred bytes per call; inside a CUDA graph the copy is
    captured with the step). FP8 rows are read as float32 scales and bfloat16 rope values at byte offsets, so
    their page and row strides and the storage's address must be multiples of 4 bytes.

    Raises:
        ValueError: as :func:`~.latent_decode.latent_decode` (dtypes, a non-contiguous last dimension,
            misaligned FP8 rows, ``block_n``, ``block_m`` or ``num_splits`` out of range).
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
