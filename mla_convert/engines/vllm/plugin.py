"""vLLM general plugin: vLLM serves ``mla`` checkpoint folders (as ``mla-convert factor`` writes them) with no export.

With mla-convert installed in vLLM's environment (``pip install --no-deps mla-convert``; ``scripts/vllm_env.sh``
does it), every vLLM process loads :func:`register` through the entry point group ``vllm.general_plugins``; then
``LLM(model=CKPT)`` and ``vllm serve CKPT`` run :class:`mla_convert.engines.vllm.model.MLAForCausalLM` on vLLM's own
MLA attention layer and latent KV cache (an ``MLAAttentionSpec`` of one head of ``kv_lora_rank + rope`` values per
token per layer).

This module imports only what vLLM's environment holds (torch, its transformers, pydantic): never our model code,
which needs a newer transformers. :func:`~mla_convert.engines.vllm.spec.served_shape` is the one place that says
which widths vLLM gets.
"""

from __future__ import annotations

from mla_convert.engines.vllm.spec import served_shape

#: The architecture name of our checkpoints' ``config.json`` (``architectures``), as vLLM's registry knows it.
ARCHITECTURE = "MLAForCausalLM"
#: ``module:class`` of the vLLM model (imported by vLLM when a checkpoint asks for it).
MODEL_CLASS = "mla_convert.engines.vllm.model:MLAForCausalLM"


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
