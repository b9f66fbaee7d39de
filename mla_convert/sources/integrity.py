"""Checks of an opened source that need more than its config and tensor headers, run before any work.

:func:`~mla_convert.sources.checkpoint.open_source` checks the layout (family, attention, tensor names and
shapes, shard files) and, with :func:`check_function_keys`, that ``config.json`` states nothing that changes the
function without being converted (soft-capping, logit/embedding scales, QK-norm, MLP biases, unread RoPE keys). :func:`preflight` adds what a conversion would otherwise trip over later, after
minutes of work or with a traceback: a missing or unreadable tokenizer, a generation config that does not
parse, a shard index that does not match the shard files, and NaN/Inf in the attention weights, which
the conversion factors first. Every problem is one :class:`~mla_convert.sources.locate.SourceError` line
saying what, where and how to fix it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mla_convert.sources.carry import GENERATION_CONFIG, has_tokenizer
from mla_convert.sources.families import Family
from mla_convert.sources.locate import SourceError

if TYPE_CHECKING:
    import torch


class OpenedSource(Protocol):
    """What :func:`preflight` reads of an opened source (a :class:`~mla_convert.sources.checkpoint.SourceModel`,
    which imports this module's checks)."""

    @property
    def path(self) -> Path:
        """The folder holding ``config.json``, the tokenizer and (for safetensors) the shards."""
        ...

    @property
    def config(self) -> Any:
        """The transformers config."""
        ...

    @property
    def family(self) -> Family:
        """The source family (tensor names, biases)."""
        ...

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file holding it."""
        ...

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        ...

    def tensor(self, name: str, dtype: torch.dtype = ...) -> torch.Tensor:
        """One tensor, read in ``dtype``."""
        ...

    def release(self) -> None:
        """Let go of the mapped pages read so far."""
        ...

INDEX = "model.safetensors.index.json"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: config.json fields that fix the tensor shapes; transformers fills a missing one with its own default
#: (``hidden_size`` 4096 for Llama), which then contradicts the weights with a misleading message.
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def check_config_fields(config_path: Path) -> None:
    """``config.json`` states every field that fixes tensor shapes (:data:`SHAPE_FIELDS`) as a positive
    integer. Belongs in ``open_source`` right after the architecture check (``checkpoint.py``);
    :func:`preflight` calls it meanwhile.

    Raises:
        SourceError: the file is not a JSON object, or a field is missing or not a positive integer.
    """
    try:
        raw = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceError(f"{config_path} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise SourceError(f"{config_path} is not a JSON object; pass a Hugging Face model folder")
    for name in SHAPE_FIELDS:
        value = raw.get(name)
        if value is None:
            raise SourceError(
                f"{config_path} has no {name}; transformers would guess a default that need not match the "
                "weights: add it from the original model's config"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SourceError(f"{config_path}: {name} is {value!r}; it must be a positive integer")


#: ``rope_parameters`` keys transformers reads, per RoPE type (its ``_validate_*_rope_parameters``); any other key
#: is ignored by transformers and so by the conversion.
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"}),
    "linear": frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"}),
    "llama3": frozenset(
        {
            "rope_type",
            "type",
            "rope_theta",
            "partial_rotary_factor",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        }
    ),
    "yarn": frozenset(
        {
            "rope_type",
            "type",
            "rope_theta",
            "partial_rotary_factor",
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}

#: config.json keys that change a model's function where its architecture has them, with the values that leave
#: a Llama/Mistral/Qwen2 unchanged and what another value means. transformers' Llama, Mistral and Qwen2 ignore
#: them (or, ``mlp_bias``, honour it where mla-convert does not copy the biases), so a checkpoint stating one
#: would convert into a model that does not do what the key says.
FUNCTION_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "attn_logit_softcapping": ((None, 0, 0.0), "attention logit soft-capping"),
    "final_logit_softcapping": ((None, 0, 0.0), "final logit soft-capping"),
    "logit_scale": ((None, 1, 1.0), "scaled output logits"),
    "logits_scaling": ((None, 1, 1.0), "scaled output logits"),
    "embedding_multiplier": ((None, 1, 1.0), "scaled input embeddings"),
    "residual_multiplier": ((None, 1, 1.0), "scaled residual branches"),
    "attention_multiplier": ((None,), "an attention scale other than 1/sqrt(head_dim)"),
    "query_pre_attn_scalar": ((None,), "an attention scale other than 1/sqrt(head_dim)"),
    "use_qk_norm": ((None, False), "QK-norm"),
    "qk_layernorm": ((None, False), "QK-norm"),
    "use_parallel_residual": ((None, False), "parallel attention and MLP residuals"),
    "parallel_attn": ((None, False), "parallel attention and MLP residuals"),
    "clip_qkv": ((None,), "clipped q/k/v activations"),
    "partial_rotary_factor": ((None, 1, 1.0), "partial rotary embedding"),
    "rotary_pct": ((None, 1, 1.0), "partial rotary embedding"),
    "alibi": ((None, False), "ALiBi position biases"),
    "num_local_experts": ((None, 0, 1), "a mixture of experts"),
    "num_experts": ((None, 0, 1), "a mixture of experts"),
    "mlp_bias": ((None, False), "MLP biases, which mla-convert does not carry over"),
}


def check_function_keys(config_path: Path, config: Any) -> None:
    """``config.json`` states nothing that changes the function without being converted: no key of
    :data:`FUNCTION_KEYS` with another value, no ``rope_parameters`` key transformers does not read for the
    RoPE type (:data:`ROPE_KEYS`) and no partial rotary factor, no ``sliding_window`` on a Llama (which has none).

    Args:
        config_path: the ``config.json`` (for messages, and the raw keys transformers drops).
        config: transformers' config of the folder.

    Raises:
        SourceError: one line naming the key, its value, what it means and how to go on.
    """
    raw = json.loads(config_path.read_text())
    for key, (neutral, what) in FUNCTION_KEYS.items():
        value = raw.get(key, getattr(config, key, None))
        if value not in neutral:
            raise SourceError(
                f"{config_path}: {key} = {value!r} means {what}, which mla-convert does not convert; only "
                f"checkpoints without it convert exactly ({key} = {neutral[-1]!r} or absent)"
            )
    if raw.get("model_type") == "llama" and raw.get("sliding_window") is not None:
        window, context = raw["sliding_window"], raw.get("max_position_embeddings")
        if context is None or int(window) < int(context):
            raise SourceError(
                f"{config_path}: sliding_window = {window} on a Llama (which transformers runs with full "
                "attention); remove the key if it is stray, or convert a full-attention checkpoint"
            )
    params = dict(getattr(config, "rope_parameters", None) or {})
    rtype = str(params.get("rope_type", params.get("type", "default")))
    known = ROPE_KEYS.get(rtype)
    if known is None:
        return  # checkpoint._check_attention refuses the type
    unknown = sorted(set(params) - known)
    if unknown:
        key = unknown[0]
        raise SourceError(
            f"{config_path}: rope_parameters key {key!r} = {params[key]!r} is not read for rope_type {rtype!r} "
            f"(reads: {', '.join(sorted(known - {'type'}))}); remove it if it is stray, or convert a checkpoint "
            "whose RoPE transformers implements"
        )
    factor = params.get("partial_rotary_factor")
    if factor is not None and float(factor) != 1.0:
        raise SourceError(
            f"{config_path}: rope_parameters partial_rotary_factor = {factor} (partial rotary embedding) is not "
            "supported; only checkpoints rotating every head dimension convert"
        )


def check_tokenizer(folder: Path) -> None:
    """The folder has a tokenizer and transformers can load it.

    Raises:
        SourceError: no tokenizer file at all, or a tokenizer/chat-template file that does not load.
    """
    if not has_tokenizer(folder):
        raise SourceError(
            f"{folder} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json + merges.txt); "
            "copy them from the original model into the source folder"
        )
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - tokenizers/transformers raise many types for a bad file
        raise SourceError(
            f"the tokenizer in {folder} cannot be loaded ({_first_line(exc)}); "
            "copy its tokenizer files again from the original model"
        ) from exc


def check_generation_config(folder: Path) -> None:
    """``generation_config.json``, when present, is a JSON object (it is carried verbatim into OUT).

    Raises:
        SourceError: the file is not valid JSON or not an object.
    """
    gen = folder / GENERATION_CONFIG
    if not gen.is_file():
        return
    try:
        data = json.loads(gen.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceError(f"{gen} is not valid JSON ({exc}); fix or delete it") from exc
    if not isinstance(data, dict):
        raise SourceError(f"{gen} is not a JSON object; fix or delete it")


def check_index(path: Path, weight_map: dict[str, str]) -> None:
    """A sharded source's index (already parsed into ``weight_map``: tensor -> file) names only shard
    files that exist, and each shard holds the tensors the index assigns to it. Reads only the shards'
    headers. Belongs with the index reading in ``checkpoint.py`` (``open_source`` should call it right
    after reading the index, before it reads tensor shapes); :func:`preflight` calls it meanwhile.

    Raises:
        SourceError: the index names a missing file, or assigns a tensor to a shard that does not hold it.
    """
    index = path / INDEX
    if not index.is_file():
        return
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, file in sorted(weight_map.items()):
        if not isinstance(file, str) or not (path / file).is_file():
            raise SourceError(
                f"{index} maps tensor {name!r} to {file!r}, which is missing from {path}; "
                "re-download the checkpoint or re-save it"
            )
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        try:
            with safe_open(str(path / file), framework="pt") as fh:
                held = set(fh.keys())
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for damaged files
            raise SourceError(
                f"{path / file} is truncated or corrupt ({_first_line(exc)}); re-download or re-save it"
            ) from exc
        for name in names:
            if name not in held:
                raise SourceError(
                    f"{index} says tensor {name!r} is in {file}, but that file does not hold it; "
                    "the index does not match the shards (re-save the checkpoint)"
                )


def check_attention_finite(src: OpenedSource) -> None:
    """Every attention weight and bias (q/k/v/o of every layer) is finite, read one tensor at a time in
    float32 (the peak is one ``[out, in]`` tensor).

    Raises:
        SourceError: the first tensor holding NaN or Inf, with its name and layer.
    """
    import torch

    for layer in range(src.num_layers):
        for p in "qkvo":
            names = [src.family.attn(f"{p}_proj", layer)]
            if src.family.has_bias(p, src.config):
                names.append(src.family.attn(f"{p}_proj", layer, "bias"))
            for name in names:
                t = src.tensor(name, torch.float32)
                if not bool(torch.isfinite(t).all()):
                    bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
                    raise SourceError(
                        f"tensor {name!r} (layer {layer}) in {src.path} contains {bad} values; "
                        "the checkpoint is damaged: re-download or re-save it"
                    )
                del t
        src.release()  # the layer's mapped pages leave the resident set


def preflight(src: OpenedSource) -> list[str]:
    """Everything about ``src`` that would fail a conversion later, checked before any work.

    Returns:
        Warnings worth printing (none so far; calibration-size warnings come from the job).

    Raises:
        SourceError: a shape field missing from ``config.json``, no or broken tokenizer, unparsable ``generation_config.json``, a shard index that
            does not match the shard files, NaN/Inf in an attention weight or bias.
    """
    check_config_fields(src.path / "config.json")
    check_tokenizer(src.path)
    check_generation_config(src.path)
    check_index(src.path, src.weight_map)
    check_attention_finite(src)
    return []
