"""The per-layer steps of a conversion, shared by every caller: a layer's partial-RoPE plan and the weighted
K/V matrix it factors, the latent widths per layer, the MLA config, one layer's assembled tensors and its
report row (docs/math.md). :mod:`mla_convert.convert.pipeline.stream` runs them layer by layer; nothing else converts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_convert import __version__
from mla_convert.convert.layer.assemble import layer_tensors, pad_plan, query_rows
from mla_convert.convert.layer.factorize import (
    Factors,
    LayerTarget,
    allocate_ranks,
    build_target,
)
from mla_convert.convert.layer.nope_rank import NopeReduction, query_nope_moment, reduce_nope
from mla_convert.convert.layer.reconstruct import Reconstruction
from mla_convert.convert.layer.rope import RopePlan, plan_layer
from mla_convert.convert.options.options import ConvertOptions, Geometry
from mla_convert.convert.stats.calibration import LayerStats
from mla_convert.mla.configuration import MLAConfig
from mla_convert.sources.checkpoint import SourceModel


@dataclass
class LayerRecord:
    """Per-layer reconstruction record (report rows)."""

    layer: int
    rope_pairs: list[list[str]]
    rank: int
    cache_width: int
    energy: float
    rel_error: float
    rel_error_act: float
    attn_rel_error: float | None = None
    rope_energy: float = 0.0
    attn_rel_error_no_refit: float | None = None  # the same with the assembled o_proj (differs where a refit is kept)
    #: the fitted reconstruction where it ran: held-out relative attention error ``before`` / ``after``, ``kept``,
    #: ``steps``, ``seconds`` (:class:`~mla_convert.convert.layer.reconstruct.Reconstruction`); None where it did not
    reconstruct: dict[str, Any] | None = None


def layer_ranks(options: ConvertOptions, spectra: list[torch.Tensor], geo: Geometry) -> list[int]:
    """Latent width per layer: ``kv_lora_rank`` everywhere, or the budget's latent values allocated by marginal
    error over every layer's singular-value ``spectra`` (:func:`~mla_convert.convert.layer.factorize.allocate_ranks`).
    The options were checked by :func:`~mla_convert.convert.options.options.check_options`."""
    if options.kv_lora_rank is not None:
        return [options.kv_lora_rank] * geo.num_layers
    budget = options.cache_budget
    if budget is None and options.cache_fraction is not None:
        budget = float(round(options.cache_fraction * geo.source_width))
    assert budget is not None
    return allocate_ranks(spectra, geo.latent_total(budget))


def plan_and_target(
    src: SourceModel, options: ConvertOptions, weights: dict[str, torch.Tensor], stats: LayerStats
) -> tuple[RopePlan, LayerTarget]:
    """One layer's partial-RoPE plan and the weighted K/V matrix it factors (float64, CPU)."""
    plan = plan_layer(
        weights,
        stats,
        src.inv_freq,
        src.num_heads,
        src.num_kv_heads,
        options.rope_mode,
        options.rope_strategy,
        options.rope_pairs,
        options.rope_context,
        options.rope_basis,
    )
    balance = options.kv_balance and options.factorization == "joint"
    return plan, build_target(weights, plan, stats, src.num_heads, options.objective, balance)


def mla_config(
    src: SourceModel, options: ConvertOptions, ranks: list[int], plans: list[RopePlan], d_nope: int
) -> MLAConfig:
    """The converted model's config: the source's sizes, per-layer ranks and the plans' RoPE pairs.

    With ``options.qk_nope_head_dim`` (:mod:`mla_convert.convert.layer.nope_rank`) every query head has its own key map:
    ``qk_nope_head_dim`` is the option and ``num_key_value_heads`` is ``H`` (``d_nope``, the plans' widest NoPE
    width, is then the width before the reduction)."""
    cfg = src.config
    reduced = options.qk_nope_head_dim is not None
    return MLAConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=src.num_layers,
        num_attention_heads=src.num_heads,
        num_key_value_heads=src.num_heads if reduced else src.num_kv_heads,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        kv_lora_rank=ranks,
        qk_rope_head_dim=plans[0].q_rope.shape[1],
        qk_nope_head_dim=options.qk_nope_head_dim if options.qk_nope_head_dim is not None else d_nope,
        v_head_dim=src.head_dim,
        num_rope_heads=len(plans[0].origin),
        rope_inv_freq=[p.inv_freq.tolist() for p in plans],
        rope_pair_origin=[p.origin for p in plans],
        softmax_scale=src.softmax_scale,
        q_bias=src.family.has_bias("q", src.config),
        kv_a_bias=src.family.has_bias("k", src.config),
        o_bias=src.family.has_bias("v", src.config) or src.family.has_bias("o", src.config),
        source={
            "origin": src.origin,
            "family": src.family.name,
            "model_type": src.config.model_type,
            "rope_mode": options.rope_mode,
            "num_key_value_heads": src.num_kv_heads,  # the source's (this config's is H after a NoPE reduction)
            "tool": f"mla-convert {__version__}",
        },
    )


def layer_state(
    src: SourceModel,
    weights: dict[str, torch.Tensor],
    plan: RopePlan,
    factors: Factors,
    d_nope: int,
    nope_width: int | None = None,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One layer's MLA attention tensors (float32), keyed by name inside ``self_attn`` (``q_proj.weight``,
    ..., ``rope_inv_freq``).

    Args:
        d_nope: the checkpoint's ``qk_nope_head_dim`` the plan is padded to (without a reduction).
        nope_width: ``--qk-nope-head-dim``: the query's NoPE width reduced to it
            (:func:`~mla_convert.convert.layer.nope_rank.reduce_nope`, one key group per query head); None: kept.
        moments: with ``nope_width``, the attention input's ``(E[x xᵀ] [D, D], E[x] [D])`` on the calibration text.
    """
    return layer_state_reduced(src, weights, plan, factors, d_nope, nope_width, moments)[0]


def layer_state_reduced(
    src: SourceModel,
    weights: dict[str, torch.Tensor],
    plan: RopePlan,
    factors: Factors,
    d_nope: int,
    nope_width: int | None = None,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], NopeReduction | None]:
    """:func:`layer_state` and what the NoPE-width reduction kept (None without one)."""
    own = plan.q_nope.shape[1]
    padded = pad_plan(plan, own if nope_width is not None else d_nope)
    if nope_width is not None and moments is None:
        raise ValueError("a NoPE-width reduction needs the layer's input moments")
    # with a reduction the d_N-wide query is assembled one head at a time inside it, never whole
    tensors = layer_tensors(weights, padded, factors, src.num_heads, src.attention_scaling, query=nope_width is None)
    record = None
    if nope_width is not None and moments is not None:
        scale = src.attention_scaling**2

        def qq(hi: int) -> torch.Tensor:
            return query_nope_moment(weights["q"], weights.get("bq"), padded.q_nope, scale, *moments, hi)

        tensors, record = reduce_nope(
            tensors, src.num_heads, src.num_kv_heads, own, plan.q_rope.shape[1], nope_width, *moments, qq,
            query_rows=lambda hi: query_rows(weights, padded, hi, src.attention_scaling),
        )
    out = {k: v.to(torch.float32) for k, v in tensors.items()}
    out["rope_inv_freq"] = plan.inv_freq.clone()
    return out, record


def layer_record(layer: int, plan: RopePlan, factors: Factors, fitted: Reconstruction | None = None) -> LayerRecord:
    """The report row of one converted layer (attention error filled in later; ``fitted``: its fitted
    reconstruction, where it ran)."""
    rope_width = len(plan.origin) * plan.q_rope.shape[1]
    return LayerRecord(
        layer=layer,
        rope_pairs=plan.origin,
        rank=factors.rank,
        cache_width=factors.rank + rope_width,
        energy=factors.energy,
        rel_error=factors.rel_error,
        rel_error_act=factors.rel_error_act,
        rope_energy=plan.rope_energy,
        reconstruct=None if fitted is None else {
            "before": round(fitted.before, 6), "after": round(fitted.after, 6), "kept": fitted.kept,
            "steps": fitted.steps, "seconds": round(fitted.seconds, 2),
        },
    )


def is_lossless(plans: list[RopePlan], factors: list[Factors]) -> bool:
    """True when every layer keeps all RoPE components and full rank: the conversion is the same function."""
    return all(p.key_nope.shape[0] == 0 for p in plans) and all(f.rel_error < 1e-9 for f in factors)
