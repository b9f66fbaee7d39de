"""Before any work: will a conversion with these options export exactly (``--export deepseek-v3 --target T``)?

:func:`export_problems` reads only the source's config and the options (no weights), so ``factor --export``,
``inspect`` and ``run --dry-run`` answer before a tensor is read. Each problem names what breaks exactness and the
options that fix it. What depends on the data (which RoPE pairs a data-driven strategy keeps) is checked again on
the finished checkpoint by :func:`~mla_convert.engines.deepseek_v3.mapping.plan_export`; here a selection that *could* need
more rope slots than an engine target holds is refused with the options that guarantee it.

A source with a static RoPE scaling (``linear``, ``llama3``, ``yarn``; issue 34) exports when the pairs the options
can keep all have their plain frequency ``rope_theta^(-2k/d)``: llama3 and YaRN leave the fastest pairs unscaled
(llama3: wavelength below ``original_max_position_embeddings / high_freq_factor``; YaRN: the band before its ramp),
and a prefix of the plain table is itself a plain table the export's one rope head holds (``rope_theta^(2P/d)``
over ``P`` slots). :func:`steer_for_export` brings ``factor --export`` (and recipes with an export) to such a prefix
where the user did not choose the selection; :func:`export_problems` refuses any other selection with that fix.
The check is :func:`~mla_convert.engines.deepseek_v3.spec.rope_slots` itself, on the source's float32 frequencies from
transformers' own rotary table (``SourceModel.inv_freq``); YaRN's attention factor is folded into ``q_proj`` by the
conversion (docs/math.md contract 3), so it needs nothing of the export.

:func:`engine_table` (the model card's "Where it serves") gives, per engine, the route, whether it computes the
checkpoint's function exactly, and the KV cache it allocates. This module sits in ``convert/`` (below
``export/``) so that the conversion reads it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from mla_convert.engines.deepseek_v3.spec import GEOMETRIC_RTOL, rope_slots
from mla_convert.engines.llamacpp.spec import cache_block_rank
from mla_convert.engines.registry import TARGETS
from mla_convert.engines.vllm.spec import (
    PLUGIN_ROUTE,
    VLLM_CPU_HEAD_DIMS,
    VLLM_GPU_HEAD_DIMS,
    VLLM_KV_LORA_RANK,
    ServeError,
    engine_nope_width,
    served_shape,
)
from mla_convert.errors import ExportError
from mla_convert.mla.algebra import transformers_inv_freq

#: The strategies whose kept pairs follow from the options alone (the others read calibration data).
FIXED_STRATEGIES = ("high", "low", "uniform")


def rope_type(src: Any) -> str:
    """The source's RoPE type (``default``, ``linear``, ``llama3``, ``yarn``) from its config."""
    from mla_convert.sources.checkpoint import rope_parameters

    params = rope_parameters(src.config)
    return str(params.get("rope_type", params.get("type", "default")))


def plain_pairs(src: Any) -> int:
    """How many RoPE pairs, from pair 0 (the fastest) on, keep their plain frequency ``rope_theta^(-2k/d)``.

    Compares ``src.inv_freq`` (``[head_dim/2]`` float32 radians per token, transformers' own rotary table of the
    source's scaling) with the ``default`` table engines compute from ``rope_theta`` (float32), to
    :data:`~mla_convert.engines.deepseek_v3.spec.GEOMETRIC_RTOL` relative. ``head_dim/2`` for an unscaled source; for
    Llama-3-8B's llama3 scaling (theta 5e5, factor 8, high_freq_factor 4, original 8192) 29 of 64; 0 for ``linear``.
    """
    from mla_convert.sources.checkpoint import rope_parameters

    inv = src.inv_freq.double()
    plain = transformers_inv_freq({"rope_type": "default", "rope_theta": rope_parameters(src.config)["rope_theta"]},
                                   inv.numel()).double()
    n = 0
    while n < inv.numel() and abs(float(inv[n] - plain[n])) <= GEOMETRIC_RTOL * float(plain[n]):
        n += 1
    return n


def _may_keep(options: Any, pairs: int, half: int) -> list[int]:
    """Source pairs a shared rope head of ``pairs`` may keep: the fixed strategies' own, any for a data-driven one."""
    if options.rope_strategy in FIXED_STRATEGIES:
        from mla_convert.convert.layer.rope import fixed_pairs

        return fixed_pairs(options.rope_strategy, pairs, half)
    return list(range(half))


def scaled_rope_problem(src: Any, options: Any, target: str) -> str | None:
    """Why a scaled source's conversion with ``options`` could keep a pair no plain rope_theta gives (None: it
    cannot, or the source is not scaled), with the options that fix it.

    The pairs the options may keep (every pair for ``2-norm``/``rotation``) go through
    :func:`~mla_convert.engines.deepseek_v3.spec.rope_slots` with the source's frequencies and the target's slot count
    (32 for ``vllm``/``vllm-cpu``): what ``plan_export`` will check on the finished checkpoint.
    """
    from mla_convert.convert.options.options import geometry

    kind = rope_type(src)
    geo = geometry(options, src)
    half = src.head_dim // 2
    if kind == "default" or geo.rope_heads != 1 or not 0 < geo.rope_pairs <= half:
        return None
    slots = VLLM_GPU_HEAD_DIMS[0][1] // 2 if target != "transformers" else None
    try:
        rope_slots([[[float(src.inv_freq[k]) for k in _may_keep(options, geo.rope_pairs, half)]]], slots)
        return None
    except ExportError:
        pass
    n = plain_pairs(src)
    if n == 0:
        return (f"the source's RoPE is {kind}-scaled and none of its {half} pairs keeps its plain frequency "
                "rope_theta^(-2k/d), so the kept frequencies are not one plain rope_theta table (the only RoPE engines "
                "apply to DeepSeek models) and no export is exact: convert without --export and use the MLA "
                f"checkpoint as is (--target transformers); {PLUGIN_ROUTE}")
    fix = min(geo.rope_pairs, n, slots or n)
    return (f"the source's RoPE is {kind}-scaled: only pairs 0..{n - 1} keep their plain frequency rope_theta^(-2k/d) "
            f"(the one table engines apply to DeepSeek models) and --rope-strategy {options.rope_strategy} with "
            f"{geo.rope_pairs} pairs can keep a scaled one ({PLUGIN_ROUTE}); to export, use --rope-strategy high "
            f"--rope-pairs {fix} (or fewer)")


def steer_for_export(
    src: Any, options: Any, given: Collection[str], target: str
) -> tuple[Any, str | None]:
    """``options`` steered so that an export of a scaled source is exact, and why (one sentence; None: unchanged).

    For a ``linear``/``llama3``/``yarn`` source whose selection could keep a scaled pair
    (:func:`scaled_rope_problem`), the levers the user did not give become ``--rope-strategy high`` and
    ``--rope-pairs min(current, n)``, ``n`` the unscaled pairs (:func:`plain_pairs`): the kept set is then a prefix
    of the plain table. Given levers are kept; when they still break it (or no pair is unscaled) the options are
    returned as they are and :func:`export_problems` refuses them with the fix.

    Args:
        src: the :class:`~mla_convert.sources.checkpoint.SourceModel` (config and ``inv_freq``; no weights).
        options: the :class:`~mla_convert.convert.options.options.ConvertOptions` as shaped so far (after ``--target``).
        given: option names the user gave explicitly (command line or recipe).
        target: the export's ``--target``.
    """
    if scaled_rope_problem(src, options, target) is None:
        return options, None
    from mla_convert.convert.options.options import geometry

    n = plain_pairs(src)
    update: dict[str, Any] = {}
    if "rope_strategy" not in given and options.rope_strategy != "high":
        update["rope_strategy"] = "high"
    if "rope_pairs" not in given and geometry(options, src).rope_pairs > n:
        update["rope_pairs"] = n
    if n == 0 or not update:
        return options, None
    steered = options.model_copy(update=update)
    if scaled_rope_problem(src, steered, target) is not None:
        return options, None
    pairs, half, kind = geometry(steered, src).rope_pairs, src.head_dim // 2, rope_type(src)
    return steered, (
        f"--export of a {kind}-scaled source: --rope-strategy high --rope-pairs {pairs} (pairs 0..{pairs - 1}; "
        f"{kind} leaves only pairs 0..{n - 1} of {half} at their plain frequency, a plain rope_theta table the "
        "DeepSeek-V3 export holds exactly); give --rope-strategy/--rope-pairs to choose otherwise (the export "
        "refuses a selection that can keep a scaled pair)"
    )


def export_problems(src: Any, options: Any, target: str = "transformers", fmt: str = "deepseek-v3") -> list[str]:
    """Reasons a conversion of ``src`` with ``options`` would not export exactly to ``target`` (empty: it will).

    Args:
        src: a :class:`~mla_convert.sources.checkpoint.SourceModel` (config and shapes only).
        options: the :class:`~mla_convert.convert.options.options.ConvertOptions`.
        target: one of :data:`~mla_convert.engines.registry.TARGETS`.
        fmt: ``deepseek-v3`` or ``gguf`` (llama.cpp's ``deepseek2``: the checkpoint's widths, ``--target
            transformers`` only; no attention or MLP bias, SiLU MLP, one plain rope table; float16 is fine there,
            the file keeps ``attn_kv_a_mqa`` float32).
    """
    from mla_convert.convert.options.options import geometry

    if target not in TARGETS:
        return [f"--target {target!r} is not one of {', '.join(TARGETS)} (SGLang: --target vllm)"]
    out: list[str] = []
    gguf = fmt == "gguf"
    if gguf and target != "transformers":
        out.append(f"--export gguf writes the checkpoint's own widths for llama.cpp (any width): drop --target {target}")
    act = getattr(src.config, "hidden_act", "silu")
    if gguf and act != "silu":
        out.append(f"the source MLP uses {act!r}; llama.cpp's deepseek2 computes SiLU only")
    geo = geometry(options, src)
    half = src.head_dim // 2
    if geo.rope_heads != 1:  # the library's per-head mode (factor and recipes have one shared rope head)
        out.append(f"these options give {geo.rope_heads} rope heads (rope_mode per-head); DeepSeek-V3 has one shared "
                   "rope head: use rope_mode shared")
    elif geo.rope_pairs == 0:
        out.append("--rope-pairs 0 leaves no rope head; DeepSeek-V3 has one shared rope head: use --rope-pairs of at "
                   "least 1")
    elif geo.rope_pairs > half:
        out.append(f"--rope-pairs {geo.rope_pairs} keeps some of the {half} frequencies for several KV heads; DeepSeek's "
                   f"one rope head holds each once: use --rope-pairs {half} or fewer")
    biased = [p for p in ("q", "k", "v", "o") if src.family.has_bias(p, src.config)]
    if biased:
        where = ("llama.cpp's deepseek2 attention has no biases; no GGUF export is exact (convert without --export, "
                 "then `mla-convert export OUT OUT.gguf --format gguf --drop-attention-biases` writes a lossy one and "
                 "prints its cost)" if gguf else "the DeepSeek-V3 files hold no attention bias (one file for every "
                 "engine, and vLLM and SGLang build DeepSeek attention without biases, dropping them silently), so no "
                 "DeepSeek-V3 export is exact; transformers runs the MLA checkpoint itself (mla-convert generate / "
                 f"eval), and {PLUGIN_ROUTE}")
        out.append(f"the source has attention biases ({', '.join(p + '_proj' for p in biased)}): {where}")
    if getattr(src.config, "mlp_bias", False):
        out.append("the source MLP has biases; DeepSeek-V3's dense MLP has none")
    scaled = rope_type(src) != "default"
    problem = scaled_rope_problem(src, options, target)
    if problem:
        out.append(problem)
    if options.dtype == "float16" and not gguf:
        out.append("--dtype float16 cannot hold the bias-free latent norm of the export; use --dtype bfloat16")
    if target != "transformers":
        slots = VLLM_GPU_HEAD_DIMS[0][1] // 2
        if half > slots and not scaled and not (options.rope_strategy == "high" and geo.rope_pairs <= slots):
            out.append(f"--target {target}'s rope head holds {slots} frequencies of one table and this source has "
                       f"{half}: a per-layer selection can span more; use --rope-strategy high --rope-pairs "
                       f"{min(slots, max(geo.rope_pairs, 1))} (or --target transformers)")
        shapes = VLLM_GPU_HEAD_DIMS if target == "vllm" else VLLM_CPU_HEAD_DIMS
        accepted = ", ".join(f"{a}/{c}" for a, _, c in shapes)
        # the query's real NoPE width: d + 2r(G-2) with one shared rope head, or --qk-nope-head-dim
        width = geo.query_nope_width if options.qk_nope_head_dim is None else options.qk_nope_head_dim
        if not any(src.head_dim <= v for *_, v in shapes):
            out.append(f"head_dim {src.head_dim} is wider than every value head --target {target} accepts "
                       f"({accepted}); use --target transformers")
        elif not any(width <= nope and src.head_dim <= v for nope, _, v in shapes):
            fix = engine_nope_width(target, src.head_dim, options.kv_lora_rank)
            exact = fix is not None and fix >= min(src.head_dim, options.kv_lora_rank or src.head_dim)
            origin = ("--qk-nope-head-dim" if options.qk_nope_head_dim is not None else
                      f"head_dim {src.head_dim} + 2 x {geo.rope_pairs} pairs x ({src.num_kv_heads} KV heads - 2)")
            out.append(f"the query's NoPE width {width} ({origin}) is wider than every qk_nope/v_head shape "
                       f"--target {target} accepts ({accepted}): use --qk-nope-head-dim {fix} (a per-head "
                       f"low-rank of the NoPE score, {'exact here' if exact else 'lossy'}) or --target transformers")
        if options.kv_lora_rank is not None and options.kv_lora_rank > VLLM_KV_LORA_RANK:
            out.append(f"--kv-lora-rank {options.kv_lora_rank} is over {VLLM_KV_LORA_RANK}, the latent vLLM's MLA "
                       "backends take")
    return out


def served_cache(src: Any, options: Any, target: str) -> tuple[float, float]:
    """``(MLA checkpoint, engine)`` cache values per token per layer of a conversion with ``options`` exported to
    ``target``: the engine targets allocate ``512 + 64``; ``transformers`` at least the checkpoint's (per-layer ranks
    are padded to the largest, known only after the conversion)."""
    from mla_convert.convert.options.options import cache_budget_of, geometry

    geo = geometry(options, src)
    mla = float(options.kv_lora_rank + geo.rope_width) if options.kv_lora_rank is not None else float(cache_budget_of(options, src) or 0)
    if target == "transformers":
        return mla, mla
    return mla, float(VLLM_KV_LORA_RANK + VLLM_GPU_HEAD_DIMS[0][1])


def export_lines(src: Any, options: Any, given: Collection[str] = ()) -> list[str]:
    """One line per target: ``exact`` or the first reason it is not, and the cache the engine allocates against
    the MLA checkpoint's and the source's (``inspect``, ``run --dry-run``). For a scaled source whose options
    ``--export`` would steer (:func:`steer_for_export`; ``given``: the options the user gave), the steered
    selection is what the line checks, and it says so."""
    from mla_convert.convert.options.options import geometry

    source = geometry(options, src).source_width
    lines = []
    for target in TARGETS:
        steered, why = steer_for_export(src, options, given, target)
        problems = export_problems(src, steered, target)
        mla, served = served_cache(src, steered, target)
        # one rank and the fastest pairs (--target llama.cpp's shape): nothing is padded, the row is known now
        exact_row = steered.kv_lora_rank is not None and steered.rope_strategy == "high"
        at_least = "at least " if target == "transformers" and not exact_row else ""
        cache = (f"engine cache {at_least}{served:g} values/token/layer (MLA {mla:g}, source {source}"
                 + ("; per-layer ranks are padded to the largest)" if at_least else ")"))
        steer = ""
        if why:
            geo = geometry(steered, src)
            steer = (f" with --rope-strategy high --rope-pairs {geo.rope_pairs}, which --export steers to (pairs "
                     f"0..{plain_pairs(src) - 1} are the ones {rope_type(src)} leaves unscaled)")
        lines.append(f"  --export deepseek-v3 --target {target}: "
                     + (f"exact{steer}; {cache}" if not problems else "not exact: " + problems[0]))
        if target == "transformers":  # llama.cpp: the same widths, K-only cache
            gguf = export_problems(src, steered, target, "gguf")
            # --cache-block 32 (the GGUF default) pads a latent or row that is not whole blocks of 32
            blocks = exact_row and (steered.kv_lora_rank or 1) % 32 == 0 and served % 32 == 0
            gguf_at_least = "" if blocks else "at least "
            gguf_line = ("  --export gguf (llama.cpp deepseek2): " + (
                f"exact{steer}; K-only cache {gguf_at_least}{served:g} values/token/layer (MLA {mla:g}, source {source}"
                + (("; the latent padded to whole blocks of 32 for llama.cpp's quantized caches)" if exact_row else
                    "; per-layer ranks are padded to the largest, then to whole blocks of 32 for llama.cpp's quantized "
                    f"caches; factor --target llama.cpp spends a {served:g}-value row as one rank and the fastest "
                    "pairs instead)") if gguf_at_least else ")") if not gguf else "not exact: " + gguf[0]))
    lines.append(gguf_line)
    lines.append(plugin_line(src, options))
    return lines


def plugin_line(src: Any, options: Any) -> str:
    """The ``inspect`` line of vLLM's plugin route (:mod:`mla_convert.engines.vllm.plugin`): the checkpoint served as
    written, biases and scaled RoPE included, or the first reason vLLM's CPU backends cannot take its widths
    (:func:`~mla_convert.engines.vllm.spec.served_shape` on the shape ``options`` give, the mean latent standing for
    the per-layer ranks, which are allocated only by the conversion)."""
    from types import SimpleNamespace

    from mla_convert.convert.options.options import cache_budget_of, geometry

    geo = geometry(options, src)
    latent = options.kv_lora_rank or max(1, round((cache_budget_of(options, src) or 0) - geo.rope_width))
    shape = SimpleNamespace(
        kv_lora_rank=[latent],
        num_hidden_layers=1,
        num_rope_heads=geo.rope_heads,
        qk_rope_head_dim=2 * geo.rope_pairs,
        v_head_dim=src.head_dim,
        qk_nope_head_dim=options.qk_nope_head_dim or geo.query_nope_width,
    )
    head = "  vLLM plugin (the MLA folder served as written, no export; biases and scaled RoPE too): "
    try:
        served = served_shape(shape, "vllm-cpu")
    except ServeError as exc:
        return head + f"not served on vLLM's CPU build: {exc}"
    mla = latent + geo.rope_width
    ranks = "; per-layer ranks over 512 are refused at load" if options.kv_lora_rank is None and latent > 256 else ""
    return (head + f"exact on vLLM's CPU build; engine cache {served.cache_width} values/token/layer (MLA {mla:g}, "
            f"source {geo.source_width}{ranks}); its GPU backends not run")


def engine_rows(src: Any, options: Any, config: Any) -> list[tuple[str, str, str, str]]:
    """``(engine, route, exact or why not, cache values per token per layer)`` for transformers, vLLM through a
    DeepSeek-V3 export, vLLM through mla-convert's plugin and llama.cpp through a GGUF export.

    Args:
        src: the :class:`~mla_convert.sources.checkpoint.SourceModel` converted (config and shapes).
        options: the :class:`~mla_convert.convert.options.options.ConvertOptions` it was converted with.
        config: the checkpoint's :class:`~mla_convert.mla.configuration.MLAConfig` (its real per-layer ranks).
    """
    widths = list(config.cache_width)
    rope = int(config.num_rope_heads) * int(config.qk_rope_head_dim)
    ranks = config.kv_lora_rank if isinstance(config.kv_lora_rank, list) else [config.kv_lora_rank] * len(widths)
    padded = max(ranks) + rope

    def verdict(problems: list[str]) -> str:
        """The first reason, without the plugin route the refusals name (the plugin has its own row)."""
        if not problems:
            return "exact"
        reason = problems[0]
        for joint in (f", but {PLUGIN_ROUTE}", f"; {PLUGIN_ROUTE}", f" ({PLUGIN_ROUTE})", PLUGIN_ROUTE):
            reason = reason.replace(joint, "")
        return "not exact: " + reason.rstrip(" ;,")

    rows = [
        (
            "transformers",
            "`import mla_convert`, then `AutoModelForCausalLM.from_pretrained(CKPT)`",
            "exact (this checkpoint)",
            f"{sum(widths) / len(widths):g} (mean of the per-layer rows)",
        )
    ]
    rows.append(
        (
            "vLLM (DeepSeek-V3 export)",
            "`mla-convert export CKPT OUT --target vllm-cpu` (or `vllm`)",
            verdict(export_problems(src, options, "vllm-cpu")),
            "576 (512 + 64)",
        )
    )
    try:
        served = served_shape(config, "vllm-cpu")
        plugin, cache = "exact on vLLM's CPU build (its GPU backends not run)", f"{served.cache_width}"
    except ServeError as exc:
        plugin, cache = f"not served: {exc}", "-"
    rows.append(
        (
            "vLLM (mla-convert plugin)",
            "`pip install --no-deps mla-convert` into vLLM's environment, then serve CKPT (docs/serving.md)",
            plugin,
            cache,
        )
    )
    gguf = export_problems(src, options, "transformers", "gguf")
    block = cache_block_rank(max(ranks), rope, 32)
    row = (f"{padded} (f16 cache); {block + rope} with its quantized caches (whole blocks of 32)" if block is not None
           else f"{padded} (f16 / bf16 / f32 caches: a rope key of {rope} is not whole blocks of 32, as its quantized "
           "caches need)")
    rows.append(
        (
            "llama.cpp (GGUF export)",
            "`mla-convert export CKPT OUT.gguf --format gguf`",
            verdict(gguf),
            row if not gguf else "-",
        )
    )
    return rows


def engine_table(src: Any, options: Any, config: Any) -> str:
    """:func:`engine_rows` as a markdown table (the model card's "Where it serves")."""
    head = "| engine | route | function | KV cache values/token/layer |\n|---|---|---|---|\n"
    return head + "".join(f"| {' | '.join(r)} |\n" for r in engine_rows(src, options, config))
