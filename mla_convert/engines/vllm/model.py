"""Our ``mla`` checkpoints as a vLLM model, on vLLM's own MLA attention layer (``MultiHeadLatentAttentionWrapper``
around ``MLAAttention``) and its latent KV cache. Loaded by vLLM through :mod:`mla_convert.engines.vllm.plugin`;
imports only vLLM, torch and our torch-only algebra.

The checkpoint (docs/math.md) is mapped, exactly, onto the shape vLLM's MLA backends take
(:func:`~mla_convert.engines.vllm.spec.served_shape`), with zero rows and columns only:

* **Latent.** Layer ``l``'s rank ``r_l`` is padded to one ``kv_lora_rank`` (512): zero rows of
  ``kv_a_proj_with_mqa`` (and its bias), zero columns of ``kv_b_proj``; the cache holds zeros there. The optional
  latent norm is an RMSNorm over the first ``r_l`` values (:class:`LatentRMSNorm`): the zeros do not count.
* **Heads.** ``kv_b_proj``'s block of KV head ``g`` is repeated for its query heads (MLA absorbs per query head);
  each head's NoPE width (query and key) and value width are zero-padded to the backend's (128 on CPU).
* **RoPE.** The ``R`` rope key heads of ``d_R`` sit side by side in vLLM's rope slot (64), then zeros; query head
  ``h``'s rope rows go to its rope head's block (``h // (H / R)``), zeros elsewhere, so its score against the one
  cached rope row is its own rope head's. :class:`PairRotary` rotates every block with the checkpoint's exact
  per-pair inverse frequencies (rotate_half pairs, float32 angles, as our model): no plain-theta table.
* **Biases** of ``q_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (Qwen2's q/k/v biases live there) are the
  layers' own; the softmax scale is the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaMLP

from mla_convert.engines.vllm.plugin import engine_target
from mla_convert.engines.vllm.spec import ServedShape, ServeError, served_shape
from mla_convert.mla.algebra import apply_rope, rope_angles


class PairRotary(nn.Module):
    """RoPE of one layer in vLLM's rope slot: ``R`` blocks of ``d_R`` dims (rotate_half pairs), block ``r`` turned by
    ``inv_freq[r]`` (float32 radians per token), the rest of the slot left as is (zeros).

    Called as vLLM's rotary embeddings are: ``(positions [T], q_pe [T, H, W], k_pe [T, 1, W]) -> (q_pe, k_pe)``.
    """

    inv_freq: torch.Tensor

    def __init__(self, rope_heads: int, rope_width: int, inv_freq: list[list[float]]) -> None:
        super().__init__()
        self.rope_heads, self.rope_width = rope_heads, rope_width
        table = torch.tensor(inv_freq, dtype=torch.float32).reshape(rope_heads, rope_width // 2)
        self.register_buffer("inv_freq", table, persistent=False)

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        used = self.rope_heads * self.rope_width
        head = x[..., :used].unflatten(-1, (self.rope_heads, self.rope_width))  # [T, n, R, d_R]
        turned = apply_rope(head, cos.to(x.dtype), sin.to(x.dtype)).flatten(-2)
        return torch.cat([turned, x[..., used:]], dim=-1) if used < x.shape[-1] else turned

    def forward(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.rope_width:
            return q_pe, k_pe
        cos, sin = rope_angles(positions.reshape(1, -1), self.inv_freq.float())  # [1, T, R, P] float32
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, R, P]: one angle per token for every head
        return self._turn(q_pe, cos, sin), self._turn(k_pe, cos, sin)


class LatentRMSNorm(nn.Module):
    """RMSNorm of a layer's latent ``c [T, kv_lora_rank]`` over its first ``rank`` values (the rest are padding
    zeros and stay zero): ``c * rsqrt(sum(c^2) / rank + eps) * weight``, in float32 as our model's norm."""

    def __init__(self, width: int, rank: int, eps: float) -> None:
        super().__init__()
        self.rank, self.eps = rank, eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        x = c.float()
        scale = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / self.rank + self.eps)
        return self.weight * (x * scale).to(c.dtype)


class MLAPluginAttention(nn.Module):
    """One layer's MLA at the served widths (module docstring); ``forward(positions [T], x [T, hidden])``."""

    def __init__(
        self, config: Any, shape: ServedShape, layer: int, vllm_config: VllmConfig, prefix: str
    ) -> None:
        super().__init__()
        h, s = config.num_attention_heads, shape
        self.rank = shape.ranks[layer]
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        self.q_proj = ColumnParallelLinear(
            config.hidden_size, h * qk, bias=config.q_bias, prefix=f"{prefix}.q_proj"
        )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            config.hidden_size, s.cache_width, bias=config.kv_a_bias, prefix=f"{prefix}.kv_a_proj_with_mqa"
        )
        self.kv_a_layernorm: nn.Module = (
            LatentRMSNorm(s.kv_lora_rank, self.rank, config.rms_norm_eps)
            if config.latent_norm
            else nn.Identity()
        )
        self.kv_b_proj = ColumnParallelLinear(
            s.kv_lora_rank, h * (s.qk_nope_head_dim + s.v_head_dim), bias=False, prefix=f"{prefix}.kv_b_proj"
        )
        self.o_proj = RowParallelLinear(
            h * s.v_head_dim, config.hidden_size, bias=config.o_bias, prefix=f"{prefix}.o_proj"
        )
        self.rotary_emb = PairRotary(s.rope_heads, s.rope_width, config.rope_inv_freq[layer])
        modules = MLAModules(
            kv_a_layernorm=self.kv_a_layernorm,
            kv_b_proj=self.kv_b_proj,
            rotary_emb=self.rotary_emb,
            o_proj=self.o_proj,
            fused_qkv_a_proj=None,
            kv_a_proj_with_mqa=self.kv_a_proj_with_mqa,
            q_a_layernorm=None,
            q_b_proj=None,
            q_proj=self.q_proj,
            indexer=None,
            is_sparse=False,
            topk_indices_buffer=None,
        )
        self.mla_attn = MultiHeadLatentAttentionWrapper(
            config.hidden_size,
            h,
            config.softmax_scale,
            s.qk_nope_head_dim,
            s.qk_rope_head_dim,
            s.v_head_dim,
            None,
            s.kv_lora_rank,
            modules,
            vllm_config.cache_config,
            vllm_config.quant_config,
            prefix,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.mla_attn(positions, x)


class MLADecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (Llama layout, our model's)."""

    def __init__(
        self, config: Any, shape: ServedShape, layer: int, vllm_config: VllmConfig, prefix: str
    ) -> None:
        super().__init__()
        self.self_attn = MLAPluginAttention(config, shape, layer, vllm_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=getattr(config, "mlp_bias", False),
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MLAModel(nn.Module):
    """Embeddings, the decoder layers and the final norm; ``forward`` gives hidden states ``[T, hidden]``."""

    def __init__(self, config: Any, shape: ServedShape, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                MLADecoderLayer(config, shape, i, vllm_config, f"{prefix}.layers.{i}")
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class MLAForCausalLM(nn.Module):
    """vLLM's model for ``architectures: [MLAForCausalLM]`` (one device: tensor parallelism is refused)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        if get_tensor_model_parallel_world_size() != 1:
            raise ServeError("the mla-convert plugin serves on one device: drop --tensor-parallel-size")
        self.config = config
        self.shape = served_shape(config, engine_target())
        self.model = MLAModel(
            config, self.shape, vllm_config, f"{prefix}model" if not prefix else f"{prefix}.model"
        )
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the checkpoint's tensors, mapped to the served widths (module docstring); returns the parameter
        names filled.

        Raises:
            ServeError: a tensor the checkpoint lacks (the folder is not a complete ``factor`` output).
        """
        stored = dict(weights)
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor, shard: Any = None) -> None:
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, value.to(param.dtype), *(() if shard is None else (shard,)))
            loaded.add(name)

        def take(name: str) -> torch.Tensor:
            if name not in stored:
                raise ServeError(
                    f"the checkpoint has no tensor {name}: pass a folder written by 'mla-convert factor'"
                )
            return stored[name]

        put("model.embed_tokens.weight", take("model.embed_tokens.weight"))
        put("model.norm.weight", take("model.norm.weight"))
        if not self.config.tie_word_embeddings:
            put("lm_head.weight", take("lm_head.weight"))
        for i in range(len(self.model.layers)):
            p = f"model.layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(f"{p}{norm}.weight", take(f"{p}{norm}.weight"))
            put(f"{p}mlp.gate_up_proj.weight", take(f"{p}mlp.gate_proj.weight"), 0)
            put(f"{p}mlp.gate_up_proj.weight", take(f"{p}mlp.up_proj.weight"), 1)
            put(f"{p}mlp.down_proj.weight", take(f"{p}mlp.down_proj.weight"))
            if getattr(self.config, "mlp_bias", False):
                put(f"{p}mlp.gate_up_proj.bias", take(f"{p}mlp.gate_proj.bias"), 0)
                put(f"{p}mlp.gate_up_proj.bias", take(f"{p}mlp.up_proj.bias"), 1)
                put(f"{p}mlp.down_proj.bias", take(f"{p}mlp.down_proj.bias"))
            a = f"{p}self_attn."
            inv = stored.get(f"{a}rope_inv_freq")
            if inv is not None:  # the checkpoint's exact float32 frequencies (equal to config.json's)
                rotary = self.get_submodule(f"{a}rotary_emb")
                assert isinstance(rotary, PairRotary)
                rotary.inv_freq.copy_(inv.float().reshape_as(rotary.inv_freq))
            for name, value in self._attention_tensors(
                i,
                lambda n, a=a: take(a + n),
                a + "q_proj.bias" in stored,
                a + "kv_a_proj_with_mqa.bias" in stored,
                a + "o_proj.bias" in stored,
            ).items():
                put(a + name, value)
        return loaded

    def _attention_tensors(
        self, layer: int, take: Any, q_bias: bool, kv_a_bias: bool, o_bias: bool
    ) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s attention tensors at the served widths (zero padding, repeated KV blocks)."""
        c, s = self.config, self.shape
        h, g, r = c.num_attention_heads, c.num_key_value_heads, s.rope_heads
        dn, dr, dv, rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, s.ranks[layer]
        out: dict[str, torch.Tensor] = {}

        def query(t: torch.Tensor) -> torch.Tensor:  # [H (dn + dr), ...] -> [H (Dn + Dr), ...]
            t = t.reshape(h, dn + dr, *t.shape[1:])
            served = t.new_zeros(h, s.qk_nope_head_dim + s.qk_rope_head_dim, *t.shape[2:])
            served[:, :dn] = t[:, :dn]
            for head in range(h):
                at = s.qk_nope_head_dim + (head // (h // r)) * dr
                served[head, at : at + dr] = t[head, dn:]
            return served.flatten(0, 1)

        def latent(t: torch.Tensor) -> torch.Tensor:  # [rank + R dr, ...] -> [C + Dr, ...]
            served = t.new_zeros(s.cache_width, *t.shape[1:])
            served[:rank] = t[:rank]
            served[s.kv_lora_rank : s.kv_lora_rank + r * dr] = t[rank:]
            return served

        out["q_proj.weight"] = query(take("q_proj.weight"))
        if q_bias:
            out["q_proj.bias"] = query(take("q_proj.bias"))
        out["kv_a_proj_with_mqa.weight"] = latent(take("kv_a_proj_with_mqa.weight"))
        if kv_a_bias:
            out["kv_a_proj_with_mqa.bias"] = latent(take("kv_a_proj_with_mqa.bias"))
        if c.latent_norm:
            norm = take("kv_a_layernorm.weight")
            out["kv_a_layernorm.weight"] = torch.cat([norm, norm.new_zeros(s.kv_lora_rank - rank)])
        kv_b = take("kv_b_proj.weight").reshape(g, dn + dv, rank)
        served_b = kv_b.new_zeros(h, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        groups = torch.arange(h) // (h // g)
        served_b[:, :dn, :rank] = kv_b[groups, :dn]
        served_b[:, s.qk_nope_head_dim : s.qk_nope_head_dim + dv, :rank] = kv_b[groups, dn:]
        out["kv_b_proj.weight"] = served_b.flatten(0, 1)
        o = take("o_proj.weight").reshape(-1, h, dv)
        served_o = o.new_zeros(o.shape[0], h, s.v_head_dim)
        served_o[..., :dv] = o
        out["o_proj.weight"] = served_o.flatten(1)
        if o_bias:
            out["o_proj.bias"] = take("o_proj.bias")
        return out
