"""PyTorch oracle for the paged latent-cache decode kernel (same signature, float64 by default).

The absorbed decode step of docs/math.md on the paged layout of docs/formats.md: for request ``b`` and
query head ``h``, with the ``n = seq_lens[b]`` cached rows ``[c_kv | k_rope]`` gathered through
``block_table[b]``::

    score[h, j]      = (q_abs[b, h] . c_kv[j] + q_rope[b, h] . k_rope[j, r(h)]) * softmax_scale
    lse[b, h]        = log sum_j exp(score[h, j])                   (natural log)
    latent_out[b, h] = sum_j softmax(score[h])[j] * c_kv[j]

``k_rope`` rows are cached already rotated at their absolute positions, so no rotation happens here.
"""

from __future__ import annotations

import torch


def check_decode_inputs(
    q_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    head_to_rope: torch.Tensor,
    softmax_scale: float,
) -> tuple[int, int, int]:
    """Check shapes and dtypes shared by the kernel and the reference.

    Returns:
        ``(d_c, d_R, rope_width)``.

    Raises:
        ValueError: a wrong rank, width, dtype or index range, naming the argument and what it needs.
    """
    if q_abs.dim() != 3:
        raise ValueError(f"q_abs must be [B, H, d_c]; got shape {tuple(q_abs.shape)}")
    b, h, d_c = q_abs.shape
    if q_rope.dim() != 3 or q_rope.shape[:2] != (b, h):
        raise ValueError(f"q_rope must be [B={b}, H={h}, d_R]; got shape {tuple(q_rope.shape)}")
    d_r = q_rope.shape[2]
    if kv_cache.dim() != 3:
        raise ValueError(
            f"kv_cache must be [num_pages, page_size, d_c + rope width]; got {tuple(kv_cache.shape)}"
        )
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
    n_rope = rope_width // d_r if d_r else 1
    if h and d_r and (int(head_to_rope.min()) < 0 or int(head_to_rope.max()) >= n_rope):
        raise ValueError(
            f"head_to_rope values must lie in [0, {n_rope}) (the cache holds {n_rope} rope heads)"
        )
    if b and int(seq_lens.max()) > block_table.shape[1] * kv_cache.shape[1]:
        raise ValueError("a sequence length exceeds block_table capacity (max_pages * page_size)")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, float | int) or not softmax_scale > 0:
        raise ValueError(
            f"softmax_scale must be a positive float (the source model's); got {softmax_scale!r}"
        )
    return d_c, d_r, rope_width


def latent_decode_reference(
    q_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    head_to_rope: torch.Tensor,
    softmax_scale: float,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a paged latent cache, computed plainly in ``dtype``.

    Args:
        q_abs: ``[B, H, d_c]`` absorbed content queries (``W_UK[g(h)]^T q_nope[h]``).
        q_rope: ``[B, H, d_R]`` rotated rope queries (``d_R`` may be 0).
        kv_cache: ``[num_pages, page_size, d_c + R * d_R]`` rows ``[c_kv | rotated k_rope]``.
        block_table: ``[B, max_pages]`` int32 page ids; entries past a sequence's pages are ignored.
        seq_lens: ``[B]`` int32 valid tokens per request (0 allowed).
        head_to_rope: ``[H]`` rope head read by each query head.
        softmax_scale: the source model's scale (required; no default by design).
        dtype: compute dtype (float64 for the oracle).

    Returns:
        ``latent_out [B, H, d_c]`` and natural-log ``lse [B, H]``, both in ``dtype``; a length-0 request
        gives zeros and ``-inf``. Slots past ``seq_lens`` are never read, so NaN there is harmless.

    Raises:
        ValueError: see :func:`check_decode_inputs`.
    """
    d_c, d_r, _ = check_decode_inputs(
        q_abs, q_rope, kv_cache, block_table, seq_lens, head_to_rope, softmax_scale
    )
    b, h, _ = q_abs.shape
    page = kv_cache.shape[1]
    out = torch.zeros(b, h, d_c, dtype=dtype, device=q_abs.device)
    lse = torch.full((b, h), float("-inf"), dtype=dtype, device=q_abs.device)
    heads = head_to_rope.long()
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pages = block_table[i, : (n + page - 1) // page].long()
        rows = kv_cache[pages].reshape(-1, kv_cache.shape[2])[:n].to(dtype)
        c_kv = rows[:, :d_c]
        scores = q_abs[i].to(dtype) @ c_kv.T  # [H, n]
        if d_r:
            k_rope = rows[:, d_c:].reshape(n, -1, d_r)[:, heads]  # [n, H, d_R]
            scores = scores + torch.einsum("hd,nhd->hn", q_rope[i].to(dtype), k_rope)
        scores = scores * softmax_scale
        lse[i] = torch.logsumexp(scores, dim=-1)
        out[i] = torch.softmax(scores, dim=-1) @ c_kv
    return out, lse
