"""Files written whole or not at all, and their sha256: the helpers every layer uses to write and identify files.

Single files go through :func:`atomic_write_bytes` / :func:`atomic_write_text`: a temporary file in the same
folder, then ``os.replace``, so a reader sees the old or the new file, never a torn one. Folders are built in a
temporary sibling (:func:`atomic_folder`) and renamed into place only when complete. :func:`sha256_file`,
:func:`sha256_bytes` and :func:`sha256_text` give 64 lowercase hex digits. Standard library only, so it can be
imported early (asset checks) without pulling in torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Read size for :func:`sha256_file` (1 MiB).
CHUNK_BYTES = 1 << 20


def sha256_file(path: Path, chunk_bytes: int = CHUNK_BYTES) -> str:
    """Hex sha256 of a file's bytes, read ``chunk_bytes`` at a time.

    Raises:
        OSError: The file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def current_umask() -> int:
    """The process umask (read by setting and restoring it; ``os.umask`` has no read-only form)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``.

    Creates missing parent folders. The file gets the mode a plain ``open`` would give, ``0o666`` less the
    umask (``mkstemp`` creates 0600). No fsync: the rename is atomic against other readers and crashes of
    this process, not against power loss.

    Raises:
        OSError: The folder cannot be created or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o666 & ~current_umask())
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


def usual_permissions(folder: Path) -> None:
    """Give ``folder`` and everything in it the permissions a plain ``mkdir``/``open`` would (``0o777``/``0o666``
    less the umask): ``mkdtemp`` and some writers create owner-only ones, which would hide a checkpoint from
    the other users of a shared machine. Symbolic links are left alone (``chmod`` would follow them)."""
    umask = current_umask()
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success replace ``out`` with it, on any error remove it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        usual_permissions(tmp)
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
