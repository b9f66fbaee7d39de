"""Low-rank factorization of the NoPE key and value maps into ``kv_a`` (down) and ``kv_b`` (up).

The matrix factored per layer is ``W = [W_kn; W_v]``: the unique NoPE key rows of every KV head
(:class:`~mla_convert.convert.layer.rope.RopePlan`) stacked on the value rows, ``[n + G*d_V, hidden]``. All
objectives minimise a weighted Frobenius error in closed form (Eckart–Young):

    min ‖L (W - W_up W_down) Rᵀ‖_F,   SVD(L W R) = U S Vᵀ,   W_down = U_rᵀ L W,   W_up = L⁻¹ U_r

* ``weight``: ``L = R = I`` (MHA2MLA's SVD).
* ``activation``: ``R = C^{1/2}`` with ``C = E[x xᵀ]`` on calibration text — PCA of the outputs
  (TransMLA, SVD-LLM style); ``W_down = U_rᵀ W`` needs no inverse of ``C``.
* ``output``: additionally ``L = M^{1/2}`` where ``M`` weights key rows by the second moment of the
  queries that read them and value rows by ``o_projᵀ o_proj`` of the heads that use them.

``joint`` factors the stacked matrix at rank ``d_c``; ``split`` factors keys and values separately at
``d_c/2`` each. K/V balance (on by default for joint) scales key rows so both blocks carry equal
weighted energy before the SVD and undoes it in ``W_up``: an exact rescaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_convert.convert.layer import linalg
from mla_convert.convert.layer.rope import RopePlan
from mla_convert.convert.options.options import FACTORIZATIONS, OBJECTIVES
from mla_convert.convert.stats.calibration import LayerStats, head_moments
from mla_convert.errors import UserError
from mla_convert.mla.algebra import head_to_group


class FactorError(UserError):
    """Impossible factorization options (one line, with the allowed range)."""


@dataclass
class LayerTarget:
    """What one layer factors: ``W [n + G*d_V, hidden]`` and its weighting.

    Attributes:
        w: float64 stacked ``[W_kn; W_v]``.
        n_key: number of key rows ``n`` at the top of ``w``.
        left: ``[rows, rows]`` float64 left weight ``L`` (identity for weight/activation objectives).
        right: ``[hidden, hidden]`` float64 ``C^{1/2}`` or identity.
        xx: ``[hidden, hidden]`` ``E[x xᵀ]`` for the activation-weighted error metric.
    """

    w: torch.Tensor
    n_key: int
    left: torch.Tensor
    right: torch.Tensor
    xx: torch.Tensor
    singular_values: torch.Tensor | None = None  # spectrum()'s memo


@dataclass
class Factors:
    """``W ≈ up @ down``: ``down [d_c, hidden]`` (kv_a latent rows), ``up [n + G*d_V, d_c]``, and metrics."""

    down: torch.Tensor
    up: torch.Tensor
    rank: int
    energy: float  # objective-weighted energy retained, 0..1
    rel_error: float  # ‖W - up down‖_F / ‖W‖_F
    rel_error_act: float  # same, weighted by C^{1/2} (calibration activations)


def xx_sqrt(st: LayerStats) -> torch.Tensor:
    """``C^½`` of the layer's input second moment ``st.xx`` (``[hidden, hidden]`` float64), computed once per
    statistics object and kept in ``st.moments``: every RoPE plan a search tries on the layer weighs by the same
    ``C^½`` (one eigendecomposition of ``hidden x hidden`` per layer instead of one per plan)."""
    if "xx_sqrt" not in st.moments:
        st.moments["xx_sqrt"] = linalg.psd_sqrt(st.xx)
    return st.moments["xx_sqrt"]


def build_target(
    w: dict[str, torch.Tensor],
    plan: RopePlan,
    st: LayerStats,
    num_heads: int,
    objective: str,
    balance: bool,
) -> LayerTarget:
    """Assemble the matrix to factor and its weights for one layer.

    Args:
        w: float64 source weights ``q, k, v, o`` and optional biases.
        plan: the layer's RoPE plan (NoPE key rows, query maps).
        st: calibration statistics of the layer's attention input.
        num_heads: ``H``.
        objective: ``weight``, ``activation`` or ``output``.
        balance: scale key rows so keys and values carry equal weighted energy.

    Raises:
        FactorError: unknown objective.
    """
    if objective not in OBJECTIVES:
        raise FactorError(f"unknown --objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    w_kn = plan.key_nope @ w["k"]
    target = torch.cat([w_kn, w["v"]])
    rows, hidden = target.shape
    n = w_kn.shape[0]
    eye_h = torch.eye(hidden, dtype=torch.float64)
    right = xx_sqrt(st) if objective != "weight" else eye_h
    left = torch.eye(rows, dtype=torch.float64)
    if objective == "output":
        h = num_heads
        g = plan.nope_index.shape[0]
        d_v = w["v"].shape[0] // g
        m = torch.zeros(rows, rows, dtype=torch.float64)
        kv_of = head_to_group(h, g).tolist()
        qq = head_moments(w, "q", h, st)  # [H, d, d] E[q_h q_hᵀ] of every source query head, bias included
        for hi in range(h):
            gi = kv_of[hi]
            q_h = qq[hi]
            idx = plan.nope_index[gi]
            if idx.numel():
                # second moment of the head's NoPE query q_nope = P q_h: P E[q_h q_hᵀ] Pᵀ
                m[idx[:, None], idx[None, :]] += plan.q_nope[hi] @ q_h @ plan.q_nope[hi].T
            wo = w["o"][:, hi * d_v : (hi + 1) * d_v]
            vs = slice(n + gi * d_v, n + (gi + 1) * d_v)
            m[vs, vs] += wo.T @ wo
        # Put keys and values on a common footing before the balance below.
        if n:
            m[:n, :n] /= float(torch.diagonal(m[:n, :n]).mean().clamp_min(1e-30))
        m[n:, n:] /= float(torch.diagonal(m[n:, n:]).mean().clamp_min(1e-30))
        left = linalg.psd_sqrt(m, eps=1e-6)  # block-diagonal: G key and G value blocks
    if balance and n:
        weighted = left @ target @ right
        ek = float(weighted[:n].square().sum())
        ev = float(weighted[n:].square().sum())
        if ek > 0 and ev > 0:
            scale = torch.ones(rows, dtype=torch.float64)
            scale[:n] = (ev / ek) ** 0.5
            left = scale[:, None] * left
    return LayerTarget(target, n, left, right, st.xx)


def spectrum(t: LayerTarget) -> torch.Tensor:
    """Singular values (descending) of the weighted matrix ``L W R`` of a layer (its rank budget curve);
    computed once per target (kept in ``t.singular_values``)."""
    if t.singular_values is None:
        t.singular_values = linalg.svdvals(t.left @ t.w @ t.right)
    return t.singular_values


def _fix_signs(u: torch.Tensor) -> torch.Tensor:
    idx = u.abs().argmax(0)
    sign = torch.sign(u[idx, torch.arange(u.shape[1])])
    sign[sign == 0] = 1
    return u * sign


def _factor_block(
    w: torch.Tensor, left: torch.Tensor, right: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if rank == 0 or w.shape[0] == 0:
        return torch.zeros(0, w.shape[1], dtype=w.dtype), torch.zeros(w.shape[0], 0, dtype=w.dtype)
    u = linalg.svd(left @ w @ right)[0][:, :rank]
    u = _fix_signs(u)
    down = u.T @ left @ w
    up = linalg.solve(left, u)
    return down, up


def factor_layer(t: LayerTarget, rank: int, factorization: str) -> Factors:
    """Factor one layer at latent width ``rank`` (``d_c``).

    Raises:
        FactorError: unknown factorization, or a rank larger than the matrix allows.
    """
    if factorization not in FACTORIZATIONS:
        raise FactorError(
            f"unknown --factorization {factorization!r}; choose one of {', '.join(FACTORIZATIONS)}"
        )
    rows, hidden = t.w.shape
    limit = min(rows, hidden)
    if not 1 <= rank <= limit:
        raise FactorError(f"--kv-lora-rank {rank} is impossible: this layer's K/V map allows 1..{limit}")
    n = t.n_key
    if (
        rank == rows
    ):  # no compression: keep the source rows as the latent (bit-exact weights, no SVD rounding)
        down, up = t.w.clone(), torch.eye(rows, dtype=torch.float64)
    elif factorization == "joint":
        down, up = _factor_block(t.w, t.left, t.right, rank)
    else:
        rk = min(rank // 2 if n else 0, n, hidden)
        rv = rank - rk
        if rv > min(rows - n, hidden):
            raise FactorError(
                f"--kv-lora-rank {rank} is impossible for split factorization here (values allow {rows - n})"
            )
        dk, uk = _factor_block(t.w[:n], t.left[:n, :n], t.right, rk)
        dv, uv = _factor_block(t.w[n:], t.left[n:, n:], t.right, rv)
        down = torch.cat([dk, dv])
        up = torch.zeros(rows, rank, dtype=torch.float64)
        up[:n, :rk], up[n:, rk:] = uk, uv
    approx = up @ down
    err = t.w - approx
    s = spectrum(t)
    energy = float(s[:rank].square().sum() / s.square().sum().clamp_min(1e-30))
    rel = float(err.norm() / t.w.norm().clamp_min(1e-30))
    act = float(
        (torch.trace(err @ t.xx @ err.T) / torch.trace(t.w @ t.xx @ t.w.T).clamp_min(1e-30))
        .clamp_min(0)
        .sqrt()
    )
    return Factors(down, up, rank, energy, rel, act)


def allocate_ranks(spectra: list[torch.Tensor], total: int, floor: int = 1) -> list[int]:
    """Spread ``total`` latent dims over layers by marginal error (CARE-style greedy).

    Each layer's relative error at rank ``r`` is ``Σ_{i>r} σ_i² / Σ σ²``; taking the globally largest
    normalised ``σ_i²`` first is optimal because each layer's gains are sorted.

    Args:
        spectra: per layer singular values (descending).
        total: latent dims to spend across all layers.
        floor: minimum rank per layer.

    Raises:
        FactorError: when ``total`` is below ``floor * layers`` or above what the layers can use.
    """
    n_layers = len(spectra)
    cap = sum(len(s) for s in spectra)
    if total < floor * n_layers or total > cap:
        raise FactorError(
            f"cache budget gives {total} latent dims over {n_layers} layers; possible: {floor * n_layers}..{cap}"
        )
    ranks = [floor] * n_layers
    gains = []
    for li, s in enumerate(spectra):
        e = s.square() / s.square().sum().clamp_min(1e-30)
        gains += [(float(e[i]), li) for i in range(floor, len(s))]
    gains.sort(key=lambda x: (-x[0], x[1]))
    for _, li in gains[: total - floor * n_layers]:
        ranks[li] += 1
    return ranks
