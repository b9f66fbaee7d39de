"""One converted MLA attention layer (:class:`MLAAttention`): its projections, three attention paths and the
caches it reads and writes.

Attention follows docs/math.md (DeepSeek-V2/V3 MLA, arXiv:2405.04434), generalised for converted
checkpoints (per-layer ranks, several rope heads, exact per-pair source frequencies):

    q             = q_proj(x)                 -> per head [q_nope (d_N) | q_rope (d_R)]
    c_kv | k_rope = kv_a_proj_with_mqa(x)     -> c_kv [B, T, d_c], k_rope [B, T, R, d_R]
    k_nope | v    = kv_b_proj(c_kv)           -> per KV head g [k_nope (d_N) | v (d_V)]
    score[h,t,j]  = (q_nope[h,t] . k_nope[g(h),j] + rope_t(q_rope[h,t]) . rope_j(k_rope[r(h),j])) * scale

Three attention paths share these weights:

* ``absorbed`` (the product): the KV cache holds only ``[c_kv | rotated k_rope]`` per token per
  layer; queries are absorbed into the latent (``q_abs = W_UK[g]^T q_nope``) and the value
  up-projection runs after attention (``W_UV[g] @ latent_out``). ``generate()`` uses it.
* ``triton``: like ``absorbed``, but every step on a :class:`~mla_convert.runtime.paged_cache.PagedLatentCache`
  runs the bundled Triton kernel (:mod:`mla_convert.kernels`) over the very rows it wrote to that cache: decode
  steps (one new token), prefill and verification blocks (several, causal inside the block), requests of
  different lengths in one batch. It needs a paged cache, takes no padding mask and never falls back: the
  backend that ran is counted in the cache's ``backend_log``.
* ``naive`` (a reference): expands K and V per KV head and caches them; never the product.

Two caches are accepted. A transformers ``DynamicCache`` (``generate()``): on the absorbed path layer
``l`` stores ``c_kv`` in its key slot ``[B, 1, S, d_c]`` and the rotated ``k_rope`` in its value slot
``[B, 1, S, R * d_R]``. A :class:`~mla_convert.runtime.paged_cache.PagedLatentCache` (``absorbed`` and
``triton``): rows ``[c_kv | rotated k_rope]`` in pages, see :mod:`mla_convert.runtime.decode`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from mla_convert.mla import algebra
from mla_convert.mla.algebra import apply_rope, rope_angles
from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.folding import FoldedWeights, fold_weights, folding_key, folding_plan
from mla_convert.runtime.paged_cache import PagedLatentCache

ATTENTION_PATHS = ("absorbed", "naive", "triton")


class Projected(NamedTuple):
    """One layer's projections of new tokens: ``q_nope [B, T, H, d_N]``, rotated ``q_rope [B, T, H, d_R]``,
    ``c_kv [B, T, d_c]`` (after the optional latent norm) and rotated ``k_rope [B, T, R, d_R]``."""

    q_nope: torch.Tensor
    q_rope: torch.Tensor
    c_kv: torch.Tensor
    k_rope: torch.Tensor


class MLAAttention(nn.Module):
    """One converted attention layer; see the module docstring for the math.

    Shapes: input ``[B, T, hidden]``; output ``[B, T, hidden]``. ``H`` query heads, ``G`` KV heads
    (latent groups), ``R`` rope heads with ``G % R == 0``; query head ``h`` uses KV head
    ``h // (H/G)`` and rope head ``h // (H/R)``.
    """

    rope_inv_freq: torch.Tensor  # buffer registered in __init__

    def __init__(self, config: MLAConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_rope_heads = config.num_rope_heads
        self.kv_lora_rank = config.kv_lora_rank[layer_idx]
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.softmax_scale = config.softmax_scale
        self.path = config.attn_implementation_mla
        hidden = config.hidden_size
        h, g, r = self.num_heads, self.num_kv_heads, self.num_rope_heads
        if g % r:
            raise ValueError(f"num_key_value_heads={g} must be a multiple of num_rope_heads={r}")
        self.q_proj = nn.Linear(
            hidden, h * (self.qk_nope_head_dim + self.qk_rope_head_dim), bias=config.q_bias
        )
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden, self.kv_lora_rank + r * self.qk_rope_head_dim, bias=config.kv_a_bias
        )
        self.kv_a_layernorm = (
            LlamaRMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps) if config.latent_norm else None
        )
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, g * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * self.v_head_dim, hidden, bias=config.o_bias)
        self._head_to_rope: dict[torch.device, torch.Tensor] = {}
        self.folding = False
        self._folded: FoldedWeights | None = None
        inv = torch.tensor(config.rope_inv_freq[layer_idx], dtype=torch.float32).reshape(r, -1)
        self.register_buffer(
            "rope_inv_freq", inv, persistent=True
        )  # saved: meta-device init would leave it empty

    def _apply(self, fn: Any, recurse: bool = True) -> MLAAttention:
        """``nn.Module._apply`` (under ``.to``, ``.cuda``, ``.half``, ``.bfloat16``, ...) that moves ``rope_inv_freq``
        with the module but keeps it float32: in bfloat16 the frequencies round to ~2^-9, an angle error of
        ~position x 2^-9 x frequency (0.7 rad at 1k tokens for mid frequencies)."""
        inv = self._buffers.get("rope_inv_freq")
        super()._apply(fn, recurse)
        new = self._buffers.get("rope_inv_freq")
        if inv is not None and new is not None and new.dtype != torch.float32:
            keep = new if inv.is_meta or new.is_meta else inv.to(new.device)  # the exact values, moved
            self._buffers["rope_inv_freq"] = keep.to(torch.float32)
        return self

    # ----------------------------------------------------------------------------- projections
    def project(self, x: torch.Tensor, position_ids: torch.Tensor) -> Projected:
        """Queries and the new latent rows of ``x``.

        Returns:
            ``q_nope [B, T, H, d_N]``, rotated ``q_rope [B, T, H, d_R]``, ``c_kv [B, T, d_c]`` (after the
            optional latent norm) and rotated ``k_rope [B, T, R, d_R]``.
        """
        b, t, _ = x.shape
        h, r, d_c = self.num_heads, self.num_rope_heads, self.kv_lora_rank
        q = self.q_proj(x).view(b, t, h, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = kv[..., :d_c]
        if self.kv_a_layernorm is not None:
            c_kv = self.kv_a_layernorm(c_kv)
        k_rope = kv[..., d_c:].reshape(b, t, r, self.qk_rope_head_dim)
        k_rope, q_rope = self._rotate(position_ids, k_rope, q_rope)
        return Projected(q_nope, q_rope, c_kv, k_rope)

    def _rotate(
        self, position_ids: torch.Tensor, k_rope: torch.Tensor, q_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k_rope [B, T, R, d_R]`` and ``q_rope [B, T, H, d_R]`` rotated at ``position_ids``; query head ``h``
        takes rope head ``h // (H / R)``'s angles (a broadcast over the heads of each rope head, no gather)."""
        if not self.qk_rope_head_dim:
            return k_rope, q_rope
        b, t, h, d_r = q_rope.shape
        r = self.num_rope_heads
        cos, sin = rope_angles(position_ids, self.rope_inv_freq)  # [B, T, R, P]
        k_rope = apply_rope(k_rope, cos.to(k_rope.dtype), sin.to(k_rope.dtype))
        cos_q, sin_q = cos[:, :, :, None].to(q_rope.dtype), sin[:, :, :, None].to(q_rope.dtype)
        q_rope = apply_rope(q_rope.reshape(b, t, r, h // r, d_r), cos_q, sin_q).reshape(b, t, h, d_r)
        return k_rope, q_rope

    # ----------------------------------------------------------------------------- inference folding
    def set_folding(self, enabled: bool) -> None:
        """Fold ``W_UK`` into ``q_proj`` and ``W_UV`` into ``o_proj`` for inference (absorbed and triton paths,
        only while autograd is off), each only where the folded product costs fewer multiply-adds per token
        than the projection plus the per-head latent product (:meth:`folding_plan`). The folded weights are
        derived (never saved) and rebuilt when a weight changes (in place or replaced)."""
        self.folding = enabled
        if not enabled:
            self._folded = None  # the derived weights' memory goes back

    def folding_plan(self) -> tuple[bool, bool]:
        """``(fold_q, fold_o)``: where folding lowers the multiply-adds per token
        (:func:`~mla_convert.mla.folding.folding_plan`)."""
        return folding_plan(
            self.q_proj.in_features, self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim
        )

    def folded_weights(self) -> FoldedWeights | None:
        """The folded inference weights when folding applies now (``None`` during training or on the naive path)."""
        if not self.folding or torch.is_grad_enabled() or self.path == "naive":
            return None
        key = folding_key(self)
        if self._folded is None or self._folded.key != key:
            self._folded = fold_weights(self, key)
        return self._folded

    def _output(self, latent_out: torch.Tensor, folded: FoldedWeights | None) -> torch.Tensor:
        """``[B, T, H, d_c]`` attended latent -> ``[B, T, hidden]`` through the folded ``o_proj`` when there is one."""
        if folded is None or folded.o_weight is None:
            return self.output_from_latent(latent_out)
        b, t = latent_out.shape[:2]
        return nn.functional.linear(latent_out.reshape(b, t, -1), folded.o_weight, self.o_proj.bias)

    def _project_folded(
        self, x: torch.Tensor, position_ids: torch.Tensor, folded: FoldedWeights
    ) -> Projected:
        """:meth:`project` with the absorbed query straight from the folded ``q_proj``: ``Projected.q_nope`` then
        holds ``q_abs [B, T, H, d_c]``."""
        b, t, _ = x.shape
        h, r, d_c = self.num_heads, self.num_rope_heads, self.kv_lora_rank
        assert folded.q_weight is not None
        q = nn.functional.linear(x, folded.q_weight, folded.q_bias).view(b, t, h, d_c + self.qk_rope_head_dim)
        q_abs, q_rope = q.split([d_c, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)  # the latent rows exactly as the unfolded path makes them
        c_kv = kv[..., :d_c]
        if self.kv_a_layernorm is not None:
            c_kv = self.kv_a_layernorm(c_kv)
        k_rope = kv[..., d_c:].reshape(b, t, r, self.qk_rope_head_dim)
        k_rope, q_rope = self._rotate(position_ids, k_rope, q_rope)
        return Projected(q_abs, q_rope, c_kv, k_rope)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [G, d_N, d_c]`` and ``W_UV [G, d_V, d_c]``, views of ``kv_b_proj.weight``."""
        return algebra.split_up_weights(self.kv_b_proj.weight, self.num_kv_heads, self.qk_nope_head_dim)

    def head_to_rope(self, device: torch.device | None = None) -> torch.Tensor:
        """``[H]`` int32: the rope head read by each query head (``h // (H / R)``)."""
        return algebra.head_to_group(self.num_heads, self.num_rope_heads, device).int()

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_abs [B, T, H, d_c]`` for ``q_nope [B, T, H, d_N]`` (:func:`~mla_convert.mla.algebra.absorb_query`)."""
        return algebra.absorb_query(q_nope, self.up_weights()[0])

    def latent_scores(
        self, q_abs: torch.Tensor, q_rope: torch.Tensor, c_all: torch.Tensor, kr_all: torch.Tensor
    ) -> torch.Tensor:
        """Unscaled scores ``[B, H, T, S]`` of absorbed queries against latent rows ``c_all [B, S, d_c]``,
        ``kr_all [B, S, R * d_R]`` (:func:`~mla_convert.mla.algebra.latent_scores`)."""
        return algebra.latent_scores(q_abs, q_rope, c_all, kr_all, self.num_rope_heads)

    def output_from_latent(self, latent_out: torch.Tensor) -> torch.Tensor:
        """``o_proj(W_UV[g(h)] latent_out[h])``: ``[B, T, H, d_c] -> [B, T, hidden]``."""
        return self.o_proj(algebra.latent_output(latent_out, self.up_weights()[1]))

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | PagedLatentCache | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, T, hidden]``.

        Args:
            x: normalised hidden states ``[B, T, hidden]``.
            position_ids: absolute positions ``[B, T]``.
            attention_mask: additive mask ``[B, 1, T, S]`` (S = cached + new tokens) or None (no mask).
            past_key_values: a ``Cache`` or bound ``PagedLatentCache``; this layer's rows are written to it.

        Raises:
            ValueError: the ``naive`` path with a paged cache, or the ``triton`` path with a ``DynamicCache``.
        """
        folded = self.folded_weights()
        if folded is not None and folded.q_weight is not None:
            p, absorbed = self._project_folded(x, position_ids, folded), True
        else:
            p, absorbed = self.project(x, position_ids), False
        if isinstance(past_key_values, PagedLatentCache):
            return self._paged(p, attention_mask, past_key_values, absorbed, folded)
        if self.path == "naive":
            return self._naive(p, attention_mask, past_key_values)
        if self.path == "triton" and past_key_values is not None:
            raise ValueError(
                "attention path 'triton' decodes from a PagedLatentCache; use mla_convert.runtime.decode.generate "
                "(or `mla-convert generate --backend triton`) instead of a DynamicCache"
            )
        return self._absorbed(p, attention_mask, past_key_values, absorbed, folded)

    def _paged(
        self,
        p: Projected,
        mask: torch.Tensor | None,
        cache: PagedLatentCache,
        absorbed: bool = False,
        folded: FoldedWeights | None = None,
    ) -> torch.Tensor:
        """Write this layer's new rows to the paged cache and attend over the request's rows; reads only the
        step's metadata (:attr:`PagedLatentCache.step`), so no host synchronisation happens here."""
        b, t = p.c_kv.shape[:2]
        if self.path == "naive":
            raise ValueError("the naive path caches expanded K/V; it cannot use a PagedLatentCache")
        step = cache.step
        if step is None:
            raise ValueError(
                "a PagedLatentCache is read inside a step: run the model on it (MLAModel.forward)"
            )
        cache.write(self.layer_idx, torch.cat([p.c_kv, p.k_rope.reshape(b, t, -1)], dim=-1))
        q_abs = p.q_nope if absorbed else self.absorb_query(p.q_nope)
        if self.path == "triton":
            from mla_convert.kernels import kernel_backend, load_kernel

            latent, _ = load_kernel().latent_decode(
                q_abs,
                p.q_rope,
                cache.pages[self.layer_idx],
                step.block_table,
                step.seq_lens,
                self.head_to_rope_on(q_abs.device),
                softmax_scale=self.softmax_scale,
                max_seq_len=step.max_seq_len,
                fp8=cache.fp8[self.layer_idx] if cache.fp8 is not None else None,
            )
            cache.backend_log[f"{kernel_backend()}:" + ("decode" if t == 1 else "prefill")] += 1
            return self._output(latent, folded)
        if not step.uniform:
            raise ValueError(
                "requests of different lengths need one token per step on the absorbed path (the triton path "
                f"takes any); got {t} new tokens for lengths {list(step.lengths)}"
            )
        rows = cache.gather_step(self.layer_idx).to(q_abs.dtype)
        d_c = self.kv_lora_rank
        cache.backend_log["absorbed-torch:" + ("decode" if t == 1 else "prefill")] += 1
        return self._attend_latent(q_abs, p.q_rope, rows[..., :d_c], rows[..., d_c:], mask, folded)

    def head_to_rope_on(self, device: torch.device) -> torch.Tensor:
        """:meth:`head_to_rope` on ``device``, built once per device (the decode step must not copy it per call)."""
        cached = self._head_to_rope.get(device)
        if cached is None:
            cached = self._head_to_rope[device] = self.head_to_rope(device)
        return cached

    def _absorbed(
        self,
        p: Projected,
        mask: torch.Tensor | None,
        cache: Cache | None,
        absorbed: bool = False,
        folded: FoldedWeights | None = None,
    ) -> torch.Tensor:
        b, t = p.c_kv.shape[:2]
        if cache is not None:
            c_all, kr_all = cache.update(p.c_kv.unsqueeze(1), p.k_rope.reshape(b, 1, t, -1), self.layer_idx)
            c_all, kr_all = c_all[:, 0], kr_all[:, 0]
        else:
            c_all, kr_all = p.c_kv, p.k_rope.reshape(b, t, -1)
        q_abs = p.q_nope if absorbed else self.absorb_query(p.q_nope)
        return self._attend_latent(q_abs, p.q_rope, c_all, kr_all, mask, folded)

    def _attend_latent(
        self,
        q_abs: torch.Tensor,
        q_rope: torch.Tensor,
        c_all: torch.Tensor,
        kr_all: torch.Tensor,
        mask: torch.Tensor | None,
        folded: FoldedWeights | None = None,
    ) -> torch.Tensor:
        """Absorbed attention over latent rows ``c_all [B, S, d_c]``, ``kr_all [B, S, R * d_R]`` (scores, softmax
        and latent sum in one SDPA call: :func:`~mla_convert.mla.algebra.attend_latent_fused`)."""
        latent = algebra.attend_latent_fused(
            q_abs, q_rope, c_all, kr_all, self.num_rope_heads, self.softmax_scale, mask
        )
        return self._output(latent, folded)

    def _naive(self, p: Projected, mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        w_uk, w_uv = self.up_weights()
        keys, values = algebra.expand_kv(p.c_kv, p.k_rope, w_uk, w_uv)  # [B, G, T, d_N + d_R], [B, G, T, d_V]
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx)
        probs = self._softmax(algebra.naive_scores(p.q_nope, p.q_rope, keys), mask)
        return self.o_proj(algebra.naive_output(probs, values))

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return algebra.attention_probs(scores, self.softmax_scale, mask)
