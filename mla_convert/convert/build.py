"""The ``factor`` pipeline: statistics -> partial RoPE -> low-rank K/V -> MLA model -> measurements.

Memory: the source model is loaded once (it must run for calibration); source attention weights
are read per layer with ``safe_open`` in float64 for the linear algebra.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mla_convert import __version__
from mla_convert.convert.assemble import layer_tensors, pad_plan
from mla_convert.convert.calibration import HeldOut, LayerStats, collect_stats
from mla_convert.convert.factorize import (
    FactorError,
    Factors,
    LayerTarget,
    allocate_ranks,
    build_target,
    factor_layer,
    spectrum,
)
from mla_convert.convert.options import ConvertOptions, Geometry, check_options, geometry
from mla_convert.convert.refit import lm_losses, refit_o_proj
from mla_convert.convert.rope import RopePlan, plan_layer
from mla_convert.mla.algebra import causal_mask
from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.modeling import MLAAttention, MLAForCausalLM
from mla_convert.sources.checkpoint import SourceModel, load_source_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ProgressFn = Callable[[str, int, int], None]  # (stage, advance, total)


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


@dataclass
class Conversion:
    """Result of :func:`convert`: the MLA model, its config and the per-layer records."""

    model: MLAForCausalLM
    config: MLAConfig
    layers: list[LayerRecord]
    timings: dict[str, float] = field(default_factory=dict)
    calib_tokens: int = 0


def _ranks(options: ConvertOptions, targets: list[Any], geo: Geometry) -> list[int]:
    """Latent width per layer: ``kv_lora_rank`` everywhere, or the budget's latent values allocated by marginal
    error (:func:`~mla_convert.convert.factorize.allocate_ranks`). The options were checked by
    :func:`~mla_convert.convert.options.check_options`."""
    if options.kv_lora_rank is not None:
        return [options.kv_lora_rank] * geo.num_layers
    assert options.cache_budget is not None
    return allocate_ranks([spectrum(t) for t in targets], geo.latent_total(options.cache_budget))


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
    """The converted model's config: the source's sizes, per-layer ranks and the plans' RoPE pairs."""
    cfg = src.config
    return MLAConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=src.num_layers,
        num_attention_heads=src.num_heads,
        num_key_value_heads=src.num_kv_heads,
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
        qk_nope_head_dim=d_nope,
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
            "tool": f"mla-convert {__version__}",
        },
    )


def layer_state(
    src: SourceModel, weights: dict[str, torch.Tensor], plan: RopePlan, factors: Factors, d_nope: int
) -> dict[str, torch.Tensor]:
    """One layer's MLA attention tensors (float32), keyed by name inside ``self_attn`` (``q_proj.weight``,
    ..., ``rope_inv_freq``)."""
    tensors = layer_tensors(weights, pad_plan(plan, d_nope), factors, src.num_heads, src.attention_scaling)
    out = {k: v.to(torch.float32) for k, v in tensors.items()}
    out["rope_inv_freq"] = plan.inv_freq.clone()
    return out


def layer_record(layer: int, plan: RopePlan, factors: Factors) -> LayerRecord:
    """The report row of one converted layer (attention error filled in later)."""
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
    )


def is_lossless(plans: list[RopePlan], factors: list[Factors]) -> bool:
    """True when every layer keeps all RoPE components and full rank: the conversion is the same function."""
    return all(p.key_nope.shape[0] == 0 for p in plans) and all(f.rel_error < 1e-9 for f in factors)


def build_mla(
    src: SourceModel,
    source_model: PreTrainedModel,
    stats: list[LayerStats],
    options: ConvertOptions,
    progress: ProgressFn | None = None,
    check_ids: torch.Tensor | None = None,
) -> tuple[MLAForCausalLM, MLAConfig, list[LayerRecord], list[RopePlan]]:
    """Convert with given calibration statistics (no text I/O): plans, factors, tensors, model — in memory
    (tests, benchmarks); ``factor`` streams the same per-layer steps (:mod:`mla_convert.convert.stream`).

    ``check_ids [M, T]`` (held-out calibration tokens): when given, the ``o_proj`` refit is kept only if
    it lowers the converted model's mean loss over the M windows (a teacher-forced fit can amplify errors that compound
    through layers); ``config.source["o_proj_refit"]`` records the losses and the decision.

    Raises:
        OptionsError: impossible options (before any tensor is built).
    """
    check_options(options, src)
    geo = geometry(options, src)
    n_layers = src.num_layers
    weights = [src.attention_weights(i) for i in range(n_layers)]
    pts = [plan_and_target(src, options, weights[i], stats[i]) for i in range(n_layers)]
    plans = [p for p, _ in pts]
    targets = [t for _, t in pts]
    rope_heads = len(plans[0].origin)
    d_r = plans[0].q_rope.shape[1]
    if rope_heads * d_r != geo.rope_width:
        raise RuntimeError(f"internal error: the plans keep {rope_heads * d_r} RoPE values, geometry says {geo.rope_width}")
    ranks = _ranks(options, targets, geo)
    factors: list[Factors] = []
    for i in range(n_layers):
        factors.append(factor_layer(targets[i], ranks[i], options.factorization))
        if progress:
            progress("factorize", 1, n_layers)
    d_nope = max(p.q_nope.shape[1] for p in plans)
    config = mla_config(src, options, ranks, plans, d_nope)
    model = MLAForCausalLM(config).to(torch.float32).eval()  # type: ignore[arg-type]  # transformers' wrapped .to
    state: dict[str, torch.Tensor] = {}
    src_state = source_model.state_dict()
    for name in src.family.copied(n_layers):
        state[name] = src_state[name]
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = src_state["lm_head.weight"]
    else:
        state["lm_head.weight"] = src_state["model.embed_tokens.weight"]
    records = []
    for i in range(n_layers):
        for k, v in layer_state(src, weights[i], plans[i], factors[i], d_nope).items():
            state[f"model.layers.{i}.self_attn.{k}"] = v
        records.append(layer_record(i, plans[i], factors[i]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"internal error assembling the MLA state: missing {missing[:3]} unexpected {unexpected[:3]}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    lossless = is_lossless(plans, factors)
    if options.refit_o_proj != "none" and not lossless:  # a lossless conversion stays the same function
        if any(st.x is None or st.out is None for st in stats):
            raise FactorError(
                "--refit-o-proj needs calibration inputs; collect statistics with keep_calibration"
            )
        before = lm_losses(model, check_ids) if check_ids is not None else None
        saved = {
            i: layer.self_attn.o_proj.weight.detach().clone() for i, layer in enumerate(model.model.layers)
        }
        for i, st in enumerate(stats):
            attn = model.model.layers[i].self_attn
            assert isinstance(attn, MLAAttention) and st.x is not None and st.out is not None
            refit_o_proj(attn, st.x, st.out)
            if progress:
                progress("refit", 1, len(stats))
        after = lm_losses(model, check_ids) if check_ids is not None else None
        mean_before = sum(before) / len(before) if before else None
        mean_after = sum(after) / len(after) if after else None
        kept = mean_before is None or mean_after is None or mean_after < mean_before
        if not kept:
            with torch.no_grad():
                for i, layer in enumerate(model.model.layers):
                    layer.self_attn.o_proj.weight.copy_(saved[i])
        config.source["o_proj_refit"] = {
            "kept": kept,
            "loss_before": mean_before,
            "loss_after": mean_after,
            "window_losses_before": before,
            "window_losses_after": after,
        }
    return model, config, records, plans


@torch.no_grad()
def attention_errors(model: MLAForCausalLM, held: list[HeldOut]) -> list[float]:
    """Relative error ``‖a_mla - a_src‖ / ‖a_src‖`` of each layer's attention output on held-out tokens,
    with the source's own layer inputs (so errors do not compound)."""
    errs = []
    for i, ho in enumerate(held):
        attn = model.model.layers[i].self_attn
        t = ho.x.shape[1]
        pos = torch.arange(t)[None].expand(ho.x.shape[0], t)
        out = attn(ho.x, pos, causal_mask(1, t), None)
        errs.append(float((out - ho.out).norm() / ho.out.norm().clamp_min(1e-30)))
    return errs


def convert(
    src: SourceModel,
    options: ConvertOptions,
    calib_windows: torch.Tensor,
    held_out: torch.Tensor,
    source_model: PreTrainedModel | None = None,
    progress: ProgressFn | None = None,
) -> tuple[Conversion, PreTrainedModel]:
    """Full conversion of ``src`` with calibration windows ``[N, T]`` and held-out windows ``[M, T]``.

    Returns:
        ``(conversion, source_model)``; the source model is returned for evaluation.
    """
    t0 = time.perf_counter()
    if source_model is None:
        source_model = load_source_model(src)
    t1 = time.perf_counter()
    stats, held = collect_stats(
        source_model,
        src,
        calib_windows,
        held_out,
        progress=(lambda n: progress("calibrate", n, len(calib_windows))) if progress else None,
        keep_calibration=options.refit_o_proj != "none",
    )
    t2 = time.perf_counter()
    model, config, records, _ = build_mla(src, source_model, stats, options, progress, check_ids=held_out)
    t3 = time.perf_counter()
    # strict=False: ``held`` is empty when there are no held-out windows
    for rec, err in zip(records, attention_errors(model, held), strict=False):
        rec.attn_rel_error = err
    t4 = time.perf_counter()
    timings = {
        "load_source_s": t1 - t0,
        "calibrate_s": t2 - t1,
        "factorize_s": t3 - t2,
        "attention_check_s": t4 - t3,
    }
    return Conversion(model, config, records, timings, stats[0].tokens), source_model
