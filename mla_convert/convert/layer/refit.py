"""The ``o_proj`` refit: a ridge least-squares fit of each converted layer's output projection to the source's
attention outputs on calibration tokens (docs/math.md, "o_proj refit"), and the LM loss that decides whether the
refit is kept."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla_convert.convert.layer import linalg
from mla_convert.mla.algebra import causal_mask
from mla_convert.mla.attention import MLAAttention
from mla_convert.mla.modeling import MLAForCausalLM

#: Attention scores per forward call of the refit's accumulation (~16 MB in float32): windows go by chunks of
#: ``SCORES_PER_CALL / (H T²)``, so ``ZᵀZ`` and ``ZᵀY`` are summed over chunks and no ``[N T, ·]`` matrix is held.
SCORES_PER_CALL = 2**22


@torch.no_grad()
def lm_losses(model: MLAForCausalLM, ids: torch.Tensor) -> list[float]:
    """Next-token loss (nats) of ``model`` on each window of ``ids [M, T]``."""
    return [float(model(input_ids=row[None], labels=row[None], use_cache=False).loss) for row in ids]


#: The refit's bfloat16 rounding sensitivity may be at most this many times the assembled ``o_proj``'s
#: (:func:`rounding_sensitivity`). An unconstrained fit to the source's outputs grows ``o_proj`` 1.3-6.8x (by norm) on
#: Qwen2.5-Coder-1.5B, large weights whose products cancel: bfloat16 rounding of the weights or of the attention output
#: then moves the model 2-3x more than it moves the source (issue 48; docs/results.md, bfloat16).
SENSITIVITY_LIMIT = 1.25


def rounding_sensitivity(w: torch.Tensor, feature_ms: torch.Tensor) -> float:
    """``‖W diag(rms z)‖_F`` for ``w [in, out]`` and ``feature_ms [in]`` (each input feature's mean square): the
    size of the output error when every input, or every weight, carries an independent relative rounding error
    of one unit (bfloat16's ``2**-9`` per value): ``Σ_ij W_ij² E[z_i²]``. Larger weights whose products cancel make
    it large against the output they compute."""
    return float((w.square() * feature_ms[:, None]).sum().sqrt())


@torch.no_grad()
def refit_o_proj(
    attn: MLAAttention, x: torch.Tensor, target: torch.Tensor, ridge: float = 1e-4, limit: float | None = None
) -> float:
    """Refit ``o_proj.weight`` by ridge least squares so the converted layer's attention output matches the
    source's on calibration tokens (teacher-forced inputs). ``o_proj`` is not part of the cache, so this
    spends no cache; it absorbs value-reconstruction and attention-probability errors linearly.

    bfloat16-safe by construction: the shrinkage toward the assembled ``o_proj`` is raised (bisection on its
    weight, one eigendecomposition of ``ZᵀZ``) until the fit's :func:`rounding_sensitivity` on the calibration
    outputs is at most ``limit`` x the assembled ``o_proj``'s. With ``limit`` at infinity this is the plain ridge
    fit; the assembled ``o_proj`` itself (an infinite shrinkage) always meets it.

    Args:
        attn: the converted layer's attention module; its ``o_proj.weight`` is replaced in place.
        x: ``[N, T, hidden]`` source attention inputs; target: ``[N, T, hidden]`` source attention outputs.
        ridge: the smallest Tikhonov weight, relative to the mean diagonal of ``ZᵀZ``; the fit is shrunk toward the
            assembled ``o_proj`` (directions the calibration tokens do not excite keep their weights).
        limit: the largest rounding sensitivity allowed, as a multiple of the assembled ``o_proj``'s (None:
            :data:`SENSITIVITY_LIMIT`).

    Returns:
        Relative residual ``‖Z Wᵀ - Y‖ / ‖Y‖`` on the fitting tokens.
    """
    n_out = attn.o_proj.weight.shape[1]
    gram = torch.zeros(n_out, n_out, dtype=torch.float64, device=x.device)  # ZᵀZ
    rhs = torch.zeros(n_out, target.shape[-1], dtype=torch.float64, device=x.device)  # Zᵀ Y
    y_sq, tokens = 0.0, 0
    bias = attn.o_proj.bias.double() if attn.o_proj.bias is not None else None
    captured: list[torch.Tensor] = []
    hook = attn.o_proj.register_forward_pre_hook(lambda _m, a: captured.append(a[0].detach()))
    try:
        n, t = x.shape[:2]
        rows = max(1, SCORES_PER_CALL // max(1, attn.num_heads * t * t))
        for start in range(0, n, rows):  # Z and Y accumulated by chunk: never the float64 [N T, ·] matrices whole
            b = min(rows, n - start)
            pos = torch.arange(t, device=x.device)[None].expand(b, t)
            attn(x[start : start + b], pos, causal_mask(b, t, 0, None, x.dtype, x.device), None)
            z = captured.pop().reshape(-1, n_out).double()
            y = target[start : start + b].reshape(-1, target.shape[-1]).double()
            if bias is not None:
                y = y - bias
            gram += z.T @ z
            rhs += z.T @ y
            y_sq += float(y.square().sum())
            tokens += z.shape[0]
    finally:
        hook.remove()
    scale = float(torch.diagonal(gram).mean().clamp_min(1e-30))
    w0 = attn.o_proj.weight.detach().double().T  # shrink toward the assembled o_proj, not toward zero
    lo = ridge * scale
    w = linalg.solve(gram + lo * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device), rhs + lo * w0)
    feature_ms = torch.diagonal(gram) / tokens
    allowed = (SENSITIVITY_LIMIT if limit is None else limit) * rounding_sensitivity(w0, feature_ms)
    if rounding_sensitivity(w, feature_ms) > allowed:
        del w  # one [n, m] float64 matrix less through the bounded fit (128 MB at 8B)
        w = _bounded_fit(gram, rhs, w0, feature_ms, allowed, lo, scale)
    attn.o_proj.weight.copy_(w.T.to(attn.o_proj.weight.dtype))
    # ‖Z W - Y‖² = tr(Wᵀ G W) - 2 tr(Wᵀ ZᵀY) + ‖Y‖² (float64: the cancellation leaves ~1e-8 of ‖Y‖)
    residual = float((w * (gram @ w)).sum() - 2 * (w * rhs).sum()) + y_sq
    return (max(residual, 0.0) / max(y_sq, 1e-60)) ** 0.5


def sensitivity_curve(
    evals: torch.Tensor, evecs: torch.Tensor, rhs: torch.Tensor, w0: torch.Tensor, feature_ms: torch.Tensor
) -> Callable[[float], float]:
    """``λ -> rounding_sensitivity((G + λI)⁻¹ (rhs + λ W0))`` for ``G = V diag(e) Vᵀ`` (``evals [n]``, ``evecs
    [n, n]``), ``rhs, w0 [n, m]``, ``feature_ms [n]``, in ``O(n²)`` a call.

    With ``A = Vᵀ rhs``, ``B = Vᵀ W0``, ``s = 1 / (e + λ)`` and ``K = Vᵀ diag(ms) V`` the fit is ``V diag(s)
    (A + λB)``, so its squared sensitivity is ``sᵀ (K ∘ (A Aᵀ + λ (A Bᵀ + B Aᵀ) + λ² B Bᵀ)) s``: the three
    ``[n, n]`` products are formed once (three ``n² m`` products and ``K``), where evaluating each fit would cost
    an ``n² m`` product per step of the bisection (35 of them; ``n = m = 4096`` at 8B: 3 s each on 2 cores)."""
    a, b = evecs.T @ rhs, evecs.T @ w0
    m0, m1 = a @ a.T, a @ b.T
    del a  # each of A and B as soon as spent: one [n, n] float64 matrix (128 MB at 8B) less at once
    m2 = b @ b.T
    del b
    m1 = m1 + m1.T
    k = (evecs.T * feature_ms) @ evecs
    for m in (m0, m1, m2):
        m.mul_(k)
    del k

    def sensitivity(lam: float) -> float:
        s = 1.0 / (evals + lam)
        # m0 + λ m1 + λ² m2 with one [n, n] temporary (the sum is formed in it; addition commutes exactly)
        quad = float(s @ torch.mul(m1, lam).add_(m0).add_(m2, alpha=lam * lam) @ s)
        return max(quad, 0.0) ** 0.5

    return sensitivity


def _bounded_fit(
    gram: torch.Tensor, rhs: torch.Tensor, w0: torch.Tensor, feature_ms: torch.Tensor, allowed: float, lo: float,
    scale: float,
) -> torch.Tensor:
    """The ridge fit ``(G + λI)⁻¹ (rhs + λ W0)`` at the smallest ``λ >= lo`` (to 2**-30 in log scale) whose
    :func:`rounding_sensitivity` is at most ``allowed`` (one eigendecomposition of ``G``, then a geometric bisection
    on :func:`sensitivity_curve`: the sensitivity falls toward the assembled ``W0``'s as ``λ`` grows)."""
    evals, evecs = linalg.eigh(gram)
    evals = evals.clamp_min(0)
    sensitivity = sensitivity_curve(evals, evecs, rhs, w0, feature_ms)
    hi = lo
    while sensitivity(hi) > allowed and hi < 1e12 * scale:
        lo, hi = hi, hi * 10
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if sensitivity(mid) > allowed else (lo, mid)
    del sensitivity  # its three [n, n] products (384 MB at 8B), before the fit's own
    # V diag(1 / (e + hi)) (Vᵀ rhs + hi Vᵀ W0), the same operations in place: two [n, m] temporaries, not three
    fit, w0_part = evecs.T @ rhs, evecs.T @ w0
    fit.add_(w0_part.mul_(hi))
    del w0_part
    return evecs @ fit.div_((evals + hi)[:, None])
