"""Executing a recipe: write the resolved recipe, then factor -> adapt -> validate -> export, skipping what is up to
date."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_convert.engines.registry import export_target
from mla_convert.files import atomic_write_text
from mla_convert.recipes.load import Resolved, resolved_yaml
from mla_convert.recipes.plan import (
    adapt_stage,
    blocked_problems,
    export_stage,
    factor_stage,
    make_plan,
    read_json,
)
from mla_convert.recipes.schema import RESOLVED_NAME, RecipeError


@dataclass
class RunResult:
    """What ``run`` did: per stage ``ran`` / ``skipped`` / ``off`` (validate: ``passed`` / ``failed``), the
    checkpoint the last stage left, and the validation result."""

    stages: dict[str, str]
    target: Path
    validation: Any = None
    #: one line per stage that measured quality (:func:`factor_line`, :func:`adapt_line`)
    quality: list[str] = field(default_factory=list)


def factor_line(folder: Path) -> str | None:
    """``factor: perplexity P (source S, xR) on N held-out tokens of TEXT; cache V values/token/layer (F of the
    source)`` from a factor stage's ``report.json``; None when it has none (e.g. an older folder)."""
    report = read_json(folder / "report.json") or {}
    model = report.get("model") or {}
    ev, cache = model.get("eval") or {}, model.get("cache") or {}
    if not ev.get("perplexity"):
        return None
    line = f"factor: perplexity {ev['perplexity']:.3f}"
    if ev.get("reference_perplexity"):
        ref = ev["reference_perplexity"]
        line += f" (source {ref:.3f}, x{ev['perplexity'] / ref:.2f})"
    line += (
        f" on {ev.get('tokens', 0)} held-out tokens of {(report.get('text') or {}).get('name', 'the text')}"
    )
    values = (cache.get("converted") or {}).get("values_per_token_per_layer")
    if values and cache.get("ratio"):
        line += f"; cache {values:g} values/token/layer ({cache['ratio']:.2%} of the source)"
    return line


def adapt_line(report: dict[str, Any]) -> str | None:
    """``adapt: perplexity B -> A (source S, xR) on N held-out tokens; KL ...; chat KL ...; T tokens trained``
    from ``run_adapt``'s report (None without before/after evaluations)."""
    b, a = report.get("before"), report.get("after")
    if not b or not a:
        return None
    ref = a["source_perplexity"]
    line = (
        f"adapt: perplexity {b['perplexity']:.3f} -> {a['perplexity']:.3f} (source {ref:.3f}, "
        f"x{a['perplexity'] / ref:.2f}) on {a['eval_tokens']} held-out tokens; KL {b['kl']:.4f} -> {a['kl']:.4f}"
    )
    if a.get("other_perplexity"):
        line += f"; {a['other_text']} {b['other_perplexity']:.3f} -> {a['other_perplexity']:.3f}"
    if a.get("chat_kl") is not None and b.get("chat_kl") is not None:
        line += f"; chat KL {b['chat_kl']:.4f} -> {a['chat_kl']:.4f}"
    return line + f"; {report.get('tokens_trained', 0):,} tokens trained"


def run_recipe(
    res: Resolved,
    overwrite: bool = False,
    say: Callable[[str], None] = lambda _m: None,
    factor_progress: Callable[[], AbstractContextManager[Callable[[str, int, int], None]]] | None = None,
    adapt_progress: Callable[[dict[str, Any]], None] | None = None,
    validate_progress: Callable[[str], None] | None = None,
) -> RunResult:
    """Execute the stages in order: write the resolved recipe, factor, adapt, validate.

    ``factor_progress`` makes the context (entered around the factor stage only) that yields the factor
    progress callback. Each stage is re-planned just before it runs (an adapt output stays valid when a
    re-run factor stage reproduces the same canonical id). Stage folders are replaced only with
    ``overwrite``.

    Raises:
        RecipeError: a stage folder would be replaced without ``overwrite`` (checked before any work).
        The stages' own errors (SourceError, OutputError, AdaptError, ValidationError, ...).
    """
    from mla_convert.adapt import train as adapt_mod
    from mla_convert.artifacts.manifest import MANIFEST
    from mla_convert.convert.pipeline import job as pipeline
    from mla_convert.validate import ladder as validate_mod
    from mla_convert.validate.report import write_validation

    recipe = res.recipe
    choices = res.resolution.choices if res.resolution is not None else None
    stop = blocked_problems(make_plan(recipe, choices))
    if stop and not overwrite:
        raise RecipeError(res.file, stop)
    if res.src is None:
        from mla_convert.sources.checkpoint import open_source

        res.src = open_source(recipe.source)
    atomic_write_text(recipe.out / RESOLVED_NAME, resolved_yaml(res))
    say(f"wrote {recipe.out / RESOLVED_NAME}")
    done: dict[str, str] = {}

    fstage, cid = factor_stage(recipe, choices)
    if fstage.action == "run":
        say(f"factor: running ({fstage.why})")
        with factor_progress() if factor_progress else nullcontext(None) as cb:
            pipeline.run_factor(
                res.src, fstage.folder, recipe.factor, overwrite=overwrite, progress=cb, resolution=res.resolution
            )
        cid = (read_json(fstage.folder / MANIFEST) or {}).get("canonical_id")
        done["factor"] = "ran"
    else:
        say(f"factor: skipped, {fstage.why}")
        done["factor"] = "skipped"
    target = fstage.folder
    quality = [line for line in [factor_line(fstage.folder)] if line]

    astage = adapt_stage(recipe, cid)
    if astage.action == "run":
        assert recipe.adapt is not None
        say(f"adapt: running ({astage.why})")
        report = adapt_mod.run_adapt(
            fstage.folder, astage.folder, recipe.adapt, overwrite=overwrite, progress=adapt_progress
        )
        done["adapt"] = "ran"
        target = astage.folder
    elif astage.action == "skip":
        say(f"adapt: skipped, {astage.why}")
        done["adapt"] = "skipped"
        target = astage.folder
        report = read_json(astage.folder / "adapt_report.json")
    else:
        done["adapt"] = "off"
        report = None
    line = adapt_line(report) if report else None
    quality += [line] if line else []

    result = RunResult(done, target, quality=quality)
    v, f = recipe.validation, recipe.factor
    if not v.enabled:
        done["validate"] = "off"
        _export(recipe, target, done, overwrite, say)
        return result
    say(f"validate: {target}")
    # the conversion's evaluation windows, against the recipe's source
    vres = validate_mod.validate(
        target,
        source=recipe.source,
        text=f.text,
        window=f.window,
        windows=f.eval_windows,
        progress=validate_progress,
        **v.ladder(),
    )
    write_validation(target, vres)
    done["validate"] = "passed" if vres.passed else "failed"
    result.validation = vres
    if vres.passed:
        _export(recipe, target, done, overwrite, say)
    elif recipe.export is not None:
        done["export"] = "off"
        say("export: not run, validation failed")
    return result


def _export(
    recipe: Any, target: Path, done: dict[str, str], overwrite: bool, say: Callable[[str], None]
) -> None:
    """The export stage: ``<output>/export`` from the last checkpoint, unless up to date or off."""
    from mla_convert.engines.deepseek_v3.write import export_checkpoint

    if recipe.export is None:
        return
    cid = (read_json(target / "mla_manifest.json") or {}).get("canonical_id")
    stage = export_stage(recipe, target, cid)
    if stage.action == "skip":
        done["export"] = "skipped"
        say(f"export: skipped, {stage.why}")
        return
    say(f"export: running ({stage.why})")
    if recipe.export.format == "gguf":
        _export_gguf(recipe, target, stage.folder, cid, say)
        done["export"] = "ran"
        return
    export_checkpoint(
        target,
        stage.folder,
        recipe.export.format,
        overwrite=overwrite or stage.replaces,
        note=say,
        dtype=recipe.export.dtype,
        target=export_target(recipe.export.target),
    )
    done["export"] = "ran"


def _export_gguf(recipe: Any, target: Path, folder: Path, cid: str | None, say: Callable[[str], None]) -> None:
    """``export: {format: gguf}``: ``<output>/export/model.gguf`` and a small ``mla_manifest.json`` beside it (the
    parent's canonical id and the export record, which tell the next run whether the file is up to date)."""
    import json

    from mla_convert.artifacts.manifest import MANIFEST
    from mla_convert.engines.llamacpp.gguf_file import export_gguf
    from mla_convert.files import atomic_folder

    with atomic_folder(folder) as staged:
        _, record = export_gguf(target, staged / "model.gguf", recipe.export.dtype, note=say)
        manifest = {"parent": {"canonical_id": cid, "checkpoint": target.name}, "export": record}
        atomic_write_text(staged / MANIFEST, json.dumps(manifest, indent=1) + "\n")
