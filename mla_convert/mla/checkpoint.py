"""Opening a converted checkpoint folder, with one-line errors: the one place that checks what a folder holds
before a command loads it (``validate``, ``eval``, ``generate``, ``adapt``).

:func:`read_checkpoint_config` is cheap (reads ``config.json`` only), so a command can refuse a wrong folder
before any slow work; :func:`load_checkpoint` then loads the model in float32 (or a given dtype), and
:func:`checkpoint_dtype` says which dtype the weights are stored in (from the safetensors headers only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mla_convert.errors import UserError


class CheckpointError(UserError):
    """A folder that is not a loadable (converted) checkpoint; one line: what, where, how to fix."""


def read_checkpoint_config(ckpt: Path | str, require_mla: bool = True) -> dict[str, Any]:
    """``ckpt/config.json`` as a dict.

    Args:
        ckpt: a checkpoint folder.
        require_mla: refuse any ``model_type`` but ``mla`` (a folder written by ``mla-convert factor``) and
            ``deepseek_v3`` folders written by ``mla-convert export``.

    Raises:
        CheckpointError: a missing folder, a file, no ``config.json``, one that is not a JSON object, or (with ``require_mla``) another
            model type.
    """
    ckpt = Path(ckpt)  # a str path works as well
    path = ckpt / "config.json"
    if not ckpt.exists():
        raise CheckpointError(f"{ckpt} does not exist; pass a folder written by 'mla-convert factor'")
    if not ckpt.is_dir():
        raise CheckpointError(
            f"{ckpt} is a file, not a checkpoint folder; pass a folder written by 'mla-convert factor'"
        )
    if not path.is_file():
        raise CheckpointError(f"{ckpt} has no config.json; pass a folder written by 'mla-convert factor'")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} does not read as JSON ({exc}); the checkpoint is damaged") from None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{path} holds {type(config).__name__}, not a JSON object; the checkpoint is damaged"
        )
    kind = config.get("model_type")
    if (
        kind == "deepseek_v3"
        and (ckpt / "mla_manifest.json").is_file()
        and '"export"' in (ckpt / "mla_manifest.json").read_text()
    ):
        return config  # an export by mla-convert: read back as MLA (load_checkpoint) or run stock
    if require_mla and kind != "mla":
        raise CheckpointError(
            f"{ckpt} holds a {kind!r} model, not a converted MLA checkpoint; run 'mla-convert factor' first"
        )
    return config


#: safetensors dtype codes of the floating dtypes a checkpoint may hold, as torch names them.
_FLOAT_CODES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def checkpoint_dtype(ckpt: Path) -> str:
    """The dtype the weights of ``ckpt`` are stored in: ``"float16"`` or ``"bfloat16"`` when every floating
    tensor but the ``rope_inv_freq`` buffers (float32 by design) is stored so, else ``"float32"`` (float32 or
    float64 weights, or half-precision types mixed: the narrowest dtype that holds every weight exactly).

    Reads only the safetensors headers (``*.safetensors`` in ``ckpt``; no tensor data).

    Raises:
        CheckpointError: no ``*.safetensors`` file, or one whose header does not read.
    """
    from safetensors import SafetensorError, safe_open

    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{ckpt} holds no *.safetensors weights; pass a folder written by 'mla-convert factor'"
        )
    found: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as fh:
                for name in fh.keys():
                    if not name.endswith("rope_inv_freq"):
                        found.add(fh.get_slice(name).get_dtype())
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(
                f"{file} does not read as safetensors ({str(exc).splitlines()[0]}); the checkpoint is damaged"
            ) from None
    floats = {_FLOAT_CODES[c] for c in found if c in _FLOAT_CODES}
    return floats.pop() if floats in ({"float16"}, {"bfloat16"}) else "float32"


def load_checkpoint(ckpt: Path | str, require_mla: bool = True, dtype: Any = None) -> Any:
    """The model in ``ckpt`` (float32 unless ``dtype`` names another torch dtype, eval mode) through
    ``AutoModelForCausalLM``, after
    :func:`read_checkpoint_config`'s checks; registers the ``mla`` model type first.

    Returns:
        An :class:`~mla_convert.mla.modeling.MLAForCausalLM` (any ``from_pretrained`` model without
        ``require_mla``; a DeepSeek-V3 export of ours read back as MLA with it,
        :func:`~mla_convert.mla.export_reader.load_export_as_mla`).

    Raises:
        CheckpointError: the checks above, or weights/config that transformers cannot load (its first line).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from mla_convert.mla.registry import register

    ckpt = Path(ckpt)
    config = read_checkpoint_config(ckpt, require_mla)
    if require_mla and config.get("model_type") == "deepseek_v3":
        from mla_convert.mla.export_reader import load_export_as_mla

        return cast_parameters(load_export_as_mla(ckpt), dtype)
    register()  # model_type "mla" (the CLI starts without transformers)
    try:
        return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype or torch.float32).eval()
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{ckpt} cannot be loaded as a checkpoint: {str(exc).splitlines()[0]}"
        ) from None


def cast_parameters(model: Any, dtype: Any = None, device: Any = None) -> Any:
    """``model`` (changed in place and returned) moved to ``device`` with its floating *parameters* cast to the
    torch ``dtype``; buffers keep their dtype: the float32 ``rope_inv_freq`` of our models and the ``inv_freq``
    of stock rotary embeddings (DeepSeek-V3 exports). ``model.to(dtype)`` would round those frequencies to the
    model dtype (~2^-9 in bfloat16), an angle error that grows with position. ``None`` leaves either as is."""
    if device is not None:
        model.to(device)
    if dtype is not None:
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model
