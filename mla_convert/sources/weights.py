"""Where the tensors of a safetensors folder are: its index or its shards (:func:`weight_map`), each shard opened
with a one-line error when it is missing or damaged (:func:`open_checked`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from mla_convert.sources.locate import SourceError


def open_checked(file: Path) -> Any:
    """``safe_open`` of ``file`` (a shard).

    Raises:
        SourceError: the file is missing, truncated or corrupt.
    """
    if not file.exists():
        raise SourceError(f"shard {file.name} named in the index is missing from {file.parent}")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise SourceError(
            f"{file} is truncated or corrupt ({str(exc).splitlines()[0]}); re-download or re-save it"
        ) from exc


def weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file in ``path`` holding it: the index's map, else every shard's keys.

    Raises:
        SourceError: an invalid index, no ``*.safetensors`` file, or a shard that is missing or unreadable.
    """
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
        for name in open_checked(f).keys():
            wmap[name] = f.name
    return wmap
