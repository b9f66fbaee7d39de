"""The options of a conversion and every rule about them: choices, ranges and the cache geometry they imply.

One home for these rules: the CLI (its flags are generated from :class:`ConvertOptions`), recipes (their
dry-run), ``inspect`` and the conversion itself call :func:`geometry` and :func:`problems`, so a rule changed
here changes everywhere. Light on purpose (pydantic only, no torch): the CLI imports it at start-up.
The geometry follows docs/math.md (partial RoPE, latent width).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mla_convert.errors import UserError
from mla_convert.text.corpora import TextError
from mla_convert.text.specs import parse_data_spec

RopeMode = Literal["per-head", "shared"]
RopeStrategy = Literal["high", "low", "uniform", "2-norm", "rotation"]
RopeBasis = Literal["complex", "real"]
Factorization = Literal["joint", "split"]
Objective = Literal["weight", "activation", "output"]
Refit = Literal["none", "teacher", "sequential"]
OutputDtype = Literal["auto", "bfloat16", "float16", "float32"]
CalibPrecision = Literal["bfloat16", "float32"]

MODES: tuple[str, ...] = get_args(RopeMode)
STRATEGIES: tuple[str, ...] = get_args(RopeStrategy)
BASES: tuple[str, ...] = get_args(RopeBasis)
FACTORIZATIONS: tuple[str, ...] = get_args(Factorization)
OBJECTIVES: tuple[str, ...] = get_args(Objective)
REFITS: tuple[str, ...] = get_args(Refit)


#: Calibration tokens the ``o_proj`` refit fits on, at most (the default budget: all of them): its time, memory and
#: disk grow with them. On SmolLM2 at 120 values fitting on all 16384 default tokens rather than every other window
#: lowered the held-out loss after the refit from 3.914 to 3.836 nats (the statistics identical).
REFIT_TOKENS = 16384


def refit_stride(windows: int, window: int) -> int:
    """Every how many calibration windows (of ``windows`` x ``window`` tokens) one is kept for the refit, so that at
    most :data:`REFIT_TOKENS` tokens are (at least one window), spread across the calibration text like the
    statistics' windows."""
    return max(1, -(-windows * window // REFIT_TOKENS))


class OptionsError(UserError):
    """Options impossible for this source (one line per problem, each naming the option and the allowed range)."""


class ConvertOptions(BaseModel):
    """Every option of a conversion (the manifest records all of them). Unknown keys are refused.

    The field descriptions are the CLI's help texts (``mla-convert factor --help``).
    """

    model_config = ConfigDict(extra="forbid")
    rope_mode: RopeMode = Field(
        "shared",
        description="per-head: one rope head per KV head (MHA2MLA) | shared: one rope head from a per-frequency "
        "PCA across KV heads (TransMLA's RoRoPE). Library only: per-head with every pair is the exactness tests' "
        "lossless path; the command line and recipes take shared (per-head lost as an anchor and no export serves it)",
        json_schema_extra={"retired": "removed; a conversion has one shared rope head (the only one the exports "
                           "serve; per-head lost as an anchor, docs/results.md): leave it out"},
    )
    rope_strategy: RopeStrategy = Field(
        "2-norm",
        description="which pairs/frequencies keep RoPE: 2-norm | rotation (weighted by how far they rotate) | high "
        "(the fastest: llama.cpp's row); not given: the strategy measured best for the cache budget (inspect says "
        "which). The library also takes low and uniform (never measured: the oracles' only)",
        json_schema_extra={"retired_values": {
            v: "retired; never measured: use 2-norm, rotation or high, or leave it out (measured best for the cache "
            "size)" for v in ("low", "uniform")}},
    )
    rope_pairs: int = Field(
        24,
        description="RoPE pairs kept by the shared rope head (per KV head in the library's per-head mode); not given "
        "on factor/inspect/a recipe with a cache budget: the split measured best for the budget (measured_splits.json)",
    )
    rope_basis: RopeBasis = Field(
        "complex",
        description="basis of the shared-mode PCA across KV heads. Library only (real was never measured; the oracles "
        "test both)",
        json_schema_extra={"retired": "removed; the shared rope head's PCA is complex (real was never measured): "
                           "leave it out"},
    )
    rope_context: int = Field(2048, description="context T in tokens of the rotation strategy")
    factorization: Factorization = Field(
        "joint",
        description="one latent for K and V, or separate halves. Library only (split was never measured)",
        json_schema_extra={"retired": "removed; K and V share one latent (split was never measured): leave it out"},
    )
    objective: Objective = Field(
        "output",
        description="SVD of W | of W C^1/2 (activation PCA) | of M^1/2 W C^1/2 (output-aware). Library only (the "
        "benchmarks' anchors use weight and activation; activation lost, docs/results.md levers)",
        json_schema_extra={"retired": "removed; the latent is output-aware (activation measured x4.77 against "
                           "x4.49 at 72 values, docs/results.md levers): leave it out"},
    )
    kv_balance: bool = Field(
        True,
        description="balance K and V energy before a joint factorization. Library only (off lost, docs/results.md "
        "levers; the anchors use it)",
        json_schema_extra={"retired": "removed; K and V are always balanced (off measured x5.46 against x4.49 at 72 "
                           "values, docs/results.md levers): leave it out"},
    )
    refit_o_proj: Refit = Field(
        "teacher",
        description="ridge least-squares refit of o_proj so each converted layer's attention output matches the "
        "source's on calibration tokens, fitted on the source's layer inputs (teacher) or on the converted "
        "model's own, layer after layer (sequential: one more forward of the calibration windows per layer); no "
        "cache cost; kept only if it helps on held-out windows; not given: the refit measured best for the cache "
        "budget (inspect says which). The library also takes none (no refit, a loser: the oracles' and anchors')",
        json_schema_extra={"retired_values": {
            "none": "retired; no refit measured x21.12 against teacher's x4.49 at 72 values (docs/results.md levers): "
            "use teacher or sequential, or leave it out (a refit is kept only where it helps on held-out windows)"}},
    )
    reconstruct_steps: int | None = Field(
        None,
        ge=0,
        le=100_000,
        description="fitted reconstruction: Adam steps per lossy layer fitting its whole converted attention to the "
        "source's outputs on the refit's windows and inputs, kept only where held-out error falls "
        "(convert/layer/reconstruct.py); 0: off; not given: 50 on a GPU (--device cuda, or auto with one), off on a "
        "CPU, where it costs as much as the rest of the conversion or more (inspect says what it would cost)",
    )
    kv_lora_rank: int | None = Field(
        None, description="latent width d_c for every layer (replaces --cache-fraction and --cache-budget)"
    )
    cache_fraction: float | None = Field(
        0.3125,
        description="KV cache kept, as a fraction of the source's 2 x KV heads x head_dim values per token per "
        "layer (0.3125: 31.25 %, MHA2MLA's largest size); latent ranks allocated per layer",
    )
    cache_budget: float | None = Field(
        None,
        description="cache values per token per layer, averaged (an absolute size; replaces --cache-fraction); "
        "latent ranks allocated per layer",
    )
    qk_nope_head_dim: int | None = Field(
        None,
        description="reduce each query head's NoPE width (qk_nope_head_dim: with one shared rope head it is "
        "head_dim + 2 x rope pairs x (KV heads - 2), the other KV heads' mixed components of each kept frequency) to "
        "this many dims (a per-head low-rank of the NoPE score, activation-weighted; exact at min(head_dim, "
        "kv_lora_rank) or more; no cache cost); not given: keep it (--target vllm and vllm-cpu set it when the width "
        "exceeds what the engine takes)",
    )
    text: str = Field(
        "wikipedia",
        description="calibration/evaluation text: wikipedia | news | shakespeare | python (the standard library's sources) | code (gensim's Python sources) | wikipedia-chat (chat-templated) | comma-separated files or folders",
    )
    calib_data: list[str] | None = Field(
        None,
        description="calibration mixture, one source each (repeat the flag): SOURCE[,weight=W][,field=|messages=NAME] "
        "as adapt --data reads it, e.g. wikipedia,weight=2 wikipedia-chat code (code: gensim's Python sources); each "
        "source's share of the calibration windows is its weight (default 1), drawn from its calibration split; "
        "replaces --text for calibration, while the report's evaluation stays on --text's evaluation split. Not "
        "given: with --text not given either, the default mixture wikipedia + wikipedia-chat + code, 1:1:1 "
        "(wikipedia-chat left out for a tokenizer without a chat template; measured by "
        "benchmarks/calibration_mix.py); with --text given, --text alone",
        json_schema_extra={"metavar": "SPEC"},
    )
    calib_tokens: int = Field(
        16384,
        description="calibration tokens, drawn as windows spread evenly across all the calibration documents",
    )
    calib_windows: int | None = Field(
        None,
        description="calibration windows (replaces --calib-tokens). Library only (the tests' small conversions); the "
        "command line and recipes say it with --calib-tokens",
        json_schema_extra={"retired": "removed; use --calib-tokens {tokens} ({value} windows of --window {window})"},
    )
    calib_precision: CalibPrecision = Field(
        "bfloat16",
        description="matrix products of the source's forward pass over the calibration windows: bfloat16 "
        "(autocast; the statistics are still summed in float64, held-out and evaluation windows run in float32) "
        "| float32",
    )
    window: int = Field(512, description="tokens per calibration/evaluation window")
    eval_windows: int = Field(8, description="held-out evaluation windows for perplexity")
    dtype: OutputDtype = Field(
        "auto",
        description="dtype of the written checkpoint (auto: the source's torch_dtype; the math runs in "
        "float32/float64 either way)",
    )
    device: str = Field(
        "auto", description="where layers run for calibration and evaluation: auto (a GPU when present) | cpu | cuda[:N]"
    )

    def calibration_windows(self) -> int:
        """Calibration windows of ``window`` tokens: ``calib_windows`` when given, else ``ceil(calib_tokens /
        window)`` (at least 1)."""
        if self.calib_windows is not None:
            return self.calib_windows
        return max(1, -(-self.calib_tokens // max(1, self.window)))

    def with_split(self, pairs: int, strategy: str | None = None, refit: str | None = None) -> ConvertOptions:
        """These options with the RoPE split ``pairs`` (and the rope strategy and ``o_proj`` refit mode, where
        given): one candidate of the search (:mod:`mla_convert.convert.pipeline.rope_split`)."""
        update: dict[str, Any] = {"rope_pairs": pairs}
        if strategy is not None:
            update["rope_strategy"] = strategy
        if refit is not None:
            update["refit_o_proj"] = refit
        return self.model_copy(update=update)

    @model_validator(mode="after")
    def _rank_replaces_budget(self) -> ConvertOptions:
        """A fixed ``kv_lora_rank`` makes the cache size moot (fraction and budget recorded as ``None``); an
        absolute ``cache_budget`` replaces the default fraction (another fraction given too is checked by
        :func:`problems`, the default one given explicitly by
        :func:`~mla_convert.convert.options.resolve.resolve_options`)."""
        if self.kv_lora_rank is not None:
            self.cache_budget = None
            self.cache_fraction = None
        elif self.cache_budget is not None and (
            "cache_fraction" not in self.model_fields_set
            or self.cache_fraction == type(self).model_fields["cache_fraction"].default  # the CLI passes defaults too
        ):
            self.cache_fraction = None
        return self


#: The calibration mixture a conversion reads when neither ``--calib-data`` nor ``--text`` is given: prose, the same
#: prose as chat-templated dialogue (left out for a tokenizer without a chat template) and code, one share each.
#: Chosen by ``benchmarks/calibration_mix.py`` (docs/results.md, calibration-mix): against Wikipedia alone it cut
#: SmolLM2-135M's perplexity on Python from x5.17 to x1.98 of the source's and its chat KL from 1.25 to 0.77, for
#: x2.10 against x1.84 on Wikipedia; on Qwen2.5-Coder-1.5B it cut Python from x17.3 to x3.5.
DEFAULT_CALIB_DATA = ("wikipedia", "wikipedia-chat", "code")

#: Adam steps of the fitted reconstruction where it is on by default (a conversion on a GPU): measured on SmolLM2-135M
#: at 31.25 % with the default mixture (benchmarks/calibration_mix.py, docs/results.md): Wikipedia x2.10 -> x1.82,
#: news x2.47 -> x2.12, Python x1.98 -> x1.71, chat KL 0.774 -> 0.659, and greedy " Paris" back (Qwen2.5-Coder-1.5B:
#: news x5.76 -> x3.52, Python x3.34 -> x2.82, HumanEval 1 -> 2 of the first 20); 200 steps gained
#: little more per layer (held-out error 0.545 -> 0.527 at layer 5) for 4x the time (benchmarks/reconstruct.py).
RECONSTRUCT_STEPS = 50


class SourceShape(Protocol):
    """What the rules need to know of a source (a :class:`~mla_convert.sources.checkpoint.SourceModel`)."""

    @property
    def head_dim(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...


@dataclass(frozen=True)
class Geometry:
    """The KV-cache geometry of one conversion of one source (values per token per layer).

    Attributes:
        rope_heads: ``R``, rope key heads (the KV heads in per-head mode, 1 shared).
        max_rope_pairs: pairs a rope head may keep (``head_dim/2``; in shared mode with the rotation strategy
            every (frequency, component) of all KV heads, ``G head_dim/2``).
        rope_pairs: the pairs asked for, clipped into ``0..max_rope_pairs``.
        rope_width: ``R * 2 * rope_pairs``, the ``k_rope`` part of a cache row.
        nope_width: key components left without RoPE (over all KV heads).
        query_nope_width: the query's NoPE dims per head before any reduction (the checkpoint's
            ``qk_nope_head_dim`` without ``--qk-nope-head-dim``): ``d - 2r`` per-head, ``d + 2r(G-2)`` with one shared
            rope head (per kept frequency the other ``G-1`` mixed components stay NoPE); with the rotation strategy
            the widest a layer can have.
        max_rank: the widest useful latent, ``min(hidden, nope_width + G * head_dim)``.
        source_width: the source's K + V values, ``2 G head_dim``.
        num_layers: layers of the source.
    """

    rope_heads: int
    max_rope_pairs: int
    rope_pairs: int
    rope_width: int
    nope_width: int
    max_rank: int
    query_nope_width: int
    source_width: int
    head_dim: int
    num_layers: int

    def latent_total(self, cache_budget: float) -> int:
        """Latent values over all layers left by ``cache_budget`` (values/token/layer) after the rope part."""
        return round(cache_budget * self.num_layers) - self.rope_width * self.num_layers

    def mean_width(self, options: ConvertOptions) -> float:
        """Mean cache values per token per layer the options give (``d_c + rope_width``)."""
        if options.kv_lora_rank is not None:
            return float(options.kv_lora_rank + self.rope_width)
        budget = options.cache_budget
        if budget is None and options.cache_fraction is not None:
            budget = float(round(options.cache_fraction * self.source_width))
        return (self.latent_total(budget or 0.0) + self.rope_width * self.num_layers) / self.num_layers


def source_width(src: SourceShape) -> int:
    """The source's KV cache per token per layer, ``2 G head_dim`` values (keys and values of every KV head)."""
    return 2 * src.num_kv_heads * src.head_dim


def cache_budget_of(options: ConvertOptions, src: SourceShape) -> float | None:
    """The cache budget ``options`` ask for on ``src``, in values per token per layer: ``cache_budget`` when given,
    else ``cache_fraction`` x :func:`source_width` rounded to a whole value; None with a fixed ``kv_lora_rank``
    (or neither given)."""
    if options.kv_lora_rank is not None:
        return None
    if options.cache_budget is not None:
        return options.cache_budget
    if options.cache_fraction is None:
        return None
    return float(round(options.cache_fraction * source_width(src)))


def geometry(options: ConvertOptions, src: SourceShape) -> Geometry:
    """The cache geometry of ``options`` on ``src`` (no I/O, no torch)."""
    half, g = src.head_dim // 2, src.num_kv_heads
    shared = options.rope_mode == "shared"
    limit = half * g if (shared and options.rope_strategy == "rotation") else half
    pairs = min(max(options.rope_pairs, 0), limit)
    heads = 1 if shared else g
    nope = 2 * half * g - 2 * pairs * heads
    if shared:  # F frequencies hold the kept slots: the query's pair at each is split over the G components
        freqs = min(pairs, half)
        query_nope = 2 * half - 2 * freqs + 2 * freqs * g - 2 * pairs
    else:
        query_nope = 2 * half - 2 * pairs
    return Geometry(
        rope_heads=heads,
        max_rope_pairs=limit,
        rope_pairs=pairs,
        rope_width=heads * 2 * pairs,
        nope_width=nope,
        max_rank=min(src.hidden_size, nope + g * src.head_dim),
        query_nope_width=query_nope,
        source_width=2 * g * src.head_dim,
        head_dim=src.head_dim,
        num_layers=src.num_layers,
    )


def problems(options: ConvertOptions, src: SourceShape | None) -> list[tuple[str, str]]:
    """Every rule ``options`` break, as ``(field, message)``; the message starts with the offending value.

    Without a source only the source-independent rules are checked.
    """
    out: list[tuple[str, str]] = []
    for key in ("calib_tokens", "calib_windows", "window", "eval_windows", "rope_context"):
        if getattr(options, key) is not None and getattr(options, key) < 1:
            out.append((key, f"{getattr(options, key)} is too small: must be at least 1"))
    for spec in options.calib_data or []:
        try:
            parsed = parse_data_spec(spec)
        except TextError as exc:
            out.append(("calib_data", str(exc).removeprefix("--data ")))
            continue
        if parsed.loss != "all":
            out.append(("calib_data", f"{spec!r}: loss= is an adaptation key (adapt --data); drop it here"))
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", options.device):
        out.append(("device", f"{options.device!r} is not one of auto, cpu, cuda, cuda:N"))
    if options.rope_pairs < 0:
        out.append(("rope_pairs", f"{options.rope_pairs} is too small: must be at least 0"))
    if options.qk_nope_head_dim is not None and options.qk_nope_head_dim < 1:
        out.append(("qk_nope_head_dim", f"{options.qk_nope_head_dim} is too small: must be at least 1"))
    if options.kv_lora_rank is not None and options.kv_lora_rank < 1:
        out.append(("kv_lora_rank", f"{options.kv_lora_rank} is too small: must be at least 1"))
    if options.kv_lora_rank is None and options.cache_budget is not None and options.cache_budget <= 0:
        out.append(("cache_budget", f"{options.cache_budget:g} is too small: must be positive"))
    if options.kv_lora_rank is None and options.cache_fraction is not None and not 0 < options.cache_fraction <= 1:
        out.append(("cache_fraction", f"{options.cache_fraction:g} is outside (0, 1]: give the share of the source's "
                    "cache to keep, e.g. 0.3125 for 31.25 %"))
    if options.kv_lora_rank is None and options.cache_budget is None and options.cache_fraction is None:
        out.append(("cache_budget", "is missing: give a cache fraction, a cache budget or a kv_lora_rank"))
    if src is None or out:
        return out  # the source-dependent rules assume the source-free ones hold
    geo = geometry(options, src)
    budget = cache_budget_of(options, src)
    fraction = options.cache_fraction
    if options.cache_budget is not None and fraction is not None and round(fraction * geo.source_width) != round(
        options.cache_budget
    ):
        out.append(("cache_fraction", f"{fraction:g} of the source's {geo.source_width} values is "
                    f"{fraction * geo.source_width:g}, not the --cache-budget {options.cache_budget:g} also given: "
                    "give only one of them"))
        return out
    if not 0 <= options.rope_pairs <= geo.max_rope_pairs:
        out.append(
            (
                "rope_pairs",
                f"{options.rope_pairs} is impossible for {options.rope_mode}/{options.rope_strategy} on this source: "
                f"allowed 0..{geo.max_rope_pairs} (head_dim {src.head_dim} has {src.head_dim // 2} RoPE pairs)",
            )
        )
    if options.qk_nope_head_dim is not None and options.qk_nope_head_dim > geo.query_nope_width:
        out.append(
            (
                "qk_nope_head_dim",
                f"{options.qk_nope_head_dim} is over the query's NoPE width {geo.query_nope_width} these options give "
                f"(head_dim {src.head_dim}, {geo.rope_pairs} rope pairs, {src.num_kv_heads} KV heads): allowed "
                f"1..{geo.query_nope_width}, or leave it out",
            )
        )
    if options.kv_lora_rank is not None:
        if not 1 <= options.kv_lora_rank <= geo.max_rank:
            out.append(
                (
                    "kv_lora_rank",
                    f"{options.kv_lora_rank} is impossible for this source: allowed 1..{geo.max_rank} (at most the "
                    f"non-RoPE key width {geo.nope_width} + value width {src.num_kv_heads * src.head_dim}, and the "
                    f"hidden size {src.hidden_size})",
                )
            )
    elif budget is not None:
        key = "cache_fraction" if options.cache_fraction is not None else "cache_budget"
        asked = (f"{budget:g}" if key == "cache_budget"
                 else f"{options.cache_fraction:g} ({budget:g} of the source's {geo.source_width} values)")
        latent = budget - geo.rope_width
        if latent < 1 or geo.latent_total(budget) < geo.num_layers:
            out.append(
                (
                    key,
                    f"{asked} leaves no latent after {geo.rope_width} RoPE values per token; lower "
                    "the rope pairs or raise the cache size",
                )
            )
        elif latent > geo.max_rank:
            out.append(
                (
                    key,
                    f"{asked} asks for a latent of {latent:g} after {geo.rope_width} RoPE values; at "
                    f"most {geo.max_rank} is possible (source cache {geo.source_width} values)",
                )
            )
    return out


def flag(field: str) -> str:
    """The CLI flag of an option field: ``rope_pairs`` -> ``--rope-pairs``."""
    return "--" + field.replace("_", "-")


def check_options(options: ConvertOptions, src: SourceShape | None) -> None:
    """Raise :class:`OptionsError` listing every broken rule (CLI spelling: ``--rope-pairs 40 is ...``)."""
    found = problems(options, src)
    if found:
        raise OptionsError("; ".join(f"{flag(k)} {msg}" for k, msg in found))
