"""Atomic output folders and files, and checkpoint writing.

Outputs are built in a temporary sibling folder (``.OUT.tmp-XXXX``, :func:`~mla_convert.files.atomic_folder`) and
renamed into place only when complete, so an error or Ctrl-C never leaves a half-written OUT. A non-empty OUT is
refused without ``overwrite``; OUT inside the source folder is refused. Single files (caches, recipes, later
artifacts such as ``validation.json``) go through :mod:`mla_convert.files`' atomic writes. Importing this module does not import torch or transformers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mla_convert.errors import UserError

__all__ = ["OutputError", "check_output", "check_writable", "save_checkpoint", "write_carried"]

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class OutputError(UserError):
    """An output location that cannot be used (one line: what, where, how to fix)."""


def check_output(out: Path, overwrite: bool, source_dir: Path | None = None) -> Path:
    """Validate OUT before any work.

    Raises:
        OutputError: OUT is a file, is non-empty without ``overwrite``, lies inside the source folder or contains
            it, or is the root, home or current folder (or one above the current folder).
    """
    out = out.expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out} exists and is a file; choose a folder path")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"output folder {out} is not empty; pass --overwrite to replace it")
    if source_dir is not None:
        src = source_dir.expanduser().resolve()
        if out == src or src in out.parents:
            raise OutputError(f"output {out} is inside the source folder {src}; write it somewhere else")
        if out in src.parents:  # replacing OUT would delete the source with it
            raise OutputError(f"output {out} contains the source folder {src}; write it somewhere else")
    cwd = Path.cwd().resolve()
    if out in (Path(out.anchor), Path.home().resolve(), cwd) or out in cwd.parents:
        raise OutputError(
            f"output {out} is the root, home or current folder, or contains the current folder; replacing it "
            "would delete what is there: choose a new folder for OUT"
        )
    check_writable(out)
    return out


def check_writable(path: Path) -> None:
    """``path`` (a file or folder to create) can be created: its nearest existing parent is a folder we can write
    in (tried by creating and removing an empty temporary folder there).

    Raises:
        OutputError: a parent is a file, or the nearest existing folder does not take new entries.
    """

    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{path} cannot be created: {parent} is a file, not a folder; choose another path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mla-write-check-", dir=parent))
    except OSError as exc:
        raise OutputError(f"{path} cannot be created: {parent} does not take new files ({exc.strerror}); "
                          "choose a folder you can write in") from None


def save_checkpoint(
    model: PreTrainedModel,
    folder: Path,
    source: Path | Sequence[Path] | None,
    model_card: str,
    max_shard_size: str = "200MB",
    state_dict: dict[str, Any] | None = None,
) -> list[str]:
    """Write a loadable MLA checkpoint into ``folder``: sharded safetensors + index (huggingface_hub
    sharding via ``save_pretrained``), config, and everything the source ships
    (:func:`~mla_convert.sources.carry.copy_carried`): its ``generation_config.json`` verbatim (else one
    from the model config's bos/eos/pad), tokenizer and chat-template files, license and README (as
    ``SOURCE_README.md``); then the model card as ``README.md``, ending with a line naming the carried files
    (:func:`write_carried`).

    Args:
        source: the source folder; or (older form) a list of files in it, whose folder is then carried
            (the listed files too); None carries nothing.
        state_dict: the weights to write instead of ``model.state_dict()`` (e.g. gathered from FSDP shards).

    Returns:
        The carried files' names in ``folder`` (relative POSIX paths, sorted).

    Raises:
        OSError: a file cannot be read or written.
    """
    if isinstance(source, Path) or source is None:
        src_dir, listed = source, []
    else:
        listed = [Path(f) for f in source]
        parents = {f.parent for f in listed}
        src_dir = parents.pop() if len(parents) == 1 else None
    model.save_pretrained(
        str(folder), max_shard_size=max_shard_size, safe_serialization=True, state_dict=state_dict
    )
    return write_carried(folder, src_dir, model.config, model_card, listed)


def write_carried(
    folder: Path,
    src_dir: Path | None,
    config: Any,
    model_card: str,
    extra_files: Sequence[Path] = (),
) -> list[str]:
    """Write everything of a checkpoint but its weights and config: what the source ships
    (:func:`~mla_convert.sources.carry.copy_carried`: tokenizer and chat-template files, license, README as
    ``SOURCE_README.md``), ``generation_config.json`` (the source's verbatim, else one from ``config``'s
    bos/eos/pad), and ``model_card`` as ``README.md`` ending with a line naming the carried files.

    Args:
        folder: the checkpoint folder being built (inside :func:`atomic_folder` or a staging folder).
        src_dir: the source folder, or None to carry nothing.
        config: the converted model's config (``bos_token_id``, ``eos_token_id``, ``pad_token_id``).
        model_card: the card's Markdown (the carried-files line is appended unless already in it).
        extra_files: more files copied under their own name.

    Returns:
        The carried files' names in ``folder`` (relative POSIX paths, sorted).

    Raises:
        OSError: a file cannot be read or written.
    """
    from mla_convert.sources.carry import copy_carried, model_card_source_files, write_generation_config

    carried = copy_carried(src_dir, folder) if src_dir is not None else []
    for f in extra_files:
        if f.name not in carried:
            shutil.copy2(f, folder / f.name)
            carried.append(f.name)
    if write_generation_config(folder, src_dir, config) and "generation_config.json" not in carried:
        carried.append("generation_config.json")
    carried.sort()
    line = model_card_source_files(carried)
    card = model_card.rstrip("\n") + "\n" + (f"\n{line}\n" if line and line not in model_card else "")
    (folder / "README.md").write_text(card)
    return carried
