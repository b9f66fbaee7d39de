"""GGUF sources, read tensor by tensor: no float32 copy of the model is ever written or held.

A ``.gguf`` SOURCE is opened in three steps, cheapest first:

1. :func:`read_metadata` parses the metadata with transformers' GGUF reader (``struct`` over a memory
   map; vocabulary and merge tables are walked, not decoded: milliseconds for any file size), and
   :func:`check_architecture` refuses a ``general.architecture`` outside the supported families before
   anything heavy happens, and :func:`~mla_convert.sources.gguf_checks.check_metadata` any key that would
   change the function without being carried over.
2. :func:`read_header` reads the tensor table and refuses a truncated file (a tensor that ends past the
   end of the file); :func:`~mla_convert.sources.gguf_checks.check_tensor_names` refuses a tensor with no
   place in the family's model.
3. :func:`cached_folder` builds, once per file (keyed by its sha256), a small folder holding only what
   transformers derives from the metadata, with what it leaves out (RoPE scaling of ``rope.scaling.*`` or
   ``rope_freqs.weight``, llama attention biases: :func:`~mla_convert.sources.gguf_checks.config_overrides`)
   filled in: ``config.json``, ``generation_config.json``, the tokenizer files, and :data:`ORIGIN_FILE` (the
   file name, sha256, architecture and the GGUF -> Hugging Face tensor-name map). No weights.

:class:`GGUFTensors` then reads one tensor at a time from the memory-mapped file: the gguf package's
``dequantize`` (the same call transformers' GGUF loader makes), then the architecture's
``TensorProcessor`` from transformers (for Llama: undo llama.cpp's q/k row permutation), so every tensor
equals what ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` loads.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mla_convert.files import atomic_folder
from mla_convert.sources import gguf_checks
from mla_convert.sources.families import REFUSED, families
from mla_convert.sources.locate import SourceError

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.integrations.gguf.reader import GgufHeader

#: The file next to ``config.json`` in a cached GGUF folder: where the folder came from.
ORIGIN_FILE = "gguf_origin.json"
#: Cache sub-folder of the per-file folders (``models/`` held the float32 safetensors copies of before).
CACHE_SUBDIR = "gguf"
#: Layout version of :data:`ORIGIN_FILE`; a folder of another version is rebuilt (2: the config carries the
#: RoPE scaling and biases of :func:`~mla_convert.sources.gguf_checks.config_overrides`).
ORIGIN_VERSION = 2

#: GGUF ``general.architecture`` -> transformers ``model_type`` where the two differ.
GGUF_MODEL_TYPES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gemma3": "gemma3_text",
    "deepseek2": "deepseek_v2",
    "command-r": "cohere",
    "gpt-oss": "gpt_oss",
}

#: ggml type ids stored as plain floats, and their torch dtype (every other type holds quantized blocks).
_GGML_F32, _GGML_F16, _GGML_BF16 = 0, 1, 30
_FLOAT_TYPES = {_GGML_F32: torch.float32, _GGML_F16: torch.float16, _GGML_BF16: torch.bfloat16}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unreadable(path: Path, exc: BaseException) -> SourceError:
    return SourceError(
        f"{path} is truncated or not a valid GGUF file ({_first_line(exc)}); re-download or re-export it"
    )


def read_metadata(path: Path) -> dict[str, Any]:
    """The GGUF metadata (key -> value; string arrays such as the vocabulary as their length only).

    Reads only the file's header through a memory map (milliseconds even for a multi-GB file).

    Raises:
        SourceError: not a GGUF file, an unsupported GGUF version, or a truncated/corrupt header.
    """
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata

        metadata, _ = read_gguf_metadata(str(path))
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - struct/unicode/value errors all mean a damaged file
        raise _unreadable(path, exc) from exc
    return dict(metadata)


def supported_families() -> str:
    """The supported family names, comma-separated (``"llama, mistral, qwen2"``)."""
    return ", ".join(sorted({fam.name for fam in families().values()}))


def check_architecture(path: Path, metadata: dict[str, Any]) -> str:
    """Refuse a GGUF whose ``general.architecture`` is outside the supported families, or whose metadata
    changes the function in a way mla-convert would not carry over
    (:func:`~mla_convert.sources.gguf_checks.check_metadata`).

    Returns:
        The GGUF architecture name (``"llama"``, ``"qwen2"``...).

    Raises:
        SourceError: one line naming the architecture, the reason when it is a known refusal, and the
            supported families; or naming the metadata key refused.
    """
    arch = str(metadata.get("general.architecture", ""))
    model_type = GGUF_MODEL_TYPES.get(arch, arch)
    if "mla_convert.export" in metadata:  # our own export: the MLA checkpoint it came from is the thing to read
        raise SourceError(
            f"{path} is an mla-convert GGUF export (llama.cpp {arch}); llama.cpp runs it (eval FILE --task humaneval "
            "--engine llama.cpp); everything else (perplexity, --engine transformers, factor) reads the MLA "
            "checkpoint folder it was exported from"
        )
    if model_type in REFUSED:
        raise SourceError(
            f"unsupported GGUF architecture {arch!r} in {path}: {REFUSED[model_type]}; "
            f"supported: {supported_families()}"
        )
    if model_type not in families():
        raise SourceError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {supported_families()}"
        )
    gguf_checks.check_metadata(path, metadata, arch)
    return arch


def read_header(path: Path) -> GgufHeader:
    """The tensor table (names, torch-order shapes, ggml types, offsets) of a GGUF file, checked
    against the file size.

    Raises:
        SourceError: the header cannot be parsed, holds a tensor type transformers cannot size, a
            tensor ends past the end of the file (a truncated download), or a tensor has no place in a model
            of the file's architecture (:func:`~mla_convert.sources.gguf_checks.check_tensor_names`).
    """
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        header = GgufHeader.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse failure is one user-facing line
        raise _unreadable(path, exc) from exc
    size = path.stat().st_size
    for info in header.tensors:
        end = header.data_start + info.offset + info.nbytes
        if end > size:
            raise SourceError(
                f"{path} is truncated or corrupt (tensor {info.name!r} ends at byte {end}, the file has "
                f"{size} bytes); re-download or re-export it"
            )
    arch = str(read_metadata(path).get("general.architecture", ""))
    gguf_checks.check_tensor_names(path, header, arch)
    return header


def type_name(ggml_type: int) -> str:
    """The ggml type's name (``"Q4_1"``, ``"F16"``), or ``"type N"`` for an id gguf does not know."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def file_type_label(metadata: dict[str, Any], header: GgufHeader) -> str:
    """The file's quantization as llama.cpp names it (``general.file_type``: ``"Q4_1"``), else the ggml
    type holding the most bytes."""
    from gguf import LlamaFileType

    value = metadata.get("general.file_type")
    if isinstance(value, int):
        try:
            return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    by_bytes: Counter[int] = Counter()
    for info in header.tensors:
        by_bytes[info.ggml_type] += info.nbytes
    return type_name(by_bytes.most_common(1)[0][0]) if by_bytes else "empty"


# ----------------------------------------------------------------------------------------------
# the cached metadata folder
# ----------------------------------------------------------------------------------------------


class _TopLevelNames:
    """What :func:`transformers.modeling_gguf_pytorch_utils.get_gguf_hf_weights_map` reads of a model:
    its config and state-dict names, without its sub-modules (whose names only repeat, for the families
    here, what the top level maps; walking them costs seconds)."""

    def __init__(self, config: PretrainedConfig, names: list[str]) -> None:
        self.config = config
        self._names = names

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self._names)

    def named_children(self) -> list[tuple[str, Any]]:
        return []


def _processor(architecture: str, config: PretrainedConfig) -> Any:
    """transformers' per-architecture GGUF ``TensorProcessor`` (Llama: reverse the q/k permutation)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def hf_names(config: PretrainedConfig, architecture: str) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name for a model of ``config``.

    transformers' own map (``get_gguf_hf_weights_map``, with gguf's tensor-name table of
    ``architecture``) over the parameter names of the model built on the meta device (no memory). Names
    of tensors the file may not hold (``lm_head.weight`` of a tied model) are included; the caller keeps
    those present in the file.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = list(model.state_dict())
    # the file's names follow its own architecture (a Mistral GGUF is written as "llama")
    shim = _TopLevelNames(config, names)
    return dict(get_gguf_hf_weights_map(shim, _processor(architecture, config), model_type=architecture))


def _causal_lm_class(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def _folder_is_current(target: Path, digest: str) -> bool:
    try:
        origin = json.loads((target / ORIGIN_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(origin, dict)
        and origin.get("version") == ORIGIN_VERSION
        and origin.get("sha256") == digest
        and (target / "config.json").exists()
    )


def cached_folder(
    gguf: Path, digest: str, architecture: str, cache_root: Path, header: GgufHeader | None = None
) -> Path:
    """The folder of config, generation config and tokenizer files of ``gguf`` (no weights), built once.

    ``cache_root/gguf/<stem>-<sha256[:16]>``, built in a temporary sibling and renamed into place
    (:func:`~mla_convert.artifacts.output.atomic_folder`). ``config.json`` is transformers' reading of
    the GGUF metadata (``AutoConfig.from_pretrained(dir, gguf_file=name)``) with ``architectures``,
    ``dtype: float32`` (the dtype tensors are dequantized to) and what transformers leaves out
    (:func:`~mla_convert.sources.gguf_checks.config_overrides`) filled in; the tokenizer is
    ``AutoTokenizer.from_pretrained(dir, gguf_file=name).save_pretrained``.

    Args:
        header: the file's tensor table (:func:`read_header`), read here when not given.

    Raises:
        SourceError: transformers cannot derive a config or tokenizer from the metadata; the RoPE scaling
            cannot be reproduced; a tensor of the file has no Hugging Face name in the model.
    """
    target = cache_root / CACHE_SUBDIR / f"{gguf.stem}-{digest[:16]}"
    if _folder_is_current(target, digest):
        return target
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    header = header or read_header(gguf)
    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # noqa: BLE001 - any reader failure is one user-facing line
        raise SourceError(f"cannot read GGUF file {gguf}: {_first_line(exc)}") from exc
    metadata = read_metadata(gguf)
    for key, value in gguf_checks.config_overrides(gguf, metadata, header, architecture, config).items():
        setattr(config, key, value)
    try:
        names = hf_names(config, architecture)
    except Exception as exc:  # noqa: BLE001 - any reader failure is one user-facing line
        raise SourceError(f"cannot read GGUF file {gguf}: {_first_line(exc)}") from exc
    for info in header.tensors:
        if info.name not in names and info.name != gguf_checks.ROPE_FREQS:
            raise SourceError(
                f"GGUF file {gguf}: tensor {info.name!r} has no counterpart in the transformers "
                f"{config.model_type} model (mla-convert would drop it and change the function); convert the "
                "original Hugging Face checkpoint instead"
            )
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [c for c in [_causal_lm_class(config.model_type)] if c] or None
    config.dtype = torch.float32
    with atomic_folder(target) as tmp:
        config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        origin = {
            "version": ORIGIN_VERSION,
            "file": gguf.name,
            "sha256": digest,
            "architecture": architecture,
            "gguf_to_hf": names,
        }
        (tmp / ORIGIN_FILE).write_text(json.dumps(origin, indent=2))
    return target


# ----------------------------------------------------------------------------------------------
# lazy tensors
# ----------------------------------------------------------------------------------------------


class GGUFTensors:
    """The tensors of one GGUF file under their Hugging Face names, dequantized one at a time.

    The file stays memory-mapped for the life of this object; nothing is read until :meth:`read`.

    Args:
        file: the ``.gguf`` file.
        header: its tensor table (:func:`read_header`).
        folder: its cached folder (:func:`cached_folder`), for the GGUF -> HF name map.
        config: the source config (head counts for the q/k un-permutation).
        metadata: the file's metadata (:func:`read_metadata`), for the quantization label.

    Raises:
        SourceError: the cached name map does not cover the file (a damaged cache folder).
    """

    def __init__(
        self,
        file: Path,
        header: GgufHeader,
        folder: Path,
        config: PretrainedConfig,
        metadata: dict[str, Any],
    ) -> None:
        from transformers.integrations.gguf.reader import load_gguf_state_dict

        origin = json.loads((folder / ORIGIN_FILE).read_text())
        gguf_to_hf: dict[str, str] = dict(origin["gguf_to_hf"])
        self.file = file
        self.architecture = str(origin["architecture"])
        self.label = file_type_label(metadata, header)
        self._infos = {info.name: info for info in header.tensors}
        #: HF name -> GGUF name, in file order; ``rope_freqs`` (in the config's RoPE scaling) is left out.
        self._gguf = {gguf_to_hf[info.name]: info.name for info in header.tensors if info.name in gguf_to_hf}
        self.unmapped = [info.name for info in header.tensors if info.name not in gguf_to_hf]
        for name in self.unmapped:
            if name != gguf_checks.ROPE_FREQS:
                raise SourceError(
                    f"GGUF file {file}: tensor {name!r} is not in the cached name map of {folder}; delete that "
                    "folder and open the file again"
                )
        self._lazy = load_gguf_state_dict(header)  # memmap views, untouched until read
        self._processor = _processor(self.architecture, config)

    def names(self) -> list[str]:
        """Hugging Face names of the file's tensors, in file order."""
        return list(self._gguf)

    def weight_map(self) -> dict[str, str]:
        """HF name -> the GGUF file's name (``SourceModel.weight_map``)."""
        return dict.fromkeys(self._gguf, self.file.name)

    def gguf_name(self, name: str) -> str:
        """The GGUF tensor name (``blk.0.attn_q.weight``) of HF ``name``."""
        return self._gguf[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape in torch order (``[out, in]`` for a linear weight)."""
        return tuple(int(d) for d in self._infos[self._gguf[name]].shape)

    def ggml_type(self, name: str) -> str:
        """How the tensor is stored: ``"Q4_1"``, ``"Q8_0"``, ``"F32"``..."""
        return type_name(self._infos[self._gguf[name]].ggml_type)

    def storage_dtype(self, name: str) -> torch.dtype:
        """``float16``/``bfloat16``/``float32`` for plain-float tensors; ``float32`` (the dequantized
        result) for quantized ones."""
        return _FLOAT_TYPES.get(self._infos[self._gguf[name]].ggml_type, torch.float32)

    def type_counts(self) -> dict[str, int]:
        """Number of mapped tensors per storage type (``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``)."""
        return dict(Counter(self.ggml_type(n) for n in self._gguf))

    def read(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32 (exact for F32/F16/BF16 storage) and un-permuted.

        Memory: the tensor's float32 size (plus the same again, briefly, while it is dequantized).

        Raises:
            SourceError: gguf cannot dequantize the tensor's type.
        """
        from gguf import GGMLQuantizationType, dequantize
        from gguf.quants import quant_shape_to_byte_shape

        gname = self._gguf[name]
        info = self._infos[gname]
        raw = self._lazy[gname].data  # uint8 memmap view of the tensor's bytes
        qtype = GGMLQuantizationType(info.ggml_type)
        data: np.ndarray
        try:
            if info.ggml_type == _GGML_F32:
                data = raw.view(np.float32).reshape(info.shape)
            elif info.ggml_type == _GGML_F16:
                data = raw.view(np.float16).reshape(info.shape)
            else:  # blocks (and BF16, which numpy lacks) as gguf's reader shapes them: rows of bytes
                data = raw.reshape(quant_shape_to_byte_shape(info.shape, qtype))
            weights = dequantize(data, qtype)
        except (NotImplementedError, ValueError) as exc:
            raise SourceError(
                f"cannot dequantize tensor {gname!r} ({qtype.name}) of {self.file}: {_first_line(exc)}"
            ) from exc
        weights = self._processor.process(weights=weights, name=gname).weights
        # a copy only when still a read-only view of the file (F32) or not contiguous (un-permuted q/k)
        return torch.from_numpy(np.require(weights, dtype=np.float32, requirements=["C", "W"]))
