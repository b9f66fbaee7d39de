"""The DeepSeek-V3 form of a converted MLA checkpoint: a config and tensors that stock transformers'
``DeepseekV3ForCausalLM`` loads (no code of ours, no remote code) and that compute the same function.

DeepSeek-V3 (arXiv:2412.19437, transformers ``models/deepseek_v3``) is MLA with fixed conventions that a
general conversion does not follow. Each difference is mapped exactly (docs/export.md gives the algebra):

* **One rope head, one rope config.** DeepSeek has one shared ``k_rope`` head and one RoPE frequency table
  for all layers. Per-head conversions (several rope heads) are refused. The kept pairs of every layer are
  placed in *slots* of one common frequency list (:func:`rope_slots`): the union of the layers' kept
  frequencies, each with the largest multiplicity any layer keeps it; a layer's unused slots get zero rows.
  When the list is a geometric sequence starting at 1 rad/token it is ``rope_type: default`` with a derived
  ``rope_theta``; otherwise ``longrope`` with per-frequency factors (``short_factor == long_factor``,
  ``attention_factor`` 1): exact in transformers. The weights use DeepSeek's interleaved layout
  (``rope_interleave: true``): our rotate_half pair ``(p, p + P)`` goes to dims ``(2 s, 2 s + 1)`` of slot ``s``.
* **Softmax scale.** DeepSeek scales scores by ``qk_head_dim ** -0.5``; ours is the source's. The ratio
  ``rho = softmax_scale * sqrt(qk_head_dim)`` is folded into every query row.
* **kv_a_layernorm.** DeepSeek RMS-normalises the latent; our model does not. The latent gets one constant
  channel: ``kv_a_proj_with_mqa`` bias ``K`` (:func:`norm_constants`) on an extra row, the real latent rows scaled
  by a power of two ``alpha`` so that ``alpha * |c_kv| <= K / 4096`` for every input (a bound from the weights,
  :func:`latent_bound`). The RMS is then ``sqrt(K^2 / d' + eps)`` to a relative ``<= 2^-25`` for any token;
  the norm weight and ``kv_b_proj`` columns undo the constant scale. The extra channel is one cached value.
* **One kv_lora_rank.** Per-layer ranks are padded with zero latent channels to the largest (cached zeros).
* **Per query head kv_b_proj.** DeepSeek's ``kv_b_proj`` has one ``[k_nope | v]`` block per query head; a GQA
  source's block of KV head ``g`` is repeated for its query heads (weights only; the cache is the latent).
* **Biases.** ``attention_bias: true`` (the constant channel needs it): ``kv_a_proj_with_mqa`` carries our rope
  key bias, ``o_proj`` our output bias (zeros when none). A query bias (Qwen2) goes through the low-rank query
  path: ``q_a_proj`` = ``alpha_q I`` plus a constant channel (bias ``K``), ``q_a_layernorm``, ``q_b_proj`` =
  the query weights with the bias as the constant channel's column (``q_lora_rank = hidden + 1``).

Everything is computed in float64 from the stored tensors and rounded once to the checkpoint's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mla_convert.errors import UserError

#: ``alpha * (bound on |c_kv|) <= K * MARGIN`` (``K`` the constant channel, :func:`norm_constants`): the RMS
#: deviates from its constant by at most ``MARGIN^2 / 2`` relative, for any input.
MARGIN = 2.0**-12
#: transformers' ``DeepseekV3RMSNorm`` default epsilon, used by ``kv_a_layernorm`` and ``q_a_layernorm``
#: (vLLM and SGLang use ``rms_norm_eps``; with ``K^2 / d' ~ 1000`` either moves the RMS by < 1e-8).
DS_NORM_EPS = 1e-6
#: Largest relative difference between a kept frequency and the ``default`` rope's float32 table for the
#: kept list to be written as ``rope_type: default``.
GEOMETRIC_RTOL = 1e-6
#: rope_theta of a ``longrope`` export (the factors carry the frequencies; any base gives the same table).
LONGROPE_BASE = 10000.0


class ExportError(UserError):
    """A checkpoint the DeepSeek-V3 format cannot express, or a folder that is not an MLA checkpoint."""


@dataclass(frozen=True)
class RopeSlots:
    """Where each layer's kept RoPE pairs go in DeepSeek's one rope head.

    Attributes:
        inv_freq: ``[P']`` the slots' inverse frequencies (radians per token), decreasing.
        slots: ``[L][P]`` the slot of each kept pair of each layer.
        parameters: the ``rope_parameters`` of the DeepSeek-V3 config.
        kind: ``"default"`` (geometric list from 1) or ``"longrope"`` (per-frequency factors).
        max_rel_error: largest relative difference between ``inv_freq`` and the table transformers computes
            (float32) from ``parameters``.
    """

    inv_freq: list[float]
    slots: list[list[int]]
    parameters: dict[str, Any]
    kind: str
    max_rel_error: float


@dataclass
class ExportPlan:
    """The DeepSeek-V3 shape of one converted checkpoint and every mapping choice (recorded in the manifest).

    Attributes:
        config: keyword arguments of ``transformers.DeepseekV3Config``.
        rope: the rope slots.
        kv_lora_rank: DeepSeek's latent width ``d' = max(kv_lora_rank) + 1`` (the constant channel last).
        q_lora_rank: ``hidden + 1`` when the source has a query bias, else None (a plain ``q_proj``).
        query_scale: ``rho``, folded into the query rows.
        dtype: torch dtype the tensors are written in.
        ranks: the checkpoint's per-layer ``kv_lora_rank``.
        qk_nope_head_dim: DeepSeek's NoPE width; in 16-bit exports the checkpoint's, padded with zero dims so
            that ``rho`` is a power of two (the query rows then round to exactly the stored values).
        latent_norm: ``(constant, norm weight)`` of the latent's constant channel (:func:`norm_constants`).
        query_norm: the same for the query path's constant channel (``q_lora_rank``), or None.
        cache_values_per_token: ``mla`` (the checkpoint, mean over layers) and ``deepseek_v3`` per token per layer.
    """

    config: dict[str, Any]
    rope: RopeSlots
    kv_lora_rank: int
    q_lora_rank: int | None
    query_scale: float
    dtype: torch.dtype
    ranks: list[int]
    qk_nope_head_dim: int
    latent_norm: tuple[float, float]
    query_norm: tuple[float, float] | None
    cache_values_per_token: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The mapping choices as JSON (manifest ``export`` field)."""
        return {
            "format": "deepseek-v3",
            "kv_lora_rank": self.kv_lora_rank,
            "latent_padding": [self.kv_lora_rank - r for r in self.ranks],
            "constant_channel": {
                "value": self.latent_norm[0],
                "norm_weight": self.latent_norm[1],
                "query_path": list(self.query_norm) if self.query_norm else None,
                "margin": MARGIN,
                "norm_eps": DS_NORM_EPS,
            },
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "query_scale": self.query_scale,
            "rope": {
                "kind": self.rope.kind,
                "parameters": self.rope.parameters,
                "slots": len(self.rope.inv_freq),
                "max_rel_error": self.rope.max_rel_error,
                "interleaved": True,
            },
            "cache_values_per_token_per_layer": self.cache_values_per_token,
            "dtype": str(self.dtype).replace("torch.", ""),
        }


# ------------------------------------------------------------------------------------------------ rope
def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def rope_slots(inv_freq: list[list[list[float]]]) -> RopeSlots:
    """Common slots for the kept pairs of every layer (module docstring).

    Args:
        inv_freq: ``[L][1][P]`` the checkpoint's ``rope_inv_freq`` (one rope head per layer).

    Returns:
        The slots; ``P' >= P`` (more when layers keep different frequencies).
    """
    per_layer = [[_f32(f) for f in layer[0]] for layer in inv_freq]
    need: dict[float, int] = {}
    for freqs in per_layer:
        for f in set(freqs):
            need[f] = max(need.get(f, 0), freqs.count(f))
    table = sorted((f for f, n in need.items() for _ in range(n)), reverse=True)
    slots: list[list[int]] = []
    for freqs in per_layer:
        used: set[int] = set()
        mine = []
        for f in freqs:
            s = next(i for i, g in enumerate(table) if g == f and i not in used)
            used.add(s)
            mine.append(s)
        slots.append(mine)
    kind, params = _rope_parameters(table)
    got = _transformers_inv_freq(params, len(table))
    want = torch.tensor(table, dtype=torch.float64)
    err = float(((got.double() - want).abs() / want.abs().clamp_min(1e-30)).max()) if table else 0.0
    return RopeSlots(table, slots, params, kind, err)


def _rope_parameters(table: list[float]) -> tuple[str, dict[str, Any]]:
    n = len(table)
    if n and table[0] == 1.0 and len(set(table)) == n:
        theta = LONGROPE_BASE if n == 1 else math.exp(-n * math.log(table[-1]) / (n - 1))
        params = {"rope_type": "default", "rope_theta": theta}
        got = _transformers_inv_freq(params, n).double()
        want = torch.tensor(table, dtype=torch.float64)
        if n == 1 or float(((got - want).abs() / want).max()) < GEOMETRIC_RTOL:
            return "default", params
    shape = torch.arange(0, 2 * n, 2, dtype=torch.float64) / max(2 * n, 1)
    factors = (1.0 / (torch.tensor(table, dtype=torch.float64) * LONGROPE_BASE**shape)).tolist()
    return "longrope", {
        "rope_type": "longrope",
        "rope_theta": LONGROPE_BASE,
        "short_factor": factors,
        "long_factor": factors,
        "factor": 1.0,
        "attention_factor": 1.0,
    }


def _transformers_inv_freq(params: Mapping[str, Any], n: int) -> torch.Tensor:
    """The ``[n]`` inverse frequencies transformers computes from ``params`` (its own formulas, float32)."""
    if not n:
        return torch.zeros(0)
    shape = torch.arange(0, 2 * n, 2, dtype=torch.int64).float() / (2 * n)
    base = torch.tensor(params["rope_theta"], dtype=torch.float32)
    if params["rope_type"] == "default":
        return 1.0 / (base**shape)
    return 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * base**shape)


# ------------------------------------------------------------------------------------------------ plan
def plan_export(config: Any, dtype: torch.dtype) -> ExportPlan:
    """The DeepSeek-V3 config and mapping of a converted checkpoint's :class:`~mla_convert.mla.configuration.MLAConfig`.

    Raises:
        ExportError: several rope heads (a ``per-head`` conversion), a latent norm, an MLP bias or an activation
            DeepSeek's MLP does not take; each message says which conversion to run instead.
    """
    c = config
    if c.num_rope_heads != 1:
        raise ExportError(
            f"this checkpoint has {c.num_rope_heads} rope heads (a per-head conversion); DeepSeek-V3 has one shared "
            "rope head: convert with --rope-mode shared to export it"
        )
    if c.latent_norm:
        raise ExportError("this checkpoint has a latent norm of its own; only mla-convert factor outputs export")
    if getattr(c, "mlp_bias", False):
        raise ExportError("the source MLP has biases; DeepSeek-V3's dense MLP has none, so it cannot be exported")
    ranks = list(c.kv_lora_rank)
    rope = rope_slots(c.rope_inv_freq) if c.qk_rope_head_dim else RopeSlots([], [[] for _ in ranks], {
        "rope_type": "default", "rope_theta": LONGROPE_BASE}, "default", 0.0)
    d_r = 2 * len(rope.inv_freq)
    if d_r == 0:
        raise ExportError("the checkpoint keeps no RoPE pair; DeepSeek-V3 needs a rope head (convert with --rope-pairs >= 1)")
    d_nope = c.qk_nope_head_dim
    head_dim = round(float(c.softmax_scale) ** -2)
    if dtype != torch.float32 and abs(head_dim * float(c.softmax_scale) ** 2 - 1) < 1e-9:
        qk = head_dim
        while qk < d_nope + d_r:
            qk *= 4
        d_nope = qk - d_r  # rho = softmax_scale * sqrt(qk) = 2^k: exact in any dtype
    qk_head_dim = d_nope + d_r
    d_lat = max(ranks) + 1
    q_lora = c.hidden_size + 1 if c.q_bias else None
    eos = c.eos_token_id
    cfg: dict[str, Any] = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "n_shared_experts": 1,
        "n_routed_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 1,
        "first_k_dense_replace": c.num_hidden_layers,  # every layer a dense DeepseekV3MLP
        "num_nextn_predict_layers": 0,
        "kv_lora_rank": d_lat,
        "q_lora_rank": q_lora,
        "qk_rope_head_dim": d_r,
        "qk_nope_head_dim": d_nope,
        "v_head_dim": c.v_head_dim,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "rope_parameters": rope.parameters,
        "rope_interleave": True,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": c.pad_token_id,
    }
    source_cache = [r + c.num_rope_heads * c.qk_rope_head_dim for r in ranks]
    return ExportPlan(
        config=cfg,
        rope=rope,
        kv_lora_rank=d_lat,
        q_lora_rank=q_lora,
        query_scale=float(c.softmax_scale) * math.sqrt(qk_head_dim),
        dtype=dtype,
        ranks=ranks,
        qk_nope_head_dim=d_nope,
        latent_norm=norm_constants(d_lat, dtype),
        query_norm=norm_constants(q_lora, dtype) if q_lora else None,
        cache_values_per_token={
            "mla": sum(source_cache) / len(ranks),
            "deepseek_v3": float(d_lat + d_r),
        },
    )


# ------------------------------------------------------------------------------------------------ tensors
def norm_constants(width: int, dtype: torch.dtype) -> tuple[float, float]:
    """``(K, w)``: the constant channel's value and the RMSNorm weight of a ``width``-wide normalised vector,
    both exactly representable in ``dtype``, with ``w`` as close as the dtype allows to the RMS
    ``sqrt(K^2 / width + eps)`` (``w`` near 32; searched over the two binades around it).

    The scale the norm leaves, ``w / RMS = 1 + delta``, is then folded into ``kv_b_proj`` as ``1 / alpha``
    times ``1 + delta``; in 16-bit dtypes ``|delta|`` (~1e-5 for bfloat16) is far below half a unit in the last
    place, so the folded weights round to exactly the stored MLA weights times a power of two.
    """
    best: tuple[float, float, float] | None = None
    finfo = torch.finfo(dtype)
    mant = 2 ** max(0, min(12, int(round(-math.log2(finfo.eps)))))
    for e in (4, 5):
        for m in range(mant, 2 * mant):
            w = m / mant * 2.0**e
            if _stored(w, dtype) != w:
                continue
            k = _stored(math.sqrt(width * (w * w - DS_NORM_EPS)), dtype)
            delta = abs(math.sqrt(k * k / width + DS_NORM_EPS) / w - 1)
            if best is None or delta < best[0]:
                best = (delta, k, w)
    assert best is not None
    return best[1], best[2]



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
            ``o_proj.weight [D, H d_V]``, optional biases).
        gamma: ``[D]`` the layer's ``input_layernorm.weight`` (bounds the layer input).
    """
    c, dt = config, plan.dtype
    h, g = c.num_attention_heads, c.num_key_value_heads
    d_n, d_r, d_v, dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.hidden_size
    r = c.kv_lora_rank[layer]
    slots, n_slots = plan.rope.slots[layer], len(plan.rope.inv_freq)
    d_lat = plan.kv_lora_rank
    f64 = {k: v.double() for k, v in t.items()}

    # queries: [nope | zero pad | rope] per head -> [nope (d_N') | interleaved slots], times rho
    pad = plan.qk_nope_head_dim - d_n
    wq = f64["q_proj.weight"].view(h, d_n + d_r, dim)
    bq = f64["q_proj.bias"].view(h, d_n + d_r) if "q_proj.bias" in f64 else None

    def q_rows(x: torch.Tensor) -> torch.Tensor:  # [H, d_N + d_R, ...] -> [H (d_N' + 2 P'), ...]
        zeros = x.new_zeros((pad, *x.shape[2:]))
        heads = [torch.cat([x[i, :d_n], zeros, _rope_rows(x[i, d_n:], slots, n_slots)]) for i in range(h)]
        return torch.cat(heads) * plan.query_scale

    out: dict[str, torch.Tensor] = {}
    if plan.q_lora_rank is None or plan.query_norm is None:
        out["q_proj.weight"] = q_rows(wq)
    else:
        k_q, w_q = plan.query_norm
        alpha_q = _pow2_at_most(k_q * MARGIN / (float(gamma.double().abs().max()) * math.sqrt(dim)))
        rms_q = math.sqrt(k_q**2 / (dim + 1) + DS_NORM_EPS)
        a = torch.zeros(dim + 1, dim, dtype=torch.float64)
        a[:dim] = torch.eye(dim, dtype=torch.float64) * alpha_q
        a_bias = torch.zeros(dim + 1, dtype=torch.float64)
        a_bias[dim] = k_q
        bias = bq if bq is not None else torch.zeros(h, d_n + d_r, dtype=torch.float64)
        out["q_a_proj.weight"] = a
        out["q_a_proj.bias"] = a_bias
        out["q_a_layernorm.weight"] = torch.full((dim + 1,), w_q, dtype=torch.float64)
        out["q_b_proj.weight"] = torch.cat(
            [q_rows(wq) * (rms_q / (alpha_q * w_q)), q_rows(bias.unsqueeze(-1)) * (rms_q / (k_q * w_q))], dim=1
        )

    # latent: [alpha c_kv | zero padding | constant K | interleaved k_rope slots]
    k_c, w_c = plan.latent_norm
    wa = f64["kv_a_proj_with_mqa.weight"]
    ba = f64.get("kv_a_proj_with_mqa.bias")
    bound = latent_bound(wa[:r], ba[:r] if ba is not None else None, gamma)
    alpha = _pow2_at_most(k_c * MARGIN / bound) if bound > 0 else 1.0
    rms0 = math.sqrt(k_c**2 / d_lat + DS_NORM_EPS)
    kv_a = torch.zeros(d_lat + 2 * n_slots, dim, dtype=torch.float64)
    kv_a[:r] = wa[:r] * alpha
    kv_a[d_lat:] = _rope_rows(wa[r:], slots, n_slots)
    kv_a_bias = torch.zeros(d_lat + 2 * n_slots, dtype=torch.float64)
    if ba is not None:
        kv_a_bias[:r] = ba[:r] * alpha
        kv_a_bias[d_lat:] = _rope_rows(ba[r:].unsqueeze(-1), slots, n_slots).squeeze(-1)
    kv_a_bias[d_lat - 1] = k_c
    out["kv_a_proj_with_mqa.weight"] = kv_a
    out["kv_a_proj_with_mqa.bias"] = kv_a_bias
    out["kv_a_layernorm.weight"] = torch.full((d_lat,), w_c, dtype=torch.float64)

    # kv_b: one [k_nope | v] block per query head, the latent columns undoing alpha and the norm's constant
    wb = f64["kv_b_proj.weight"].view(g, d_n + d_v, r) * (rms0 / (alpha * w_c))
    wb = torch.cat([wb[:, :d_n], wb.new_zeros(g, pad, r), wb[:, d_n:]], dim=1)  # NoPE zero pad
    per_head = wb.repeat_interleave(h // g, dim=0)  # query head h reads KV head h // (H / G)
    kv_b = torch.zeros(h * (d_n + pad + d_v), d_lat, dtype=torch.float64)
    kv_b[:, :r] = per_head.reshape(h * (d_n + pad + d_v), r)
    out["kv_b_proj.weight"] = kv_b
    out["o_proj.weight"] = f64["o_proj.weight"]
    out["o_proj.bias"] = f64.get("o_proj.bias", torch.zeros(dim, dtype=torch.float64))
    return {k: v.to(dt).contiguous() for k, v in out.items()}


def attention_layout(plan: ExportPlan, config: Any) -> dict[str, tuple[int, ...]]:
    """Shapes of :func:`export_attention`'s tensors (names inside ``self_attn.``)."""
    c = config
    h, dim = c.num_attention_heads, c.hidden_size
    qk = plan.qk_nope_head_dim + 2 * len(plan.rope.inv_freq)
    d_lat, d_r = plan.kv_lora_rank, 2 * len(plan.rope.inv_freq)
    shapes: dict[str, tuple[int, ...]] = {}
    if plan.q_lora_rank is None:
        shapes["q_proj.weight"] = (h * qk, dim)
    else:
        shapes.update({
            "q_a_proj.weight": (dim + 1, dim),
            "q_a_proj.bias": (dim + 1,),
            "q_a_layernorm.weight": (dim + 1,),
            "q_b_proj.weight": (h * qk, dim + 1),
        })
    shapes.update({
        "kv_a_proj_with_mqa.weight": (d_lat + d_r, dim),
        "kv_a_proj_with_mqa.bias": (d_lat + d_r,),
        "kv_a_layernorm.weight": (d_lat,),
        "kv_b_proj.weight": (h * (plan.qk_nope_head_dim + c.v_head_dim), d_lat),
        "o_proj.weight": (dim, h * c.v_head_dim),
        "o_proj.bias": (dim,),
    })
    return shapes


def export_state_dict(model: Any, dtype: torch.dtype | None = None) -> tuple[ExportPlan, dict[str, torch.Tensor]]:
    """The DeepSeek-V3 plan and full state dict of an in-memory :class:`~mla_convert.mla.modeling.MLAForCausalLM`
    (tests and small models; ``mla-convert export`` streams layer by layer instead)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    dt = dtype or next(iter(state.values())).dtype
    plan = plan_export(model.config, dt)
    return plan, dict(map_tensors(plan, model.config, list(state), state.__getitem__))


def map_tensors(
    plan: ExportPlan, config: Any, names: list[str], read: Callable[[str], torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Every exported tensor, in order: attention tensors through :func:`export_attention`, the rest as stored
    (cast to ``plan.dtype``); ``rope_inv_freq`` buffers are dropped (the config's rope parameters carry them)."""
    out: list[tuple[str, torch.Tensor]] = []
    done: set[int] = set()
    for name in names:
        if name.endswith("rope_inv_freq"):
            continue
        if ".self_attn." in name:
            i = int(name.split(".")[2])
            if i in done:
                continue
            done.add(i)
            prefix = f"model.layers.{i}.self_attn."
            attn = {n[len(prefix):]: read(n) for n in names if n.startswith(prefix) and not n.endswith("rope_inv_freq")}
            gamma = read(f"model.layers.{i}.input_layernorm.weight")
            out += [(prefix + k, v) for k, v in export_attention(plan, config, i, attn, gamma).items()]
        else:
            out.append((name, read(name).to(plan.dtype).contiguous()))
    return out
