"""Sharded safetensors output assembled tensor by tensor, in bounded memory.

A streamed conversion produces its tensors in pieces (per-layer files in the work folder, tensors copied
from the source). :func:`write_shards` plans the shards with ``huggingface_hub``'s
``split_torch_state_dict_into_shards`` on meta tensors (names, shapes and dtypes only), then fills one shard
at a time from a loader, so memory holds at most one shard. The layout is the one ``save_pretrained`` writes:
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

#: Default largest shard: one shard is held in memory while it is written.
DEFAULT_MAX_SHARD_SIZE = "2GB"
INDEX = "model.safetensors.index.json"


def write_shards(
    folder: Path,
    layout: Mapping[str, torch.Tensor],
    load: Callable[[str], torch.Tensor],
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Write the tensors named in ``layout`` into ``folder`` as (sharded) safetensors.

    Args:
        folder: destination folder (exists).
        layout: name -> tensor on the ``meta`` device with the output shape and dtype, in checkpoint order.
        load: returns the real tensor of a name (same shape and dtype as in ``layout``, any device).
        max_shard_size: largest shard, bytes or a string such as ``"2GB"`` (huggingface_hub's parser).
        progress: called with ``(shards written, shards in all)`` after each shard.

    Returns:
        The file names written (shards, and the index when sharded).

    Raises:
        ValueError: a loaded tensor whose shape or dtype differs from the layout.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(dict(layout), max_shard_size=max_shard_size)
    written = []
    files = split.filename_to_tensors
    for n, (file, names) in enumerate(files.items(), 1):
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            t = load(name)
            want = layout[name]
            if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
                raise ValueError(
                    f"internal error: tensor {name} is {list(t.shape)} {t.dtype}, the layout says "
                    f"{list(want.shape)} {want.dtype}"
                )
            tensors[name] = t.detach().to("cpu").contiguous()
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        written.append(file)
        del tensors
        if progress:
            progress(n, len(files))
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(INDEX)
    return written
