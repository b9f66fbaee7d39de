"""The one sha256 helper: files (read in chunks), bytes and text; 64 lowercase hex digits each.

Standard library only, so it can be imported early (asset checks) without pulling in torch.
"""

from __future__ import annotations

import hashlib
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
