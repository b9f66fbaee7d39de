"""Source checkpoints: resolve, validate before any work, and read tensors lazily.

A SOURCE is a local Hugging Face folder (``config.json`` + single or sharded ``*.safetensors``), a
``.gguf`` file (read by transformers with the ``gguf`` package and converted once into a cached
safetensors folder), or the built-in name of the bundled demo model (:data:`BUILTIN_MODELS`).
Everything that can be checked without reading weights is checked in :func:`open_source`: family,
attention layout, RoPE type, tensor presence and shapes, file integrity. Remote code never runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from mla_convert.artifacts.hashing import sha256_bytes, sha256_file
from mla_convert.artifacts.output import atomic_folder
from mla_convert.mla.algebra import head_dim_of, source_softmax_scale
from mla_convert.sources.families import REFUSED, Family, families
from mla_convert.sources.locate import SourceError, locate_source

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Built-in source names -> loader of the bundled real model.
#: RoPE types whose per-pair frequencies do not depend on sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class SourceModel:
    """A validated source checkpoint with lazy per-tensor access.

    Attributes:
        path: the safetensors folder actually read.
        origin: what the user passed (folder, GGUF file or built-in name).
        origin_files: the user's files (the GGUF file, or the folder's safetensors) for hashing.
        config: the transformers config of the source.
        family: the source family (tensor names, biases).
        weight_map: tensor name -> safetensors file name inside ``path``.
        inv_freq: ``[head_dim/2]`` float32 RoPE inverse frequencies (radians per token), pair ``k`` =
            dims ``(k, k + head_dim/2)`` (rotate_half layout).
        attention_scaling: RoPE attention factor (1.0 except YaRN); multiplies cos and sin in HF.
    """

    path: Path
    origin: str
    origin_files: list[Path]
    config: PretrainedConfig
    family: Family
    weight_map: dict[str, str]
    inv_freq: torch.Tensor
    attention_scaling: float
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.num_heads)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    @property
    def softmax_scale(self) -> float:
        """The source attention scale (:func:`~mla_convert.mla.algebra.source_softmax_scale`)."""
        return source_softmax_scale(self.head_dim)

    @property
    def kv_cache_width(self) -> int:
        """Values the source caches per token per layer: ``2 * n_kv_heads * head_dim``."""
        return 2 * self.num_kv_heads * self.head_dim

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def tensor(self, name: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Read one tensor from disk (``safe_open``, one tensor at a time) as ``dtype``.

        Raises:
            SourceError: when the tensor is missing.
        """
        if name not in self.weight_map:
            raise SourceError(f"tensor {name!r} is missing from {self.path}; is the checkpoint complete?")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file].get_tensor(name).to(dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return tuple(self._handles[file].get_slice(name).get_shape())

    def attention_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """float64 ``q, k, v, o`` weights (``[out, in]``) and any biases (``bq, bk, bv, bo``) of a layer."""
        out: dict[str, torch.Tensor] = {}
        for p in "qkvo":
            out[p] = self.tensor(self.family.attn(f"{p}_proj", layer))
            if self.family.has_bias(p, self.config):
                out[f"b{p}"] = self.tensor(self.family.attn(f"{p}_proj", layer, "bias"))
        return out

    def describe(self) -> dict[str, Any]:
        """Plain facts about the source for reports, manifests and ``inspect``."""
        weights = (
            f"GGUF file {self.origin_files[0].name}, dequantized to float32 by transformers"
            if self.origin_files and self.origin_files[0].suffix == ".gguf"
            else f"safetensors in {self.path.name} ({len(set(self.weight_map.values()))} file(s))"
        )
        return {
            "origin": self.origin,
            "weights": weights,
            "family": self.family.name,
            "model_type": self.config.model_type,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_parameters": rope_parameters(self.config),
            "attention_scaling": self.attention_scaling,
            "softmax_scale": self.softmax_scale,
            "kv_cache_values_per_token_per_layer": self.kv_cache_width,
            "tie_word_embeddings": bool(getattr(self.config, "tie_word_embeddings", False)),
            "attention_bias": {p: self.family.has_bias(p, self.config) for p in "qkvo"},
        }


def rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    """The config's RoPE parameters as a dict (transformers 5 ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None) or {}
    if not params and getattr(config, "rope_theta", None) is not None:
        params = {"rope_type": "default", "rope_theta": config.rope_theta}
    return dict(params)


def _cache_root() -> Path:
    from mla_convert.sources.assets import cache_dir

    return cache_dir()


def gguf_to_folder(gguf: Path) -> Path:
    """Convert a GGUF file once into a cached float32 safetensors folder (config, tokenizer, weights).

    The folder is keyed by the file's sha256 and built in a temporary sibling, then renamed.

    Raises:
        SourceError: when transformers cannot read the file.
    """
    digest = sha256_file(gguf)
    target = _cache_root() / "models" / f"{gguf.stem}-{digest[:16]}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # noqa: BLE001 - any reader failure is one user-facing line
        raise SourceError(f"cannot read GGUF file {gguf}: {str(exc).splitlines()[0]}") from exc
    model.hf_quantizer = None  # type: ignore[assignment]  # set dynamically by transformers, not declared
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_folder(target) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / "gguf_origin.json").write_text(json.dumps({"file": gguf.name, "sha256": digest}, indent=2))
    return target


def _weight_map(path: Path) -> dict[str, str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError) as exc:
            raise SourceError(
                f"{index} is not a valid safetensors index ({exc}); re-save the checkpoint"
            ) from exc
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (PyTorch .bin checkpoints: re-save with safetensors)" if list(path.glob("*.bin")) else ""
        raise SourceError(f"no *.safetensors files in {path}{hint}")
    wmap: dict[str, str] = {}
    for f in files:
        for name in _open_checked(f).keys():
            wmap[name] = f.name
    return wmap


def _open_checked(file: Path) -> Any:
    if not file.exists():
        raise SourceError(f"shard {file.name} named in the index is missing from {file.parent}")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise SourceError(
            f"{file} is truncated or corrupt ({str(exc).splitlines()[0]}); re-download or re-save it"
        ) from exc


def _check_architecture(config_path: Path) -> str:
    try:
        raw = json.loads(config_path.read_text())
    except ValueError as exc:
        raise SourceError(f"{config_path} is not valid JSON ({exc})") from exc
    model_type = str(raw.get("model_type", ""))
    if model_type in REFUSED:
        raise SourceError(f"unsupported architecture {model_type!r} in {config_path}: {REFUSED[model_type]}")
    if model_type not in families():
        raise SourceError(
            f"unsupported architecture {model_type!r} in {config_path}; supported: {', '.join(sorted(families()))}"
        )
    return model_type


def _check_attention(config: PretrainedConfig, family: Family, where: Path) -> None:
    for fld in family.sliding_window_fields:
        value = getattr(config, fld, None)
        if fld == "use_sliding_window" and value:
            raise SourceError(f"{where}: sliding-window attention (use_sliding_window=true) is not supported")
        if fld == "sliding_window" and value is not None and value < config.max_position_embeddings:
            raise SourceError(
                f"{where}: sliding-window attention (sliding_window={value}) is not supported; "
                "only full-attention checkpoints convert exactly"
            )
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise SourceError(
            f"{where}: alternating/sliding attention layers ({set(layer_types)}) are not supported"
        )
    params = rope_parameters(config)
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype not in STATIC_ROPE_TYPES:
        raise SourceError(
            f"{where}: RoPE scaling {rtype!r} changes frequencies with sequence length; "
            f"supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    if getattr(config, "num_attention_heads", 0) % (getattr(config, "num_key_value_heads", None) or 1):
        raise SourceError(f"{where}: num_attention_heads is not a multiple of num_key_value_heads")


def _rope_tables(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rot = LlamaRotaryEmbedding(config=config)  # type: ignore[arg-type]
    return rot.inv_freq.detach().to(torch.float32).clone(), float(rot.attention_scaling)


def _check_tensors(src: SourceModel) -> None:
    h, g, d, hid = src.num_heads, src.num_kv_heads, src.head_dim, src.hidden_size
    expected: dict[str, tuple[int, ...]] = {}
    for i in range(src.num_layers):
        expected[src.family.attn("q_proj", i)] = (h * d, hid)
        expected[src.family.attn("k_proj", i)] = (g * d, hid)
        expected[src.family.attn("v_proj", i)] = (g * d, hid)
        expected[src.family.attn("o_proj", i)] = (hid, h * d)
        for p, rows in (("q", h * d), ("k", g * d), ("v", g * d), ("o", hid)):
            if src.family.has_bias(p, src.config):
                expected[src.family.attn(f"{p}_proj", i, "bias")] = (rows,)
    for name in src.family.copied(src.num_layers):
        expected.setdefault(name, ())
    if not getattr(src.config, "tie_word_embeddings", False):
        expected[src.family.lm_head] = (int(src.config.vocab_size), hid)
    for name, shape in expected.items():
        if name not in src.weight_map:
            raise SourceError(f"tensor {name!r} is missing from {src.path}; is the checkpoint complete?")
        if shape and src.shape(name) != shape:
            raise SourceError(
                f"tensor {name!r} in {src.path} has shape {list(src.shape(name))}, expected {list(shape)} "
                "from config.json; the config does not match the weights"
            )


def open_source(spec: str | Path) -> SourceModel:
    """Resolve and validate a SOURCE without loading weights.

    Args:
        spec: a folder, a ``.gguf`` file or a name in :data:`BUILTIN_MODELS`.

    Raises:
        SourceError: unknown path, unsupported architecture (QK-norm, sliding window, dynamic RoPE,
            unknown family), missing/mis-shaped tensors, truncated or corrupt safetensors files.
    """
    origin = str(spec)
    kind, located = locate_source(spec)
    if kind == "builtin":
        from mla_convert.sources.assets import bundled_gguf_path

        gguf = bundled_gguf_path()
        path, origin_files = gguf_to_folder(gguf), [gguf]
    elif kind == "gguf":
        assert located is not None
        path, origin_files = gguf_to_folder(located), [located]
    else:
        assert located is not None
        path, origin_files = located, []
    config_path = path / "config.json"
    if not config_path.exists():
        raise SourceError(f"{path} has no config.json; pass a Hugging Face model folder")
    model_type = _check_architecture(config_path)
    family = families()[model_type]
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    _check_attention(config, family, config_path)
    wmap = _weight_map(path)
    for file in sorted(set(wmap.values())):
        _open_checked(path / file)
    if not origin_files:
        origin_files = [path / f for f in sorted(set(wmap.values()))]
    inv_freq, scaling = _rope_tables(config)
    src = SourceModel(path, origin, origin_files, config, family, wmap, inv_freq, scaling)
    _check_tensors(src)
    return src


def load_source_model(src: SourceModel, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The source as a transformers causal LM (eval mode, eager attention) for calibration and evaluation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(src.path), dtype=dtype, trust_remote_code=False, attn_implementation="eager"
    )
    return model.eval()


def tokenizer_files(src: SourceModel) -> list[Path]:
    """Tokenizer files of the source folder, copied next to a converted checkpoint."""
    names = (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "added_tokens.json",
    )
    return [src.path / n for n in names if (src.path / n).exists()]


def tokenizer_digest(src: SourceModel) -> str:
    """sha256 over the tokenizer files' names and bytes (sorted by name)."""
    blob = b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in sorted(tokenizer_files(src)))
    return sha256_bytes(blob)
