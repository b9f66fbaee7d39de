"""The converted MLA causal language model (a transformers ``PreTrainedModel``).

The decoder blocks, the model and its LM head around :class:`~mla_convert.mla.attention.MLAAttention`, whose
module docstring gives the attention math (docs/math.md), its three paths and the two caches it accepts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from mla_convert.mla.algebra import causal_mask
from mla_convert.mla.attention import ATTENTION_PATHS, MLAAttention
from mla_convert.mla.configuration import MLAConfig
from mla_convert.runtime.paged_cache import PagedLatentCache


class MLADecoderLayer(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (Llama layout)."""

    def __init__(self, config: MLAConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)  # type: ignore[arg-type]
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | PagedLatentCache | None,
    ) -> torch.Tensor:
        """``[B, T, hidden] -> [B, T, hidden]``."""
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), position_ids, attention_mask, past_key_values
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MLAPreTrainedModel(PreTrainedModel):
    """Base class: config class, weight init and checkpoint conventions of converted MLA models."""

    config_class = MLAConfig
    config: MLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MLADecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, LlamaRMSNorm):
            nn.init.ones_(module.weight)


class MLAModel(MLAPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` MLA decoder blocks and the final RMSNorm."""

    def __init__(self, config: MLAConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([MLADecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: Cache | PagedLatentCache | None = None,
        **inputs: Any,
    ) -> BaseModelOutputWithPast:
        """Hidden states ``[B, T, hidden]`` of ``input_ids [B, T]``; positions default to ``past + arange(T)``.

        ``inputs`` (all optional, as :meth:`MLAForCausalLM.forward` names them): ``inputs_embeds [B, T, hidden]``
        instead of ``input_ids``, 2-D padding ``attention_mask [B, past + T]``, ``position_ids [B, T]``,
        ``use_cache``; other keys (e.g. transformers' ``cache_position``) are ignored.

        With a :class:`PagedLatentCache` (bound to ``B`` requests) the new rows are written to its pages
        and committed after the last layer; positions default to each request's committed length.
        """
        inputs_embeds: torch.Tensor | None = inputs.get("inputs_embeds")
        attention_mask: torch.Tensor | None = inputs.get("attention_mask")
        position_ids: torch.Tensor | None = inputs.get("position_ids")
        use_cache: bool | None = inputs.get("use_cache")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        assert inputs_embeds is not None
        b, t, _ = inputs_embeds.shape
        if isinstance(past_key_values, PagedLatentCache):
            return self._forward_paged(inputs_embeds, position_ids, attention_mask, past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(t, device=inputs_embeds.device) + past)[None].expand(b, t)  # type: ignore[assignment]
        assert position_ids is not None
        mask = causal_mask(b, t, past, attention_mask, inputs_embeds.dtype, inputs_embeds.device)
        hidden = inputs_embeds
        cache = past_key_values if use_cache else None
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                hidden = self._gradient_checkpointing_func(layer.__call__, hidden, position_ids, mask, cache)
            else:
                hidden = layer(hidden, position_ids, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=cache)

    def _forward_paged(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache: PagedLatentCache,
    ) -> BaseModelOutputWithPast:
        b, t, _ = hidden.shape
        if b != len(cache.active):
            raise ValueError(f"{b} batch rows but the paged cache is bound to {len(cache.active)} requests")
        triton_path = self.config.attn_implementation_mla == "triton"
        if attention_mask is not None and triton_path:
            raise ValueError(
                "the triton path takes no padding mask: give requests of different lengths their own cache "
                "requests (the kernel reads each request's own length)"
            )
        step = cache.begin_step(t)  # pages and the step's device metadata, built once for all layers
        if position_ids is None:
            position_ids = step.positions
        assert position_ids is not None
        mask = None
        if not triton_path:
            if step.uniform:
                mask = causal_mask(b, t, step.max_seq_len - t, attention_mask, hidden.dtype, hidden.device)
            elif t != 1 or attention_mask is not None:
                cache.step = None
                raise ValueError(
                    "requests of different lengths take one token per step and no padding mask on the "
                    "absorbed path (the triton path takes several)"
                )
        try:
            for layer in self.layers:
                hidden = layer(hidden, position_ids, mask, cache)
        except BaseException:
            cache.step = None  # the step's rows were written but are never committed
            raise
        cache.commit(t)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=None)


class MLAForCausalLM(MLAPreTrainedModel, GenerationMixin):
    """Causal LM head on :class:`MLAModel`; ``generate()`` runs on the absorbed latent-cache path."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MLAConfig) -> None:
        super().__init__(config)
        self.model = MLAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def set_folding(self, enabled: bool) -> None:
        """Fold the up-projections into ``q_proj``/``o_proj`` for inference in every layer where it pays
        (:meth:`MLAAttention.set_folding`); the same function, fewer per-token products and ops."""
        for layer in self.model.layers:
            layer.self_attn.set_folding(enabled)

    @property
    def folding(self) -> bool:
        """Whether inference folding is on (:meth:`set_folding`)."""
        return bool(self.model.layers) and bool(self.model.layers[0].self_attn.folding)

    def set_attention_path(self, path: str) -> None:
        """Switch every layer to ``absorbed`` (latent cache, torch), ``triton`` (latent paged cache, the
        bundled kernel for every step on a paged cache) or ``naive`` (expanded K/V reference).

        Raises:
            ValueError: for any other name. A cache filled by one path must not be reused by the other.
        """
        if path not in ATTENTION_PATHS:
            raise ValueError(f"unknown attention path {path!r}; choose one of {ATTENTION_PATHS}")
        self.config.attn_implementation_mla = path
        for layer in self.model.layers:
            layer.self_attn.path = path

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | PagedLatentCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits ``[B, T, vocab]`` (the last ``logits_to_keep`` positions when > 0) and the LM loss."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


def latent_cache_bytes(cache: Cache) -> tuple[int, int]:
    """Bytes and values actually held by a cache's tensors, summed over layers.

    Returns:
        ``(bytes, values)`` where values counts tensor elements (all batch rows and tokens).
    """
    total_bytes = total_values = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total_bytes += tensor.numel() * tensor.element_size()
                total_values += tensor.numel()
    return total_bytes, total_values
