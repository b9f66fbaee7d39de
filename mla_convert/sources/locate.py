"""Where a SOURCE is, checked without opening it: the built-in demo model, a ``.gguf`` file or a folder.

Light on purpose (no torch): the CLI refuses a wrong path in a fraction of a second, before it imports the
libraries that read checkpoints (:func:`~mla_convert.sources.checkpoint.open_source` then checks the contents).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from mla_convert.errors import UserError

#: Names that stand for a real model fetched from registry packages, never a model hub: the bundled demo model and
#: the second real model (Qwen2.5-Coder-1.5B-Instruct, 1.1 GB, fetched on first use: sources/qwen_coder.py).
BUILTIN_MODELS = ("smollm2-135m", "qwen2.5-coder-1.5b")


class SourceError(UserError):
    """A SOURCE that cannot be converted; the message names the path and the reason."""


def locate_source(spec: str | Path) -> tuple[Literal["builtin", "gguf", "folder"], Path | None]:
    """What ``spec`` names: ``("builtin", None)``, ``("gguf", file)`` or ``("folder", folder)`` (resolved paths).

    Raises:
        SourceError: no such path, or a path that is neither a folder nor a ``.gguf`` file.
    """
    origin = str(spec)
    if origin.lower() in BUILTIN_MODELS:
        return "builtin", None
    p = Path(spec).expanduser()
    if not p.exists():
        raise SourceError(
            f"source {origin!r} not found: pass a HF folder, a .gguf file or one of {', '.join(BUILTIN_MODELS)}"
        )
    if p.is_file() and p.suffix == ".gguf":
        return "gguf", p.resolve()
    if p.is_dir():
        return "folder", p.resolve()
    raise SourceError(f"source {origin!r} is neither a folder nor a .gguf file")
