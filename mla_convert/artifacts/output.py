"""Atomic output folders and files, and checkpoint writing.

Outputs are built in a temporary sibling folder (``.OUT.tmp-XXXX``) and renamed into place only when
complete, so an error or Ctrl-C never leaves a half-written OUT. A non-empty OUT is refused without
``overwrite``; OUT inside the source folder is refused. Single files (caches, recipes, later artifacts
such as ``validation.json``) go through :func:`atomic_write_bytes` / :func:`atomic_write_text`: a
temporary file in the same folder, then ``os.replace``, so a reader sees the old or the new file, never
a torn one. Importing this module does not import torch or transformers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from mla_convert.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class OutputError(UserError):
    """An output location that cannot be used (one line: what, where, how to fix)."""


def check_output(out: Path, overwrite: bool, source_dir: Path | None = None) -> Path:
    """Validate OUT before any work.

    Raises:
        OutputError: OUT is a file, is non-empty without ``overwrite``, or lies inside the source folder.
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
    return out


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``.

    Creates missing parent folders. The file gets mode 0644 (``mkstemp`` creates 0600). No fsync: the
    rename is atomic against other readers and crashes of this process, not against power loss.

    Raises:
        OSError: The folder cannot be created or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str, encoding: str = "utf-8") -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded with ``encoding`` (no newline translation).

    Raises:
        OSError: The folder cannot be created or written.
    """
    atomic_write_bytes(path, text.encode(encoding))


def _usual_permissions(folder: Path) -> None:
    """Give ``folder`` and everything in it the permissions a plain ``mkdir``/``open`` would (``0o777``/``0o666``
    less the umask): ``mkdtemp`` and some writers create owner-only ones, which would hide a checkpoint from
    the other users of a shared machine."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success replace ``out`` with it, on any error remove it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _usual_permissions(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(
    model: PreTrainedModel,
    folder: Path,
    tokenizer_files: list[Path],
    model_card: str,
    max_shard_size: str = "200MB",
) -> None:
    """Write a loadable MLA checkpoint: sharded safetensors + index (huggingface_hub sharding via
    ``save_pretrained``), config, generation config, the source's tokenizer files and a model card."""
    from transformers import GenerationConfig

    model.save_pretrained(str(folder), max_shard_size=max_shard_size, safe_serialization=True)
    cfg = model.config
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(str(folder))
    for f in tokenizer_files:
        shutil.copy2(f, folder / f.name)
    (folder / "README.md").write_text(model_card)
