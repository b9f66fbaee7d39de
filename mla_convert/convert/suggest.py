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


def measured_rope_pairs(options: ConvertOptions, src: SourceShape, path: Path | None = None) -> tuple[int, str] | None:
    """The RoPE pairs of the split measured best at ``options.cache_budget`` on ``src``, and why (one sentence).

    The measured RoPE share of the cache row (``measured_splits.json``) is interpolated linearly in the cache
    fraction between the measured sizes (clamped outside them) and turned into pairs of ``options``' rope heads.
    None when nothing is measured or the options fix the latent width (``kv_lora_rank``: the split is then moot).
    """
    if options.cache_budget is None or options.kv_lora_rank is not None:
        return None
    model, measured = measured_splits(path)
    if not measured:
        return None
    frac = options.cache_budget / (2 * src.num_kv_heads * src.head_dim)
    points = sorted((f, float(m["rope_share"])) for f, m in measured.items())
    if frac <= points[0][0]:
        share = points[0][1]
    elif frac >= points[-1][0]:
        share = points[-1][1]
    else:
        (f0, s0), (f1, s1) = next((a, b) for a, b in zip(points, points[1:], strict=False) if a[0] <= frac <= b[0])
        share = s0 + (s1 - s0) * (frac - f0) / (f1 - f0)
    heads = geometry(options, src).rope_heads
    want = max(1, round(share * options.cache_budget / (2 * heads)))
    pairs = geometry(options.model_copy(update={"rope_pairs": want}), src).rope_pairs
    why = (f"--rope-pairs {pairs}: the RoPE share measured best at {100 * frac:.2f} % of the source's cache "
           f"({share:.2f} of the row; {model}, dev windows, measured_splits.json); pass --rope-pairs to choose")
    return pairs, why


def follow_budget(options: ConvertOptions, src: SourceShape, given: bool) -> tuple[ConvertOptions, str | None]:
    """``options`` with the measured split for its budget when ``--rope-pairs`` was not ``given``; and why."""
    if given:
        return options, None
    found = measured_rope_pairs(options, src)
    if found is None:
        return options, None
    pairs, why = found
    return options.model_copy(update={"rope_pairs": pairs}), why
