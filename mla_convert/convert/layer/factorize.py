"""Low-rank factorization of the NoPE key and value maps into ``kv_a`` (down) and ``kv_b`` (up).

The matrix factored per layer is ``W = [W_kn; W_v]``: the unique NoPE key rows of every KV head
(:class:`~mla_convert.convert.layer.rope.RopePlan`) stacked on the value rows, ``[n + G*d_V, hidden]``. All
objectives minimise a weighted Frobenius error in closed form (Eckart–Young):

    min ‖L (W - W_up W_down) Rᵀ‖_F,   SVD(L W R) = U S Vᵀ,   W_down = U_rᵀ L W,   W_up = L⁻¹ U_r

Only ``U`` and ``S`` are needed, and ``W`` has far fewer rows than columns at scale (``[1920, 4096]`` for a
Llama-3-8B layer), so both come from the eigendecomposition of the ``[rows, rows]`` Gram matrix
``L W (R Rᵀ) Wᵀ Lᵀ = U S² Uᵀ``: no square root of ``C`` and no SVD of the wide matrix (at 8B shapes, 5 s a layer
against 120 s for ``C^{1/2}`` and 136 s for the SVD and the spectrum). The Gram squares the condition number: the
singular values below ``1e-8 σ_max`` lose their digits, which no kept rank reaches.

* ``weight``: ``L = R = I`` (MHA2MLA's SVD).
* ``activation``: ``R Rᵀ = C`` with ``C = E[x xᵀ]`` on calibration text — PCA of the outputs
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
        input_weighted: the right weight is the inputs' (``R Rᵀ = C``: activation and output objectives), else
            the identity (weight objective).
        xx: ``[hidden, hidden]`` ``E[x xᵀ]`` for the activation-weighted error metric and ``R Rᵀ``.
        eig: :func:`gram_eig`'s memo (saved with the target: pass 2 factors with pass 1's decomposition).
    """

    w: torch.Tensor
    n_key: int
    left: torch.Tensor
    input_weighted: bool
    xx: torch.Tensor
    eig: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def right_gram(self) -> torch.Tensor:
        """``R Rᵀ`` ``[hidden, hidden]`` float64: ``C`` with a ridge (:func:`ridged_moment`), or the identity."""
        if self.input_weighted:
            return ridged_moment(self.xx)
        return torch.eye(self.xx.shape[0], dtype=torch.float64, device=self.xx.device)


#: Ridge of :func:`ridged_moment`, relative to the mean of ``C``'s diagonal: directions calibration never saw keep a
#: trace of weight (the same ridge the earlier ``C^{1/2}`` weighting added).
RIDGE = 1e-10


@dataclass
class Factors:
    """``W ≈ up @ down``: ``down [d_c, hidden]`` (kv_a latent rows), ``up [n + G*d_V, d_c]``, and metrics."""

    down: torch.Tensor
    up: torch.Tensor
    rank: int
    energy: float  # objective-weighted energy retained, 0..1
    rel_error: float  # ‖W - up down‖_F / ‖W‖_F
    rel_error_act: float  # same, weighted by C^{1/2} (calibration activations)


def ridged_moment(xx: torch.Tensor) -> torch.Tensor:
    """``C + ε I``: the layer's input second moment ``xx`` (``[hidden, hidden]`` float64) with the ridge
    ``ε = RIDGE * mean diag C``, the right weight ``R Rᵀ`` of the activation and output objectives."""
    ridge = RIDGE * float(torch.diagonal(xx).mean().clamp_min(1e-30))
    return xx + ridge * torch.eye(xx.shape[0], dtype=xx.dtype, device=xx.device)


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
    input_weighted = objective != "weight"
    right_gram = ridged_moment(st.xx) if input_weighted else torch.eye(hidden, dtype=torch.float64)
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
        weighted = left @ target
        energy = ((weighted @ right_gram) * weighted).sum(dim=1)  # row i: ‖(L W R)_i‖²
        ek = float(energy[:n].sum())
        ev = float(energy[n:].sum())
        if ek > 0 and ev > 0:
            scale = torch.ones(rows, dtype=torch.float64)
            scale[:n] = (ev / ek) ** 0.5
            left = scale[:, None] * left
    return LayerTarget(target, n, left, input_weighted, st.xx)


def _weighted_gram(w: torch.Tensor, left: torch.Tensor, right_gram: torch.Tensor) -> torch.Tensor:
    """``L W (R Rᵀ) Wᵀ Lᵀ`` ``[rows, rows]``, symmetric to the last bit."""
    lw = left @ w
    gram = lw @ right_gram @ lw.T
    return (gram + gram.T) / 2


def _eig_descending(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues ``[n]`` (descending, clamped at 0) and eigenvectors ``[n, n]`` (columns, signs fixed) of a PSD
    Gram matrix."""
    evals, evecs = linalg.eigh(gram)
    return evals.flip(0).clamp_min(0), _fix_signs(evecs.flip(1))


def gram_eig(t: LayerTarget) -> tuple[torch.Tensor, torch.Tensor]:
    """``S² [rows]`` (descending) and ``U [rows, rows]`` of the weighted matrix ``L W R = U S Vᵀ``, from the
    eigendecomposition of its Gram matrix; computed once per target (kept in ``t.eig``)."""
    if t.eig is None:
        t.eig = _eig_descending(_weighted_gram(t.w, t.left, t.right_gram))
    return t.eig


def spectrum(t: LayerTarget) -> torch.Tensor:
    """Singular values ``[min(rows, hidden)]`` (descending) of the weighted matrix ``L W R`` of a layer (its rank
    budget curve), from :func:`gram_eig`."""
    return gram_eig(t)[0][: min(t.w.shape)].sqrt()


def _fix_signs(u: torch.Tensor) -> torch.Tensor:
    idx = u.abs().argmax(0)
    sign = torch.sign(u[idx, torch.arange(u.shape[1])])
    sign[sign == 0] = 1
    return u * sign


def _factor_block(
    w: torch.Tensor, left: torch.Tensor, u: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``down = U_rᵀ L W`` ``[rank, hidden]`` and ``up = L⁻¹ U_r`` ``[rows, rank]`` from the left singular vectors
    ``u [rows, ≥ rank]`` of ``L W R``."""
    u = u[:, :rank]
    down = u.T @ left @ w
    up = linalg.solve(left, u)
    return down, up


def _factor_split_block(
    w: torch.Tensor, left: torch.Tensor, right_gram: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block (keys or values) of the split factorization, with its own Gram matrix; empty at rank 0."""
    if rank == 0 or w.shape[0] == 0:
        return torch.zeros(0, w.shape[1], dtype=w.dtype), torch.zeros(w.shape[0], 0, dtype=w.dtype)
    return _factor_block(w, left, _eig_descending(_weighted_gram(w, left, right_gram))[1], rank)


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
        down, up = _factor_block(t.w, t.left, gram_eig(t)[1], rank)
    else:
        rk = min(rank // 2 if n else 0, n, hidden)
        rv = rank - rk
        if rv > min(rows - n, hidden):
            raise FactorError(
                f"--kv-lora-rank {rank} is impossible for split factorization here (values allow {rows - n})"
            )
        right_gram = t.right_gram
        dk, uk = _factor_split_block(t.w[:n], t.left[:n, :n], right_gram, rk)
        dv, uv = _factor_split_block(t.w[n:], t.left[n:, n:], right_gram, rv)
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
