"""vLLM general plugin: vLLM serves ``mla`` checkpoint folders (as ``mla-convert factor`` writes them) with no export.

With mla-convert installed in vLLM's environment (``pip install --no-deps mla-convert``; ``scripts/vllm_env.sh``
does it), every vLLM process loads :func:`register` through the entry point group ``vllm.general_plugins``; then
``LLM(model=CKPT)`` and ``vllm serve CKPT`` run :class:`mla_convert.serve.vllm_model.MLAForCausalLM` on vLLM's own
MLA attention layer and latent KV cache (an ``MLAAttentionSpec`` of one head of ``kv_lora_rank + rope`` values per
token per layer).

This module imports only what vLLM's environment holds (torch, its transformers, pydantic): never our model code,
which needs a newer transformers. :func:`served_shape` is the one place that says which widths vLLM gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The architecture name of our checkpoints' ``config.json`` (``architectures``), as vLLM's registry knows it.
ARCHITECTURE = "MLAForCausalLM"
#: ``module:class`` of the vLLM model (imported by vLLM when a checkpoint asks for it).
MODEL_CLASS = "mla_convert.serve.vllm_model:MLAForCausalLM"
#: The route an export refusal names for what no DeepSeek-V3 file holds (biases, scaled RoPE): serve the checkpoint.
PLUGIN_ROUTE = (
    "vLLM serves the MLA checkpoint itself exactly through mla-convert's plugin, with no export (pip install "
    "--no-deps mla-convert into vLLM's environment, then vllm serve CKPT; docs/serving.md)"
)


class ServeError(ValueError):
    """A checkpoint whose shape vLLM's MLA backends cannot take; one line: what, and the ``factor`` option to fix it."""


@dataclass(frozen=True)
class ServedShape:
    """The widths vLLM runs a checkpoint at (every padding is zero rows and columns: exact).

    Attributes:
        kv_lora_rank: the latent width vLLM caches (``>=`` every layer's rank; the rest of a row is zeros).
        qk_rope_head_dim: the rope width vLLM caches: the checkpoint's ``R`` rope heads of ``d_R`` side by side,
            then zeros; query head ``h`` fills only its rope head's block.
        qk_nope_head_dim / v_head_dim: each head's NoPE query/key and value widths (zero-padded).
        ranks: the checkpoint's per-layer ``kv_lora_rank``.
        rope_heads / rope_width: ``R`` and ``d_R`` of the checkpoint.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    ranks: tuple[int, ...]
    rope_heads: int
    rope_width: int

    @property
    def cache_width(self) -> int:
        """Values vLLM caches per token per layer (one latent head)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def served_shape(config: Any, target: str = "vllm-cpu") -> ServedShape:
    """The widths of ``config`` (an ``mla`` config) in vLLM's MLA backends of ``target`` (``vllm-cpu``: AMX_MLA and
    CPU_MLA, 512 + 64 and qk_nope / v_head 128; ``vllm``: FlashMLA's 512 + 64 and the smallest (qk_nope, v_head)
    pair its prefill accepts that holds the checkpoint's).

    Raises:
        ServeError: a rank over the engine's latent width, rope heads wider than its rope width, or NoPE / value
            widths no accepted pair holds (each names the ``factor`` option that fits the engine).
    """
    from mla_convert.convert.engine import ENGINE_HEAD_DIMS, ENGINE_ROWS

    rank_cap, rope_cap = ENGINE_ROWS[target]
    given = config.kv_lora_rank
    ranks = (
        [int(r) for r in given] if isinstance(given, list) else [int(given)] * int(config.num_hidden_layers)
    )
    rope = int(config.num_rope_heads) * int(config.qk_rope_head_dim)
    if max(ranks) > rank_cap:
        raise ServeError(
            f"kv_lora_rank {max(ranks)} is over the {rank_cap} vLLM's MLA backends cache: convert with "
            f"--kv-lora-rank {rank_cap} or a smaller --cache-fraction"
        )
    if rope > rope_cap:
        raise ServeError(
            f"{config.num_rope_heads} rope head(s) of {config.qk_rope_head_dim} need {rope} rope values, "
            f"vLLM's MLA backends cache {rope_cap}: convert again with factor (one shared rope head) and --rope-pairs "
            f"{rope_cap // 2} or fewer"
        )
    nope, v = int(config.qk_nope_head_dim), int(config.v_head_dim)
    fits = [(n, vv) for n, r, vv in ENGINE_HEAD_DIMS[target] if r == rope_cap and nope <= n and v <= vv]
    if not fits:
        widest = max(n for n, _, _ in ENGINE_HEAD_DIMS[target])
        raise ServeError(
            f"qk_nope_head_dim {nope} / v_head_dim {v} fit none of the head shapes vLLM's {target} MLA "
            f"backends take {[(n, vv) for n, _, vv in ENGINE_HEAD_DIMS[target]]}: convert with "
            f"--qk-nope-head-dim {widest} (or --target {target})"
        )
    return ServedShape(
        rank_cap,
        rope_cap,
        fits[0][0],
        fits[0][1],
        tuple(ranks),
        int(config.num_rope_heads),
        int(config.qk_rope_head_dim),
    )


def engine_target() -> str:
    """``vllm-cpu`` on vLLM's CPU platform, else ``vllm`` (its GPU MLA backends)."""
    from vllm.platforms import current_platform

    return "vllm-cpu" if current_platform.is_cpu() else "vllm"


def _convertor() -> type:
    """vLLM's model-architecture reader for ``model_type: mla``: an MLA model (one latent head per token per layer)
    whose cached head is :func:`served_shape`'s width."""
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    class MLAArchConfigConvertor(ModelArchConfigConvertorBase):  # type: ignore[misc,valid-type]
        def is_deepseek_mla(self) -> bool:
            return True

        def get_head_size(self) -> int:
            return served_shape(self.hf_text_config, engine_target()).cache_width

    return MLAArchConfigConvertor


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``mla`` config type with vLLM's transformers, its
    architecture reader and :data:`ARCHITECTURE` with vLLM's model registry (idempotent; runs in every vLLM
    process)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    from vllm import ModelRegistry
    from vllm.transformers_utils import model_arch_config_convertor as arch

    from mla_convert.mla.configuration import MLAConfig

    AutoConfig.register("mla", MLAConfig, exist_ok=True)
    # factor's config.json names no architectures: vLLM then takes the model type's entry of this table
    MODEL_MAPPING_NAMES.setdefault("mla", ARCHITECTURE)
    arch.MODEL_ARCH_CONFIG_CONVERTORS.setdefault("mla", _convertor())
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
