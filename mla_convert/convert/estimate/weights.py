"""The weights ledger of a conversion (issue 51): parameters and bytes of the converted attention against the
source's, per layer and in total, in each place a converted model is stored or served; the whole model's against the
source's; the break-even, the cached tokens above which converted weights + KV cache take less memory than the source's.

``D`` hidden size, ``H`` query heads, ``G`` KV heads of width ``d``, ``L`` layers, ``r_l`` layer ``l``'s
``kv_lora_rank``, ``R`` rope heads of ``d_R``, ``d_N`` / ``d_V`` NoPE and value widths per head (docs/math.md).
Parameters are element counts; bytes at one dtype (bfloat16: 2 a value; GGUF keeps some tensors float32). Caches:
values per token, summed over the layers. Places (tensor names of their files):

* ``mla``, the folder ``factor`` writes (transformers with ``import mla_convert``; mla/attention.py): ``q_proj
  [H (d_N + d_R), D]``, ``kv_a_proj_with_mqa [r_l + R d_R, D]``, ``kv_b_proj [G' (d_N + d_V), r_l]`` (``G' = H`` after a
  NoPE-width reduction: convert/layer/steps.py ``mla_config``), ``o_proj [D, H d_V]``, the source's biases (q; k in
  ``kv_a``; v, o in ``o_proj``), ``kv_a_layernorm [r_l]`` with a latent norm. Cache ``sum_l r_l + R d_R``. The float32
  ``rope_inv_freq`` buffers (``R d_R / 2`` a layer) are stored, not counted.
* ``vllm-plugin:vllm|vllm-cpu``, the folder as vLLM holds it through our plugin (engines/vllm/model.py
  ``_attention_tensors`` at engines/vllm/spec.py ``served_shape``): ranks padded to 512, a 64-wide rope slot per query
  head, ``kv_b_proj`` per query head, NoPE / value widths padded to the backend's, biases and a tied head kept.
* ``deepseek-v3:transformers|vllm|vllm-cpu``, ``export --target`` (engines/deepseek_v3/mapping.py ``plan_export``,
  ``_head_dims``, ``attention_layout``): one rope head of the ``P'`` slots of one plain table (``rope_slots``; 32 for
  vLLM), ranks padded to the largest or 512, ``kv_b_proj`` per query head, ``kv_a_layernorm`` always, no bias,
  ``lm_head`` written even where tied; a 16-bit ``transformers`` export widens ``d_N + d_R`` to ``d 4^k``. Cache
  ``d' + 2 P'`` (transformers 5's DeepseekV3, vLLM and MLX-LM cache the latent).
* ``gguf``, ``export --format gguf`` (engines/llamacpp/gguf_file.py ``gguf_plan``, ``_tensor_plan``, ``_ggml_type``):
  the ``transformers`` export's tensors (widened in a bfloat16 file only), the latent padded to a multiple of 32 where
  the rope width is one (default ``--cache-block``), ``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b`` (the same
  count), 1-D tensors float32 (and ``attn_kv_a_mqa`` in a float16 file).

A place that refuses a conversion (export biases, a rank over vLLM's 512, a scaled RoPE) is counted as its rules
would store it, with why in :attr:`Place.refused`. This module sits below the engines (scripts/imports.py): it
re-derives their widths from their specs; tests/convert/test_weights.py holds them to the exporters' own tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Any

from mla_convert.convert.layer.rope import fixed_pairs
from mla_convert.convert.options.options import ConvertOptions, OptionsError, cache_budget_of, geometry
from mla_convert.engines.deepseek_v3.spec import rope_slots
from mla_convert.engines.llamacpp.spec import Q8_0_BLOCK, cache_block_rank
from mla_convert.engines.vllm.spec import ENGINE_HEAD_DIMS, ENGINE_ROWS, ServedShape, ServeError, served_shape
from mla_convert.errors import ExportError
from mla_convert.mla.configuration import MLAConfig
from mla_convert.sources.checkpoint import SourceModel
from mla_convert.sources.families import families
from mla_convert.sources.geometry import head_dim_of

#: Bytes per value of the dtypes a ledger is taken at.
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Who reads each place, in the ledger's order.
READERS = {
    "mla": "the mla folder (transformers with import mla_convert)",
    "vllm-plugin:vllm": "vLLM GPU through our plugin",
    "vllm-plugin:vllm-cpu": "vLLM CPU through our plugin",
    "deepseek-v3:transformers": "DeepSeek-V3 export (transformers, MLX-LM)",
    "deepseek-v3:vllm": "DeepSeek-V3 export --target vllm (vLLM GPU, SGLang)",
    "deepseek-v3:vllm-cpu": "DeepSeek-V3 export --target vllm-cpu",
    "gguf": "GGUF (llama.cpp)",
}
Shape = tuple[int, ...]


def source_tensors(source: SourceModel | Any) -> tuple[dict[str, Shape], list[Shape], int]:
    """One layer's attention tensors (``q [H d, D]``, ``k, v [G d, D]``, ``o [D, H d]``, the family's biases), every
    other tensor (embedding, final norm, untied ``lm_head``, per layer two norms and the MLP) and the KV cache per
    token (``2 G d L`` values) of ``source``: a :class:`SourceModel`, a transformers config or a ``config.json`` dict
    (Llama, Mistral, Qwen2)."""
    cfg = source.config if isinstance(source, SourceModel) else source
    cfg = SimpleNamespace(**cfg) if isinstance(cfg, Mapping) else cfg
    d, i, n, vocab = int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers), int(cfg.vocab_size)
    q = int(cfg.num_attention_heads) * head_dim_of(cfg)
    kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim_of(cfg)
    attn: dict[str, Shape] = {"q_proj.weight": (q, d), "k_proj.weight": (kv, d), "v_proj.weight": (kv, d),
                              "o_proj.weight": (d, q)}
    family = families()[cfg.model_type]
    attn |= {f"{p}_proj.bias": (w,) for p, w in zip("qkvo", (q, kv, kv, d), strict=True) if family.has_bias(p, cfg)}
    layer = [(d,), (d,), (i, d), (i, d), (d, i), *([(i,), (i,), (d,)] if getattr(cfg, "mlp_bias", False) else [])]
    head = [] if getattr(cfg, "tie_word_embeddings", False) else [(vocab, d)]
    return attn, [(vocab, d), (d,), *head, *layer * n], 2 * kv * n


@dataclass(frozen=True)
class Widths:
    """One place's attention widths: ``kv_b_heads`` blocks in ``kv_b_proj``, ``q_rope`` rope dims per query head,
    ``k_rope`` rope values of ``kv_a_proj_with_mqa`` after the latent, ``ranks`` the latent width of each layer."""

    hidden: int
    heads: int
    kv_b_heads: int
    nope: int
    q_rope: int
    k_rope: int
    v_head: int
    ranks: tuple[int, ...]
    q_bias: bool = False
    kv_a_bias: bool = False
    o_bias: bool = False
    latent_norm: bool = False

    def layer(self, i: int) -> dict[str, Shape]:
        """Layer ``i``'s attention tensors (names inside ``self_attn.``) and their shapes."""
        d, r = self.hidden, self.ranks[i]
        q, a = self.heads * (self.nope + self.q_rope), r + self.k_rope
        out: dict[str, Shape] = {"q_proj.weight": (q, d), "kv_a_proj_with_mqa.weight": (a, d),
                                 "kv_b_proj.weight": (self.kv_b_heads * (self.nope + self.v_head), r),
                                 "o_proj.weight": (d, self.heads * self.v_head)}
        extra = {"q_proj.bias": (self.q_bias, q), "kv_a_proj_with_mqa.bias": (self.kv_a_bias, a),
                 "kv_a_layernorm.weight": (self.latent_norm, r), "o_proj.bias": (self.o_bias, d)}
        return out | {k: (n,) for k, (on, n) in extra.items() if on}


@dataclass(frozen=True)
class Place:
    """One row of the ledger: ``attention_params`` / ``attention_bytes`` per layer, the whole model's parameters and
    bytes, the cache in values per token over all layers, why the place refuses the conversion (None: it takes it)."""

    name: str
    attention_params: tuple[int, ...]
    attention_bytes: tuple[int, ...]
    model_params: int
    model_bytes: int
    cache_values: int
    refused: str | None = None


def _place(name: str, layers: list[dict[str, Shape]], rest: list[Shape], cache: int, dtype: str,
           why: list[str] | None = None, gguf: bool = False) -> Place:
    """A :class:`Place` of per-layer attention tensors and the other tensors' shapes (GGUF: float32 where
    ``_ggml_type`` keeps it)."""
    def size(tensor: str, shape: Shape) -> int:
        f32 = gguf and (len(shape) == 1 or (dtype == "float16" and tensor.startswith("kv_a_proj")))
        return math.prod(shape) * (4 if f32 else BYTES[dtype])

    params = tuple(sum(math.prod(s) for s in t.values()) for t in layers)
    nbytes = tuple(sum(size(n, s) for n, s in t.items()) for t in layers)
    rest_params, rest_bytes = sum(math.prod(s) for s in rest), sum(size("", s) for s in rest)
    return Place(name, params, nbytes, sum(params) + rest_params, sum(nbytes) + rest_bytes, cache,
                 "; ".join(why) if why else None)


def _plugin(c: MLAConfig, target: str) -> tuple[Widths, list[str]]:
    """vLLM's widths through the plugin (``served_shape``); refused: the row padded as far as it goes."""
    why: list[str] = []
    try:
        s = served_shape(c, target)
    except ServeError as exc:
        why.append(str(exc).split(":")[0])
        rank, rope = ENGINE_ROWS[target]
        fits = [(n, v) for n, _, v in ENGINE_HEAD_DIMS[target] if c.qk_nope_head_dim <= n and c.v_head_dim <= v]
        n, v = fits[0] if fits else (c.qk_nope_head_dim, c.v_head_dim)
        s = ServedShape(max(rank, *c.kv_lora_rank), max(rope, c.num_rope_heads * c.qk_rope_head_dim), n, v,
                        tuple(c.kv_lora_rank), c.num_rope_heads, c.qk_rope_head_dim)
    h = c.num_attention_heads
    return Widths(c.hidden_size, h, h, s.qk_nope_head_dim, s.qk_rope_head_dim, s.qk_rope_head_dim, s.v_head_dim,
                  (s.kv_lora_rank,) * c.num_hidden_layers, c.q_bias, c.kv_a_bias, c.o_bias, c.latent_norm), why


def _deepseek(c: MLAConfig, target: str, dtype: str) -> tuple[Widths, list[str]]:
    """The DeepSeek-V3 export's widths (``plan_export``, ``_head_dims``) and what it refuses."""
    engine = target != "transformers"
    checks = (("several rope heads", c.num_rope_heads != 1), ("no RoPE pair", not c.qk_rope_head_dim),
              ("attention biases", c.q_bias or c.kv_a_bias or c.o_bias), ("MLP biases", getattr(c, "mlp_bias", False)),
              ("a latent norm of its own", c.latent_norm), ("float16", dtype == "float16"))
    why = [w for w, bad in checks if bad]
    slots = ENGINE_HEAD_DIMS["vllm"][0][1] // 2 if engine else None
    d_r = 2 * slots if slots else c.num_rope_heads * c.qk_rope_head_dim
    if c.num_rope_heads == 1 and c.qk_rope_head_dim:
        try:
            d_r = 2 * len(rope_slots(c.rope_inv_freq, slots).inv_freq)
        except ExportError as exc:
            why.append(str(exc).split(";")[0])
    d_n, d_v = c.qk_nope_head_dim, c.v_head_dim
    if not engine and dtype != "float32":  # rho = softmax_scale sqrt(qk) a power of two: exact in 16-bit
        qk = round(float(c.softmax_scale) ** -2)
        while qk < d_n + d_r:
            qk *= 4
        d_n = qk - d_r
    elif engine:
        fits = [(n, v) for n, _, v in ENGINE_HEAD_DIMS[target] if d_n <= n and d_v <= v]
        if fits:
            d_n, d_v = fits[0]
        else:
            why.append(f"qk_nope_head_dim {d_n} / v_head_dim {d_v} over every shape --target {target} takes")
    top = max(c.kv_lora_rank)
    if engine and top > ENGINE_ROWS[target][0]:
        why.append(f"kv_lora_rank {top} over vLLM's {ENGINE_ROWS[target][0]}")
    d_lat = max(top, ENGINE_ROWS[target][0]) if engine else top
    h = c.num_attention_heads
    return Widths(c.hidden_size, h, h, d_n, d_r, d_r, d_v, (d_lat,) * c.num_hidden_layers, latent_norm=True), why


def _gguf(c: MLAConfig, dtype: str) -> tuple[Widths, list[str]]:
    """The GGUF's widths (``gguf_plan``: the ``transformers`` plan at bfloat16 or float32, the latent padded)."""
    w, why = _deepseek(c, "transformers", "bfloat16" if dtype == "bfloat16" else "float32")
    if c.hidden_act != "silu":
        why.append(f"MLP activation {c.hidden_act} (llama.cpp's deepseek2 computes SiLU)")
    width = cache_block_rank(w.ranks[0], w.k_rope, Q8_0_BLOCK) or w.ranks[0]
    return replace(w, ranks=(width,) * c.num_hidden_layers), why


def break_even(weights: float, cache: float, source_weights: float, source_cache: float) -> int | None:
    """Cached tokens (batch x context) above which ``weights + tokens x cache`` is below the source's (bytes; caches
    per token): ``floor((weights - source_weights) / (source_cache - cache))``, 0 when the weights are not larger;
    None when the cache is not smaller (no count of tokens makes the converted model smaller)."""
    if cache >= source_cache:
        return None
    return max(0, math.floor((weights - source_weights) / (source_cache - cache)))


@dataclass(frozen=True)
class WeightsLedger:
    """The ledger of one conversion at ``dtype``: the ``source`` row and the converted ``places``; ``estimate``
    says how the figures are estimated (None: exact, from a converted config)."""

    dtype: str
    source: Place
    places: tuple[Place, ...]
    estimate: str | None = None

    def place(self, name: str) -> Place:
        """The row called ``name`` (``mla``, ``gguf``, ``deepseek-v3:vllm``...)."""
        return next(p for p in self.places if p.name == name)

    def break_even(self, name: str = "mla") -> int | None:
        """:func:`break_even` of place ``name`` against the source (whole models, caches at ``dtype``)."""
        p, s, b = self.place(name), self.source, BYTES[self.dtype]
        return break_even(p.model_bytes, p.cache_values * b, s.model_bytes, s.cache_values * b)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (report.json, the manifest): every row (per-layer lists), with its ratios to the source and
        its break-even in tokens (``None``: never)."""
        s = self.source
        row = {p.name: {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(p).items()}
               for p in (s, *self.places)}
        for p in self.places:
            row[p.name] |= {"attention_ratio": sum(p.attention_params) / sum(s.attention_params),
                            "model_ratio": p.model_params / s.model_params,
                            "cache_ratio": p.cache_values / s.cache_values,
                            "break_even_tokens": self.break_even(p.name)}
        return {"dtype": self.dtype, "bytes_per_value": BYTES[self.dtype], "estimate": self.estimate,
                "source": row.pop("source"), "places": row}

    def lines(self) -> list[str]:
        """Short lines for people: the ``mla`` checkpoint against the source, its break-even, then each engine."""
        s, m = self.source, self.place("mla")
        sa = sum(s.attention_params)

        def tokens(p: Place) -> str:
            n = self.break_even(p.name)
            if n is None:
                return "never (its cache is not smaller)"
            return f"above {n:,} cached tokens" if n else "from the first cached token"

        out = [f"estimate before conversion: {self.estimate}"] if self.estimate else []
        out += [
            f"attention weights: {_count(sum(m.attention_params))} params ({sum(m.attention_params) / sa:.2f}x the "
            f"source's {_count(sa)}); whole model {_count(m.model_params)} ({m.model_params / s.model_params:.2f}x the "
            f"source's {_count(s.model_params)}), {m.model_bytes / 1e9:.2f} GB in {self.dtype}",
            f"KV cache: {m.cache_values:,} values per token ({m.cache_values / s.cache_values:.1%} of the source's "
            f"{s.cache_values:,}); break-even: {tokens(m)} (batch x context) the converted model uses less memory "
            f"than the source, weights + cache ({self.dtype})",
        ]
        for p in self.places[1:]:
            a = sum(p.attention_params)
            out.append(f"{READERS.get(p.name, p.name)}: attention {_count(a)} ({a / sa:.2f}x), model "
                       f"{_count(p.model_params)} ({p.model_params / s.model_params:.2f}x), cache "
                       f"{p.cache_values / s.cache_values:.1%}, less memory {tokens(p)}"
                       + (f" (refused: {p.refused})" if p.refused else ""))
        return out


def _count(n: float) -> str:
    """``53.3M``, ``1.23B``: a parameter count in people's units."""
    scale, unit = next(((x, u) for x, u in ((1e9, "B"), (1e6, "M"), (1e3, "K")) if n >= x), (1, ""))
    return f"{n / scale:.{2 if unit == 'B' else 1 if unit else 0}f}{unit}"


def weights_ledger(config: MLAConfig | Mapping[str, Any], source: SourceModel | Any,
                   dtype: str = "bfloat16", estimate: str | None = None) -> WeightsLedger:
    """The ledger of a converted checkpoint (exact) in every place (module docstring).

    Args:
        config: the checkpoint's :class:`MLAConfig` or its ``config.json`` dict.
        source: the source (:func:`source_tensors`).
        dtype: ``bfloat16`` | ``float16`` | ``float32``: the bytes of weights and caches.
        estimate: how the config was estimated (:func:`estimate_ledger`), None for a converted one.

    Raises:
        ValueError: an unknown dtype.
    """
    if dtype not in BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(BYTES)}")
    c = config if isinstance(config, MLAConfig) else MLAConfig.from_dict(dict(config))
    attn, rest, cache, n = *source_tensors(source), c.num_hidden_layers
    head = ((c.vocab_size, c.hidden_size),) if c.tie_word_embeddings else ()  # the exports write lm_head

    def row(name: str, w: Widths, why: list[str], extra: tuple[Shape, ...] = (), gguf: bool = False) -> Place:
        layers, per_token = [w.layer(i) for i in range(n)], sum(r + w.k_rope for r in w.ranks)
        return _place(name, layers, [*rest, *extra], per_token, dtype, why, gguf)

    mla = Widths(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                 c.num_rope_heads * c.qk_rope_head_dim, c.v_head_dim, tuple(c.kv_lora_rank), c.q_bias, c.kv_a_bias,
                 c.o_bias, c.latent_norm)
    places = [row("mla", mla, [])]
    places += [row(f"vllm-plugin:{t}", *_plugin(c, t)) for t in ENGINE_ROWS]
    places += [row(f"deepseek-v3:{t}", *_deepseek(c, t, dtype), head) for t in ("transformers", *ENGINE_ROWS)]
    places.append(row("gguf", *_gguf(c, dtype), head, gguf=True))
    return WeightsLedger(dtype, _place("source", [attn] * n, rest, cache, dtype), tuple(places), estimate)


def estimated_config(src: SourceModel, options: ConvertOptions) -> MLAConfig:
    """The config a conversion of ``src`` with resolved ``options`` writes, before it runs (convert/layer/steps.py
    ``mla_config``): ``qk_nope_head_dim`` the option or the geometry's query NoPE width (the widest layer's with
    ``--rope-strategy rotation``), ``kv_b_proj`` per query head with a NoPE reduction, ``v_head_dim = head_dim``,
    ``2 x pairs`` rope dims on the geometry's rope heads. Ranks: ``--kv-lora-rank``, else the budget's latent total
    (the one the allocation spends) spread evenly: the sum, and so the ``mla`` figures and cache, are exact; the
    largest rank, which the exports pad to, is a lower bound. Kept pairs: the strategy's for ``high`` / ``low`` /
    ``uniform``, else the fastest (the fewest DeepSeek-V3 rope slots: a lower bound).

    Raises:
        OptionsError: options that give no cache size.
    """
    geo, n, half = geometry(options, src), src.num_layers, src.head_dim // 2
    if options.kv_lora_rank is not None:
        ranks = [options.kv_lora_rank] * n
    else:
        budget = cache_budget_of(options, src)
        if budget is None:
            raise OptionsError("the options give no cache size: resolve them first (resolve_options)")
        total = geo.latent_total(budget)
        ranks = [total // n + (i < total % n) for i in range(n)]
    pairs, strategy = geo.rope_pairs, options.rope_strategy
    kept = fixed_pairs(strategy, pairs, half) if strategy in ("high", "low", "uniform") else list(range(pairs))
    freqs = [float(src.inv_freq[k % half]) for k in kept]
    cfg, bias = src.config, src.family.has_bias
    return MLAConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n, num_attention_heads=src.num_heads,
        num_key_value_heads=src.num_heads if options.qk_nope_head_dim is not None else src.num_kv_heads,
        hidden_act=cfg.hidden_act, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)), kv_lora_rank=ranks, qk_rope_head_dim=2 * pairs,
        qk_nope_head_dim=options.qk_nope_head_dim or geo.query_nope_width, v_head_dim=src.head_dim,
        num_rope_heads=geo.rope_heads, rope_inv_freq=[[list(freqs)] * geo.rope_heads for _ in range(n)],
        softmax_scale=src.softmax_scale, q_bias=bias("q", cfg), kv_a_bias=bias("k", cfg),
        o_bias=bias("v", cfg) or bias("o", cfg), source={"num_key_value_heads": src.num_kv_heads},
    )


def estimate_ledger(src: SourceModel, options: ConvertOptions, dtype: str = "bfloat16") -> WeightsLedger:
    """The ledger before conversion (``inspect``): :func:`weights_ledger` of :func:`estimated_config`, at the
    resolved options' RoPE split (the conversion's search may choose another, with another ``qk_nope_head_dim``)."""
    note = ("ranks spread evenly over the layers (the mla figures exact; exports pad to the largest rank, which a "
            "per-layer allocation makes larger), at the RoPE split resolved before the search")
    return weights_ledger(estimated_config(src, options), src, dtype, note)
