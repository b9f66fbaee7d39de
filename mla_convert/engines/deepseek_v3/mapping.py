"""The DeepSeek-V3 form of a converted MLA checkpoint: a config and tensors that stock transformers'
``DeepseekV3ForCausalLM``, vLLM's and SGLang's DeepSeek-V2/V3 models load (no code of ours) and that compute the
same function in each of them.

DeepSeek-V3 (arXiv:2412.19437, transformers ``models/deepseek_v3``, vLLM ``model_executor/models/deepseek_v2.py``)
is MLA with fixed conventions that a general conversion does not follow, and the engines read only a subset of
what transformers reads: no attention biases (skipped silently), only ``rope_type: default`` (any other type is
rewritten to their own DeepSeek scalings), ``rms_norm_eps`` for every norm (transformers hard-codes 1e-6 for
``kv_a_layernorm``), an explicit ``lm_head``. The mapping (docs/export.md gives the algebra) keeps to that subset:

* **One rope head, one plain rope_theta.** The kept pairs of every layer are placed in the *slots* of one
  geometric table ``theta^(-j/n)`` (:func:`rope_slots`): the kept frequencies are powers of one ratio (the source's
  table, or a sub-lattice of it); a layer's unused slots get zero rows. A kept set no plain theta expresses is
  refused (:class:`ExportError`) with the options that make it exportable. Interleaved layout
  (``rope_interleave: true``): our rotate_half pair ``(p, p + P)`` goes to dims ``(2 s, 2 s + 1)`` of slot ``s``.
* **Softmax scale.** DeepSeek scales scores by ``qk_head_dim ** -0.5``; ours is the source's. The ratio
  ``rho = softmax_scale * sqrt(qk_head_dim)`` is folded into every query row.
* **A bias-free latent norm.** DeepSeek RMS-normalises the latent; our model does not. The latent rows of
  ``kv_a_proj_with_mqa`` are scaled by a power of two ``beta`` so small that ``mean(c^2) <= 2^-24 eps`` for every
  input (a bound from the weights, :func:`latent_bound`): RMSNorm is then linear, ``c / sqrt(eps)`` to a relative
  ``2^-25``; ``kv_a_layernorm.weight`` and the ``kv_b_proj`` columns undo ``beta / sqrt(eps)``.
* **One epsilon.** Every norm uses ``rms_norm_eps = 1e-6`` (the value transformers applies to ``kv_a_layernorm``);
  the residual stream is scaled by ``s`` (embeddings, ``o_proj``, ``down_proj``; :func:`residual_scale`), so
  ``RMSNorm(s h; 1e-6) = RMSNorm(h; 1e-6 / s^2)``: the source's epsilon exactly in float32, the nearest power of
  two's in 16-bit (no second rounding); ``lm_head`` is written unscaled.
* **Engine shapes** (:data:`TARGETS`). ``transformers``: the checkpoint's widths. ``vllm``: ``kv_lora_rank`` 512,
  rope 64 (FlashMLA) and a (qk_nope, v_head) pair vLLM's GPU prefill accepts. ``vllm-cpu``: 512 + 64 with qk_nope
  and v_head 128 (``AMX_MLA``). Padding is zero rows and columns (cached zeros in the latent).
* **Per query head kv_b_proj.** A GQA source's block of KV head ``g`` is repeated for its query heads (weights
  only; the cache is the latent).

Refused: several rope heads, attention or MLP biases (Qwen2: vLLM and SGLang drop them), float16 (the scaled
latent is subnormal there), kept frequencies of a scaled source RoPE that no plain table gives (the pairs llama3
and YaRN leave unscaled, the fastest ones, are a plain table and export: ``engines/precheck.py``).
Everything is computed in float64 from the stored tensors and rounded once to the checkpoint's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mla_convert.engines.deepseek_v3.spec import RopeSlots, rope_slots
from mla_convert.engines.registry import TARGETS
from mla_convert.engines.vllm.spec import (
    PLUGIN_ROUTE,
    VLLM_CPU_HEAD_DIMS,
    VLLM_GPU_HEAD_DIMS,
    VLLM_KV_LORA_RANK,
    engine_nope_width,
)
from mla_convert.errors import ExportError
from mla_convert.mla.export_reader import DS_NORM_EPS

#: The expert keys of a dense export (``config.json``): every count 0. transformers' ``DeepseekV3Config`` takes ints
#: only (no null) and would default absent keys to DeepSeek-V3's 256 experts; vLLM, SGLang and MLX-LM build MoE only
#: for layers at or above ``first_k_dense_replace`` (``num_hidden_layers`` here); llama.cpp's ``convert_hf_to_gguf.py``
#: writes these counts as ``expert_count``, ``expert_used_count``, ``expert_group_count``, ``expert_group_used_count``,
#: ``expert_shared_count``, and llama.cpp requires all of them 0 when there are no experts (it aborts on 1).
DENSE_EXPERT_KEYS = {"n_shared_experts": 0, "n_routed_experts": 0, "n_group": 0, "topk_group": 0, "num_experts_per_tok": 0}
#: The epsilon MLX-LM's DeepSeek-V3 hard-codes for ``kv_a_layernorm`` (``mlx_lm/models/deepseek_v3.py``, 0.32.2), as
#: transformers does: the bias-free latent norm is exact in both because it is :data:`DS_NORM_EPS`.
MLX_KV_A_NORM_EPS = 1e-6
#: ``mean((beta c)^2) <= LINEAR_MARGIN * 2 * eps``: the latent norm's deviation from linear, relative, for any input.
LINEAR_MARGIN = 2.0**-25
#: The decode backend each target expects.
BACKENDS = {"transformers": "eager/SDPA (transformers)", "vllm": "FLASHMLA", "vllm-cpu": "AMX_MLA"}


@dataclass
class ExportPlan:
    """The DeepSeek-V3 shape of one converted checkpoint and every mapping choice (recorded in the manifest).

    Attributes:
        config: keyword arguments of ``transformers.DeepseekV3Config``.
        target: one of :data:`TARGETS`.
        rope: the rope slots.
        kv_lora_rank: DeepSeek's latent width (``>= max`` of the checkpoint's per-layer ranks).
        query_scale: ``rho``, folded into the query rows.
        residual_scale: ``s`` of the residual stream (:func:`residual_scale`).
        dtype: torch dtype the tensors are written in.
        ranks: the checkpoint's per-layer ``kv_lora_rank``.
        source_norm_eps: the checkpoint's ``rms_norm_eps``.
        qk_nope_head_dim / v_head_dim: DeepSeek's widths (the checkpoint's, zero-padded).
        cache_values_per_token: ``source`` (K and V), ``mla`` (the checkpoint, mean over layers) and
            ``deepseek_v3`` (what the engine allocates) values per token per layer.
    """

    config: dict[str, Any]
    target: str
    rope: RopeSlots
    kv_lora_rank: int
    query_scale: float
    residual_scale: float
    dtype: torch.dtype
    ranks: list[int]
    qk_nope_head_dim: int
    v_head_dim: int
    source_norm_eps: float = DS_NORM_EPS
    cache_values_per_token: dict[str, float] = field(default_factory=dict)

    @property
    def norm_eps(self) -> float:
        """The epsilon the exported hidden-state norms apply in the source's units: ``DS_NORM_EPS / s^2``."""
        return DS_NORM_EPS / self.residual_scale**2

    def record(self) -> dict[str, Any]:
        """The mapping choices as JSON (manifest ``export`` field)."""
        return {
            "format": "deepseek-v3",
            "target": self.target,
            "backend": BACKENDS[self.target],
            "kv_lora_rank": self.kv_lora_rank,
            "latent_padding": [self.kv_lora_rank - r for r in self.ranks],
            "latent_norm": {"kind": "linear", "eps": DS_NORM_EPS, "margin": LINEAR_MARGIN},
            "residual_scale": self.residual_scale,
            "norm_eps": {"config": DS_NORM_EPS, "effective": self.norm_eps, "source": self.source_norm_eps},
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            "query_scale": self.query_scale,
            "rope": {
                "kind": "default",
                "parameters": self.rope.parameters,
                "slots": len(self.rope.inv_freq),
                "slots_used": self.rope.used,
                "max_rel_error": self.rope.max_rel_error,
                "interleaved": True,
            },
            "cache_values_per_token_per_layer": self.cache_values_per_token,
            "dtype": str(self.dtype).replace("torch.", ""),
        }


def top_level_keys(plan: ExportPlan) -> dict[str, Any]:
    """``config.json`` keys written beside what ``DeepseekV3Config.save_pretrained`` writes: ``rope_theta`` at the top
    level, equal to ``rope_parameters.rope_theta`` (transformers 5 folds a top-level ``rope_theta`` into
    ``rope_parameters`` and does not write it back; MLX-LM's DeepSeek-V3 reads only the top-level key and defaults to
    10000, a different function; llama.cpp's converter reads either)."""
    return {"rope_theta": plan.rope.parameters["rope_theta"]}


# ------------------------------------------------------------------------------------------------ rope
# ------------------------------------------------------------------------------------------------ plan
def _head_dims(target: str, d_n: int, d_v: int, head_dim: int, d_r: int, dtype: torch.dtype) -> tuple[int, int]:
    """(qk_nope_head_dim, v_head_dim) of the export: the checkpoint's, or the smallest engine shape holding them."""
    if target == "transformers":
        if dtype == torch.float32:
            return d_n, d_v
        qk = head_dim
        while qk < d_n + d_r:
            qk *= 4
        return qk - d_r, d_v  # rho = softmax_scale * sqrt(qk) = 2^k: exact in 16-bit
    shapes = VLLM_GPU_HEAD_DIMS if target == "vllm" else VLLM_CPU_HEAD_DIMS
    for nope, _, v in shapes:
        if d_n <= nope and d_v <= v:
            return nope, v
    raise ExportError(
        f"qk_nope_head_dim {d_n} / v_head_dim {d_v} exceed every shape --target {target} accepts "
        f"({', '.join(f'{a}/{c}' for a, _, c in shapes)}); convert with --qk-nope-head-dim "
        f"{engine_nope_width(target, d_v, None) or shapes[-1][0]} (a per-head low-rank of the NoPE score, exact when "
        "it is at least min(head_dim, kv_lora_rank)) or export with --target transformers"
    )


def plan_export(config: Any, dtype: torch.dtype, target: str = "transformers") -> ExportPlan:
    """The DeepSeek-V3 config and mapping of a converted checkpoint's :class:`~mla_convert.mla.configuration.MLAConfig`.

    Raises:
        ExportError: an unknown target, several rope heads, no rope pair, biases, float16, a latent norm of its
            own, a rope set no plain theta expresses, widths the target does not take; each message says what
            to convert or export with instead.
    """
    c = config
    if target not in TARGETS:
        raise ExportError(f"--target {target!r} is not one of {', '.join(TARGETS)} (SGLang: --target vllm)")
    if c.num_rope_heads != 1:
        raise ExportError(
            f"this checkpoint has {c.num_rope_heads} rope heads (a per-head conversion); DeepSeek-V3 has one shared "
            "rope head: convert it again with factor (one shared rope head) to export it"
        )
    if c.latent_norm:
        raise ExportError("this checkpoint has a latent norm of its own; only mla-convert factor outputs export")
    if getattr(c, "mlp_bias", False):
        raise ExportError("the source MLP has biases; DeepSeek-V3's dense MLP has none, so it cannot be exported")
    if c.q_bias or c.kv_a_bias or c.o_bias:
        raise ExportError(
            "the source has attention biases (Qwen2-style q/k/v biases): vLLM and SGLang build DeepSeek attention "
            "without biases and drop them silently, so no DeepSeek-V3 export is exact there; instead, "
            f"{PLUGIN_ROUTE}"
        )
    if dtype == torch.float16:
        raise ExportError(
            "--dtype float16 cannot hold the bias-free latent norm (its scaled latent is subnormal in float16); "
            "export as bfloat16 or float32"
        )
    if not c.qk_rope_head_dim:
        raise ExportError("the checkpoint keeps no RoPE pair; DeepSeek-V3 needs a rope head (convert with --rope-pairs >= 1)")
    ranks = list(c.kv_lora_rank)
    engine = target != "transformers"
    rope = rope_slots(c.rope_inv_freq, VLLM_GPU_HEAD_DIMS[0][1] // 2 if engine else None)
    d_r = 2 * len(rope.inv_freq)
    head_dim = round(float(c.softmax_scale) ** -2)
    d_nope, d_v = _head_dims(target, c.qk_nope_head_dim, c.v_head_dim, head_dim, d_r, dtype)
    if engine and max(ranks) > VLLM_KV_LORA_RANK:
        raise ExportError(
            f"kv_lora_rank {max(ranks)} is over {VLLM_KV_LORA_RANK}, the latent vLLM's MLA backends take; convert with "
            f"--kv-lora-rank {VLLM_KV_LORA_RANK} or less, or export with --target transformers"
        )
    d_lat = VLLM_KV_LORA_RANK if engine else max(ranks)
    cfg: dict[str, Any] = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        # a dense model has no experts: counts 0 (transformers and vLLM build a dense MLP below first_k_dense_replace
        # and never read them; llama.cpp's converter copies them into GGUF keys and llama.cpp aborts on 1 expert)
        **DENSE_EXPERT_KEYS,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": c.num_hidden_layers,  # every layer a dense DeepseekV3MLP
        "num_nextn_predict_layers": 0,
        "kv_lora_rank": d_lat,
        "q_lora_rank": None,
        "qk_rope_head_dim": d_r,
        "qk_nope_head_dim": d_nope,
        "v_head_dim": d_v,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": DS_NORM_EPS,
        "tie_word_embeddings": False,  # engines do not tie DeepSeek's lm_head: it is written
        "rope_parameters": rope.parameters,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
    }
    d_src = 2 * int(c.source.get("num_key_value_heads", c.num_key_value_heads)) * head_dim  # the source's KV heads
    return ExportPlan(
        config=cfg,
        target=target,
        rope=rope,
        kv_lora_rank=d_lat,
        query_scale=float(c.softmax_scale) * math.sqrt(d_nope + d_r),
        residual_scale=residual_scale(float(c.rms_norm_eps), dtype),
        source_norm_eps=float(c.rms_norm_eps),
        dtype=dtype,
        ranks=ranks,
        qk_nope_head_dim=d_nope,
        v_head_dim=d_v,
        cache_values_per_token={
            "source": float(d_src),
            "mla": sum(r + c.qk_rope_head_dim for r in ranks) / len(ranks),
            "deepseek_v3": float(d_lat + d_r),
        },
    )


def residual_scale(source_eps: float, dtype: torch.dtype) -> float:
    """``s`` scaling the residual stream so that ``RMSNorm(s h; DS_NORM_EPS) = RMSNorm(h; DS_NORM_EPS / s^2)``.

    float32: ``sqrt(DS_NORM_EPS / source_eps)``, the source's epsilon exactly (the scaled writers round once, at
    float32 precision). 16-bit: the power of two nearest to it (log scale), so no weight is rounded a second time;
    the norms then apply ``DS_NORM_EPS / s^2`` (SmolLM2's 1e-5 -> 1.6e-5; measured on the reference conversion:
    max |Δlogit| 0.077 in float32, against 0.33 for rounding its weights to bfloat16).
    """
    exact = math.sqrt(DS_NORM_EPS / source_eps)
    return exact if dtype == torch.float32 else 2.0 ** round(math.log2(exact))


# ------------------------------------------------------------------------------------------------ tensors
def _pow2_at_most(x: float) -> float:
    """The largest power of two ``<= x`` (``x > 0``)."""
    return 2.0 ** math.floor(math.log2(x))


def _stored(x: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(dtype).double())


def latent_bound(w_c: torch.Tensor, b_c: torch.Tensor | None, gamma: torch.Tensor) -> float:
    """An upper bound on ``|W_c x + b_c|_2`` over every layer input ``x = gamma * h / rms(h)`` (RMSNorm output).

    ``|h / rms(h)|_2 <= sqrt(D)`` for any ``h`` (``D`` = hidden size), so
    ``|W_c x + b_c| <= ||W_c||_2 max|gamma| sqrt(D) + |b_c|``: a bound from the weights, for every token.
    """
    d = gamma.numel()
    bound = float(torch.linalg.matrix_norm(w_c.double(), ord=2)) * float(gamma.double().abs().max()) * math.sqrt(d)
    return bound + (float(b_c.double().norm()) if b_c is not None else 0.0)


def latent_scale(bound: float, width: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """``(beta, w, fold)`` of the bias-free latent norm of a ``width``-wide latent with ``|c|_2 <= bound``.

    ``beta`` (a power of two) makes ``mean((beta c)^2) <= 2 LINEAR_MARGIN eps``, so
    ``RMSNorm(beta c) = w beta c / sqrt(eps)`` to ``LINEAR_MARGIN`` relative; ``w`` is ``sqrt(eps) / beta`` as
    ``dtype`` stores it, and ``fold = sqrt(eps) / (beta w)`` (1 up to ``w``'s rounding) multiplies ``kv_b_proj``.
    """
    beta = _pow2_at_most(math.sqrt(2 * LINEAR_MARGIN * DS_NORM_EPS * width) / bound) if bound > 0 else 1.0
    w = _stored(math.sqrt(DS_NORM_EPS) / beta, dtype)
    return beta, w, math.sqrt(DS_NORM_EPS) / (beta * w)


def _rope_rows(rows: torch.Tensor, slots: list[int], n_slots: int) -> torch.Tensor:
    """Our rotate_half rope rows ``[2P, ...]`` (pair p = rows p, p + P) -> interleaved slots ``[2 P', ...]``."""
    p = len(slots)
    out = rows.new_zeros((2 * n_slots, *rows.shape[1:]))
    for i, s in enumerate(slots):
        out[2 * s] = rows[i]
        out[2 * s + 1] = rows[i + p]
    return out


def export_attention(
    plan: ExportPlan, config: Any, layer: int, t: Mapping[str, torch.Tensor], gamma: torch.Tensor
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 attention tensors of one layer (names inside ``self_attn.``), in ``plan.dtype``.

    Args:
        plan: from :func:`plan_export`.
        config: the checkpoint's MLAConfig.
        layer: layer index.
        t: the layer's MLA tensors, names inside ``self_attn.`` (``q_proj.weight [H (d_N + d_R), D]``,
            ``kv_a_proj_with_mqa.weight [d_c + d_R, D]``, ``kv_b_proj.weight [G (d_N + d_V), d_c]``,
            ``o_proj.weight [D, H d_V]``).
        gamma: ``[D]`` the layer's ``input_layernorm.weight`` (bounds the layer input).

    Returns:
        ``q_proj.weight [H (d_N' + d_R'), D]``, ``kv_a_proj_with_mqa.weight [d' + d_R', D]``,
        ``kv_a_layernorm.weight [d']``, ``kv_b_proj.weight [H (d_N' + d_V'), d']``, ``o_proj.weight [D, H d_V']``.
    """
    c, dt = config, plan.dtype
    h, g = c.num_attention_heads, c.num_key_value_heads
    d_n, d_r, d_v, dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.hidden_size
    r = c.kv_lora_rank[layer]
    slots, n_slots = plan.rope.slots[layer], len(plan.rope.inv_freq)
    d_lat, pad, v_pad = plan.kv_lora_rank, plan.qk_nope_head_dim - d_n, plan.v_head_dim - d_v
    # 16-bit: start from the tensors as the export's dtype holds them, so that factors within half a unit of 1
    # (the norm weight's rounding in kv_b_proj) round back to them instead of moving some weights by one unit
    f64 = {k: (v if dt == torch.float32 else v.to(dt)).double() for k, v in t.items()}

    # queries: [nope | zero pad | interleaved rope slots] per head, times rho
    wq = f64["q_proj.weight"].view(h, d_n + d_r, dim)
    heads = [torch.cat([wq[i, :d_n], wq.new_zeros(pad, dim), _rope_rows(wq[i, d_n:], slots, n_slots)]) for i in range(h)]
    out: dict[str, torch.Tensor] = {"q_proj.weight": torch.cat(heads) * plan.query_scale}

    # latent: [beta c_kv | zero padding | interleaved k_rope slots]; the norm is linear on it
    wa = f64["kv_a_proj_with_mqa.weight"]
    beta, w, fold = latent_scale(latent_bound(wa[:r], None, gamma), d_lat, dt)
    kv_a = torch.zeros(d_lat + 2 * n_slots, dim, dtype=torch.float64)
    kv_a[:r] = wa[:r] * beta
    kv_a[d_lat:] = _rope_rows(wa[r:], slots, n_slots)
    out["kv_a_proj_with_mqa.weight"] = kv_a
    out["kv_a_layernorm.weight"] = torch.full((d_lat,), w, dtype=torch.float64)

    # kv_b: one [k_nope | zero pad | v | zero pad] block per query head
    wb = f64["kv_b_proj.weight"].view(g, d_n + d_v, r) * fold
    wb = torch.cat([wb[:, :d_n], wb.new_zeros(g, pad, r), wb[:, d_n:], wb.new_zeros(g, v_pad, r)], dim=1)
    per_head = wb.repeat_interleave(h // g, dim=0)  # query head h reads KV head h // (H / G)
    kv_b = torch.zeros(h * (plan.qk_nope_head_dim + plan.v_head_dim), d_lat, dtype=torch.float64)
    kv_b[:, :r] = per_head.reshape(-1, r)
    out["kv_b_proj.weight"] = kv_b
    wo = f64["o_proj.weight"].view(dim, h, d_v) * plan.residual_scale
    out["o_proj.weight"] = torch.cat([wo, wo.new_zeros(dim, h, v_pad)], dim=2).reshape(dim, -1)
    return {k: v.to(dt).contiguous() for k, v in out.items()}


def attention_layout(plan: ExportPlan, config: Any) -> dict[str, tuple[int, ...]]:
    """Shapes of :func:`export_attention`'s tensors (names inside ``self_attn.``)."""
    c = config
    h, dim = c.num_attention_heads, c.hidden_size
    d_r = 2 * len(plan.rope.inv_freq)
    return {
        "q_proj.weight": (h * (plan.qk_nope_head_dim + d_r), dim),
        "kv_a_proj_with_mqa.weight": (plan.kv_lora_rank + d_r, dim),
        "kv_a_layernorm.weight": (plan.kv_lora_rank,),
        "kv_b_proj.weight": (h * (plan.qk_nope_head_dim + plan.v_head_dim), plan.kv_lora_rank),
        "o_proj.weight": (dim, h * plan.v_head_dim),
    }


#: Tensors of the residual stream's writers (times ``residual_scale``), by name suffix.
RESIDUAL_WRITERS = ("model.embed_tokens.weight", ".mlp.down_proj.weight")


def export_other(plan: ExportPlan, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A non-attention tensor as exported: the residual stream's writers times ``residual_scale``, the rest as
    stored, in ``plan.dtype``."""
    stored = tensor.to(plan.dtype)  # 16-bit: rounded first, then times a power of two (exact)
    t = stored.double() * plan.residual_scale if name.endswith(RESIDUAL_WRITERS) else stored
    return t.to(plan.dtype).contiguous()


def other_names(names: list[str]) -> list[str]:
    """The non-attention tensors of an export, in order: the checkpoint's, plus ``lm_head.weight`` (a tied
    checkpoint stores none; engines do not tie DeepSeek's head)."""
    out = [n for n in names if ".self_attn." not in n and not n.endswith("rope_inv_freq")]
    return out if "lm_head.weight" in out else [*out, "lm_head.weight"]


def export_state_dict(
    model: Any, dtype: torch.dtype | None = None, target: str = "transformers"
) -> tuple[ExportPlan, dict[str, torch.Tensor]]:
    """The DeepSeek-V3 plan and full state dict of an in-memory :class:`~mla_convert.mla.modeling.MLAForCausalLM`
    (tests and small models; ``mla-convert export`` streams layer by layer instead)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    dt = dtype or state["model.embed_tokens.weight"].dtype
    plan = plan_export(model.config, dt, target)
    return plan, dict(map_tensors(plan, model.config, list(state), state.__getitem__))


def map_tensors(
    plan: ExportPlan, config: Any, names: list[str], read: Callable[[str], torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Every exported tensor, in order: attention tensors through :func:`export_attention`, the rest through
    :func:`export_other` (``lm_head.weight`` read as the embedding when the checkpoint ties it);
    ``rope_inv_freq`` buffers are dropped (the config's rope parameters carry them)."""
    out: list[tuple[str, torch.Tensor]] = []
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.self_attn."
        attn = {n[len(prefix):]: read(n) for n in names if n.startswith(prefix) and not n.endswith("rope_inv_freq")}
        gamma = read(f"model.layers.{i}.input_layernorm.weight")
        out += [(prefix + k, v) for k, v in export_attention(plan, config, i, attn, gamma).items()]
    for name in other_names(names):
        src = name if name in names else "model.embed_tokens.weight"
        out.append((name, export_other(plan, name, read(src))))
    return out
