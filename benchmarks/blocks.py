"""The generated blocks of README.md and docs/*.md: text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``.

Every writer (``benchmarks/*.py --readme``, ``benchmarks/readme.py``, ``scripts/serve_check.sh``) writes its block
with :func:`replace_block`, which finds the file that holds the markers (README.md or a page of docs/), so a block
can move between them without touching its writer. ``tests/docs/test_generated_blocks.py`` regenerates every block
from the stored results (:mod:`collect`) and compares.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- ([A-Za-z0-9_-]+):start -->$", re.M)  # on a line of its own (not quoted in prose)


def block_files(root: Path = ROOT) -> list[Path]:
    """README.md and every ``docs/*.md`` under ``root``: the files a generated block may live in."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def block_names(text: str) -> list[str]:
    """The names of the ``<!-- NAME:start -->`` markers in ``text``, in order."""
    return MARKER.findall(text)


def find_block(name: str, root: Path = ROOT) -> Path:
    """The one file of :func:`block_files` that holds block ``name``.

    Raises:
        SystemExit: no file, or more than one, holds both markers (a section was renamed, removed or copied).
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    found = [p for p in block_files(root) if p.exists() and start in (t := p.read_text()) and end in t]
    if len(found) != 1:
        where = ", ".join(str(p.relative_to(root)) for p in found) or "no file"
        raise SystemExit(f"error: the {name!r} block ({start} ... {end}) is in {where}; it must be in exactly one "
                         "of README.md and docs/*.md: put the markers back where the block belongs")  # fmt: skip
    return found[0]


def read_block(name: str, root: Path = ROOT) -> str:
    """The text between block ``name``'s markers, without the newlines next to them."""
    text = find_block(name, root).read_text()
    return text.split(f"<!-- {name}:start -->", 1)[1].split(f"<!-- {name}:end -->", 1)[0].strip("\n")


def replace_block(name: str, body: str, root: Path = ROOT) -> Path:
    """Replace the text between block ``name``'s markers, in whichever file holds them, with ``body``; returns
    that file.

    Raises:
        SystemExit: as :func:`find_block`.
    """
    path = find_block(name, root)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    head, rest = path.read_text().split(start, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(f"{head}{start}\n{body.strip(chr(10)).rstrip()}\n{end}{tail}")
    return path
