"""Before any work: will a conversion with these options export exactly (``--export deepseek-v3 --target T``)?

:func:`export_problems` reads only the source's config and the options (no weights), so ``factor --export``,
``inspect`` and ``run --dry-run`` answer before a tensor is read. Each problem names what breaks exactness and the
options that fix it. What depends on the data (which RoPE pairs a data-driven strategy keeps) is checked again on
the finished checkpoint by :func:`~mla_convert.export.deepseek_v3.plan_export`; here a selection that *could* need
more rope slots than an engine target holds is refused with the options that guarantee it.
"""

from __future__ import annotations

from typing import Any

from mla_convert.export.deepseek_v3 import TARGETS, VLLM_CPU_HEAD_DIMS, VLLM_GPU_HEAD_DIMS, VLLM_KV_LORA_RANK


def export_problems(src: Any, options: Any, target: str = "transformers") -> list[str]:
    """Reasons a conversion of ``src`` with ``options`` would not export exactly to ``target`` (empty: it will).

    Args:
        src: a :class:`~mla_convert.sources.checkpoint.SourceModel` (config and shapes only).
        options: the :class:`~mla_convert.convert.options.ConvertOptions`.
        target: one of :data:`~mla_convert.export.deepseek_v3.TARGETS`.
    """
    from mla_convert.convert.engine import engine_nope_width
    from mla_convert.convert.options import geometry
    from mla_convert.sources.checkpoint import rope_parameters

    if target not in TARGETS:
        return [f"--target {target!r} is not one of {', '.join(TARGETS)} (SGLang: --target vllm)"]
    out: list[str] = []
    geo = geometry(options, src)
    half = src.head_dim // 2
    if geo.rope_heads != 1 or geo.rope_pairs == 0:
        out.append(f"these options give {geo.rope_heads} rope heads with {geo.rope_pairs} pairs each; DeepSeek-V3 has "
                   "one shared rope head: use --rope-mode shared (with --rope-pairs of at least 1)")
    elif geo.rope_pairs > half:
        out.append(f"--rope-pairs {geo.rope_pairs} keeps some of the {half} frequencies for several KV heads; DeepSeek's "
                   f"one rope head holds each once: use --rope-pairs {half} or fewer")
    biased = [p for p in ("q", "k", "v", "o") if src.family.has_bias(p, src.config)]
    if biased:
        out.append(f"the source has attention biases ({', '.join(p + '_proj' for p in biased)}): vLLM and SGLang build "
                   "DeepSeek attention without biases and drop them silently; no DeepSeek-V3 export is exact there")
    if getattr(src.config, "mlp_bias", False):
        out.append("the source MLP has biases; DeepSeek-V3's dense MLP has none")
    rope = rope_parameters(src.config)
    if rope.get("rope_type", "default") != "default":
        out.append(f"the source's RoPE is scaled ({rope.get('rope_type')}); serving engines apply only a plain "
                   "rope_theta (or their own DeepSeek scalings) to DeepSeek models, so no export is exact")
    if options.dtype == "float16":
        out.append("--dtype float16 cannot hold the bias-free latent norm of the export; use --dtype bfloat16")
    if target != "transformers":
        slots = VLLM_GPU_HEAD_DIMS[0][1] // 2
        if half > slots and not (options.rope_strategy == "high" and geo.rope_pairs <= slots):
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
    from mla_convert.convert.options import geometry

    geo = geometry(options, src)
    mla = float(options.kv_lora_rank + geo.rope_width) if options.kv_lora_rank is not None else float(options.cache_budget)
    if target == "transformers":
        return mla, mla
    return mla, float(VLLM_KV_LORA_RANK + VLLM_GPU_HEAD_DIMS[0][1])


def export_lines(src: Any, options: Any) -> list[str]:
    """One line per target: ``exact`` or the first reason it is not, and the cache the engine allocates against
    the MLA checkpoint's and the source's (``inspect``, ``run --dry-run``)."""
    from mla_convert.convert.options import geometry

    source = geometry(options, src).source_width
    lines = []
    for target in TARGETS:
        problems = export_problems(src, options, target)
        mla, served = served_cache(src, options, target)
        at_least = "at least " if target == "transformers" else ""
        cache = (f"engine cache {at_least}{served:g} values/token/layer (MLA {mla:g}, source {source}"
                 + ("; per-layer ranks are padded to the largest)" if at_least else ")"))
        lines.append(f"  --export deepseek-v3 --target {target}: "
                     + (f"exact; {cache}" if not problems else "not exact: " + problems[0]))
    return lines
