"""PyTorch oracle for the paged latent-cache attention kernel (same signature, float64 by default).

The absorbed attention of docs/math.md on the paged layout of docs/formats.md. Request ``b`` has
``n = seq_lens[b]`` cached rows ``[c_kv | k_rope]`` (gathered through ``block_table[b]``), of which the last
``s_q`` are the request's new tokens; query ``i`` (``0 <= i < s_q``) of head ``h`` sees rows
``j <= n - s_q + i`` (causal inside the query block, as in FlashMLA's ``s_q > 1`` decoding)::

    score[i, h, j]      = (q_abs[b, i, h] . c_kv[j] + q_rope[b, i, h] . k_rope[j, r(h)]) * softmax_scale
    lse[b, i, h]        = log sum_j exp(score[i, h, j])                  (natural log)
    latent_out[b, i, h] = sum_j softmax(score[i, h])[j] * c_kv[j]

With one query token per request (``s_q = 1``) the queries may be given as ``[B, H, d]`` and the outputs come
back as ``[B, H, d_c]`` / ``[B, H]``. ``k_rope`` rows are cached already rotated at their absolute positions,
so no rotation happens here.

Empty request convention: a request with ``seq_lens[b] = 0`` (and a query row that sees no row) gives a zero
``latent_out`` and ``lse = -inf`` (FlashInfer's convention; FlashMLA's test suite writes ``+inf``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .fp8 import Fp8Layout


def _as_4d(q: torch.Tensor, name: str) -> torch.Tensor:
    if q.dim() == 3:
        return q.unsqueeze(1)
    if q.dim() == 4:
        return q
    raise ValueError(f"{name} must be [B, H, d] or [B, s_q, H, d]; got shape {tuple(q.shape)}")


def check_decode_inputs(
    q_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    head_to_rope: torch.Tensor,
    softmax_scale: float,
    fp8: Fp8Layout | None = None,
) -> tuple[int, int, int]:
    """Check shapes, dtypes and devices shared by the kernel and the reference; never reads tensor values.

    With ``fp8`` (an :class:`~mla_convert.kernels.fp8.Fp8Layout`) the cache is uint8 FP8 rows of that layout.

    Value checks (page ids, lengths, rope heads) are :func:`check_decode_values`: they read index tensors,
    which costs a device-to-host synchronisation unless the tensors live on the CPU.

    Returns:
        ``(d_c, d_R, rope_width)``.

    Raises:
        ValueError: a wrong rank, width, dtype or device, naming the argument and what it needs.
    """
    q4 = _as_4d(q_abs, "q_abs")
    b, s_q, h, d_c = q4.shape
    if q_rope.dim() != q_abs.dim() or q_rope.shape[:-1] != q_abs.shape[:-1]:
        raise ValueError(
            f"q_rope must be {list(q_abs.shape[:-1]) + ['d_R']} like q_abs; got shape {tuple(q_rope.shape)}"
        )
    d_r = q_rope.shape[-1]
    if kv_cache.dim() != 3:
        raise ValueError(
            f"kv_cache must be [num_pages, page_size, d_c + rope width]; got {tuple(kv_cache.shape)}"
        )
    if fp8 is not None or kv_cache.dtype == torch.uint8:
        if fp8 is None or kv_cache.dtype != torch.uint8:
            raise ValueError(
                "an FP8 cache is uint8 rows together with its layout (fp8=...); got one without the other"
            )
        if (
            fp8.d_c != d_c
            or kv_cache.shape[2] < fp8.row_bytes
            or (d_r == 0) != (fp8.rope_width == 0)
            or (d_r and fp8.rope_width % d_r)
        ):
            raise ValueError(
                f"FP8 rows of {kv_cache.shape[2]} bytes with layout d_c={fp8.d_c}, rope width {fp8.rope_width} "
                f"({fp8.row_bytes} bytes) do not fit q_abs d_c={d_c} and q_rope d_R={d_r}"
            )
        rope_width = fp8.rope_width
    else:
        rope_width = kv_cache.shape[2] - d_c
    if rope_width < 0 or (d_r == 0) != (rope_width == 0) or (d_r and rope_width % d_r):
        raise ValueError(
            f"kv_cache rows are {kv_cache.shape[2]} wide but q_abs has d_c={d_c} and q_rope d_R={d_r}: "
            "the row must be d_c + (number of rope heads) * d_R"
        )
    if not 1 <= kv_cache.shape[1] <= 128:
        raise ValueError(f"page size {kv_cache.shape[1]} is outside the supported 1..128")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table must be int32 [B={b}, max_pages]; got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if seq_lens.shape != (b,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B={b}]; got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if head_to_rope.shape != (h,):
        raise ValueError(f"head_to_rope must be [H={h}]; got {tuple(head_to_rope.shape)}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, float | int) or not softmax_scale > 0:
        raise ValueError(
            f"softmax_scale must be a positive float (the source model's); got {softmax_scale!r}"
        )
    named = {
        "q_abs": q_abs,
        "q_rope": q_rope,
        "kv_cache": kv_cache,
        "block_table": block_table,
        "seq_lens": seq_lens,
        "head_to_rope": head_to_rope,
    }
    devices = {name: t.device for name, t in named.items()}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(
            f"all inputs must be on one device; got {where} (move the model and its cache together)"
        )
    return d_c, d_r, rope_width


def check_decode_values(
    q_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    head_to_rope: torch.Tensor,
    fp8: Fp8Layout | None = None,
) -> None:
    """Check the index tensors' values: rope heads, lengths against block-table capacity and ``s_q``, and
    every page id a request reads (its first ``ceil(seq_lens[b] / page_size)`` entries) in ``[0, num_pages)``.

    Reads the tensors, so on a GPU it synchronises with the device: the kernel calls it only for CPU tensors.

    Raises:
        ValueError: a value out of range, naming the request and entry.
    """
    b, s_q = q_abs.shape[0], (q_abs.shape[1] if q_abs.dim() == 4 else 1)
    h, d_r = head_to_rope.shape[0], q_rope.shape[-1]
    rope_width = fp8.rope_width if fp8 is not None else kv_cache.shape[2] - q_abs.shape[-1]
    num_pages, page = kv_cache.shape[0], kv_cache.shape[1]
    n_rope = rope_width // d_r if d_r else 1
    if h and d_r and (int(head_to_rope.min()) < 0 or int(head_to_rope.max()) >= n_rope):
        raise ValueError(
            f"head_to_rope values must lie in [0, {n_rope}) (the cache holds {n_rope} rope heads)"
        )
    if not b:
        return
    lens = seq_lens.cpu().long()
    if int(lens.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0; got {lens.tolist()}")
    if int(lens.max()) > block_table.shape[1] * page:
        raise ValueError("a sequence length exceeds block_table capacity (max_pages * page_size)")
    short = ((lens > 0) & (lens < s_q)).nonzero().flatten().tolist()
    if short:
        raise ValueError(
            f"request {short[0]} has {int(lens[short[0]])} rows for {s_q} query tokens: seq_lens counts the "
            "new tokens too, so it must be 0 or >= s_q"
        )
    used = -(-lens // page)  # entries each request reads
    table = block_table.cpu().long()
    live = torch.arange(table.shape[1])[None, :] < used[:, None]
    bad = live & ((table < 0) | (table >= num_pages))
    if bool(bad.any()):
        req, entry = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{req}, {entry}] = {int(table[req, entry])} is not a page id in [0, {num_pages}) "
            f"(request {req} reads {int(used[req])} pages)"
        )


def latent_decode_reference(
    q_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    head_to_rope: torch.Tensor,
    softmax_scale: float,
    dtype: torch.dtype = torch.float64,
    fp8: Fp8Layout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``s_q`` new query tokens per request over a paged latent cache, computed plainly in ``dtype``.

    Args:
        q_abs: ``[B, H, d_c]`` or ``[B, s_q, H, d_c]`` absorbed content queries (``W_UK[g(h)]^T q_nope[h]``).
        q_rope: ``[B, H, d_R]`` or ``[B, s_q, H, d_R]`` rotated rope queries (``d_R`` may be 0).
        kv_cache: ``[num_pages, page_size, d_c + R * d_R]`` rows ``[c_kv | rotated k_rope]`` (the row stride may
            be padded: only the last dimension must be contiguous).
        block_table: ``[B, max_pages]`` int32 page ids; entries past a sequence's pages are ignored.
        seq_lens: ``[B]`` int32 rows per request, the ``s_q`` new ones included (0 allowed).
        head_to_rope: ``[H]`` rope head read by each query head.
        softmax_scale: the source model's scale (required; no default by design).
        dtype: compute dtype (float64 for the oracle).
        fp8: the layout of an FP8 cache (uint8 rows, :mod:`mla_convert.kernels.fp8`): the rows are dequantized
            exactly as the kernel does, then computed in ``dtype``.

    Returns:
        ``latent_out`` shaped like ``q_abs`` and natural-log ``lse`` (``q_abs``'s shape without ``d_c``), both in
        ``dtype``; a length-0 request gives zeros and ``-inf``. Slots past ``seq_lens`` are never read, so NaN
        there is harmless.

    Raises:
        ValueError: see :func:`check_decode_inputs` and :func:`check_decode_values`.
    """
    d_c, d_r, _ = check_decode_inputs(
        q_abs, q_rope, kv_cache, block_table, seq_lens, head_to_rope, softmax_scale, fp8
    )
    check_decode_values(q_abs, q_rope, kv_cache, block_table, seq_lens, head_to_rope, fp8)
    if fp8 is not None:
        from .fp8 import dequantize_rows

        kv_cache = dequantize_rows(kv_cache, fp8)
    qa, qr = _as_4d(q_abs, "q_abs"), _as_4d(q_rope, "q_rope")
    b, s_q, h, _ = qa.shape
    page = kv_cache.shape[1]
    out = torch.zeros(b, s_q, h, d_c, dtype=dtype, device=q_abs.device)
    lse = torch.full((b, s_q, h), float("-inf"), dtype=dtype, device=q_abs.device)
    heads = head_to_rope.long()
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pages = block_table[i, : (n + page - 1) // page].long()
        rows = kv_cache[pages].reshape(-1, kv_cache.shape[2])[:n].to(dtype)
        c_kv = rows[:, :d_c]
        scores = torch.einsum("shc,nc->shn", qa[i].to(dtype), c_kv)  # [s_q, H, n]
        if d_r:
            k_rope = rows[:, d_c:].reshape(n, -1, d_r)[:, heads]  # [n, H, d_R]
            scores = scores + torch.einsum("shd,nhd->shn", qr[i].to(dtype), k_rope)
        scores = scores * softmax_scale
        visible = torch.arange(n)[None, :] <= (n - s_q + torch.arange(s_q))[:, None]  # [s_q, n]
        scores = scores.masked_fill(~visible[:, None, :].to(scores.device), float("-inf"))
        lse[i] = torch.logsumexp(scores, dim=-1)
        out[i] = torch.einsum("shn,nc->shc", torch.softmax(scores, dim=-1), c_kv)
    if q_abs.dim() == 3:
        return out[:, 0], lse[:, 0]
    return out, lse
