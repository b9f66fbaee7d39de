"""``run`` and ``init-recipe``: whole recipes (factor -> adapt -> validate -> export) from YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from mla_convert.cli.render import (
    STATE,
    err_console,
    fail,
    note,
    plain,
    progress_bar,
    step_printer,
    user_errors,
    validation_failed,
)


def recipe_fail(exc: Any) -> None:
    """Print a RecipeError (one line, or a count and one indented line per problem) and exit 2."""
    lines = exc.lines()
    err_console.print(f"[bold red]error:[/] {escape(lines[0])}", highlight=False, soft_wrap=True)
    for line in lines[1:]:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def recipe_path(recipe: str) -> Path:
    """RECIPE as a file, or the bundled recipe of that name when no such file exists."""
    from mla_convert.recipes.catalog import bundled_path

    p = Path(recipe).expanduser()
    if not p.exists():
        bundled = bundled_path(recipe)
        if bundled is not None:
            return bundled
    return p


def run_recipe_cmd(
    recipe: str = typer.Argument(..., help="A recipe YAML file (or the name of a bundled recipe)."),
    overrides: list[str] = typer.Argument(
        None, help="key=value / section.key=value, values read as YAML (factor.rope_pairs=16, adapt=null)."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check the recipe, source architecture, shapes and memory estimate without loading weights; "
        "print the plan; write nothing.",
    ),
    overwrite: bool = typer.Option(
        False,
        help="Replace stage folders (OUTPUT/factor, OUTPUT/adapt) whose outputs do not match the recipe.",
    ),
) -> None:
    """Run a recipe: factor -> adapt -> validate (-> export), skipping stages whose outputs already match.

    Prints the resolved recipe and the plan, saves OUTPUT/recipe.resolved.yaml, runs the stages into
    OUTPUT/factor and OUTPUT/adapt (a stage whose manifest matches the recipe is skipped), and ends with the
    validation ladder (exit 1 naming the failing rung). Every recipe problem is listed at once with its
    YAML path (exit 2, nothing written).

    Examples:

      mla-convert run smollm2-135m-quickstart.yaml --dry-run

      mla-convert run smollm2-135m-quickstart.yaml factor.rope_pairs=20 adapt=null
    """
    from mla_convert.adapt.options import AdaptError
    from mla_convert.recipes.load import load_recipe, resolved_yaml
    from mla_convert.recipes.memory import memory_lines
    from mla_convert.recipes.plan import blocked_problems, make_plan, plan_lines, shape_lines
    from mla_convert.recipes.run import run_recipe
    from mla_convert.recipes.schema import RecipeError

    path = recipe_path(recipe)
    try:
        res = load_recipe(path, overrides or [])
    except RecipeError as exc:
        recipe_fail(exc)
    r, src = res.recipe, res.src
    assert src is not None
    plan = make_plan(r, res.resolution.choices if res.resolution is not None else None)
    show = dry_run or not STATE["quiet"]
    if show:
        plain(f"# recipe {path}" + (f" with {' '.join(overrides)}" if overrides else "") + ", resolved:")
        plain(resolved_yaml(res).rstrip())
        plain(
            f"\nsource {r.source}: {src.family.name}"
            + (f" ({src.config.model_type})" if src.config.model_type != src.family.name else "")
            + f", {src.num_layers} layers, "
            f"{src.num_heads} query / {src.num_kv_heads} KV heads, head_dim {src.head_dim}, hidden {src.hidden_size}"
        )
        plain(f"\nplan (output {r.out}):")
        for line in plan_lines(plan, overwrite):
            plain(line)
    if dry_run:
        plain("\nshapes per layer (from the config; no weights loaded):")
        for line in shape_lines(r, src):
            plain(line)
        plain("\nmemory (estimate, GB; factor streams layer by layer, checkpoints in their dtype):")
        for line in memory_lines(r, src):
            plain(line)
    if r.export is not None and show:  # load_recipe refused the recipe if it were not exact
        plain(f"\nexport (target {r.export.target}): exact, checked before any work")
    stop = blocked_problems(plan)
    if stop and not overwrite:
        recipe_fail(RecipeError(res.file, stop))
    if dry_run:
        plain(
            f"\ndry run: recipe, source and options check out; nothing was loaded or written "
            f"(the run writes {r.out / 'recipe.resolved.yaml'} and the stage folders)"
        )
        return

    with user_errors():
        try:
            result = run_recipe(
                res,
                overwrite=overwrite,
                say=note,
                factor_progress=progress_bar,
                adapt_progress=step_printer(),
                validate_progress=note,
            )
        except RecipeError as exc:
            recipe_fail(exc)
        except AdaptError as exc:
            fail(str(exc))
    summary = ", ".join(f"{k} {v}" for k, v in result.stages.items())
    for line in result.quality:  # what each stage measured (its report says on what)
        plain(line)
    vres = result.validation
    if vres is not None and not STATE["quiet"]:
        for rung in vres.rungs:
            verdict = f"skipped ({rung.skipped})" if rung.skipped else ("pass" if rung.passed else "FAIL")
            plain(f"  rung {rung.number} {rung.name}: {verdict}")
    where = f"; report {result.target / 'validation.md'}" if vres is not None else ""
    plain(f"recipe {r.name}: {summary}; checkpoint {result.target}{where}")
    if vres is not None and not vres.passed:
        validation_failed(vres)


def init_recipe_cmd(
    name: str = typer.Argument(None, help="A bundled recipe; omit it to list them."),
    dest: Path = typer.Argument(
        None,
        help="Where to write it (default ./NAME.yaml; a folder, or a new path without .yaml/.yml, gets NAME.yaml).",
    ),
    overwrite: bool = typer.Option(False, help="Replace an existing DEST."),
) -> None:
    """Copy a bundled recipe to edit and run.

    Example: mla-convert init-recipe smollm2-135m-quickstart && mla-convert run smollm2-135m-quickstart.yaml --dry-run
    """
    from mla_convert.files import atomic_write_text
    from mla_convert.recipes.catalog import (
        accelerate_configs,
        bundled_description,
        bundled_names,
        bundled_path,
    )

    names = bundled_names()
    launch = accelerate_configs()
    if name is None:
        for n in names:
            plain(f"{n:<26} {bundled_description(n)}")
        for n in launch:
            plain(f"{n:<26} accelerate launch configuration for multi-GPU adapt (docs/adapt.md)")
        return
    src = bundled_path(name) or launch.get(name.removesuffix(".yaml"))
    if src is None:
        hint = ""
        if name.endswith((".yaml", ".yml")) or "/" in name:  # a destination given as the first argument
            example = "smollm2-135m-quickstart" if "smollm2-135m-quickstart" in names else names[0]
            hint = f"; NAME comes first, then DEST: mla-convert init-recipe {example} {name}"
        fail(f"no bundled recipe {name!r}; bundled: {', '.join([*names, *launch])}{hint}")
    assert src is not None
    stem = next((n for n, p in launch.items() if p == src), src.stem)
    target = dest if dest is not None else Path(f"{stem}.yaml")
    if target.is_dir() or (not target.exists() and target.suffix.lower() not in (".yaml", ".yml")):
        target = target / f"{stem}.yaml"
    if target.exists() and not overwrite:
        fail(f"{target} exists; pass --overwrite to replace it")
    from mla_convert.artifacts.output import check_writable

    with user_errors():
        check_writable(target)
    atomic_write_text(target, src.read_text())
    if stem in launch:
        plain(
            f"wrote {target}; then: accelerate launch --config_file {target} --num_processes N "
            "-m mla_convert adapt CKPT OUT ..."
        )
    else:
        plain(f"wrote {target}; edit it, then: mla-convert run {target} --dry-run")
