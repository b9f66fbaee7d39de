"""The peak-memory estimate of a recipe's stages, from the config and safetensors headers (no weight read).

Each stage goes through phases; the estimate of a phase is the sum of what the code holds at its worst moment,
and a stage's peak is its largest phase. ``factor`` streams layer by layer: its phases, disk and time come from
:mod:`mla_convert.convert.estimate.estimate` (what ``inspect`` prints; ``README.md`` §Memory gives the formula).
``adapt`` and ``validate`` hold whole models: the source in float32 (``adapt``'s teacher, ``validate``'s
reference, :func:`~mla_convert.sources.checkpoint.load_source_model`) and the converted model in float32
(:func:`~mla_convert.mla.checkpoint.load_checkpoint`'s default).

``tests/recipes/test_recipe_memory.py`` checks the ``factor`` estimate against the streamed conversion of the
bundled model and an 8B shape. The ``adapt`` estimate is rougher (activations by formula) and not checked
against a measurement.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mla_convert.adapt.options import AdaptOptions
from mla_convert.convert.estimate.estimate import Phase, factor_shape, peak
from mla_convert.convert.estimate.estimate_memory import factor_disk
from mla_convert.convert.estimate.estimate_memory import factor_phases as streamed_phases
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.recipes.schema import Recipe

if TYPE_CHECKING:
    from mla_convert.sources.checkpoint import SourceModel

__all__ = [
    "Phase",
    "peak",
    "factor_phases",
    "adapt_phases",
    "validate_phases",
    "memory_estimate",
    "memory_lines",
]

GB = 1e9

#: Resident bytes of the process before any model: Python, torch, transformers, mla_convert, a tokenizer and
#: the loaded text (measured 0.58 GB with torch 2.13 CPU and transformers 5.2 on Linux; rounded up). ``factor``
#: uses :data:`mla_convert.convert.estimate.estimate.RUNTIME_BYTES`, which adds what its passes leave resident.
RUNTIME_BYTES = 0.6e9

#: Bytes of evaluation logits per (token, vocabulary entry): float64 logits and log-probabilities of both
#: models (4 x 8) plus the three float64 temporaries of the KL term (3 x 8), one window at a time.
EVAL_LOGIT_BYTES = 56


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of the source and of its conversion (per-layer attention and whole model)."""

    source: int  # parameters of the source checkpoint (safetensors headers)
    converted: float  # parameters of the converted model (mean latent width over layers)
    source_attn: int  # q, k, v, o weights of one source layer
    converted_attn: float  # q, kv_a, kv_b, o weights of one converted layer (mean latent width)


def sizes(options: ConvertOptions, src: SourceModel) -> Sizes:
    """Parameter counts from the config, the safetensors headers and the cache geometry of ``options``.

    The converted query/key NoPE width is the widest any layer can get
    (:func:`~mla_convert.convert.estimate.estimate.d_nope_bound`), so the converted count is an upper bound.
    """
    s = factor_shape(options, src)
    return Sizes(s.source_params, s.output_params, s.attn_params, s.conv_attn_params)


def eval_logits(window: int, src: SourceModel) -> float:
    """Bytes of :func:`~mla_convert.metrics.evaluate`'s logits for one window against a reference."""
    return float(EVAL_LOGIT_BYTES * window * int(src.config.vocab_size))


def factor_phases(
    options: ConvertOptions, src: SourceModel, max_shard_size: str | int | None = None
) -> list[Phase]:
    """The phases of the streamed ``mla-convert factor`` (:func:`~mla_convert.convert.pipeline.job.run_factor`) in bytes:
    :func:`mla_convert.convert.estimate.estimate.factor_phases`.

    Raises:
        ValueError: a ``max_shard_size`` huggingface_hub cannot read.
    """
    return streamed_phases(options, src, max_shard_size)


def adapt_phases(options: AdaptOptions, factor: ConvertOptions, src: SourceModel) -> list[Phase]:
    """The training phase of ``mla-convert adapt`` in bytes (activations by formula; not measured)."""
    size = sizes(factor, src)
    n, h, hid = src.num_layers, src.num_heads, src.hidden_size
    vocab = int(src.config.vocab_size)
    inter = src.intermediate_size
    trainable = {
        "attention": n * size.converted_attn,
        "attention+norms": n * (size.converted_attn + 2 * hid),
        "all": size.converted,
    }[options.trainable]
    tokens = options.batch_size * options.seq_len
    per_layer = 4 * tokens * (10 * hid + 4 * inter + 2 * h * options.seq_len)
    acts = per_layer + 4 * n * tokens * hid if options.gradient_checkpointing else per_layer * n
    items = (
        ("runtime", RUNTIME_BYTES),
        ("student", 4.0 * size.converted),
        ("teacher", 4.0 * size.source),
        ("grads + AdamW", 12.0 * trainable),
        ("activations", float(acts)),
        ("logits", 6 * 4.0 * tokens * vocab),
    )
    return [Phase("adapt", "training", items)]


def validate_phases(factor: ConvertOptions, src: SourceModel) -> list[Phase]:
    """The heaviest rung of ``mla-convert validate`` (perplexity and KL against the source) in bytes."""
    size = sizes(factor, src)
    items = (
        ("runtime", RUNTIME_BYTES),
        ("converted model", 4.0 * size.converted),
        ("source model", 4.0 * size.source),
        ("evaluation logits", eval_logits(factor.window, src)),
    )
    return [Phase("validate", "evaluation", items)]


@dataclass(frozen=True)
class MemoryEstimate:
    """The peak phase of each stage that runs, the parameter counts, and the disk the stages write (bytes)."""

    stages: dict[str, Phase]
    sizes: Sizes
    disk: tuple[tuple[str, float], ...]  # (what, bytes) of each written checkpoint and the factor work folder


def memory_estimate(recipe: Recipe, src: SourceModel) -> MemoryEstimate:
    """The peak of every stage of ``recipe`` on ``src`` (no weights read)."""
    stages = {"factor": peak(factor_phases(recipe.factor, src))}
    size = sizes(recipe.factor, src)
    fdisk = factor_disk(recipe.factor, src)
    dtype = factor_shape(recipe.factor, src).out_dtype
    disk: tuple[tuple[str, float], ...] = (
        (f"factor checkpoint ({dtype})", fdisk.output),
        ("factor work folder at its peak, removed at the end", fdisk.work_peak - fdisk.output),
    )
    if recipe.adapt is not None:
        stages["adapt"] = peak(adapt_phases(recipe.adapt, recipe.factor, src))
        disk += (("adapt checkpoint (float32)", 4.0 * size.converted),)
    if recipe.validation.enabled:
        stages["validate"] = peak(validate_phases(recipe.factor, src))
    return MemoryEstimate(stages, size, disk)


def memory_lines(recipe: Recipe, src: SourceModel) -> list[str]:
    """:func:`memory_estimate` as text lines (GB = 1e9 bytes)."""
    est = memory_estimate(recipe, src)
    out = []
    for stage, phase in est.stages.items():
        inner = ", ".join(f"{k} {b / GB:.2f}" for k, b in phase.largest(5))
        out.append(f"  {stage:<9} ~{phase.total / GB:.1f} GB peak in {phase.name} ({inner})")
    kept = sum(b for what, b in est.disk if "work folder" not in what)
    work = max(b for what, b in est.disk if "work folder" in what)
    parts = ", ".join(f"{what} {b / GB:.2f}" for what, b in est.disk)
    out.append(
        f"  disk      ~{kept / GB:.1f} GB kept, ~{(kept + work) / GB:.1f} GB while factor runs ({parts})"
    )
    out.append(
        f"  estimate from the config and safetensors headers: {est.sizes.source / 1e6:.1f} M source parameters, "
        f"~{est.sizes.converted / 1e6:.1f} M converted"
    )
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return out
    top = max(p.total for p in est.stages.values())
    note = "" if top < ram else " (less than the estimated peak)"
    out.append(f"  this machine has {ram / GB:.1f} GB of memory{note}")
    return out
