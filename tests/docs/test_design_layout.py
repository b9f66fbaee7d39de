"""docs/design.md's package-layout table is the tree of ``mla_convert/``: every folder and module has a row, and
every row names a folder or module that exists.

The table is the one under ``## Package layout``: one row per folder (``convert/``) and per module
(``convert/pipeline/stream.py``), paths relative to ``mla_convert/``, the first cell a single backticked path. A folder's
``__init__.py`` is covered by the folder's row; the package's own ``__init__.py`` and ``__main__.py`` have rows.
When a module is added, moved or removed, the failure message lists the exact rows to add (with the module's
docstring as a first draft of the description) and to remove.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mla_convert"
DESIGN = ROOT / "docs" / "design.md"
HEADING = "## Package layout"
CELL_SPLIT = re.compile(r"(?<!\\)\|")  # a cell may hold an escaped pipe, `[c_kv \| k_rope]`
PATH_CELL = re.compile(r"^`([^`]+)`$")


def layout_rows(text: str) -> list[tuple[str, str]]:
    """The (path, description) rows of the table under :data:`HEADING` in ``text``, in order.

    Raises:
        AssertionError: there is no such heading, no table under it, or a row whose first cell is not one
            backticked path.
    """
    assert HEADING in text, (
        f"docs/design.md has no {HEADING!r} section: the package-layout table lives under it"
    )
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows: list[tuple[str, str]] = []
    for line in section.splitlines():
        if not line.startswith("|"):
            if rows:
                break  # the first table of the section ends here
            continue
        cells = [c.strip() for c in CELL_SPLIT.split(line.strip())[1:-1]]
        if cells and (cells[0] in ("path",) or set(cells[0]) <= set("-: ")):
            continue  # header and separator
        match = PATH_CELL.match(cells[0]) if cells else None
        assert match and len(cells) == 2, (
            f"docs/design.md {HEADING}: a row must be | `path` | what it is |, got {line!r}"
        )
        rows.append((match.group(1), cells[1]))
    assert rows, f"docs/design.md {HEADING}: no table found"
    return rows


def tree_paths(package: Path = PACKAGE) -> set[str]:
    """Every folder (``name/``) and module (``name.py``) under ``package``, relative to it; a sub-folder's
    ``__init__.py`` is its folder's row, not one of its own."""
    paths: set[str] = set()
    for path in package.rglob("*"):
        rel = path.relative_to(package)
        if any(part == "__pycache__" or part.startswith(".") for part in rel.parts):
            continue
        if path.is_dir():
            paths.add(f"{rel.as_posix()}/")
        elif path.suffix == ".py" and not (path.name == "__init__.py" and len(rel.parts) > 1):
            paths.add(rel.as_posix())
    return paths


def _summary(rel: str) -> str:
    """A first draft of a missing row's description: the first line of the module's docstring."""
    path = PACKAGE / rel.rstrip("/")
    path = path / "__init__.py" if path.is_dir() else path
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except (OSError, SyntaxError):
        doc = ""
    return doc.split("\n", 1)[0].replace("``", "`").replace("|", "\\|") or "WHAT IT IS"


def test_layout_table_is_the_tree():
    """Every folder and module of mla_convert/ has a row, and every row names one that exists."""
    rows = layout_rows(DESIGN.read_text())
    named = [path for path, _ in rows]
    doubled = sorted({p for p in named if named.count(p) > 1})
    tree = tree_paths()
    missing = sorted(tree - set(named))
    stale = sorted(set(named) - tree)
    problems = []
    if missing:
        rows_to_add = "\n".join(f"| `{p}` | {_summary(p)} |" for p in missing)
        problems.append(f"add these rows (a folder's row first, then its modules):\n{rows_to_add}")
    if stale:
        rows_to_remove = "\n".join(f"| `{p}` | {dict(rows)[p]} |" for p in stale)
        problems.append(f"remove these rows (no such folder or module under mla_convert/):\n{rows_to_remove}")
    if doubled:
        problems.append(
            "these paths have more than one row; keep one: " + ", ".join(f"`{p}`" for p in doubled)
        )
    assert not problems, (
        f"docs/design.md, table under {HEADING!r}, disagrees with mla_convert/:\n" + "\n".join(problems)
    )


def test_layout_rows_say_what_they_are():
    """No row is left with an empty or placeholder description."""
    empty = [path for path, what in layout_rows(DESIGN.read_text()) if not what or what == "WHAT IT IS"]
    assert not empty, f"docs/design.md {HEADING}: describe these rows: {empty}"


def test_folders_outside_the_package_exist():
    """The folders the section names outside the package (``- `mla_kernels/`: ...``) are there."""
    section = DESIGN.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"^- `([^`]+/)`", section, re.M)
    assert named, f"docs/design.md {HEADING}: the list of folders outside the package is missing"
    gone = [n for n in named if not (ROOT / n).is_dir()]
    assert not gone, f"docs/design.md {HEADING} names folders that do not exist: {gone}"


def test_parser_reports_rows_to_add_and_remove(tmp_path: Path):
    """The checker's own parts on a made-up tree and table: escaped pipes, nested folders, __init__ rules."""
    pkg = tmp_path / "pkg"
    (pkg / "a" / "b").mkdir(parents=True)
    for name in ("__init__.py", "top.py", "a/__init__.py", "a/one.py", "a/b/__init__.py"):
        (pkg / name).write_text('"""Doc of it."""\n')
    (pkg / "a" / "__pycache__").mkdir()
    (pkg / "a" / "data.json").write_text("{}")
    assert tree_paths(pkg) == {"__init__.py", "top.py", "a/", "a/one.py", "a/b/"}
    text = f"# x\n\n{HEADING}\n\nintro\n\n| path | what it is |\n|---|---|\n| `a/` | one \\| two |\n| `gone.py` | was |\n\n## Next\n"
    assert layout_rows(text) == [("a/", "one \\| two"), ("gone.py", "was")]
