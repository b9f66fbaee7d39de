"""The README stays what a newcomer reads in five minutes (issue 49): under 1,500 words, one results table.

The lab tables and long results live in ``docs/results.md`` and the other pages of ``docs/``; their generated
blocks are checked there by ``tests/docs/test_generated_blocks.py``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
blocks = importlib.import_module("blocks")

README = ROOT / "README.md"
MAX_WORDS = 1500


def test_readme_is_short():
    """Under 1,500 words, counted as ``wc -w`` counts them."""
    words = len(README.read_text().split())
    assert words < MAX_WORDS, (
        f"README.md has {words} words (limit {MAX_WORDS}): move detail to the docs/ page it belongs to "
        "(measurements to docs/results.md; a generated block moves with its markers, its writer follows)"
    )


def test_readme_holds_two_results_tables():
    """Two generated results blocks: the reference conversion's, and whether converted models still do their job
    (issue 50: the quality table); every other one lives in docs/."""
    names = blocks.block_names(README.read_text())
    assert names == ["reference", "quality"], (
        f"README.md's generated blocks are {names}; keep only 'reference' and 'quality', move the rest to docs/"
    )
