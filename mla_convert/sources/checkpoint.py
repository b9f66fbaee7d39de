"""Source checkpoints: resolve, validate before any work, and read tensors lazily.

A SOURCE is a local Hugging Face folder (``config.json`` + single or sharded ``*.safetensors``), a
``.gguf`` file (its metadata turned once into a small cached folder of config and tokenizer files, its
tensors dequantized one at a time from the memory-mapped file: :mod:`mla_convert.sources.gguf`), or the
built-in name of the bundled demo model (:data:`BUILTIN_MODELS`). Everything that can be checked without
reading weights is checked in :func:`open_source`: family (for a GGUF from its metadata, before anything
else), attention layout, RoPE type, tensor presence and shapes, file integrity. Remote code never runs.
Tensors are read through a :class:`TensorReader` (:class:`SafetensorsTensors` or
:class:`~mla_convert.sources.gguf.GGUFTensors`), never all at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from mla_convert.files import sha256_bytes, sha256_file
from mla_convert.sources import gguf as gguf_source
from mla_convert.sources import integrity
from mla_convert.sources.families import REFUSED, Family, families
from mla_convert.sources.geometry import head_dim_of, intermediate_size_of, source_softmax_scale
from mla_convert.sources.locate import SourceError, locate_source
from mla_convert.sources.weights import open_checked, weight_map

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: RoPE types whose per-pair frequencies do not depend on sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: safetensors dtype names -> torch dtypes (``storage_dtype``).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorReader(Protocol):
    """Lazy access to a source's tensors under their Hugging Face names (one tensor read at a time)."""

    def names(self) -> list[str]:
        """Every tensor name, in file order."""
        ...

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> the file holding it."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape without reading the tensor."""
        ...

    def storage_dtype(self, name: str) -> torch.dtype:
        """The dtype as stored (a dequantized type for quantized storage)."""
        ...

    def read(self, name: str) -> torch.Tensor:
        """The tensor, in :meth:`storage_dtype` or wider."""
        ...


class SafetensorsTensors:
    """Tensors of a safetensors folder (single file or sharded), each file opened once with ``safe_open``.

    Args:
        path: the folder.
        weight_map: tensor name -> file name in ``path`` (index order, or each file's keys in turn).
    """

    def __init__(self, path: Path, weight_map: dict[str, str]) -> None:
        self.path = path
        self._map = weight_map
        self._handles: dict[str, Any] = {}

    def _handle(self, name: str) -> Any:
        file = self._map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self._map)

    def weight_map(self) -> dict[str, str]:
        return dict(self._map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def storage_dtype(self, name: str) -> torch.dtype:
        stored = str(self._handle(name).get_slice(name).get_dtype())
        if stored not in _SAFETENSORS_DTYPES:
            raise SourceError(f"tensor {name!r} in {self.path} has unsupported dtype {stored}")
        return _SAFETENSORS_DTYPES[stored]

    def read(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self._handle(name).get_tensor(name)
        return tensor

    def release(self) -> None:
        """Close the open files: their mapped pages stop counting as this process's resident memory."""
        self._handles.clear()


@dataclass
class SourceModel:
    """A validated source checkpoint with lazy per-tensor access.

    Attributes:
        path: a folder holding ``config.json`` and the tokenizer files: the source folder itself, or for a
            GGUF the cached metadata folder (no weights there; they are read from the GGUF file).
        origin: what the user passed (folder, GGUF file or built-in name).
        origin_files: the user's files (the GGUF file, or the folder's safetensors) for hashing.
        config: the transformers config of the source.
        family: the source family (tensor names, biases).
        weight_map: tensor name -> file name holding it (a safetensors file in ``path``, or the GGUF
            file's name); its keys are every tensor of the source (a tied ``lm_head`` is not one).
        inv_freq: ``[head_dim/2]`` float32 RoPE inverse frequencies (radians per token), pair ``k`` =
            dims ``(k, k + head_dim/2)`` (rotate_half layout).
        attention_scaling: RoPE attention factor (1.0 except YaRN); multiplies cos and sin in HF.
        reader: where tensors are read from, one at a time.
    """

    path: Path
    origin: str
    origin_files: list[Path]
    config: PretrainedConfig
    family: Family
    weight_map: dict[str, str]
    inv_freq: torch.Tensor
    attention_scaling: float
    reader: TensorReader = field(repr=False)

    @property
    def gguf_file(self) -> Path | None:
        """The GGUF file the tensors come from, or None for a safetensors source."""
        return self.reader.file if isinstance(self.reader, gguf_source.GGUFTensors) else None

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
    def intermediate_size(self) -> int:
        """The MLP's inner width (:func:`~mla_convert.sources.geometry.intermediate_size_of`)."""
        return intermediate_size_of(self.config)

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    @property
    def softmax_scale(self) -> float:
        """The source attention scale (:func:`~mla_convert.sources.geometry.source_softmax_scale`)."""
        return source_softmax_scale(self.head_dim)

    @property
    def kv_cache_width(self) -> int:
        """Values the source caches per token per layer: ``2 * n_kv_heads * head_dim``."""
        return 2 * self.num_kv_heads * self.head_dim

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _require(self, name: str) -> None:
        if name not in self.weight_map:
            where = self.gguf_file or self.path
            raise SourceError(f"tensor {name!r} is missing from {where}; is the checkpoint complete?")

    def release(self) -> None:
        """Drop open file handles (a streamed conversion calls this after each layer, so the source's mapped
        pages of finished layers leave the resident set); later reads reopen the files."""
        release = getattr(self.reader, "release", None)
        if release is not None:
            release()

    def tensor(self, name: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Read one tensor from disk as ``dtype`` (safetensors: ``safe_open``; GGUF: dequantized alone).

        Raises:
            SourceError: when the tensor is missing.
        """
        self._require(name)
        return self.reader.read(name).to(dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading it.

        Raises:
            SourceError: when the tensor is missing.
        """
        self._require(name)
        return self.reader.shape(name)

    def tensor_names(self) -> list[str]:
        """Every tensor name (Hugging Face names), in file order."""
        return self.reader.names()

    def storage_dtype(self, name: str) -> torch.dtype:
        """The dtype as stored: bf16/fp16/fp32 for safetensors; for a GGUF ``float16``/``bfloat16`` for
        F16/BF16 tensors and ``float32`` (the dequantized result) for F32 and quantized ones.

        Raises:
            SourceError: when the tensor is missing.
        """
        self._require(name)
        return self.reader.storage_dtype(name)

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
        reader = self.reader
        weights = (
            f"GGUF file {reader.file.name} ({reader.label}), dequantized tensor by tensor"
            if isinstance(reader, gguf_source.GGUFTensors)
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


def _open_gguf(gguf: Path, digest: str | None = None) -> tuple[Path, Any, dict[str, Any]]:
    """Check a GGUF file (architecture from its metadata first, then its tensor table) and return its
    cached metadata folder (built on first use), its tensor table and its metadata.

    Args:
        gguf: the file.
        digest: its sha256 when already known (the verified bundled file), else computed here.

    Raises:
        SourceError: unreadable or truncated file, unsupported architecture, config or tokenizer that
            transformers cannot derive from the metadata.
    """
    metadata = gguf_source.read_metadata(gguf)
    architecture = gguf_source.check_architecture(gguf, metadata)
    header = gguf_source.read_header(gguf)
    folder = gguf_source.cached_folder(gguf, digest or sha256_file(gguf), architecture, _cache_root(), header)
    return folder, header, metadata


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
    where = src.gguf_file or src.path
    for name, shape in expected.items():
        if name not in src.weight_map:
            raise SourceError(f"tensor {name!r} is missing from {where}; is the checkpoint complete?")
        if shape and src.shape(name) != shape:
            raise SourceError(
                f"tensor {name!r} in {where} has shape {list(src.shape(name))}, expected {list(shape)} "
                "from config.json; the config does not match the weights"
            )


def open_source(spec: str | Path) -> SourceModel:
    """Resolve and validate a SOURCE without loading weights.

    Args:
        spec: a folder, a ``.gguf`` file or a name in :data:`BUILTIN_MODELS`.

    A GGUF's architecture is checked from its metadata before anything else (milliseconds); its config
    and tokenizer files are then derived once into a cached folder (``src.path``) and its tensors are
    read from the file itself, one at a time.

    Raises:
        SourceError: unknown path, unsupported architecture (QK-norm, sliding window, dynamic RoPE,
            unknown family), a config or GGUF key or tensor that changes the function but is not converted
            (:func:`~mla_convert.sources.integrity.check_function_keys`, :mod:`~mla_convert.sources.gguf_checks`),
            missing/mis-shaped tensors, truncated or corrupt safetensors or GGUF files.
    """
    origin = str(spec)
    kind, located = locate_source(spec)
    gguf: Path | None = None
    if kind == "builtin" and origin.lower() == "smollm2-135m":
        from mla_convert.sources.assets import GGUF_SHA256, bundled_gguf_path

        gguf = bundled_gguf_path()  # verified against GGUF_SHA256
        path, header, metadata = _open_gguf(gguf, GGUF_SHA256)
    elif kind == "builtin":
        from mla_convert.sources import qwen_coder

        gguf = qwen_coder.qwen_coder_gguf_path()  # verified against its pinned sha256
        path, header, metadata = _open_gguf(gguf, qwen_coder.GGUF_SHA256)
    elif kind == "gguf":
        assert located is not None
        gguf = located
        path, header, metadata = _open_gguf(gguf)
    else:
        assert located is not None
        path = located
    config_path = path / "config.json"
    if not config_path.exists():
        raise SourceError(f"{path} has no config.json; pass a Hugging Face model folder")
    model_type = _check_architecture(config_path)
    integrity.check_config_fields(config_path)
    family = families()[model_type]
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    _check_attention(config, family, config_path)
    integrity.check_function_keys(config_path, config)
    reader: TensorReader
    if gguf is not None:
        reader = gguf_source.GGUFTensors(gguf, header, path, config, metadata)
        origin_files = [gguf]
    else:
        wmap = weight_map(path)
        for file in sorted(set(wmap.values())):
            open_checked(path / file)
        if (path / "model.safetensors.index.json").exists():
            integrity.check_index(path, wmap)
        origin_files = [path / f for f in sorted(set(wmap.values()))]
        reader = SafetensorsTensors(path, wmap)
    inv_freq, scaling = _rope_tables(config)
    src = SourceModel(
        path, origin, origin_files, config, family, reader.weight_map(), inv_freq, scaling, reader
    )
    _check_tensors(src)
    return src


def load_source_model(src: SourceModel, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The source as a transformers causal LM (eval mode, eager attention) for calibration and evaluation.

    A safetensors source loads with ``from_pretrained(src.path)``. A GGUF source is built by transformers'
    loader from its config and the tensors of :meth:`SourceModel.tensor` (``from_pretrained(None,
    config=..., state_dict=...)``): the same weights ``from_pretrained(dir, gguf_file=name)`` gives
    (tests/sources/test_gguf.py compares every tensor), in seconds instead of that loader's half minute,
    and as a plain float model (no GGUF quantizer attached).

    Memory: the model in ``dtype`` plus, for a GGUF, the state dict in ``dtype`` while it loads.
    """
    from transformers import AutoModelForCausalLM

    if src.gguf_file is not None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(src.config)]
        state = {name: src.tensor(name, dtype) for name in src.tensor_names()}
        model = model_class.from_pretrained(
            None,
            config=src.config,
            state_dict=state,
            dtype=dtype,
            trust_remote_code=False,
            attn_implementation="eager",
        )
        del state
        return model.eval()
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
