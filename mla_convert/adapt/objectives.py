"""What adaptation trains and what it minimises (docs/math.md §Adaptation).

Trainable sets (:func:`select_trainable`): ``attention`` (the MLA projections ``q_proj``,
``kv_a_proj_with_mqa``, latent norm, ``kv_b_proj``, ``o_proj``), ``attention+norms`` (plus the RMSNorms)
or ``all``. Objectives (:func:`objective_loss`): the language-model loss, distillation from the frozen
source model (``T^2 * KL(p_src^T || p_mla^T)`` per token, Hinton et al. 2015) or a mix
``w * distill + (1 - w) * lm``, plus an optional per-layer hidden-state term (:func:`hidden_loss`, fed by
:class:`LayerOutputs`). Attention transfer (:func:`attention_transfer_loss`, fed by :class:`AttentionIO`)
fits each MLA attention block alone to the source attention's output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mla_convert.adapt.options import AdaptError, AdaptOptions


def select_trainable(model: torch.nn.Module, which: str) -> dict[str, Any]:
    """Freeze everything except ``which``; returns the inventory (names and parameter counts).

    ``attention``: parameters under ``.self_attn.``; ``attention+norms``: also every RMSNorm weight
    (``*layernorm*``, ``model.norm``); ``all``: everything.
    """
    trainable: list[tuple[str, int]] = []
    frozen: list[tuple[str, int]] = []
    for name, p in model.named_parameters():
        keep = which == "all" or ".self_attn." in name
        if which == "attention+norms" and ("layernorm" in name or name == "model.norm.weight"):
            keep = True
        p.requires_grad_(keep)
        (trainable if keep else frozen).append((name, p.numel()))
    return {
        "set": which,
        "trainable_parameters": sum(n for _, n in trainable),
        "frozen_parameters": sum(n for _, n in frozen),
        "trainable": [n for n, _ in trainable],
        "frozen": [n for n, _ in frozen],
    }


def hidden_loss(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layers and tokens of ``mean_d (n(h_mla) - n(h_src))^2`` with ``n(x) = x / rms(x)``.

    Args:
        student, teacher: one ``[B, T, hidden]`` output per decoder layer, same length.

    Normalising each token's vector (what the next layer's RMSNorm sees) keeps the few massive-activation
    tokens from dominating; 0 for identical directions, 2 for orthogonal ones. Intermediate-layer
    distillation in the manner of TinyBERT (Jiao et al. 2020).
    """

    def n(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    return torch.stack([(n(s) - n(t)).pow(2).mean() for s, t in zip(student, teacher, strict=True)]).mean()


def objective_loss(
    o: AdaptOptions,
    logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    hidden: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch ``ids [B, T]``, logits ``[B, T, V]``; next-token positions ``0..T-2``.

    Args:
        teacher_logits: the source's ``[B, T, V]`` (needed by ``distill`` and ``mix``).
        hidden: per-layer outputs (MLA, source) for the ``hidden_weight`` term (:func:`hidden_loss`).
        mask: ``[B, T]`` bool, True where token ``t`` is a loss target (``loss=assistant`` data): the LM and
            distillation terms average over the positions predicting such tokens only (a micro-batch with
            none contributes 0); None: every position. The hidden-state term always covers every token.

    Returns:
        the scalar loss and its parts (``lm``, ``kl`` in nats/token, ``hidden``) as floats.
    """
    s = logits[:, :-1].float()
    parts: dict[str, float] = {}
    target = None if mask is None else mask[:, 1:].reshape(-1).to(s.dtype)

    def mean(per_token: torch.Tensor) -> torch.Tensor:
        if target is None:
            return per_token.mean()
        return (per_token * target).sum() / target.sum().clamp_min(1.0)

    lm = mean(F.cross_entropy(s.reshape(-1, s.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"))
    parts["lm"] = float(lm.detach())
    loss = lm
    if o.objective != "lm":
        if teacher_logits is None:
            raise ValueError(f"objective {o.objective!r} needs the source's logits")
        t = teacher_logits[:, :-1].float() / o.temperature
        log_p_t = F.log_softmax(t, -1)
        log_p_s = F.log_softmax(s / o.temperature, -1)
        kl = mean((log_p_t.exp() * (log_p_t - log_p_s)).sum(-1).reshape(-1)) * o.temperature**2
        parts["kl"] = float(kl.detach())
        loss = kl if o.objective == "distill" else o.mix_weight * kl + (1 - o.mix_weight) * lm
    if o.hidden_weight > 0:
        if hidden is None:
            raise ValueError("hidden_weight > 0 needs the per-layer outputs of both models")
        h = hidden_loss(*hidden)
        parts["hidden"] = float(h.detach())
        loss = loss + o.hidden_weight * h
    return loss, parts


class AttentionIO:
    """Forward hooks recording each source attention block's input and output in one forward pass.

    ``take()`` returns one ``(x [B, T, hidden], y [B, T, hidden])`` per layer: ``x`` the normalised hidden
    states the attention read, ``y`` its output (after ``o_proj``). Hugging Face Llama/Mistral/Qwen2 layout
    (``model.model.layers[i].self_attn``). Raises AdaptError when the model has no such modules.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise AdaptError(
                f"{type(model).__name__} has no model.layers[*].self_attn for attention transfer"
            )
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.enabled = False
        self.handles = [
            layer.self_attn.register_forward_hook(self._hook, with_kwargs=True) for layer in layers
        ]

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self.handles:
            h.remove()

    def _hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if self.enabled:
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self.pairs.append((x, output[0] if isinstance(output, tuple) else output))

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The recorded (input, output) pairs (and forget them)."""
        out, self.pairs = self.pairs, []
        return out


def attention_transfer_loss(
    model: torch.nn.Module, pairs: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Attention transfer (LoLCATs, Zhang et al. 2024, applied to MLA): every MLA attention block is fed
    the source's normalised hidden states of its layer and trained to reproduce the source attention's
    output, ``mean_l ||attn_l(x_l) - y_l||^2 / ||y_l||^2`` (relative squared error, each layer alone).

    Args:
        model: the MLA model (``model.model.layers[l].self_attn``).
        pairs: ``(x_l, y_l)`` per layer from :class:`AttentionIO`, ``[B, T, hidden]`` each, positions
            ``0..T-1`` (packed windows, causal, no padding).

    Returns:
        the scalar loss and its parts (``transfer``: the mean relative error; ``transfer_first`` and
        ``transfer_last`` for the first and last layer).
    """
    from mla_convert.mla.algebra import causal_mask

    layers: list[torch.nn.Module] = list(model.model.layers)  # type: ignore[union-attr,arg-type]
    if len(pairs) != len(layers):
        raise ValueError(f"{len(pairs)} recorded source layers for {len(layers)} MLA layers")
    b, t, _ = pairs[0][0].shape
    device = pairs[0][0].device
    positions = torch.arange(t, device=device)[None].expand(b, t)
    mask = causal_mask(b, t, 0, None, torch.float32, device)
    errs = []
    for layer, (x, y) in zip(layers, pairs, strict=True):
        pred = layer.self_attn(x.detach(), positions, mask)  # type: ignore[operator]
        y = y.detach().float()
        errs.append((pred.float() - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-12))
    loss = torch.stack(errs).mean()
    parts = {
        "transfer": float(loss.detach()),
        "transfer_first": float(errs[0].detach()),
        "transfer_last": float(errs[-1].detach()),
    }
    return loss, parts


class LayerOutputs:
    """Forward hooks recording each decoder layer's output ``[B, T, hidden]`` of one forward pass.

    Works on the MLA model and on Hugging Face Llama/Mistral/Qwen2 models (``model.model.layers``).
    Raises AdaptError when the model has no ``model.layers``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise AdaptError(
                f"{type(model).__name__} has no model.layers; hidden_weight needs decoder layers"
            )
        self.outputs: list[torch.Tensor] = []
        self.enabled = False
        self.handles = [layer.register_forward_hook(self._hook) for layer in layers]

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self.handles:
            h.remove()

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.enabled:
            self.outputs.append(output[0] if isinstance(output, tuple) else output)

    def take(self) -> list[torch.Tensor]:
        """The recorded outputs (and forget them)."""
        out, self.outputs = self.outputs, []
        return out
