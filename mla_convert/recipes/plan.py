"""The plan of a recipe: which stage runs, is skipped or is off, and why; and the cache shapes it gives.

Stages write ``<output>/factor`` and ``<output>/adapt``. A stage is skipped when its folder already holds
a manifest whose options (and source, or parent canonical id) match the recipe; a stage that would replace
a non-empty folder needs ``--overwrite``. ``run`` always ends with ``validate`` (unless disabled).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mla_convert.artifacts.manifest import recorded_options
from mla_convert.convert.options.options import cache_budget_of, geometry
from mla_convert.recipes.schema import Recipe

if TYPE_CHECKING:
    from mla_convert.sources.checkpoint import SourceModel


@dataclass
class Stage:
    """One stage of the plan: ``run``, ``skip`` or ``off``, its folder, and why."""

    name: str
    action: str
    folder: Path
    why: str
    replaces: bool = False  # an existing folder would be replaced (needs --overwrite)


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _norm(x: Any) -> Any:
    """``x`` as a manifest records it (through JSON)."""
    return json.loads(json.dumps(x))


def _diff(old: Any, new: dict[str, Any]) -> str:
    """The first three options that differ, ``key old -> new``."""
    if not isinstance(old, dict):
        return "no options recorded"
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    shown = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:3])
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _occupied(folder: Path) -> bool:
    return folder.exists() and (not folder.is_dir() or any(folder.iterdir()))


def searched_keys(manifest: dict[str, Any], choices: dict[str, str] | None) -> set[str]:
    """The options of a factor output that its own search chose and that the recipe leaves to the same search: the
    manifest's ``choices[k]`` is this resolution's ``choices[k]`` (same candidates, same prior) and says the value
    was measured on the source (:data:`~mla_convert.convert.options.resolve.SEARCHED`). Their recorded values are the
    search's winners, which the recipe's resolved prior need not equal."""
    from mla_convert.convert.options.resolve import SEARCHED

    made = manifest.get("choices")
    if not choices or not isinstance(made, dict):
        return set()
    return {k for k, why in choices.items() if why.startswith(SEARCHED) and made.get(k) == why}


def factor_stage(recipe: Recipe, choices: dict[str, str] | None = None) -> tuple[Stage, str | None]:
    """Whether ``<output>/factor`` is up to date; returns the stage and its canonical id when it is.

    ``choices``: where each resolved option of the recipe came from (``Resolution.choices``; None: compare every
    option as recorded), so that the options a search chose (:func:`searched_keys`) do not make the output stale.
    """
    from mla_convert.artifacts.manifest import MANIFEST, canonical_id, origin_name

    folder = recipe.out / "factor"
    if not _occupied(folder):
        return Stage("factor", "run", folder, "no output yet"), None

    def stale(why: str) -> tuple[Stage, None]:
        return Stage("factor", "run", folder, why, True), None

    m = read_json(folder / MANIFEST)
    if not isinstance(m, dict) or "canonical_id" not in m:
        return stale(f"the folder holds no readable {MANIFEST}")
    if canonical_id(m) != m["canonical_id"]:
        return stale(f"{MANIFEST} does not match its canonical id")
    missing = [name for name in m.get("outputs", {}) if not (folder / name).is_file()]
    if missing:
        return stale(f"{missing[0]} listed in the manifest is missing")
    want = recorded_options(_norm(recipe.factor.model_dump()))  # as a manifest records them
    got = m.get("options")
    if isinstance(got, dict):
        want |= {k: got.get(k) for k in searched_keys(m, choices)}
    if got != want:
        return stale("options differ: " + _diff(m.get("options"), want))
    origin = (m.get("source") or {}).get("origin")
    if origin != origin_name(recipe.source):
        return stale(f"converted from {origin!r}, not {recipe.source!r}")
    cid = str(m["canonical_id"])
    return Stage("factor", "skip", folder, f"up to date (canonical id {cid[:12]})"), cid


def adapt_stage(recipe: Recipe, factor_cid: str | None) -> Stage:
    """Whether ``<output>/adapt`` is up to date for the factor output with canonical id ``factor_cid``
    (None: the factor stage runs first, so the adapt stage runs too)."""
    from mla_convert.artifacts.manifest import MANIFEST

    folder = recipe.out / "adapt"
    if recipe.adapt is None:
        return Stage("adapt", "off", folder, "no adapt section (adapt: null)")
    occupied = _occupied(folder)
    if factor_cid is None:
        why = "the factor stage runs first" if occupied else "no output yet"
        return Stage("adapt", "run", folder, why, occupied)
    if not occupied:
        return Stage("adapt", "run", folder, "no output yet")
    rep = read_json(folder / "adapt_report.json")
    m = read_json(folder / MANIFEST)
    if not isinstance(rep, dict) or not isinstance(m, dict):
        why = f"the folder holds no readable adapt_report.json / {MANIFEST}"
        return Stage("adapt", "run", folder, why, True)
    want = _norm(recipe.adapt.model_dump())
    if rep.get("options") != want:
        return Stage("adapt", "run", folder, "options differ: " + _diff(rep.get("options"), want), True)
    parent = (m.get("parent") or {}).get("canonical_id")
    if parent != factor_cid:
        return Stage("adapt", "run", folder, "adapted from a different factor output", True)
    return Stage("adapt", "skip", folder, f"up to date (parent {factor_cid[:12]})")


def export_stage(recipe: Recipe, target: Path, target_cid: str | None) -> Stage:
    """Whether ``<output>/export`` is up to date for the checkpoint in ``target`` (canonical id ``target_cid``;
    None: an earlier stage runs first)."""
    from mla_convert.artifacts.manifest import MANIFEST

    folder = recipe.out / "export"
    if recipe.export is None:
        return Stage("export", "off", folder, "no export section")
    occupied = _occupied(folder)
    if target_cid is None or not occupied:
        why = "an earlier stage runs first" if occupied else "no output yet"
        return Stage("export", "run", folder, why, occupied)
    m = read_json(folder / MANIFEST)
    e = (m or {}).get("export") if isinstance(m, dict) else None
    if not isinstance(e, dict):
        return Stage("export", "run", folder, f"the folder holds no readable export {MANIFEST}", True)
    if (m.get("parent") or {}).get("canonical_id") != target_cid:
        return Stage("export", "run", folder, "exported from a different checkpoint", True)
    want = recipe.export.dtype
    if e.get("format") != recipe.export.format or (want != "auto" and e.get("dtype") != want):
        return Stage("export", "run", folder, "format or dtype differ", True)
    return Stage("export", "skip", folder, f"up to date (parent {target_cid[:12]})")


def make_plan(recipe: Recipe, choices: dict[str, str] | None = None) -> list[Stage]:
    """The stages with run/skip/off and the reason, from what ``<output>`` holds now (export only when the recipe
    has an ``export`` section; ``choices`` as :func:`factor_stage` takes them)."""
    fstage, cid = factor_stage(recipe, choices)
    astage = adapt_stage(recipe, cid if fstage.action == "skip" else None)
    target = astage.folder if astage.action != "off" else fstage.folder
    v = recipe.validation
    vstage = (
        Stage("validate", "run", target, f"6-rung ladder on the last stage's output, {v.backend} backend")
        if v.enabled
        else Stage("validate", "off", target, "validate.enabled is false")
    )
    target_cid = None
    if (astage.action == "skip") or (astage.action == "off" and fstage.action == "skip"):
        target_cid = (read_json(target / "mla_manifest.json") or {}).get("canonical_id")
    stages = [fstage, astage, vstage]
    return stages + [export_stage(recipe, target, target_cid)] if recipe.export is not None else stages


def blocked(plan: list[Stage]) -> list[Stage]:
    """Stages that would replace an existing folder (allowed only with ``--overwrite``)."""
    return [s for s in plan if s.action == "run" and s.replaces]


def blocked_problems(plan: list[Stage]) -> list[str]:
    """One line per stage that would replace a non-empty folder, naming the fix."""
    return [
        f"{s.name} stage: {s.folder} is not empty ({s.why}); pass --overwrite to replace it"
        for s in blocked(plan)
    ]


def plan_lines(plan: list[Stage], overwrite: bool) -> list[str]:
    """The plan as text: ``  NAME ACTION FOLDER  (why)``."""
    out = []
    for s in plan:
        why = s.why
        if s.replaces:
            why += "; replaces the folder" + ("" if overwrite else " (needs --overwrite)")
        out.append(f"  {s.name:<9} {s.action:<5} {s.folder}  ({why})")
    return out


def shape_lines(recipe: Recipe, src: SourceModel) -> list[str]:
    """Per-layer cache shapes of the conversion, from the config alone
    (:func:`~mla_convert.convert.options.options.geometry`)."""
    fo = recipe.factor
    geo = geometry(fo, src)
    g, d, n = src.num_kv_heads, src.head_dim, geo.num_layers
    rope, base, heads = geo.rope_width, geo.source_width, geo.rope_heads
    if fo.kv_lora_rank is not None:
        latent = f"{fo.kv_lora_rank} in every layer (kv_lora_rank)"
    else:
        total = geo.latent_total(cache_budget_of(fo, src) or 0.0)
        latent = (
            f"{total / n:g} on average ({total} over {n} layers, allocated per layer by marginal error "
            "when converting)"
        )
    width = geo.mean_width(fo)
    mode = f"{fo.rope_mode}: {heads} rope head{'s' if heads > 1 else ''} x {geo.rope_pairs} pairs"
    return [
        f"  source K + V             {base} values/token/layer ({g} KV heads x {d} x 2), {4 * base} bytes float32",
        f"  RoPE kept                {rope} values ({mode}, {fo.rope_strategy})",
        f"  latent d_c               {latent}",
        f"  MLA cache [c_kv|k_rope]  {width:g} values/token/layer, {4 * width:g} bytes float32",
        f"  ratio to source          {width / base:.4f} ({width:g} / {base})",
        f"  whole model              {width * n:g} values/token over {n} layers (source {base * n})",
    ]
