"""Every generated block of README.md and docs/*.md equals its writer's output on the stored results, and every
relative link there resolves.

A block is the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; its writer is
``benchmarks/collect.py``'s ``COLLECTORS[NAME]`` (the ``--collect`` path of the benchmark that writes it), which
reads ``benchmarks/results/*``, the pinned manifest or the code and measures nothing.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
blocks = importlib.import_module("blocks")
collect = importlib.import_module("collect")

FILES = blocks.block_files(ROOT)
FOUND = [(p, name) for p in FILES for name in blocks.block_names(p.read_text())]


def test_blocks_are_found():
    """The headline blocks are there (README.md or docs/); each marker pair occurs once in all the files."""
    names = [n for _, n in FOUND]
    assert {"reference", "validate", "second-model", "engine-parity", "vllm-parity", "recipe"} <= set(names)
    assert len(names) == len(set(names)), f"a block's markers occur more than once: {sorted(names)}"
    for path, name in FOUND:
        assert path.read_text().count(f"<!-- {name}:end -->") == 1, f"{path.name}: {name} has no single end marker"


@pytest.mark.parametrize("path,name", FOUND, ids=[f"{p.name}:{n}" for p, n in FOUND])
def test_block_is_its_writers_output(path: Path, name: str):
    """The block's text is what its writer regenerates from the stored results; a block without a writer fails."""
    assert name in collect.COLLECTORS, (
        f"{path.relative_to(ROOT)}: block {name!r} has no writer in benchmarks/collect.py COLLECTORS; "
        "give it one that regenerates it from stored results"
    )
    assert blocks.read_block(name, ROOT) == collect.COLLECTORS[name]().strip("\n").rstrip(), (
        f"{path.relative_to(ROOT)}: block {name!r} is stale; run `python benchmarks/collect.py {name}`"
    )


def test_replace_block_writes_into_the_file_that_holds_it(tmp_path: Path):
    """The shared helper finds a block in docs/ as well as in README.md, and refuses a missing or doubled one."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# r\n<!-- a:start -->\nold\n<!-- a:end -->\n")
    (tmp_path / "docs" / "x.md").write_text("x\n<!-- b:start -->\nold\n<!-- b:end -->\ntail\n")
    assert blocks.replace_block("b", "new\n", tmp_path) == tmp_path / "docs" / "x.md"
    assert (tmp_path / "docs" / "x.md").read_text() == "x\n<!-- b:start -->\nnew\n<!-- b:end -->\ntail\n"
    assert blocks.read_block("a", tmp_path) == "old"
    with pytest.raises(SystemExit, match="'c' block"):
        blocks.replace_block("c", "x", tmp_path)
    (tmp_path / "docs" / "y.md").write_text("<!-- a:start -->\n<!-- a:end -->\n")
    with pytest.raises(SystemExit, match="README.md, docs/y.md"):
        blocks.find_block("a", tmp_path)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_relative_links_resolve(path: Path):
    """Every relative markdown link in README.md and docs/*.md names a file or folder that exists."""
    missing = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"
