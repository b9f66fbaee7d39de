"""The one resolution of a conversion's options for a source: what ``factor``, ``inspect``, recipes and the library run.

Options as given (on the command line, in a recipe, or as a :class:`ConvertOptions` built in Python) leave some
choices open: the cache size (a fraction of the source's cache by default), the RoPE split and the levers (from
measurements, where not given), and the shape an engine ``--target`` serves. :func:`resolve_options` fixes all of
them in one order, so ``ConvertOptions(cache_budget=72)`` converts as ``factor --cache-budget 72`` does:

0. the calibration text: without ``--calib-data`` and ``--text``, the default mixture of prose, chat-templated prose
   and code (:data:`~mla_convert.convert.options.options.DEFAULT_CALIB_DATA`), written into ``calib_data``;
1. the cache size: ``--kv-lora-rank``, else ``--cache-budget``, else ``--cache-fraction`` x the source's
   ``2 G head_dim`` values (:func:`~mla_convert.convert.options.options.cache_budget_of`), written into ``cache_budget``;
2. an engine target's shape (:func:`~mla_convert.engines.vllm.shape.shape_for_engine`), unless the user gave their own;
   for ``--target llama.cpp`` the cache size is llama.cpp's served row, spent as one rank and a plain rope head
   (:func:`~mla_convert.engines.llamacpp.shape.shape_for_llamacpp`; refuses what llama.cpp cannot run exactly);
3. the RoPE split and levers measured best for the budget where not given
   (:func:`~mla_convert.convert.options.suggest.follow_budget`: measured on another model, a prior, and said so); the
   split's pairs are then measured on the source itself among candidates around that prior
   (:func:`~mla_convert.convert.options.candidates.rope_candidates`), and the rope strategy and ``o_proj`` refit mode
   too where not given (the conversion chooses, before converting); for a source of 4 or more KV heads the query's
   NoPE width bounded at ``head_dim``, exactly (:func:`bound_nope_width`), unless ``--qk-nope-head-dim`` is given;
4. with an export asked for, a scaled-RoPE source's selection steered to the pairs one plain RoPE table holds
   (:func:`~mla_convert.engines.precheck.steer_for_export`);
5. the fitted reconstruction, where ``--reconstruct-steps`` is not given: on for a conversion on a GPU, off on a CPU
   (:func:`default_reconstruction`).

Each choice's origin is recorded (:attr:`Resolution.choices`, the manifest's ``choices``). Config and tokenizer files
only: no weights; torch only to ask whether ``--device auto`` has a GPU (:func:`on_accelerator`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from mla_convert.convert.options.options import (
    DEFAULT_CALIB_DATA,
    RECONSTRUCT_STEPS,
    ConvertOptions,
    OptionsError,
    SourceShape,
    cache_budget_of,
    geometry,
    source_width,
)

#: The options whose origin a resolution records (the others are taken as given or at their defaults).
CHOSEN = ("cache_budget", "kv_lora_rank", "rope_mode", "rope_strategy", "rope_pairs", "refit_o_proj", "qk_nope_head_dim")


@dataclass(frozen=True)
class Resolution:
    """Options with every choice fixed, why the rules chose what they chose, and where each choice came from.

    Attributes:
        options: the options a conversion runs (``cache_budget`` in values per token per layer, or
            ``kv_lora_rank``; the RoPE split and levers fixed).
        why: sentences for the user (joined by ``"; "``), None when nothing was chosen for them.
        choices: option name -> its origin: ``"given"``, ``"default"``, or the rule that chose it.
        rope_candidates: the RoPE pairs the conversion measures on the source before converting
            (:mod:`mla_convert.convert.pipeline.rope_split`), ``options.rope_pairs`` (the prior) among them; empty: the
            pairs are fixed (given, an engine's row, a fixed ``kv_lora_rank``, a steered
            export selection).
        rope_strategies: the other rope strategies the conversion measures at the pairs it chose (with
            ``rope_candidates`` only, where ``--rope-strategy`` is not given); ``options.rope_strategy`` is the
            prior.
        refit_modes: the other ``o_proj`` refit modes the conversion measures at the split it chose (with
            ``rope_candidates`` only, where ``--refit-o-proj`` is not given and the prior refits);
            ``options.refit_o_proj`` is the prior.
        reconstruction: whether the fitted reconstruction runs and why, for the user ('' where
            ``--reconstruct-steps`` is given): :func:`default_reconstruction`.
    """

    options: ConvertOptions
    why: str | None
    choices: dict[str, str] = field(default_factory=dict)
    rope_candidates: tuple[int, ...] = ()
    rope_strategies: tuple[str, ...] = ()
    refit_modes: tuple[str, ...] = ()
    reconstruction: str = ""


def expected_measurements(res: Resolution) -> int:
    """The splits a conversion with ``res`` is expected to convert on the held-out windows: the prior and its
    neighbours on the ladder, each other strategy and each other refit mode (a local search that walks on
    measures more)."""
    ladder = res.rope_candidates
    if len(ladder) < 2:
        return 1
    at = ladder.index(res.options.rope_pairs)
    return len(ladder[max(0, at - 1) : at + 2]) + len(res.rope_strategies) + len(res.refit_modes)


def check_sizes_given(options: ConvertOptions, given: Collection[str]) -> None:
    """Refuse cache sizes given together that replace each other (no source needed: the CLI asks before any I/O).

    Raises:
        OptionsError: two of ``--cache-fraction``, ``--cache-budget``, ``--kv-lora-rank`` given (one line).
    """
    if "cache_fraction" in given and "cache_budget" in given:
        raise OptionsError(
            f"--cache-fraction and --cache-budget {options.cache_budget:g} both given: the budget is an absolute size "
            "that replaces the fraction; give only one of them"
        )
    if "cache_budget" in given and "kv_lora_rank" in given:
        raise OptionsError(
            f"--cache-budget and --kv-lora-rank {options.kv_lora_rank} both given: "
            "--kv-lora-rank fixes one latent width for every layer and replaces the budget; give only one of them"
        )
    if "cache_fraction" in given and "kv_lora_rank" in given:
        raise OptionsError(
            f"--cache-fraction and --kv-lora-rank {options.kv_lora_rank} both given: "
            "--kv-lora-rank fixes one latent width for every layer and replaces the fraction; give only one of them"
        )


def _calibration(options: ConvertOptions, src: SourceShape, given: Collection[str]) -> tuple[ConvertOptions, str]:
    """Step 0: the calibration text. Neither ``--calib-data`` nor ``--text`` given: the default mixture
    (:data:`~mla_convert.convert.options.options.DEFAULT_CALIB_DATA`, its chat part left out where the source's
    tokenizer has no chat template), written into ``calib_data``; returns the options and the choice's origin ('' when
    the options name their calibration text)."""
    from mla_convert.text.chats import CHAT_CORPORA, has_chat_template

    if options.calib_data is not None or "calib_data" in given or "text" in given:
        return options, ""
    chat = has_chat_template(getattr(src, "path", None))
    mixture = [s for s in DEFAULT_CALIB_DATA if chat or s not in CHAT_CORPORA]
    left = "" if chat else " (wikipedia-chat left out: the tokenizer has no chat template)"
    return (
        options.model_copy(update={"calib_data": mixture}),
        f"default: {' + '.join(mixture)}, one share each{left} (benchmarks/calibration_mix.py)",
    )


#: The KV heads ``G`` from which a default conversion bounds the query's NoPE width (:func:`bound_nope_width`).
NOPE_BOUND_KV_HEADS = 4
#: The origin of a bounded ``qk_nope_head_dim`` (``Resolution.choices``; the manifest's ``choices``).
NOPE_BOUND = (
    f"default: bounded at head_dim for {NOPE_BOUND_KV_HEADS} or more KV heads (exact: each head's NoPE score has rank "
    "at most head_dim; benchmarks/nope_rank.py)"
)


def bound_nope_width(options: ConvertOptions, src: SourceShape, given: Collection[str]) -> tuple[ConvertOptions, str]:
    """The query's NoPE width bounded at ``head_dim`` for a wide-GQA source (issue 51; docs/math.md §NoPE-width
    reduction), unless ``--qk-nope-head-dim`` is given.

    With one shared rope head each query head's NoPE width is ``d + 2r(G-2)`` (``Geometry.query_nope_width``): 512
    to 896 on Llama-3-8B (``G = 8`` KV heads, ``d = 128``), which makes ``q_proj`` 5-8x the source's and the converted
    model larger than its cache saving up to ~80k cached tokens (``mla_convert.convert.estimate.weights``). Each
    head's NoPE score is a function of its ``head_dim`` source query values, so its rank is at most ``head_dim`` and
    the reduction to ``head_dim`` (:mod:`mla_convert.convert.layer.nope_rank`) keeps it exactly (to rounding;
    ``tests/convert/test_nope_oracle.py``): the bound costs no quality, and the RoPE pairs are still searched under it.
    Applied from :data:`NOPE_BOUND_KV_HEADS` KV heads on, where the width is over ``2d`` at the pairs measured best;
    below (SmolLM2's 3: 112 against 64; 2 or 1 KV head: at most ``d``) the query is left as it is.

    Returns:
        The options (``qk_nope_head_dim`` set, or unchanged) and the reason for the user ('' when unchanged).
    """
    if "qk_nope_head_dim" in given or options.qk_nope_head_dim is not None or options.rope_mode != "shared":
        return options, ""
    if src.num_kv_heads < NOPE_BOUND_KV_HEADS:
        return options, ""
    natural = geometry(options, src).query_nope_width
    if natural <= src.head_dim:
        return options, ""
    return options.model_copy(update={"qk_nope_head_dim": src.head_dim}), (
        f"the query's NoPE width {natural} (head_dim {src.head_dim} + 2 x {options.rope_pairs} pairs x "
        f"({src.num_kv_heads} KV heads - 2)) is bounded at --qk-nope-head-dim {src.head_dim}, exact (each head's "
        "NoPE score has rank at most head_dim), so q_proj stays near the source's size"
    )


#: The origin of a fitted reconstruction on by default (``Resolution.choices``; the manifest's ``choices``).
RECONSTRUCT_ON = (
    f"default on a GPU: {RECONSTRUCT_STEPS} steps (by FLOPs well under a minute per billion parameters there; "
    "benchmarks/calibration_mix.py measured the gain)"
)


def on_accelerator(device: str) -> bool:
    """Whether ``--device`` runs the conversion on a GPU: ``cuda[:N]``, or ``auto`` where torch sees one (the one
    place a resolution asks torch anything; ``cpu`` and ``cuda`` are answered without it)."""
    if device != "auto":
        return device.startswith("cuda")
    import torch

    return bool(torch.cuda.is_available())


def default_reconstruction(options: ConvertOptions, given: Collection[str]) -> tuple[ConvertOptions, str, str]:
    """The fitted reconstruction (issue 50, Required 4) where ``--reconstruct-steps`` is not given: on where it pays
    for itself, off where it costs as much as the rest of the conversion or more.

    Measured on SmolLM2-135M at 31.25 % (docs/results.md, calibration-mix and reconstruct): 50 steps cut the default's
    perplexity on Wikipedia from x2.10 to x1.82 and on news from x2.47 to x2.12 of the source's, the chat KL from
    0.774 to 0.659, and gave back the greedy " Paris"; on Qwen2.5-Coder-1.5B, Wikipedia x3.04 -> x2.19, news x5.76 ->
    x3.52, Python x3.34 -> x2.82, chat KL 0.775 -> 0.594, HumanEval 1 -> 2 of the first 20. On the reference CPU it costs 11 min against the 7 of the rest
    of that conversion, its search included (35 min against 36 on Qwen2.5-Coder-1.5B, ~4 h on an 8B shape:
    :func:`~mla_convert.convert.estimate.estimate_time.factor_time`), so a CPU conversion leaves it off and says how
    to ask for it. On a GPU it is ~1e15 FLOP for an 8B (a minute or less of float32 throughput, an estimate by
    FLOPs: no GPU run is recorded yet), so it is on.

    Returns:
        The options (``reconstruct_steps`` an int), its origin for ``choices`` ('' when off by default: absent from
        the manifest's choices, as before the step existed) and what the user is told (``Resolution.reconstruction``;
        '' when given).
    """
    if options.reconstruct_steps is not None:
        return options, ("given" if "reconstruct_steps" in given else "default"), ""
    if on_accelerator(options.device):
        return options.model_copy(update={"reconstruct_steps": RECONSTRUCT_STEPS}), RECONSTRUCT_ON, (
            f"on: {RECONSTRUCT_STEPS} Adam steps per lossy layer, each layer's fit kept where its held-out error falls "
            f"(the conversion runs on a GPU: --device {options.device}; --reconstruct-steps 0 turns it off)"
        )
    where = "--device cpu" if options.device == "cpu" else f"--device {options.device} finds no GPU here"
    return options.model_copy(update={"reconstruct_steps": 0}), "", (
        f"off: the conversion runs on the CPU ({where}), where the fit costs as much as the rest of the conversion "
        f"or more; --reconstruct-steps {RECONSTRUCT_STEPS} asks for it (news perplexity x2.47 -> x2.12 of the source's "
        "on SmolLM2, x5.76 -> x3.52 on Qwen2.5-Coder-1.5B; inspect with it estimates its time). On a GPU it runs by "
        "default"
    )


def _budget(options: ConvertOptions, src: SourceShape, given: Collection[str]) -> tuple[ConvertOptions, str]:
    """Step 1: the cache size in values per token per layer, and its origin."""
    check_sizes_given(options, given)
    if options.kv_lora_rank is not None:
        return options, "given (--kv-lora-rank)"
    width = source_width(src)
    if options.cache_budget is not None:
        if options.cache_fraction is not None:
            return options, f"--cache-fraction {options.cache_fraction:g} of the source's {width} values"
        return options, "given (--cache-budget)"
    budget = cache_budget_of(options, src)
    if budget is None:
        return options, "missing"
    origin = "given" if "cache_fraction" in given else "default"
    return (
        options.model_copy(update={"cache_budget": budget}),
        f"--cache-fraction {options.cache_fraction:g} ({origin}) of the source's {width} values",
    )


def resolve_options(
    options: ConvertOptions,
    src: SourceShape,
    target: str = "transformers",
    given: Collection[str] | None = None,
    export: str | None = None,
) -> Resolution:
    """Fix every open choice of ``options`` for ``src`` (module docstring), the same for every caller.

    Args:
        options: the options as parsed (defaults filled in).
        src: the source's shape (config only).
        target: ``transformers`` | ``vllm`` | ``vllm-cpu`` | ``llama.cpp``
            (:data:`~mla_convert.engines.registry.SHAPE_TARGETS`).
        given: the option names the user set (typed on the command line, a recipe's keys with a value); default:
            the fields a Python caller passed with a value other than None (``options.model_fields_set``).
        export: the export format asked for (``--export``), None for none: a scaled-RoPE source's selection is
            then steered to pairs one plain RoPE table holds (:func:`~mla_convert.engines.precheck.steer_for_export`).

    Returns:
        The :class:`Resolution`; its options still need :func:`~mla_convert.convert.options.options.check_options`.

    Raises:
        OptionsError: options that contradict each other (``--cache-budget`` with ``--kv-lora-rank``), or an
            engine target's shape (``--rope-mode per-head`` for vLLM, ...).
    """
    from mla_convert.convert.options.candidates import rope_candidates
    from mla_convert.convert.options.suggest import follow_budget, measured_rope_pairs
    from mla_convert.engines.llamacpp.shape import LLAMACPP, shape_for_llamacpp
    from mla_convert.engines.vllm.shape import shape_for_engine
    from mla_convert.engines.vllm.spec import ENGINE_ROWS

    if given is None:  # a Python caller: the fields it passed, None meaning "not set"
        given = {k for k in options.model_fields_set if getattr(options, k) is not None}
    given = set(given)
    options, budget_origin = _budget(options, src, given)
    options, calibration = _calibration(options, src, given)
    whys: list[str] = []
    choices = {k: ("given" if k in given else "default") for k in CHOSEN}
    choices["cache_budget"] = budget_origin
    if calibration:
        choices["calib_data"] = calibration
    shaped = False
    candidates: tuple[int, ...] = ()
    if target == LLAMACPP:
        from mla_convert.convert.options.suggest import measured_levers

        levers = measured_levers(options, src, given)  # the o_proj refit measured best at the row's size
        options, row_why, chosen = shape_for_llamacpp(options, src, given, budget_origin)
        whys.append(row_why)
        choices.update(chosen)
        if levers and "refit_o_proj" in levers[0]:
            options = options.model_copy(update={"refit_o_proj": levers[0]["refit_o_proj"]})
            choices["refit_o_proj"] = "measured best for the budget on another model (a prior: measured_splits.json)"
        shaped = True
    elif target in ENGINE_ROWS:
        engine, why = shape_for_engine(options, src, target, given)
        if why:
            whys.append(why)
        if engine is not options:
            shaped = True
            for k in ("rope_mode", "rope_strategy", "rope_pairs", "kv_lora_rank", "cache_budget", "qk_nope_head_dim"):
                if k not in given and getattr(engine, k) != getattr(options, k):
                    choices[k] = f"--target {target} (the engine's row)"
            options = engine
    if not shaped:
        before = options
        options, split = follow_budget(options, src, given)
        if split:
            whys.append(split)
        options, bounded = bound_nope_width(options, src, given)
        if bounded:
            whys.append(bounded)
            choices["qk_nope_head_dim"] = NOPE_BOUND
        prior = "measured best for the budget on another model (a prior: measured_splits.json)"
        if "rope_pairs" not in given and measured_rope_pairs(before, src) is not None:
            choices["rope_pairs"] = prior
            budget = cache_budget_of(options, src)
            if budget is not None:
                candidates = rope_candidates(options, src, budget)
        for k in ("rope_strategy", "refit_o_proj"):
            if getattr(options, k) != getattr(before, k):
                choices[k] = prior
    if export:
        from mla_convert.engines.precheck import scaled_rope_problem, steer_for_export

        before = options
        held = "transformers" if target == LLAMACPP else target
        options, steer = steer_for_export(src, options, given, held)
        candidates = tuple(  # only splits the export holds
            c for c in candidates
            if scaled_rope_problem(src, options.model_copy(update={"rope_pairs": c}), held) is None
        )
        if steer:
            whys.append(steer)
        for k in ("rope_strategy", "rope_pairs"):
            if getattr(options, k) != getattr(before, k):
                choices[k] = f"--export {export} (the pairs a plain RoPE table holds for this scaled source)"
                candidates = ()  # the steered selection is the one an export holds
    strategies: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    if len(candidates) > 1:
        listed = ", ".join(map(str, candidates))
        choices["rope_pairs"] = (
            f"{SEARCHED}: the lowest held-out KL in a local search over --rope-pairs {listed} from "
            f"the prior (the prior {options.rope_pairs}: {choices['rope_pairs']})"
        )
        if "rope_strategy" not in given:
            strategies = _other_strategies(options, src, export, target)
        if strategies:
            choices["rope_strategy"] = (
                f"{SEARCHED} at the pairs chosen: the lower held-out KL of --rope-strategy "
                f"{', '.join((options.rope_strategy, *strategies))} (the prior {options.rope_strategy}: "
                f"{choices['rope_strategy']})"
            )
        if "refit_o_proj" not in given and options.refit_o_proj in REFIT_MODES:
            modes = tuple(m for m in REFIT_MODES if m != options.refit_o_proj)
            choices["refit_o_proj"] = (
                f"{SEARCHED} at the split chosen: the lower held-out KL of --refit-o-proj "
                f"{', '.join((options.refit_o_proj, *modes))} (the prior {options.refit_o_proj}: "
                f"{choices['refit_o_proj']})"
            )
        also = f" and --rope-strategy {', '.join(strategies)} at the best pairs" if strategies else ""
        also += f", --refit-o-proj {', '.join(modes)} at the best split" if modes else ""
        whys.append(f"the conversion searches --rope-pairs {listed} from {options.rope_pairs} (its neighbours first, "
                    f"the others only while the best is at an edge){also} on this source (KL on held-out windows) and "
                    "converts the best")
    else:
        candidates = ()
    options, fitted, fit_why = default_reconstruction(options, given)
    if fitted and options.reconstruct_steps:  # off by default: absent from choices, as before the step existed
        choices["reconstruct_steps"] = fitted
    why = "; ".join(whys) if whys else None
    return Resolution(options, why, choices, candidates, strategies, modes, fit_why)


#: How a choice the conversion measures on the source begins (``Resolution.choices``; the manifest's ``choices``):
#: the option's value in the manifest is then the search's winner, not the prior resolved before it.
SEARCHED = "measured on this source"

#: The ``o_proj`` refit modes a conversion measures against its prior (where the prior refits at all).
REFIT_MODES = ("teacher", "sequential")
#: The rope strategies a conversion measures against its prior (the ones measured best at some cache size:
#: measured_splits.json).
MEASURED_STRATEGIES = ("2-norm", "rotation")


def _other_strategies(options: ConvertOptions, src: SourceShape, export: str | None, target: str) -> tuple[str, ...]:
    """The strategies of :data:`MEASURED_STRATEGIES` other than ``options``' that keep its pairs on ``src`` (and,
    with ``export``, that a scaled source's export holds)."""
    from mla_convert.engines.precheck import scaled_rope_problem

    out = []
    for s in MEASURED_STRATEGIES:
        alt = options.model_copy(update={"rope_strategy": s})
        if s == options.rope_strategy or geometry(alt, src).rope_pairs != options.rope_pairs:
            continue
        if export and scaled_rope_problem(src, alt, "transformers" if target == "llama.cpp" else target):
            continue
        out.append(s)
    return tuple(out)
