"""Configuration of a converted Multi-Head Latent Attention (MLA) causal language model.

Field names follow DeepSeek-V3 (``transformers.models.deepseek_v3``): ``kv_lora_rank``,
``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``. What a general conversion needs on top:

* ``kv_lora_rank`` may be one integer or one per layer (a cache budget spread across layers).
* RoPE lives on ``num_rope_heads`` rope key heads per layer (the source's KV heads in ``per-head``
  mode, one shared head in ``shared`` mode). Query head ``h`` reads rope head ``h // (H / R)``.
* Every rope pair keeps its exact source frequency: ``rope_inv_freq[layer][rope_head][pair]`` in
  radians per token. Within a rope head of width ``qk_rope_head_dim = 2 * n_pairs`` the layout is
  rotate_half: pair ``p`` is dims ``(p, p + n_pairs)`` as in HF Llama.
* ``softmax_scale`` is the source model's scale (1/sqrt(head_dim) for Llama), never derived from
  the latent width.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class MLAConfig(PretrainedConfig):
    """Config of :class:`mla_convert.mla.modeling.MLAForCausalLM`.

    Args:
        kv_lora_rank: latent width ``d_c`` of the KV cache, an int or one int per layer.
        qk_rope_head_dim: width ``d_R`` of one rope head (2 x pairs kept), 0 when no RoPE is kept.
        qk_nope_head_dim: width ``d_N`` of the NoPE part of each query/key head.
        v_head_dim: value head width ``d_V`` (the source's head_dim).
        num_rope_heads: rope key heads ``R`` per layer; must divide ``num_attention_heads``.
        rope_inv_freq: ``[L][R][d_R/2]`` inverse frequencies (radians per token) of the kept pairs.
        rope_pair_origin: ``[L][R][d_R/2]`` human-readable origin of each pair (for reports).
        softmax_scale: the source model's attention scale.
        latent_norm: whether an RMSNorm (``kv_a_layernorm``) sits on ``c_kv``.
        q_bias / kv_a_bias / o_bias: which projections carry a bias (see docs/math.md §Biases).
        source: a dict naming the source model (family, path, architecture) for records.

    Raises:
        ValueError: when the per-layer lists do not match ``num_hidden_layers`` or heads do not divide.
    """

    model_type = "mla"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        hidden_act: str = "silu",
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        tie_word_embeddings: bool = False,
        mlp_bias: bool = False,
        kv_lora_rank: int | list[int] = 96,
        qk_rope_head_dim: int = 16,
        qk_nope_head_dim: int = 48,
        v_head_dim: int = 64,
        num_rope_heads: int = 1,
        rope_inv_freq: list[list[list[float]]] | None = None,
        rope_pair_origin: list[list[list[str]]] | None = None,
        softmax_scale: float = 0.125,
        latent_norm: bool = False,
        q_bias: bool = False,
        kv_a_bias: bool = False,
        o_bias: bool = False,
        attn_implementation_mla: str = "absorbed",
        source: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.mlp_bias = mlp_bias
        if isinstance(kv_lora_rank, int):
            kv_lora_rank = [kv_lora_rank] * num_hidden_layers
        self.kv_lora_rank = list(kv_lora_rank)
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.num_rope_heads = num_rope_heads
        n_pairs = qk_rope_head_dim // 2
        if rope_inv_freq is None:
            rope_inv_freq = [
                [[0.0] * n_pairs for _ in range(num_rope_heads)] for _ in range(num_hidden_layers)
            ]
        self.rope_inv_freq = rope_inv_freq
        self.rope_pair_origin = rope_pair_origin
        self.softmax_scale = softmax_scale
        self.latent_norm = latent_norm
        self.q_bias = q_bias
        self.kv_a_bias = kv_a_bias
        self.o_bias = o_bias
        self.attn_implementation_mla = attn_implementation_mla
        self.source = source or {}
        self._check()
        # transformers' runtime __init__ wrapper takes these keywords; its stub signature does not list them
        super().__init__(  # type: ignore[call-arg]
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def _check(self) -> None:
        L = self.num_hidden_layers
        if len(self.kv_lora_rank) != L:
            raise ValueError(f"kv_lora_rank has {len(self.kv_lora_rank)} entries; the model has {L} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_rope_heads < 1 or self.num_attention_heads % self.num_rope_heads:
            raise ValueError("num_rope_heads must be >= 1 and divide num_attention_heads")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even (it holds RoPE pairs)")
        if len(self.rope_inv_freq) != L or any(len(r) != self.num_rope_heads for r in self.rope_inv_freq):
            raise ValueError("rope_inv_freq must be [num_hidden_layers][num_rope_heads][qk_rope_head_dim/2]")
        if self.attn_implementation_mla not in ("absorbed", "naive", "triton"):
            raise ValueError("attn_implementation_mla must be 'absorbed', 'naive' or 'triton'")

    @property
    def cache_width(self) -> list[int]:
        """Values cached per token per layer: ``kv_lora_rank[l] + num_rope_heads * qk_rope_head_dim``."""
        return [r + self.num_rope_heads * self.qk_rope_head_dim for r in self.kv_lora_rank]
