"""The fitted reconstruction step: a converted attention block trained alone, by gradient, to reproduce the source
block's attention output on calibration tokens (block-wise reconstruction, as in the layer-wise distillation stage of
X-EcoMLA / Zebra-Llama and the block reconstruction of GPTQ / OmniQuant-style quantization; docs/math.md, "Fitted
reconstruction").

Starting from the closed-form factors, every weight of the converted attention (``q_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, and their biases) is fitted by Adam to

    min  ‖attn(x) - y‖² / ‖y‖²     over calibration windows (x: the layer's attention inputs, y: the source's outputs)

and kept only where it lowers the relative error on held-out windows (like the ``o_proj`` refit). The RoPE
frequencies, the softmax scale and the shapes (so the cache width) never change: the fit moves only what the closed form
chose, inside the same MLA function class. An exact layer (closed-form error below :data:`EXACT_ERROR` on the fitting
tokens) is left untouched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mla_convert.mla.algebra import causal_mask
from mla_convert.mla.attention import MLAAttention

#: Relative error below which a layer is exact (float32 rounding of an exact conversion is ~1e-7): nothing to fit.
EXACT_ERROR = 1e-5
#: Adam steps per layer, and the learning rate relative to each weight's RMS (a scale-free step size).
STEPS = 200
LR = 2e-3
#: Windows per Adam step.
BATCH = 4


@dataclass(frozen=True)
class Reconstruction:
    """What the fitted reconstruction did to one layer.

    Attributes:
        before: the closed form's relative error ``‖attn(x) - y‖ / ‖y‖`` on the held-out windows.
        after: the fitted block's, on the same windows (``before`` where nothing was fitted).
        kept: whether the fitted weights were kept (``after < before``); otherwise the layer is as it was.
        steps: Adam steps taken (0 for an exact layer).
        seconds: wall time of the fit.
    """

    before: float
    after: float
    kept: bool
    steps: int
    seconds: float


def _forward(attn: MLAAttention, x: torch.Tensor) -> torch.Tensor:
    """``attn``'s output ``[B, T, hidden]`` for normalised inputs ``x [B, T, hidden]`` (absolute positions from 0)."""
    b, t, _ = x.shape
    pos = torch.arange(t, device=x.device)[None].expand(b, t)
    return attn(x, pos, causal_mask(b, t, 0, None, x.dtype, x.device), None)


@torch.no_grad()
def relative_error(attn: MLAAttention, x: torch.Tensor, y: torch.Tensor, batch: int = BATCH) -> float:
    """``‖attn(x) - y‖ / ‖y‖`` over every window of ``x, y [N, T, hidden]``."""
    num, den = 0.0, 0.0
    for s in range(0, x.shape[0], batch):
        out = _forward(attn, x[s : s + batch])
        num += float((out - y[s : s + batch]).square().sum())
        den += float(y[s : s + batch].square().sum())
    return (num / max(den, 1e-30)) ** 0.5


def reconstruct_attention(
    attn: MLAAttention,
    x: torch.Tensor,
    y: torch.Tensor,
    held_x: torch.Tensor,
    held_y: torch.Tensor,
    steps: int = STEPS,
    lr: float = LR,
    batch: int = BATCH,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Reconstruction:
    """Fit ``attn``'s weights in place to the source's attention outputs (module docstring); keep-if-better.

    Args:
        attn: the converted layer's attention (float32; its weights as the checkpoint would round them).
        x: ``[N, T, hidden]`` the layer's attention inputs on calibration windows (normalised hidden states: the
            source's, teacher-forced, or the converted model's own, sequential); y: ``[N, T, hidden]`` the source
            block's attention outputs on them.
        held_x, held_y: the same on held-out windows, never fitted on: they decide whether the fit is kept.
        steps: Adam steps; lr: learning rate of each weight relative to its RMS; batch: windows per step;
            seed: the window order; dtype: the output dtype the fitted weights are rounded to (as the checkpoint
            holds them) before the held-out decision.

    Returns:
        The :class:`Reconstruction` (errors before and after, whether kept, steps, seconds).
    """
    started = time.perf_counter()
    x, y, held_x, held_y = x.detach(), y.detach(), held_x.detach(), held_y.detach()
    before = relative_error(attn, held_x, held_y, batch)
    if relative_error(attn, x, y, batch) < EXACT_ERROR:
        return Reconstruction(before, before, False, 0, time.perf_counter() - started)
    params = [p for p in attn.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    groups = [
        {"params": [p], "lr": lr * float(p.detach().square().mean().sqrt().clamp_min(1e-8))} for p in params
    ]
    opt = torch.optim.Adam(groups)
    gen = torch.Generator().manual_seed(seed)
    scale = float(y.square().mean().clamp_min(1e-30))
    with torch.enable_grad():
        for _ in range(steps):
            pick = torch.randint(0, x.shape[0], (min(batch, x.shape[0]),), generator=gen).to(x.device)
            loss = (_forward(attn, x[pick]) - y[pick]).square().mean() / scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(dtype).to(p.dtype))
    after = relative_error(attn, held_x, held_y, batch)
    kept = after < before
    if not kept:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    return Reconstruction(before, after if kept else before, kept, steps, time.perf_counter() - started)
