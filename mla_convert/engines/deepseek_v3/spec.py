"""What the DeepSeek-V3 folder format accepts of a checkpoint's RoPE: one rope head, the kept RoPE pairs of every
layer placed in the slots of one plain-theta table (:func:`rope_slots`, :data:`GEOMETRIC_RTOL`), the table
transformers, vLLM and MLX-LM compute (:func:`~mla_convert.mla.algebra.transformers_inv_freq`).

The conversion steers by it (:mod:`~mla_convert.engines.precheck`) and the export enforces it
(:mod:`~mla_convert.engines.deepseek_v3.mapping`): this module sits below both (scripts/imports.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mla_convert.engines.vllm.spec import PLUGIN_ROUTE
from mla_convert.errors import ExportError
from mla_convert.mla.algebra import transformers_inv_freq

#: Largest relative difference between a kept frequency and the ``default`` rope's float32 table.
GEOMETRIC_RTOL = 1e-6


@dataclass(frozen=True)
class RopeSlots:
    """Where each layer's kept RoPE pairs go in DeepSeek's one rope head.

    Attributes:
        inv_freq: ``[P']`` the slots' inverse frequencies (radians per token), ``theta^(-j/P')``, decreasing.
        slots: ``[L][P]`` the slot of each kept pair of each layer.
        parameters: the ``rope_parameters`` of the DeepSeek-V3 config (``rope_type: default``).
        max_rel_error: largest relative difference between a kept frequency and the table engines compute (float32)
            from ``parameters``.
    """

    inv_freq: list[float]
    slots: list[list[int]]
    parameters: dict[str, Any]
    max_rel_error: float

    @property
    def used(self) -> int:
        """Slots some layer uses."""
        return len({s for layer in self.slots for s in layer})


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _lattice(logs: list[float]) -> float | None:
    """The largest ``lam`` with every ``l`` in ``logs`` an integer multiple of it (to ``1e-4`` of a step)."""
    positive = sorted(x for x in logs if x > 1e-9)
    if not positive:
        return None
    for k in range(1, 257):
        lam = positive[0] / k
        steps = [round(x / lam) for x in positive]
        if all(abs(x / lam - j) < 1e-4 for x, j in zip(positive, steps, strict=True)):
            # least squares over every kept frequency: the float32 rounding of one does not set the ratio
            return sum(j * x for j, x in zip(steps, positive, strict=True)) / sum(j * j for j in steps)
    return None


def rope_slots(inv_freq: list[list[list[float]]], n_slots: int | None = None) -> RopeSlots:
    """The slots of one plain-theta table ``theta^(-j/n)`` holding every layer's kept pairs (module docstring).

    Args:
        inv_freq: ``[L][1][P]`` the checkpoint's ``rope_inv_freq`` (one rope head per layer).
        n_slots: the table length (``qk_rope_head_dim / 2``) an engine fixes; None: the fewest that hold the pairs.

    Raises:
        ExportError: a layer keeps one frequency twice, the kept frequencies are not powers of one ratio (a
            scaled source RoPE), or they need more than ``n_slots`` slots; the message says what to convert with.
    """
    per_layer = [[_f32(f) for f in layer[0]] for layer in inv_freq]
    for i, freqs in enumerate(per_layer):
        if len(set(freqs)) != len(freqs):
            raise ExportError(
                f"layer {i} keeps the same RoPE frequency for several KV heads (--rope-strategy rotation with more "
                "pairs than head_dim / 2); DeepSeek's one rope head holds each frequency once: convert with "
                "--rope-pairs at most head_dim / 2, or another --rope-strategy"
            )
    union = sorted({f for freqs in per_layer for f in freqs}, reverse=True)
    if any(f > 1.0 or f <= 0 for f in union):
        raise ExportError(
            "a kept RoPE frequency is above 1 rad/token or not positive: no rope_theta gives it"
        )
    logs = [-math.log(f) for f in union]
    lam = _lattice(logs)
    if lam is None and any(x > 1e-9 for x in logs):
        raise ExportError(
            "the kept RoPE frequencies are not powers of one ratio (a scaled source RoPE: llama3, YaRN, longrope); "
            "serving engines apply only a plain rope_theta to DeepSeek models, so no export is exact: convert with "
            "--rope-strategy high and no more --rope-pairs than the pairs the scaling leaves unscaled (factor --export "
            f"steers to them; inspect says how many); or, with no export, {PLUGIN_ROUTE}"
        )
    steps = {f: round(x / lam) if lam else 0 for f, x in zip(union, logs, strict=True)}
    need = max(steps.values()) + 1
    n = n_slots or need
    if need > n:
        raise ExportError(
            f"the kept RoPE frequencies span {need} steps of one geometric table; this target's rope head holds "
            f"{n} (qk_rope_head_dim {2 * n}): convert with --rope-strategy high --rope-pairs {n} or fewer pairs"
        )
    theta = math.exp((lam or 1.0) * n)
    params = {"rope_type": "default", "rope_theta": theta}
    table = transformers_inv_freq(params, n)
    err = 0.0
    for f in union:
        err = max(err, abs(float(table[steps[f]]) - f) / f)
    if err > GEOMETRIC_RTOL:
        raise ExportError(
            f"the kept RoPE frequencies are a geometric table only to {err:.1e} relative (over {GEOMETRIC_RTOL:g}); "
            "no plain rope_theta reproduces them"
        )
    return RopeSlots(table.tolist(), [[steps[f] for f in freqs] for freqs in per_layer], params, err)
