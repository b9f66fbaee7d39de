"""What a streamed conversion (:mod:`mla_convert.convert.pipeline.stream`) reads and hands back: its token windows,
its result record and the cache record of its probe prefill."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mla_convert.convert.layer.steps import LayerRecord
from mla_convert.metrics import EvalResult
from mla_convert.mla.configuration import MLAConfig

ProgressFn = Callable[[str, int, int], None]


@dataclass
class Texts:
    """Token windows of each role: ``calib [N, T]``, ``held [M, T]``, ``eval [E, T]``, ``probe [1, P]``."""

    calib: torch.Tensor
    held: torch.Tensor
    eval: torch.Tensor
    probe: torch.Tensor


@dataclass
class Streamed:
    """What a streamed conversion measured and wrote (report and manifest inputs)."""

    config: MLAConfig
    layers: list[LayerRecord]
    eval: EvalResult | None  # None: no evaluation windows (an in-memory conversion, mla_convert.convert.pipeline.build)
    refit: dict[str, Any] | None
    cache_source: dict[str, Any]
    cache_converted: dict[str, Any]
    calib_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    per_layer: list[dict[str, float]] = field(default_factory=list)
    dtype: str = "float32"
    device: str = "cpu"
    #: per-layer attention errors on held-out tokens of each ``o_proj`` variant (``plain``; ``fit`` when a refit
    #: ran), whichever was kept
    attn_err_variants: dict[str, list[float]] = field(default_factory=dict)


def cache_record(measured: list[tuple[int, int]], tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    """Per token and layer: values and bytes of the measured ``(bytes, values)`` of each layer's cache."""
    per = tokens * len(measured)
    return {
        "values_per_token_per_layer": sum(v for _, v in measured) / per,
        "bytes_per_token_per_layer": sum(b for b, _ in measured) / per,
        "dtype": str(dtype).replace("torch.", ""),
        "tokens": tokens,
        "layers": len(measured),
    }


def streamed_record(
    state: dict[str, Any], config: MLAConfig, ev: EvalResult | None, probe_tokens: int, dtype: torch.dtype,
    device: torch.device,
) -> Streamed:
    """The :class:`Streamed` record of a finished conversion from its ``state``: per-layer records with the kept
    ``o_proj`` variant's attention errors (``config.source["o_proj_refit"]`` set to the refit decision), the caches
    measured on ``probe_tokens`` tokens, and the timings summed over layers."""
    refit = state.get("refit")
    errs = state["attn_err"]["fit" if state.get("variant") else "plain"]
    records: list[LayerRecord] = state["records"]
    for rec, err, plain in zip(records, errs, state["attn_err"]["plain"], strict=False):
        rec.attn_rel_error, rec.attn_rel_error_no_refit = err, plain
    if refit is not None:
        config.source["o_proj_refit"] = refit
    per_layer = state["timings"]
    totals: dict[str, float] = {}
    for row in per_layer:
        for k, v in row.items():
            totals[k] = totals.get(k, 0.0) + v
    return Streamed(
        config,
        records,
        ev,
        refit,
        cache_record(state["cache_source"], probe_tokens, torch.float32),
        cache_record(state["cache_converted"], probe_tokens, torch.float32),
        int(state["calib_tokens"]),
        totals,
        per_layer,
        str(dtype).replace("torch.", ""),
        str(device),
        {k: list(v) for k, v in state["attn_err"].items() if v},
    )

