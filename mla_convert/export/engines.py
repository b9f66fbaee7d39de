"""Where a converted checkpoint serves: per engine, the route, whether it computes the checkpoint's function
exactly, and the KV cache the engine allocates (the model card's table; ``inspect`` says the same before any work,
:func:`~mla_convert.export.precheck.export_lines`).

Config only: the checkpoint's widths (per-layer ranks, rope heads) and the source's shape; nothing is loaded.
"""

from __future__ import annotations

from typing import Any

from mla_convert.export.precheck import export_problems


def engine_rows(src: Any, options: Any, config: Any) -> list[tuple[str, str, str, str]]:
    """``(engine, route, exact or why not, cache values per token per layer)`` for transformers, vLLM through a
    DeepSeek-V3 export, vLLM through mla-convert's plugin and llama.cpp through a GGUF export.

    Args:
        src: the :class:`~mla_convert.sources.checkpoint.SourceModel` converted (config and shapes).
        options: the :class:`~mla_convert.convert.options.ConvertOptions` it was converted with.
        config: the checkpoint's :class:`~mla_convert.mla.configuration.MLAConfig` (its real per-layer ranks).
    """
    from mla_convert.export.gguf_file import cache_block_rank
    from mla_convert.serve.vllm_plugin import PLUGIN_ROUTE, ServeError, served_shape

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

    rows = [("transformers", "`import mla_convert`, then `AutoModelForCausalLM.from_pretrained(CKPT)`",
             "exact (this checkpoint)", f"{sum(widths) / len(widths):g} (mean of the per-layer rows)")]  # fmt: skip
    rows.append(("vLLM (DeepSeek-V3 export)", "`mla-convert export CKPT OUT --target vllm-cpu` (or `vllm`)",
                 verdict(export_problems(src, options, "vllm-cpu")), "576 (512 + 64)"))  # fmt: skip
    try:
        served = served_shape(config, "vllm-cpu")
        plugin, cache = "exact on vLLM's CPU build (its GPU backends not run)", f"{served.cache_width}"
    except ServeError as exc:
        plugin, cache = f"not served: {exc}", "-"
    rows.append(("vLLM (mla-convert plugin)", "`pip install --no-deps mla-convert` into vLLM's environment, then "
                 "serve CKPT (docs/serving.md)", plugin, cache))  # fmt: skip
    gguf = export_problems(src, options, "transformers", "gguf")
    block = cache_block_rank(max(ranks), rope, 32)
    row = (f"{padded} (f16 cache); {block + rope} with its quantized caches (whole blocks of 32)" if block is not None
           else f"{padded} (f16 / bf16 / f32 caches: a rope key of {rope} is not whole blocks of 32, as its quantized "
           "caches need)")
    rows.append(("llama.cpp (GGUF export)", "`mla-convert export CKPT OUT.gguf --format gguf`", verdict(gguf),
                 row if not gguf else "-"))  # fmt: skip
    return rows


def engine_table(src: Any, options: Any, config: Any) -> str:
    """:func:`engine_rows` as a markdown table (the model card's "Where it serves")."""
    head = "| engine | route | function | KV cache values/token/layer |\n|---|---|---|---|\n"
    return head + "".join(f"| {' | '.join(r)} |\n" for r in engine_rows(src, options, config))
