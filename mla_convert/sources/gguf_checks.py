"""What in a GGUF file changes the model's function: every such metadata key and tensor is read exactly or
refused by name, so no file converts with a part of its function silently dropped.

transformers' GGUF reader (which builds the config of a ``.gguf`` SOURCE) maps only the shape keys of
llama/mistral/qwen2 (``context_length``, ``embedding_length``, ``block_count``, ``feed_forward_length``, head
counts, ``rope.freq_base``, ``layer_norm_rms_epsilon``, ``vocab_size``; ``rope.dimension_count`` as
``head_dim`` for llama/mistral only) and drops everything else, tensors without a Hugging Face name included.
This module covers the rest, in three steps:

1. :func:`check_metadata` (metadata only, before the file is hashed): every key under the architecture's
   prefix (``llama.``) is one transformers maps, one read here (:data:`READ_HERE`), one whose value is checked to
   be neutral (:data:`NEUTRAL`: no experts, causal attention, no soft-capping, no logit/embedding/residual scale,
   no sliding window shorter than the context, head widths equal to the rotary width), or it is refused by name.
   So are LoRA adapters (``general.type``) and split files (``split.count``).
2. :func:`check_tensor_names` (tensor table only): every tensor is one the family's Hugging Face model holds
   (``token_embd``, ``output_norm``, ``output``, per layer ``attn_norm``, ``attn_q/k/v/output``, ``ffn_norm``,
   ``ffn_gate/up/down``; q/k/v biases for qwen2, all four or none for llama) or ``rope_freqs.weight``; anything else
   (MoE routers and experts, fused QKV, MLP biases, per-layer RoPE tables) is refused by name.
3. :func:`config_overrides`: what the config must say beyond transformers' reading: the RoPE scaling of
   ``rope.scaling.*`` (linear, YaRN) or of the ``rope_freqs.weight`` tensor (llama.cpp's form of Llama-3.1's
   ``llama3`` scaling: per-pair divisors of the frequencies, fitted back to the four ``llama3`` parameters and
   checked to reproduce every frequency to 1e-6 relative), ``attention_bias`` when a llama file holds the biases,
   ``rope_theta`` 10000 (llama.cpp's default) when the file states none, and no sliding window for a Mistral file
   that states none (llama.cpp runs it with full attention; ``MistralConfig`` would default to 4096).

Every refusal is one :class:`~mla_convert.sources.locate.SourceError` line: what, which key or tensor, how to fix.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mla_convert.sources.locate import SourceError

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.integrations.gguf.reader import GgufHeader

#: Keys under ``{arch}.`` that transformers' GGUF reader maps into the config.
TRANSFORMERS_READS = frozenset(
    {
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "rope.freq_base",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.layer_norm_rms_epsilon",
        "vocab_size",
    }
)
#: Keys under ``{arch}.`` read here (:func:`config_overrides`) or checked against the head width.
READ_HERE = frozenset(
    {
        "rope.dimension_count",
        "attention.key_length",
        "attention.value_length",
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.scale_linear",
        "rope.scaling.original_context_length",
        "rope.scaling.yarn_attn_factor",
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_ext_factor",
    }
)
#: Keys under ``{arch}.`` that llama.cpp does not use for these architectures, or that say nothing about the
#: function (``rope.scaling.finetuned`` is a note; ``layer_norm_epsilon`` is not read where the norm is RMS).
IGNORED = frozenset({"rope.scaling.finetuned", "attention.layer_norm_epsilon", "tensor_data_layout"})
#: Keys under ``{arch}.`` allowed only with the value that leaves the function unchanged, and what else means.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "expert_count": ((0,), "a mixture of experts (Mixtral-style); only dense models convert"),
    "expert_used_count": ((0,), "a mixture of experts (Mixtral-style); only dense models convert"),
    "attention.causal": ((True,), "non-causal attention (an embedding model)"),
    "use_parallel_residual": ((False,), "parallel attention and MLP residuals"),
    "logit_scale": ((1.0,), "scaled output logits"),
    "embedding_scale": ((1.0,), "scaled input embeddings"),
    "residual_scale": ((1.0,), "scaled residual branches"),
    "attn_logit_softcapping": ((0.0,), "attention logit soft-capping"),
    "final_logit_softcapping": ((0.0,), "final logit soft-capping"),
    "rope.scaling.attn_factor": ((1.0,), "a RoPE attention factor"),
    "rope.scaling.yarn_log_multiplier": ((0.0,), "a YaRN log multiplier (DeepSeek-style mscale)"),
}
#: Keys under ``{arch}.`` llama.cpp requires and transformers would otherwise fill with its own defaults.
REQUIRED = ("attention.layer_norm_rms_epsilon", "attention.head_count", "embedding_length", "block_count")
#: Architectures whose llama.cpp graph reads ``rope_freqs.weight`` (Qwen2's does not load it).
ROPE_FREQS_ARCHS = frozenset({"llama", "mistral"})
#: The tensor llama.cpp stores per-pair RoPE frequency divisors in.
ROPE_FREQS = "rope_freqs.weight"
#: llama.cpp's RoPE base when a file states none.
LLAMA_CPP_ROPE_THETA = 10000.0
#: Largest relative difference between the frequencies of a fitted RoPE scaling and the file's.
ROPE_FIT_RTOL = 1e-6

_GLOBAL_TENSORS = frozenset({"token_embd.weight", "output_norm.weight", "output.weight"})
_LAYER_WEIGHTS = frozenset(
    {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"}
)
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_HOW = "convert the original Hugging Face checkpoint instead"


def _where(path: Path) -> str:
    return f"GGUF file {path}"


def _key(arch: str, name: str) -> str:
    return f"{arch}.{name}"


def head_width(arch: str, metadata: dict[str, Any]) -> int:
    """The head width transformers builds the model with: ``rope.dimension_count`` for llama/mistral (mapped to
    ``head_dim``), ``embedding_length / head_count`` otherwise (Qwen2's config has no ``head_dim``)."""
    heads = int(metadata.get(_key(arch, "attention.head_count"), 0) or 0)
    width = int(metadata.get(_key(arch, "embedding_length"), 0) or 0)
    rot = metadata.get(_key(arch, "rope.dimension_count"))
    if arch != "qwen2" and rot is not None:
        return int(rot)
    return width // heads if heads else 0


def check_metadata(path: Path, metadata: dict[str, Any], arch: str) -> None:
    """Refuse a GGUF whose metadata says something about the function that mla-convert would not carry over.

    Args:
        path: the file (for messages).
        metadata: its metadata (:func:`~mla_convert.sources.gguf.read_metadata`).
        arch: its ``general.architecture`` (checked supported already).

    Raises:
        SourceError: an adapter or split file, a key of :data:`REQUIRED` missing, an unknown key under ``{arch}.``,
            a key of :data:`NEUTRAL` with
            another value, a rotary or key/value width unequal to the head width, or a RoPE scaling type other
            than none/linear/yarn.
    """
    kind = metadata.get("general.type")
    if kind is not None and kind != "model":
        raise SourceError(
            f"{_where(path)} is a {kind!r} file (general.type), not a model; merge it into its base model first "
            "(llama.cpp: llama-export-lora)"
        )
    if int(metadata.get("split.count", 1) or 1) > 1:
        raise SourceError(
            f"{_where(path)} is part {int(metadata.get('split.no', 0)) + 1} of a split GGUF "
            f"(split.count = {metadata['split.count']}); merge the parts with `llama-gguf-split --merge` and pass "
            "the merged file"
        )
    if any(k.startswith("adapter.") for k in metadata):
        raise SourceError(f"{_where(path)} holds adapter.* keys: a LoRA adapter, not a model; merge it first")
    prefix = f"{arch}."
    for key, value in metadata.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if name in TRANSFORMERS_READS or name in READ_HERE or name in IGNORED:
            continue
        if name in NEUTRAL:
            allowed, what = NEUTRAL[name]
            if value not in allowed:
                raise SourceError(
                    f"{_where(path)}: {key} = {value!r} means {what}, which mla-convert does not convert; "
                    f"supported: {key} = {allowed[0]!r} or absent"
                )
            continue
        if name == "attention.sliding_window":
            context = metadata.get(_key(arch, "context_length"))
            if value and (context is None or int(value) < int(context)):
                raise SourceError(
                    f"{_where(path)}: {key} = {value} (sliding-window attention) is not supported; only "
                    "full-attention models convert exactly"
                )
            continue
        raise SourceError(
            f"{_where(path)}: metadata key {key} = {_short(value)} is not one mla-convert reads, and it may change "
            f"the model's function; {_HOW}"
        )
    for name in REQUIRED:
        if _key(arch, name) not in metadata:
            raise SourceError(
                f"{_where(path)} has no {arch}.{name} (llama.cpp requires it; transformers would guess a "
                "default); re-export the file with llama.cpp's convert_hf_to_gguf.py"
            )
    width = head_width(arch, metadata)
    for name in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = metadata.get(_key(arch, name))
        if value is not None and width and int(value) != width:
            what = (
                "partial rotary embedding"
                if name.startswith("rope")
                else "a head width other than the rotary one"
            )
            raise SourceError(
                f"{_where(path)}: {arch}.{name} = {value} but the heads are {width} wide ({what}); not supported"
            )
    rtype = metadata.get(_key(arch, "rope.scaling.type"))
    if rtype is not None and rtype not in ("none", "linear", "yarn"):
        raise SourceError(
            f"{_where(path)}: {arch}.rope.scaling.type = {rtype!r} is not supported; supported: none, linear, yarn"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_tensor_names(path: Path, header: GgufHeader, arch: str) -> None:
    """Refuse a GGUF holding a tensor that has no place in the family's Hugging Face model.

    Reads the tensor table only. Allowed: :data:`_GLOBAL_TENSORS`, :data:`ROPE_FREQS` (llama/mistral), per layer
    the weights of :data:`_LAYER_WEIGHTS`, the q/k/v biases (qwen2) or the q/k/v/o biases of every layer at once
    (llama/mistral: ``attention_bias``).

    Raises:
        SourceError: the first tensor outside that set, naming it and what it is.
    """
    names = [info.name for info in header.tensors]
    layers = {int(m.group(1)) for n in names if (m := _LAYER_TENSOR.fullmatch(n))}
    biases = {n for n in names if n.endswith(".bias")}
    for name in names:
        if name in _GLOBAL_TENSORS:
            continue
        if name == ROPE_FREQS:
            if arch not in ROPE_FREQS_ARCHS:
                raise SourceError(
                    f"{_where(path)}: tensor {name!r} (RoPE frequency factors) is not read by llama.cpp for "
                    f"{arch!r}, so the file's function is ambiguous; {_HOW}"
                )
            continue
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None:
            raise SourceError(
                f"{_where(path)}: tensor {name!r} has no place in a {arch} model (mla-convert would drop it and "
                f"change the function); {_HOW}"
            )
        part, kind = match.group(2), match.group(3)
        if kind == "weight" and part in _LAYER_WEIGHTS:
            continue
        if kind == "bias" and part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            if arch == "qwen2" and part != "attn_output":
                continue
            if arch != "qwen2":
                wanted = {
                    f"blk.{i}.{p}.bias" for i in layers for p in ("attn_q", "attn_k", "attn_v", "attn_output")
                }
                if wanted <= biases:
                    continue
                missing = sorted(wanted - biases)[0]
                raise SourceError(
                    f"{_where(path)}: tensor {name!r} is present but {missing!r} is not; a {arch} model has "
                    f"biases on all of q/k/v/o or on none; {_HOW}"
                )
        what = {"ffn_gate_inp": "an MoE router", "attn_qkv": "a fused QKV projection"}.get(part, f"a {kind}")
        if "exps" in part or "shexp" in part:
            what = "MoE experts"
        raise SourceError(
            f"{_where(path)}: tensor {name!r} ({what}) has no place in a {arch} model (mla-convert would drop it "
            f"and change the function); {_HOW}"
        )


def _read_vector(header: GgufHeader, name: str) -> np.ndarray:
    """One small tensor of the file, dequantized to float64."""
    from gguf import GGMLQuantizationType, dequantize
    from gguf.quants import quant_shape_to_byte_shape
    from transformers.integrations.gguf.reader import load_gguf_state_dict

    info = next(i for i in header.tensors if i.name == name)
    raw = load_gguf_state_dict(header)[name].data
    qtype = GGMLQuantizationType(info.ggml_type)
    data: np.ndarray
    if qtype == GGMLQuantizationType.F32:
        data = raw.view(np.float32).reshape(info.shape)
    elif qtype == GGMLQuantizationType.F16:
        data = raw.view(np.float16).reshape(info.shape)
    else:
        data = dequantize(raw.reshape(quant_shape_to_byte_shape(info.shape, qtype)), qtype)
    return np.asarray(data, dtype=np.float64).reshape(-1)


def _inv_freq(config: PretrainedConfig, rope: dict[str, Any]) -> torch.Tensor:
    """transformers' float64 view of the inverse frequencies ``config`` gives with ``rope_parameters = rope``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    trial = config.__class__.from_dict({**config.to_dict(), "rope_parameters": rope})
    return LlamaRotaryEmbedding(config=trial).inv_freq.detach().double()  # type: ignore[arg-type]


def _llama3_candidates(factors: np.ndarray, inv_freq: np.ndarray) -> list[dict[str, Any]]:
    """``llama3`` parameters that may give ``inv_freq / factors``: the fit of the pairs between the two
    thresholds (``1 / f`` is linear in ``1 / wavelength`` there; ``low_freq_factor`` 1 fixes the free scale),
    then Llama-3.1's own values."""
    factor = float(factors.max())
    out: list[dict[str, Any]] = []
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if mid.sum() >= 2 and factor > 1:
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        x = inv_freq[mid] / (2 * math.pi)
        slope, intercept = np.polyfit(x, smooth, 1)  # smooth = orig / (high - low) * x - low / (high - low)
        if slope > 0 and intercept < 0:
            b = -float(intercept)
            high, orig = 1.0 + 1.0 / b, float(slope) / b
            out.append(
                {
                    "factor": factor,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": round(high, 6),
                    "original_max_position_embeddings": int(round(orig)),
                }
            )
            out.append(
                {
                    "factor": factor,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": orig,
                }
            )
    out.append(
        {
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    )
    return [{"rope_type": "llama3", **c} for c in out]


def rope_from_freq_factors(
    path: Path, config: PretrainedConfig, factors: np.ndarray, theta: float
) -> dict[str, Any] | None:
    """The ``rope_parameters`` under which transformers gives llama.cpp's frequencies ``inv_freq / factors``
    (``inv_freq`` the unscaled ``theta^(-2k/d)``), or None when every factor is 1.

    Constant factors are ``linear`` scaling; others must be ``llama3`` (:func:`_llama3_candidates`). A candidate
    is taken only when every frequency matches to :data:`ROPE_FIT_RTOL` relative.

    Raises:
        SourceError: the tensor's length is not half the head width, or no candidate reproduces it.
    """
    base = _inv_freq(config, {"rope_type": "default", "rope_theta": theta})
    if factors.shape != (base.numel(),):
        raise SourceError(
            f"{_where(path)}: tensor {ROPE_FREQS!r} has {factors.size} values, expected {base.numel()} (half the "
            f"head width); the file is inconsistent: {_HOW}"
        )
    if np.all(factors == 1.0):
        return None
    if not np.all(np.isfinite(factors)) or factors.min() <= 0:
        raise SourceError(
            f"{_where(path)}: tensor {ROPE_FREQS!r} holds non-positive or non-finite factors; {_HOW}"
        )
    target = base / torch.from_numpy(factors)
    if np.all(factors == factors[0]):
        candidates = [{"rope_type": "linear", "factor": float(factors[0])}]
    else:
        candidates = _llama3_candidates(factors, base.numpy())
    for rope in candidates:
        rope = {**rope, "rope_theta": theta}
        got = _inv_freq(config, rope)
        if float(((got - target).abs() / target).max()) <= ROPE_FIT_RTOL:
            return rope
    raise SourceError(
        f"{_where(path)}: tensor {ROPE_FREQS!r} scales the RoPE frequencies in a way no linear or llama3 scaling "
        f"reproduces (factors {factors.min():.4g}..{factors.max():.4g}); {_HOW}"
    )


def _scaling_from_keys(path: Path, arch: str, metadata: dict[str, Any]) -> dict[str, Any] | None:
    """``rope_parameters`` (without ``rope_theta``) of the ``rope.scaling.*`` keys, or None for no scaling."""
    rtype = metadata.get(_key(arch, "rope.scaling.type"))
    factor = metadata.get(_key(arch, "rope.scaling.factor"), metadata.get(_key(arch, "rope.scale_linear")))
    if rtype in (None, "none", "linear") and factor in (None, 0.0, 1.0):
        if rtype == "linear" and factor is None:
            raise SourceError(f"{_where(path)}: {arch}.rope.scaling.type = 'linear' with no factor; {_HOW}")
        return None
    if rtype == "none":
        raise SourceError(
            f"{_where(path)}: {arch}.rope.scaling.type = 'none' with factor {factor}: ambiguous; {_HOW}"
        )
    if rtype in (None, "linear") and factor is not None:  # llama.cpp's default scaling type is linear
        return {"rope_type": "linear", "factor": float(factor)}
    orig = metadata.get(_key(arch, "rope.scaling.original_context_length"))
    if factor is None or orig is None:
        raise SourceError(
            f"{_where(path)}: YaRN scaling needs {arch}.rope.scaling.factor and "
            f"{arch}.rope.scaling.original_context_length; the file lacks one: {_HOW}"
        )
    ext = metadata.get(_key(arch, "rope.scaling.yarn_ext_factor"))
    if ext is not None and float(ext) != 1.0:
        raise SourceError(
            f"{_where(path)}: {arch}.rope.scaling.yarn_ext_factor = {ext} (transformers' YaRN uses 1); not supported"
        )
    rope: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(orig),
    }
    for gguf_name, hf_name in (
        ("yarn_attn_factor", "attention_factor"),
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
    ):
        value = metadata.get(_key(arch, f"rope.scaling.{gguf_name}"))
        if value is not None:
            rope[hf_name] = float(value)
    return rope


def config_overrides(
    path: Path, metadata: dict[str, Any], header: GgufHeader, arch: str, config: PretrainedConfig
) -> dict[str, Any]:
    """Config attributes to set on transformers' reading of the file (see the module docstring, step 3).

    Args:
        path: the file (for messages).
        metadata: its metadata; ``header``: its tensor table; ``arch``: its architecture.
        config: transformers' config of the file (``AutoConfig.from_pretrained(dir, gguf_file=name)``).

    Returns:
        Attribute -> value: ``rope_parameters`` always; ``attention_bias`` for a llama file with biases;
        ``sliding_window`` None for a Mistral file (no window shorter than the context).

    Raises:
        SourceError: RoPE scaling stated twice (keys and ``rope_freqs.weight``), or in a form not reproduced.
    """
    theta = float(metadata.get(_key(arch, "rope.freq_base"), LLAMA_CPP_ROPE_THETA))
    rope = _scaling_from_keys(path, arch, metadata)
    names = {info.name for info in header.tensors}
    if ROPE_FREQS in names:
        from_tensor = rope_from_freq_factors(path, config, _read_vector(header, ROPE_FREQS), theta)
        if from_tensor is not None and rope is not None:
            raise SourceError(
                f"{_where(path)}: RoPE scaling stated twice ({arch}.rope.scaling.* and tensor {ROPE_FREQS!r}); {_HOW}"
            )
        rope = rope or from_tensor
    out: dict[str, Any] = {"rope_parameters": {"rope_type": "default", **(rope or {}), "rope_theta": theta}}
    if arch != "qwen2" and any(n.endswith(".attn_q.bias") for n in names):
        out["attention_bias"] = True  # check_tensor_names saw q/k/v/o biases in every layer
    if config.model_type == "mistral":  # check_metadata refused any window shorter than the context
        out["sliding_window"] = None
    return out
