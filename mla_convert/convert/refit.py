"""The ``o_proj`` refit: a ridge least-squares fit of each converted layer's output projection to the source's
attention outputs on calibration tokens (docs/math.md, "o_proj refit"), and the LM loss that decides whether the
refit is kept."""

from __future__ import annotations

import torch

from mla_convert.convert import linalg
from mla_convert.mla.algebra import causal_mask
from mla_convert.mla.modeling import MLAAttention, MLAForCausalLM


@torch.no_grad()
def lm_losses(model: MLAForCausalLM, ids: torch.Tensor) -> list[float]:
    """Next-token loss (nats) of ``model`` on each window of ``ids [M, T]``."""
    return [float(model(input_ids=row[None], labels=row[None], use_cache=False).loss) for row in ids]


@torch.no_grad()
def refit_o_proj(attn: MLAAttention, x: torch.Tensor, target: torch.Tensor, ridge: float = 1e-4) -> float:
    """Refit ``o_proj.weight`` by ridge least squares so the converted layer's attention output matches the
    source's on calibration tokens (teacher-forced inputs). ``o_proj`` is not part of the cache, so this
    spends no cache; it absorbs value-reconstruction and attention-probability errors linearly.

    Args:
        attn: the converted layer's attention module; its ``o_proj.weight`` is replaced in place.
        x: ``[N, T, hidden]`` source attention inputs; target: ``[N, T, hidden]`` source attention outputs.
        ridge: Tikhonov weight relative to the mean diagonal of ``ZᵀZ``; the fit is shrunk toward the
            assembled ``o_proj`` (directions the calibration tokens do not excite keep their weights).

    Returns:
        Relative residual ``‖Z Wᵀ - Y‖ / ‖Y‖`` on the fitting tokens.
    """
    captured: list[torch.Tensor] = []
    hook = attn.o_proj.register_forward_pre_hook(lambda _m, a: captured.append(a[0].detach()))
    try:
        n, t = x.shape[:2]
        rows = max(1, 2**22 // max(1, attn.num_heads * t * t))  # ~16 MB of float32 scores per call
        for start in range(0, n, rows):
            b = min(rows, n - start)
            pos = torch.arange(t, device=x.device)[None].expand(b, t)
            attn(x[start : start + b], pos, causal_mask(b, t, 0, None, x.dtype, x.device), None)
    finally:
        hook.remove()
    z = torch.cat(captured).reshape(-1, captured[0].shape[-1]).double()
    y = target.reshape(-1, target.shape[-1]).double()
    if attn.o_proj.bias is not None:
        y = y - attn.o_proj.bias.double()
    gram = z.T @ z
    lam = ridge * float(torch.diagonal(gram).mean().clamp_min(1e-30))
    w0 = attn.o_proj.weight.detach().double().T  # shrink toward the assembled o_proj, not toward zero
    w = linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device), z.T @ y + lam * w0)
    attn.o_proj.weight.copy_(w.T.to(attn.o_proj.weight.dtype))
    return float((z @ w - y).norm() / y.norm().clamp_min(1e-30))
