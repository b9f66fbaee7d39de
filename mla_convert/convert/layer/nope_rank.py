"""The query's NoPE width reduced to ``n`` dims a head: a per-head low-rank of the NoPE score form (docs/math.md
§NoPE-width reduction; issue 34).

With one shared rope head the query's NoPE width is ``d + 2r(G-2)`` (per kept frequency the other ``G-1`` mixed
components stay NoPE): 512 on Llama-3-8B, wider than any ``qk_nope_head_dim`` vLLM's GPU prefill takes (64/128/192).
Per query head ``h`` reading KV head ``g = g(h)`` the NoPE score of query token ``t`` and key token ``j`` is

    s_h(t, j) = q_h(x_t)ᵀ W_g c_j         q_h = W_qN[h] x + b_qN[h]  [d_N],  W_g = W_UK[g]  [d_N, d_c],  c = W_down x [d_c]

(the brief's ``x_tᵀ A_h c_j`` with ``A_h = W_qN[h]ᵀ W_g``, query bias included). It is replaced by
``(T_h q_h)ᵀ (K_h c_j)`` with ``T_h [n, d_N]`` (new ``q_proj`` NoPE rows ``T_h W_qN[h]``) and ``K_h [n, d_c]`` (a new
``W_UK`` of this head alone, in ``kv_b_proj``), minimising the mean over all calibration (query, key) token pairs

    E_{t,j} (s_h - s'_h)² = ‖Q_h^{1/2} (W_g - T_hᵀ K_h) C_c^{1/2}‖_F²,   Q_h = E[q_h q_hᵀ],  C_c = E[c cᵀ],

the activation-weighted objective of the latent (factorize.py) on both sides. Because the query map only enters
through ``Q_h``, this is the same optimum as minimising over any ``P_h [D, n]`` in ``x`` space (``x_tᵀ P_h K_h c_j``).
Eckart–Young: with ``N = Q_h^{1/2} W_g C_c^{1/2} = U S Vᵀ`` and ``V_n`` its top ``n`` right singular vectors (the
eigenvectors of ``C_c^{1/2} W_gᵀ Q_h W_g C_c^{1/2}``, ``[d_c, d_c]``: no square root of ``Q_h``, which is rank
deficient whenever ``d_N > D``)

    B_h = T_hᵀ K_h = W_g C_c^{1/2} V_n V_nᵀ C_c^{-1/2}       (Q_h^{1/2} B_h C_c^{1/2} = N V_n V_nᵀ, the best rank n),

and the minimum is ``Σ_{i>n} σ_i²`` (the dropped eigenvalues). ``C_c`` carries a tiny ridge (:func:`psd_roots`), so
latent directions the calibration never reached keep ``W_g`` when the rank allows rather than being zeroed. ``T_h``
and ``K_h`` are the balanced factors of ``B_h`` (its SVD, singular values split evenly), as well scaled as ``W_g``
for rounding to 16 bits. When the form's rank on the queries the head can have is at most ``n`` it is kept (to rounding): through the decomposition when
the head's NoPE query is a function of fewer than ``n`` values (every head's is of its ``head_dim`` source values,
so ``n >= min(head_dim, d_c)`` is exact), and without one when it can be read off the shapes:
``d_N <= n`` (``T_h = [I; 0]``, ``K_h = [W_g; 0]``) or ``d_c <= n`` (``T_h = [W_gᵀ; 0]``, the absorbed query,
``K_h = [I; 0]``). Each query head then has its own key map: the MLA layer has ``H`` key groups, the value rows of
``kv_b_proj`` replicated per head; the cache row ``[c_kv | k_rope]`` is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mla_convert.convert.layer import linalg

#: Relative ridge on the latent's second moment ``C_c`` (:func:`psd_roots`).
RIDGE = 1e-9


@dataclass
class NopeReduction:
    """What the reduction kept in one layer.

    Attributes:
        width: ``n``, the query's NoPE dims per head after the reduction.
        kept: ``[H]`` float64, per head the fraction of the weighted NoPE score energy kept
            (``Σ_{i<=n} σ_i² / Σ σ_i²``; 1.0 when exact).
        dropped: ``[H]`` float64, per head the minimum ``E_{t,j} (s_h - s'_h)²`` (``Σ_{i>n} σ_i²``, 0 when exact):
            the mean squared NoPE score error over all calibration (query, key) token pairs, before the
            softmax scale.
    """

    width: int
    kept: torch.Tensor
    dropped: torch.Tensor


def input_moment(w: torch.Tensor, b: torch.Tensor | None, xx: torch.Tensor, x_mean: torch.Tensor) -> torch.Tensor:
    """``E[y yᵀ]`` ``[out, out]`` for ``y = W x + b`` (``w [out, D]``, ``b [out]`` or None) from the input's
    ``xx = E[x xᵀ] [D, D]`` and ``x_mean = E[x] [D]`` (float64)."""
    m = w @ xx @ w.T
    if b is not None:
        wm = w @ x_mean
        m = m + torch.outer(wm, b) + torch.outer(b, wm) + torch.outer(b, b)
    return m


def query_nope_moment(
    w_q: torch.Tensor,
    b_q: torch.Tensor | None,
    q_nope: torch.Tensor,
    scale: float,
    xx: torch.Tensor,
    x_mean: torch.Tensor,
    head: int,
) -> torch.Tensor:
    """Query head ``h``'s ``E[q_N q_Nᵀ]`` ``[d_N, d_N]`` for the NoPE query ``q_N = scale * A_h (W_h x + b_h)`` that
    :func:`~mla_convert.convert.layer.assemble.layer_tensors` assembles (``A_h = q_nope[h] [d_N, d]``, the plan's
    query map; ``W_h [d, D]`` the source head's rows): ``scale² A_h E[y yᵀ] A_hᵀ`` with ``y = W_h x + b_h``, so the
    ``D x D`` moment is taken on ``d`` rows instead of ``d_N`` (what :func:`reduce_nope` would do). One head per
    call: :func:`reduce_nope` asks for each as it goes, and no ``[H, d_N, d_N]`` stack is held (205 MB at
    Llama-3-8B's shapes).

    Args:
        w_q: ``[H d, D]`` the source query weight (float64); ``b_q``: ``[H d]`` or None.
        q_nope: ``[H, d_N, d]`` the plan's NoPE query maps (padded as assembled).
        scale: the factor the assembled query rows carry (``attention_scaling²``).
        xx, x_mean: ``E[x xᵀ] [D, D]`` and ``E[x] [D]`` of the layer's attention input.
        head: ``h``.
    """
    d = q_nope.shape[2]
    rows = slice(head * d, (head + 1) * d)
    m = input_moment(w_q[rows], b_q[rows] if b_q is not None else None, xx, x_mean)
    a = q_nope[head] * scale
    return a @ m @ a.T


def psd_roots(m: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M_r^{1/2}, M_r^{-1/2})`` ``[k, k]`` of a PSD ``m [k, k]`` (float64) with ``M_r = M + ridge * mean(diag M) I``.

    The ridge gives directions the calibration text never reached (a latent covariance of rank below ``d_c``: fewer
    distinct tokens than dims) a tiny weight instead of none, so a form the rank allows is kept exactly on them too
    (a pseudo-inverse would zero them: another token's scores would move)."""
    k = m.shape[0]
    lam = ridge * float(torch.diagonal(m).mean().clamp_min(1e-300))
    evals, evecs = linalg.eigh(m + lam * torch.eye(k, dtype=m.dtype))
    evals = evals.clamp_min(lam)
    return (evecs * evals.sqrt()) @ evecs.T, (evecs * evals.rsqrt()) @ evecs.T


def head_form(
    w_uk: torch.Tensor, qq: torch.Tensor, cc_root: torch.Tensor, cc_inv_root: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """One head's rank-``width`` NoPE form.

    Args:
        w_uk: ``[d_N, d_c]`` the head's key map ``W_g`` (float64).
        qq: ``[d_N, d_N]`` ``E[q qᵀ]`` of the head's NoPE query.
        cc_root, cc_inv_root: ``[d_c, d_c]`` ``C_c^{1/2}`` and ``C_c^{-1/2}`` (:func:`psd_roots`, with its ridge).
        width: ``n``.

    Returns:
        ``(T [n, d_N], K [n, d_c], kept, dropped)``: the new query map and key map (zero rows pad an exact form to
        ``n``), the kept fraction of the weighted energy and the dropped energy ``Σ_{i>n} σ_i²``.
    """
    d_n, d_c = w_uk.shape
    f64 = torch.float64
    t = torch.zeros(width, d_n, dtype=f64)
    k = torch.zeros(width, d_c, dtype=f64)
    if d_n <= width:  # the head's own width fits: keep it
        t[:d_n], k[:d_n] = torch.eye(d_n, dtype=f64), w_uk
        return t, k, 1.0, 0.0
    if d_c <= width:  # the absorbed query q_abs = W_gᵀ q is exact
        t[:d_c], k[:d_c] = w_uk.T, torch.eye(d_c, dtype=f64)
        return t, k, 1.0, 0.0
    weighted = w_uk @ cc_root  # W_g C_c^{1/2}, [d_N, d_c]
    gram = weighted.T @ (qq @ weighted)  # NᵀN, [d_c, d_c]
    evals, evecs = linalg.eigh((gram + gram.T) / 2)
    evals, evecs = evals.flip(0).clamp_min(0), evecs.flip(1)
    v = evecs[:, :width]
    # the optimum Tᵀ K = (W_g C_c^{1/2} V_n) (V_nᵀ C_c^{-1/2}) = P R, [d_N, d_c], rank <= n; its SVD from the two
    # thin factors (QR of each, then the n x n core's SVD): the form's own SVD without forming it
    q_left, r_left = linalg.qr(weighted @ v)
    q_right, r_right = linalg.qr(cc_inv_root @ v)  # (V_nᵀ C_c^{-1/2})ᵀ; C_c^{-1/2} is symmetric
    u_core, sv, vh_core = linalg.svd(r_left @ r_right.T)
    # balanced factors (singular values split evenly): each as well scaled as W_g, so rounding them to 16 bits
    # costs what rounding W_g does (V_nᵀ C_c^{-1/2} alone can hold large entries)
    half = sv.sqrt()
    t = (q_left @ u_core * half).T
    k = half[:, None] * (vh_core @ q_right.T)
    total = float(evals.sum())
    dropped = float(evals[width:].sum())
    return t, k, (1.0 - dropped / total) if total > 0 else 1.0, dropped


def reduce_nope(
    tensors: dict[str, torch.Tensor],
    num_heads: int,
    num_kv_heads: int,
    d_nope: int,
    d_rope: int,
    width: int,
    xx: torch.Tensor,
    x_mean: torch.Tensor,
    query_moments: Callable[[int], torch.Tensor] | None = None,
    query_rows: Callable[[int], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
) -> tuple[dict[str, torch.Tensor], NopeReduction]:
    """One assembled MLA layer with its query NoPE width reduced to ``width`` (module docstring).

    Args:
        tensors: float64 MLA attention tensors of one layer (:func:`~mla_convert.convert.layer.assemble.layer_tensors`):
            ``q_proj.weight [H (d_N + d_R), D]`` (optional ``q_proj.bias``), ``kv_a_proj_with_mqa.weight
            [d_c + R d_R, D]`` (optional bias), ``kv_b_proj.weight [G (d_N + d_V), d_c]``, ``o_proj.*``.
        num_heads: ``H``.
        num_kv_heads: ``G``, the key groups of ``kv_b_proj`` as assembled.
        d_nope: ``d_N``, the layer's query NoPE width as assembled.
        d_rope: ``d_R``, the query's rope width per head.
        width: ``n`` >= 1, the NoPE width to reduce to (a head with ``d_N <= n`` or ``d_c <= n`` is kept exactly,
            zero-padded).
        xx: ``[D, D]`` ``E[x xᵀ]`` of the layer's attention input on the calibration text.
        x_mean: ``[D]`` ``E[x]``.
        query_moments: ``head -> [d_N, d_N]``, the head's ``E[q qᵀ]`` of its NoPE query as assembled, when the
            caller has it cheaper (:func:`query_nope_moment`: from the ``head_dim``-wide source query, 7x fewer FLOPs at
            Llama-3-8B's shapes); None: from ``q_proj`` and ``xx`` here (``d_N x D x D`` a head).
        query_rows: ``head -> (rows [d_N + d_R, D], bias [d_N + d_R] or None)``, the assembled query of one head
            (:func:`~mla_convert.convert.layer.assemble.query_rows`), when ``tensors`` has no ``q_proj``: the
            ``d_N``-wide map is then never whole (1 GB in float64 at Llama-3-8B's shapes, against 0.27 GB reduced).

    Returns:
        ``(tensors, record)``: ``q_proj.weight [H (n + d_R), D]`` (and bias), ``kv_b_proj.weight
        [H (n + d_V), d_c]`` (one key group per query head, the values of its KV head), the rest unchanged.

    Raises:
        ValueError: ``width`` < 1 or shapes that do not match.
    """
    if width < 1:
        raise ValueError(f"NoPE width {width} must be at least 1")
    h, g = num_heads, num_kv_heads
    wb = tensors["kv_b_proj.weight"]
    d_c, d_v = wb.shape[1], wb.shape[0] // g - d_nope
    rows_of: Callable[[int], tuple[torch.Tensor, torch.Tensor | None]]
    if query_rows is None:
        wq = tensors["q_proj.weight"]
        wq3 = wq.view(h, d_nope + d_rope, -1)
        bq = tensors.get("q_proj.bias")
        bq2 = bq.view(h, d_nope + d_rope) if bq is not None else None

        def whole_rows(hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            return wq3[hi], (bq2[hi] if bq2 is not None else None)

        rows_of, shape_ok = whole_rows, wq.shape[0] == h * (d_nope + d_rope)
    else:
        rows_of, shape_ok = query_rows, "q_proj.weight" not in tensors
    if not shape_ok or wb.shape[0] != g * (d_nope + d_v) or h % g:
        raise ValueError(f"q_proj / kv_b_proj {tuple(wb.shape)} do not fit {h} heads, {g} KV groups, NoPE {d_nope}, "
                         f"rope {d_rope} (query_rows given: {query_rows is not None})")
    wb3 = wb.view(g, d_nope + d_v, d_c)
    wa = tensors["kv_a_proj_with_mqa.weight"][:d_c]
    ba = tensors["kv_a_proj_with_mqa.bias"][:d_c] if "kv_a_proj_with_mqa.bias" in tensors else None
    root, inv_root = psd_roots(input_moment(wa, ba, xx, x_mean))
    # each head's rows are written into the reduced q_proj as they are formed: a list of them and its concatenation
    # would be two [H (n + d_R), D] float64 copies at once (201 MB each at Llama-3-8B's shapes)
    per_head = width + d_rope
    q_out: torch.Tensor | None = None
    q_bias: list[torch.Tensor] = []
    kv_rows, kept, dropped = [], [], []
    for hi in range(h):
        gi = hi // (h // g)
        rows, b_rows = rows_of(hi)
        if q_out is None:
            q_out = rows.new_empty(h * per_head, rows.shape[1])
        wn = rows[:d_nope]
        bn = b_rows[:d_nope] if b_rows is not None else None
        qq = query_moments(hi) if query_moments is not None else input_moment(wn, bn, xx, x_mean)
        t, k, kp, dr = head_form(wb3[gi, :d_nope], qq, root, inv_root, width)
        del qq
        q_out[hi * per_head : hi * per_head + width] = t @ wn
        q_out[hi * per_head + width : (hi + 1) * per_head] = rows[d_nope:]
        if b_rows is not None and bn is not None:
            q_bias += [t @ bn, b_rows[d_nope:]]
        kv_rows += [k, wb3[gi, d_nope:]]
        kept.append(kp)
        dropped.append(dr)
    assert q_out is not None  # h >= 1 heads
    out = dict(tensors)
    out["q_proj.weight"] = q_out
    if q_bias:
        out["q_proj.bias"] = torch.cat(q_bias)
    out["kv_b_proj.weight"] = torch.cat(kv_rows)
    f64 = torch.float64
    return out, NopeReduction(width, torch.tensor(kept, dtype=f64), torch.tensor(dropped, dtype=f64))

