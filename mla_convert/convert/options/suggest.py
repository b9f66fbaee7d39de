"""What a conversion of a source would give at the standard cache sizes, and the split measured best for each.

The split (how much of the cache row keeps RoPE) comes only from measurements: ``benchmarks/perplexity.py
--readme`` writes ``measured_splits.json`` next to this module (cache fraction -> the RoPE share with the lowest
perplexity ratio on dev windows). Without that file nothing is suggested. The levers (the rope strategy and the
``o_proj`` refit) come from ``benchmarks/levers.py --readme``, which records per measured size the row with the
lowest dev ratio among those that also beat the default on held-out windows; a budget takes the levers of the
nearest measured size (categorical choices are not interpolated).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_convert.convert.options.options import (
    ConvertOptions,
    SourceShape,
    cache_budget_of,
    geometry,
    source_width,
)

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
    #: lever options measured best at this size that differ from the defaults (``--rope-strategy``, ...)
    levers: dict[str, str] = field(default_factory=dict)


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
        levers: dict[str, str] = {}
        if m is not None:
            want = max(1, round(m["rope_share"] * size / 2))
            opts = ConvertOptions.model_validate({"cache_budget": size, "rope_pairs": want})
            pairs = geometry(opts, src).rope_pairs
            found = measured_levers(opts, src, (), path)
            levers = found[0] if found else {}
        out.append(Suggestion(frac, size, pairs, model if m is not None else None, levers))
    return out


def measured_rope_pairs(options: ConvertOptions, src: SourceShape, path: Path | None = None) -> tuple[int, str] | None:
    """The RoPE pairs of the split measured best at ``options.cache_budget`` on ``src``, and why (one sentence).

    The measured RoPE share of the cache row (``measured_splits.json``) is interpolated linearly in the cache
    fraction between the measured sizes and turned into pairs of ``options``' rope heads. Outside the measured sizes
    the nearest one's share is used and the sentence says so; a share the rope head cannot hold (more pairs than it
    has) is clipped and the sentence says so too; a source of another shape than the measured model is told that the
    split is a prior. None when nothing is measured or the options fix the latent width (``kv_lora_rank``: the split
    is then moot).
    """
    budget = cache_budget_of(options, src)
    if budget is None or options.kv_lora_rank is not None:
        return None
    model, measured = measured_splits(path)
    if not measured:
        return None
    frac = budget / source_width(src)
    points = sorted((f, float(m["rope_share"])) for f, m in measured.items())
    notes = []
    if frac < points[0][0] or frac > points[-1][0]:
        near = points[0] if frac < points[0][0] else points[-1]
        share = near[1]
        notes.append(f"outside the measured sizes ({100 * points[0][0]:.2f}-{100 * points[-1][0]:.2f} %): the share "
                     f"of the nearest, {100 * near[0]:.2f} %, is used")
    else:
        (f0, s0), (f1, s1) = next((a, b) for a, b in zip(points, points[1:], strict=False) if a[0] <= frac <= b[0])
        share = s0 + (s1 - s0) * (frac - f0) / (f1 - f0) if f1 > f0 else s0
    heads = geometry(options, src).rope_heads
    want = max(1, round(share * budget / (2 * heads)))
    pairs = geometry(options.model_copy(update={"rope_pairs": want}), src).rope_pairs
    if pairs < want:
        notes.append(f"the share asks for {want} pairs; clipped to {pairs}, all a rope head holds here, so the RoPE "
                     f"part is {2 * heads * pairs / budget:.2f} of the row, not {share:.2f}")
    shape = _measured_shape(path)
    if shape and (shape.get("head_dim"), shape.get("num_kv_heads")) != (src.head_dim, src.num_kv_heads):
        notes.append(f"measured on head_dim {shape.get('head_dim')} with {shape.get('num_kv_heads')} KV heads, a "
                     f"prior for this source's head_dim {src.head_dim} with {src.num_kv_heads}")
    extra = "; ".join(notes)
    at = f"{100 * frac:.2f} % of the source's cache"
    if frac < points[0][0] or frac > points[-1][0]:
        at = f"{100 * near[0]:.2f} % of the source's cache, the nearest measured size to this {100 * frac:.2f} %"
    why = (f"--rope-pairs {pairs}: the RoPE share measured best at {at} "
           f"({share:.2f} of the row; {model}, dev windows, measured_splits.json"
           f"{'; ' + extra if extra else ''}); pass --rope-pairs to choose")
    return pairs, why


def _measured_shape(path: Path | None = None) -> dict[str, Any]:
    """The attention shape of the model ``measured_splits.json`` was measured on (``{}`` when not recorded)."""
    path = path or MEASURED_SPLITS
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text()).get("shape", {}))


#: Options ``benchmarks/levers.py`` measures per cache size (on dev windows, kept only when they also win on the
#: held-out ones) and ``measured_splits.json`` records as ``levers``; a rope strategy applies to the shared rope head.
LEVER_OPTIONS = ("rope_strategy", "refit_o_proj")


def measured_levers(
    options: ConvertOptions, src: SourceShape, given: Collection[str], path: Path | None = None
) -> tuple[dict[str, str], str] | None:
    """The lever options (:data:`LEVER_OPTIONS`) measured best at the cache size nearest ``options.cache_budget``
    (as a fraction of the source's K + V), those not ``given``, and why (one sentence). None when nothing applies:
    no measurement, a fixed ``kv_lora_rank``, or every lever given (a rope strategy only for a shared rope head
    whose mode was not given either)."""
    budget = cache_budget_of(options, src)
    if budget is None or options.kv_lora_rank is not None:
        return None
    model, measured = measured_splits(path)
    with_levers = {f: m for f, m in measured.items() if m.get("levers")}
    if not with_levers:
        return None
    frac = budget / source_width(src)
    near = min(with_levers, key=lambda f: abs(f - frac))
    entry = with_levers[near]
    free = {k: v for k, v in entry["levers"].items() if k in LEVER_OPTIONS and k not in given}
    if "rope_mode" in given or options.rope_mode != "shared":
        free.pop("rope_strategy", None)
    free = {k: v for k, v in free.items() if getattr(options, k) != v}
    if not free:
        return None
    flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in free.items())
    others = [f"--{k.replace('_', '-')} {v}" for k, v in entry["levers"].items() if k not in free and getattr(options, k) != v]
    along = f", measured together with {', '.join(others)} (given otherwise here)" if others else ""
    outside = not min(with_levers) <= frac <= max(with_levers)
    why = (f"{flags}: measured best at {100 * near:.2f} % of the source's cache, the size nearest this budget"
           f"{' (outside the measured sizes)' if outside else ''}{along} ({entry.get('levers_evidence', 'dev windows')}; {model}, measured_splits.json); give the flag "
           "to choose")
    return free, why


def follow_budget(
    options: ConvertOptions, src: SourceShape, given: Collection[str]
) -> tuple[ConvertOptions, str | None]:
    """``options`` with what was measured best for its budget, where the user did not give it (``given``: the
    option names set on the command line or in the recipe): the RoPE split (:func:`measured_rope_pairs`) and the
    levers (:func:`measured_levers`); and why (sentences joined by ``"; "``), None when nothing changed."""
    update: dict[str, Any] = {}
    whys: list[str] = []
    if "rope_pairs" not in given:
        found = measured_rope_pairs(options, src)
        if found is not None:
            update["rope_pairs"], why = found
            whys.append(why)
    levers = measured_levers(options, src, given)
    if levers is not None:
        update.update(levers[0])
        whys.append(levers[1])
    if not update:
        return options, None
    return options.model_copy(update=update), "; ".join(whys)
