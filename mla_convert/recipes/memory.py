"""The one peak-memory estimate of a recipe's stages (float32 models), from the config and safetensors headers.

Each stage goes through phases; the estimate of a phase is the sum of what the code holds at its worst
moment, and a stage's peak is its largest phase. The ``factor`` phases follow :mod:`mla_convert.convert.job`,
:mod:`~mla_convert.convert.build` and :mod:`~mla_convert.convert.calibration`:

* ``calibration`` (the end of :func:`~mla_convert.convert.calibration.collect_stats`, the usual peak): the
  attention inputs and source outputs of every kept window (``calib_windows + HELD_OUT_WINDOWS`` with the
  ``o_proj`` refit on, the held-out ones alone without), ``2 x 4 x hidden x window`` bytes per window and
  layer; their ``torch.cat`` copies (the per-window lists live until the function returns); and the heap
  that the per-window float64 temporaries of the statistics hooks leave fragmented between them;
* ``build``: the kept captures, the float64 weights and factorization targets, the converted model;
* ``evaluation``: both models and the float64 logits of :func:`~mla_convert.validate.metrics.evaluate`.

``tests/recipes/test_recipe_memory.py`` checks the ``factor`` estimate of the default options on the bundled model
against the resident peak that the pinned reference conversion measured (its manifest's ``run.peak_rss_mb``).
The ``adapt`` estimate is rougher (activations by formula) and not checked against a measurement.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mla_convert.adapt.options import AdaptOptions
from mla_convert.convert.options import ConvertOptions, geometry
from mla_convert.recipes.schema import Recipe

if TYPE_CHECKING:
    from mla_convert.sources.checkpoint import SourceModel

GB = 1e9

#: Resident bytes of the process before any model: Python, torch, transformers, mla_convert, a tokenizer and
#: the loaded text (measured 0.58 GB with torch 2.13 CPU and transformers 5.2 on Linux; rounded up).
RUNTIME_BYTES = 0.6e9

#: Heap kept per byte captured by the calibration hooks besides the captures and their concatenated copies:
#: the freed float64 temporaries of each window's statistics sit between that window's captures and are not
#: handed back to the system (measured 0.85 on SmolLM2-135M: resident memory grew 2.85x the captured bytes;
#: rounded up).
CAPTURE_SLACK = 1.0

#: Bytes of evaluation logits per (token, vocabulary entry): float64 logits and log-probabilities of both
#: models (4 x 8) plus the three float64 temporaries of the KL term (3 x 8), one window at a time.
EVAL_LOGIT_BYTES = 56


@dataclass(frozen=True)
class Phase:
    """What one moment of a stage holds: ``items`` as ``(what, bytes)``."""

    stage: str
    name: str
    items: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        """Bytes of all items."""
        return sum(b for _, b in self.items)


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of the source and of its conversion (per-layer attention and whole model)."""

    source: int  # parameters of the source checkpoint (safetensors headers)
    converted: float  # parameters of the converted model (mean latent width over layers)
    source_attn: int  # q, k, v, o weights of one source layer
    converted_attn: float  # q, kv_a, kv_b, o weights of one converted layer (mean latent width)


def sizes(options: ConvertOptions, src: SourceModel) -> Sizes:
    """Parameter counts from the config, the safetensors headers and the cache geometry of ``options``.

    The converted query/key NoPE width is its upper bound (every non-RoPE key component read by every head
    in shared mode), so the converted count is an upper bound too.
    """
    geo = geometry(options, src)
    h, g, d, hid = src.num_heads, src.num_kv_heads, src.head_dim, src.hidden_size
    d_nope = geo.nope_width // geo.rope_heads  # per query head
    d_r = 2 * geo.rope_pairs  # per rope head
    d_c = geo.mean_width(options) - geo.rope_width
    src_attn = 2 * h * d * hid + 2 * g * d * hid
    mla_attn = hid * h * (d_nope + d_r) + hid * (d_c + geo.rope_width) + d_c * g * (d_nope + d) + h * d * hid
    p_src = sum(math.prod(src.shape(name)) for name in src.weight_map)
    return Sizes(p_src, p_src + geo.num_layers * (mla_attn - src_attn), src_attn, mla_attn)


def peak(phases: list[Phase]) -> Phase:
    """The phase that holds the most."""
    return max(phases, key=lambda p: p.total)


def eval_logits(window: int, src: SourceModel) -> float:
    """Bytes of :func:`~mla_convert.validate.metrics.evaluate`'s logits for one window against a reference."""
    return float(EVAL_LOGIT_BYTES * window * int(src.config.vocab_size))


def factor_phases(options: ConvertOptions, src: SourceModel) -> list[Phase]:
    """The phases of ``mla-convert factor`` (:func:`~mla_convert.convert.job.run_factor`) in bytes."""
    from mla_convert.convert.job import HELD_OUT_WINDOWS

    size = sizes(options, src)
    geo = geometry(options, src)
    n, h, g, d, hid = src.num_layers, src.num_heads, src.num_kv_heads, src.head_dim, src.hidden_size
    t, vocab = options.window, int(src.config.vocab_size)
    kept = (options.calib_windows if options.refit_o_proj != "none" else 0) + HELD_OUT_WINDOWS
    captures = float(2 * 4 * hid * t * kept * n)  # float32 attention inputs and outputs, every layer
    base = (("runtime", RUNTIME_BYTES), ("source model", 4.0 * size.source))
    weights64 = ("float64 attention weights", 8.0 * n * size.source_attn)
    rows = geo.nope_width + g * d  # NoPE key rows stacked on value rows, per layer
    converted = ("converted model", 4.0 * size.converted)
    return [
        Phase(
            "factor",
            "calibration",
            base
            + (
                ("forward logits", 4.0 * t * vocab),
                weights64,
                ("statistics", 8.0 * n * (hid * hid + hid + (h + g) * d // 2)),
                (f"captures of {kept} windows", captures),
                ("their concatenated copies", captures),
                ("allocator slack", CAPTURE_SLACK * captures),
            ),
        ),
        Phase(
            "factor",
            "build",
            base
            + (
                (f"captures of {kept} windows", captures),
                weights64,
                ("factorization targets", 8.0 * n * (rows * hid + rows * rows + hid * hid)),
                converted,
                ("refit-check logits", 2 * 4.0 * t * vocab),
            ),
        ),
        Phase("factor", "evaluation", base + (converted, ("evaluation logits", eval_logits(t, src)))),
    ]


def adapt_phases(options: AdaptOptions, factor: ConvertOptions, src: SourceModel) -> list[Phase]:
    """The training phase of ``mla-convert adapt`` in bytes (activations by formula; not measured)."""
    size = sizes(factor, src)
    n, h, hid = src.num_layers, src.num_heads, src.hidden_size
    vocab = int(src.config.vocab_size)
    inter = int(getattr(src.config, "intermediate_size", None) or 4 * hid)
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
    """The peak phase of each stage that runs, and the disk the checkpoints take (bytes)."""

    stages: dict[str, Phase]
    sizes: Sizes
    checkpoints: int

    @property
    def disk_per_checkpoint(self) -> float:
        """Bytes of one float32 converted checkpoint."""
        return 4.0 * self.sizes.converted


def memory_estimate(recipe: Recipe, src: SourceModel) -> MemoryEstimate:
    """The peak of every stage of ``recipe`` on ``src`` (no weights read)."""
    stages = {"factor": peak(factor_phases(recipe.factor, src))}
    if recipe.adapt is not None:
        stages["adapt"] = peak(adapt_phases(recipe.adapt, recipe.factor, src))
    if recipe.validation.enabled:
        stages["validate"] = peak(validate_phases(recipe.factor, src))
    return MemoryEstimate(stages, sizes(recipe.factor, src), 2 if recipe.adapt is not None else 1)


def memory_lines(recipe: Recipe, src: SourceModel) -> list[str]:
    """:func:`memory_estimate` as text lines (GB = 1e9 bytes)."""
    est = memory_estimate(recipe, src)
    out = []
    for stage, phase in est.stages.items():
        inner = ", ".join(f"{k} {b / GB:.2f}" for k, b in phase.items)
        out.append(f"  {stage:<9} ~{phase.total / GB:.1f} GB peak in {phase.name} ({inner})")
    k, per = est.checkpoints, est.disk_per_checkpoint
    out.append(
        f"  disk      ~{k * per / GB:.1f} GB ({k} float32 checkpoint{'s' if k > 1 else ''} of ~{per / GB:.2f} GB)"
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
