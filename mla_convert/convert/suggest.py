"""What a conversion of a source would give at the standard cache sizes, and the split measured best for each.

The split (how much of the cache row keeps RoPE) comes only from measurements: ``benchmarks/perplexity.py
--readme`` writes ``measured_splits.json`` next to this module (cache fraction -> the RoPE share with the lowest
perplexity ratio on dev windows). Without that file nothing is suggested.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_convert.convert.options import ConvertOptions, SourceShape, geometry

MEASURED_SPLITS = Path(__file__).with_name("measured_splits.json")
#: The cache fractions ``inspect`` reports: 31.25 %, 18.75 % and 12.5 % of the source's K + V.
FRACTIONS = (0.3125, 0.1875, 0.125)


@dataclass(frozen=True)
class Suggestion:
    """One cache size: ``values`` per token per layer (``fraction`` of the source's) and, when measured, the
    options that realise the measured split (``rope_pairs`` of a shared rope head, ``cache_budget``)."""

    fraction: float
    values: int
    rope_pairs: int | None
    measured_on: str | None


def measured_splits(path: Path | None = None) -> tuple[str, dict[float, dict[str, Any]]]:
    """``(model, {cache fraction: split})`` from ``measured_splits.json``; ``("no model", {})`` when absent."""
    path = path or MEASURED_SPLITS
    if not path.exists():
        return "no model", {}
    data = json.loads(path.read_text())
    return str(data["model"]), {float(s["cache_fraction"]): s for s in data["splits"]}


def suggestions(src: SourceShape, path: Path | None = None) -> list[Suggestion]:
    """One :class:`Suggestion` per fraction in :data:`FRACTIONS` for ``src`` (default options otherwise)."""
    model, measured = measured_splits(path)
    base = 2 * src.num_kv_heads * src.head_dim
    out = []
    for frac in FRACTIONS:
        size = round(base * frac)
        m = measured.get(frac)
        pairs = None
        if m is not None:
            want = max(1, round(m["rope_share"] * size / 2))
            geo = geometry(ConvertOptions.model_validate({"cache_budget": size, "rope_pairs": want}), src)
            pairs = geo.rope_pairs
        out.append(Suggestion(frac, size, pairs, model if m is not None else None))
    return out
