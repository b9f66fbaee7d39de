"""Reading a recipe: YAML with the line of every key, overrides, validation, and every problem at once.

Loading collects *every* problem before failing, each with its dotted YAML path and its line (or "set on
the command line"): YAML duplicates, schema errors, values outside their choices, ranks or RoPE pairs
impossible for the source's shapes (read from its config and safetensors headers, never its weights), and
settings the stages cannot run with together.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from mla_convert.convert.options.fields import (
    choice_message,
    literal_choices,
    offered_choices,
    retired,
    retired_fields,
)
from mla_convert.convert.options.options import ConvertOptions, problems
from mla_convert.recipes.catalog import bundled_names
from mla_convert.recipes.overrides import apply_override, parse_override, yaml_reason
from mla_convert.recipes.schema import SECTIONS, Recipe, RecipeError, allowed_keys

if TYPE_CHECKING:
    from mla_convert.convert.options.resolve import Resolution
    from mla_convert.sources.checkpoint import SourceModel


@dataclass
class Resolved:
    """A checked recipe: the model, where it came from, and (when checked against it) its source."""

    recipe: Recipe
    file: str
    overrides: list[str]
    src: SourceModel | None = None
    #: how the factor options were resolved for the source (None when the source was not opened)
    resolution: Resolution | None = None


KeyPath = tuple[Any, ...]  # a YAML key path (pydantic locations may hold ints)


@dataclass
class _Doc:
    """Parsing state: the raw mapping, YAML lines of each key path, override paths, problems."""

    file: str
    raw: Any = None
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)
    overridden: set[tuple[str, ...]] = field(default_factory=set)
    problems: list[tuple[KeyPath, str]] = field(default_factory=list)

    def add(self, path: KeyPath, msg: str) -> None:
        self.problems.append((tuple(path), msg))

    def _where(self, path: KeyPath) -> tuple[int | None, str]:
        """The YAML line of ``path`` (its nearest recorded parent) and the note to print with it."""
        spath = tuple(str(p) for p in path)
        if path and any(spath[: len(o)] == o or o[: len(spath)] == spath for o in self.overridden):
            return None, " (set on the command line)"
        line = next(
            (self.lines[spath[:n]] for n in range(len(spath), 0, -1) if spath[:n] in self.lines), None
        )
        return line, f" (line {line})" if line is not None else ""

    def render(self) -> list[str]:
        """One line per problem, ordered by position in the file (command-line ones last)."""
        rows = []
        for i, (path, msg) in enumerate(self.problems):
            where = ".".join(str(p) for p in path)
            line, note = self._where(path)
            text = f"{where}: {msg}" if where else msg
            rows.append((line if line is not None else math.inf, i, text + note))
        return [text for _, _, text in sorted(rows)]


def _walk(node: Any, prefix: tuple[str, ...], doc: _Doc) -> None:
    """Record the line of every mapping key, and report duplicate keys (YAML keeps the last silently)."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for knode, vnode in node.value:
        key = str(knode.value)
        line = knode.start_mark.line + 1
        path = prefix + (key,)
        if key in seen:
            doc.add(path, f"duplicate key (lines {seen[key]} and {line}); give it once")
        seen[key] = line
        doc.lines[path] = line
        _walk(vnode, path, doc)


def _read(file: str, text: str) -> _Doc:
    """Parse ``text`` into a mapping with the line of every key.

    Raises:
        RecipeError: invalid YAML (one line naming ``file:LINE``), or a document that is not a mapping.
    """
    doc = _Doc(file)
    try:
        doc.raw = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else file
        col = f" (column {mark.column + 1})" if mark is not None else ""
        raise RecipeError(where, [f"invalid YAML: {yaml_reason(exc)}{col}"]) from None
    _walk(node, (), doc)
    if doc.raw is None:
        doc.raw = {}
    if not isinstance(doc.raw, dict):
        kind = type(doc.raw).__name__
        raise RecipeError(
            file, [f"the file must hold a mapping (name, source, output, factor, ...), not {kind}"]
        )
    return doc


def _override(doc: _Doc, overrides: list[str] | tuple[str, ...]) -> None:
    """Apply ``key=value`` items, then the normalizations: ``kv_lora_rank`` replaces the cache size, a ``cache_budget`` the
    recipe's ``cache_fraction`` unless that was overridden too (as on
    the factor command line); ``adapt.source`` defaults to the recipe's source."""
    raw: dict[str, Any] = doc.raw
    for item in overrides:
        try:
            opath, value = parse_override(item)
            apply_override(raw, opath, value)
            doc.overridden.add(opath)
        except ValueError as exc:
            doc.add((), str(exc))
    fraw = raw.get("factor")
    if isinstance(fraw, dict) and fraw.get("kv_lora_rank") is not None:
        fraw["cache_budget"] = fraw["cache_fraction"] = None
    elif isinstance(fraw, dict) and fraw.get("cache_budget") is not None and ("factor", "cache_fraction") not in doc.overridden:
        fraw["cache_fraction"] = None  # an absolute budget replaces the recipe's fraction, as on the command line
    araw = raw.get("adapt")
    if isinstance(araw, dict) and araw.get("source") is None and isinstance(raw.get("source"), str):
        araw["source"] = raw["source"]


def _retired(doc: _Doc) -> None:
    """Refuse the ``factor`` keys and values the command line no longer takes, each with what replaces it
    (:func:`~mla_convert.convert.options.options.retired`); a retired key set to null (not given) is dropped."""
    fraw = doc.raw.get("factor")
    if not isinstance(fraw, dict):
        return
    gone = retired_fields()
    for key, reason in retired(fraw):
        value = fraw.pop(key)
        doc.add(("factor", key), _recipe_words(reason if key in gone else f"{value}: {reason}"))
    for key in gone:
        if key in fraw and fraw[key] is None:
            del fraw[key]


def _schema_problem(e: Any) -> str:
    """The message of one pydantic error: unknown keys with the closest allowed key, choices listed."""
    loc = tuple(e["loc"])
    if e["type"] == "extra_forbidden":
        model = SECTIONS.get(tuple(str(p) for p in loc[:-1]))
        if model is None:
            return "unknown key"
        keys = allowed_keys(model)
        close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
        return "unknown key" + (f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(keys)}")
    if e["type"] == "missing":
        return "required key is missing"
    if e["type"] == "literal_error":
        field = str(loc[-1]) if len(loc) == 2 and loc[0] == "factor" else ""
        return choice_message(e.get("input"), offered_choices(field, literal_choices(e)))
    msg = str(e["msg"]).removeprefix("Value error, ")
    return msg if isinstance(e.get("input"), dict) else msg + f" (got {e.get('input')!r})"


def _failed_factor_keys(failed: set[KeyPath]) -> set[str]:
    """The ``factor`` keys that failed the schema (their range rules are not checked again)."""
    return {str(p[1]) for p in failed if len(p) >= 2 and p[0] == "factor"}


def _validate(doc: _Doc) -> tuple[Recipe | None, set[KeyPath], ConvertOptions | None]:
    """Validate the mapping: ``(recipe or None, paths that failed, factor options to range-check)``.

    When the recipe fails elsewhere, the factor options are still built from the keys that passed, so
    their range problems are reported in the same run.
    """
    try:
        recipe = Recipe.model_validate(doc.raw)
        return recipe, set(), recipe.factor
    except ValidationError as exc:
        failed: set[KeyPath] = set()
        for e in exc.errors():
            failed.add(tuple(e["loc"]))
            doc.add(tuple(e["loc"]), _schema_problem(e))
    fraw = doc.raw.get("factor")
    if ("factor",) in failed:
        return None, failed, None
    bad = _failed_factor_keys(failed)
    fvals = fraw if isinstance(fraw, dict) else {}
    try:
        return None, failed, ConvertOptions.model_validate({k: v for k, v in fvals.items() if k not in bad})
    except ValidationError:
        return None, failed, None


def _open(doc: _Doc, path: KeyPath, spec: str) -> SourceModel | None:
    """Open a source (config and headers only); a failure becomes a problem at ``path``."""
    from mla_convert.sources.checkpoint import SourceError, open_source

    try:
        return open_source(spec)
    except SourceError as exc:
        doc.add(path, str(exc))
        return None


def _check_stages(recipe: Recipe, doc: _Doc) -> None:
    """Settings the stages cannot run with together: validate reads the conversion's evaluation windows."""
    v, f = recipe.validation, recipe.factor
    if not v.enabled:
        return
    if f.eval_windows < 2:
        doc.add(("factor", "eval_windows"), "the validate stage needs at least 2 evaluation windows")
    if v.prompt_tokens + v.new_tokens > f.window:
        doc.add(
            ("validate", "prompt_tokens"),
            f"prompt_tokens + new_tokens = {v.prompt_tokens + v.new_tokens} exceeds factor.window "
            f"({f.window}), the evaluation windows validate reads",
        )


def _check_output(output: str, src: SourceModel | None, doc: _Doc) -> None:
    """The output root must be a folder (or nothing yet), and not inside the source folder."""
    out = Path(output).expanduser().resolve()
    if out.exists() and not out.is_dir():
        doc.add(("output",), f"{out} exists and is a file; give a folder")
    if src is not None:
        sdir = src.path.resolve()
        if out == sdir or sdir in out.parents:
            doc.add(("output",), f"{out} is inside the source folder {sdir}; write it somewhere else")


def _recipe_words(msg: str) -> str:
    """A message written for the command line in a recipe's keys: ``--rope-mode`` -> ``factor.rope_mode``,
    ``--target`` -> ``export.target``."""
    import re

    def key(m: re.Match[str]) -> str:
        name = m.group(1)
        return "export.target" if name == "target" else "factor." + name.replace("-", "_")

    return re.sub(r"--([a-z][a-z-]*)", key, msg)


def load_recipe(
    path: Path | str,
    overrides: list[str] | tuple[str, ...] = (),
    check_source: bool = True,
    text: str | None = None,
) -> Resolved:
    """Read, override, validate and check a recipe; every problem is reported at once.

    Args:
        path: the YAML file (only its name is used when ``text`` is given).
        overrides: ``key=value`` / ``a.b=c`` items, values read as YAML, applied before validation.
        check_source: open the source (config and safetensors headers, no weights) and check ranks,
            RoPE pairs and the output location against it.
        text: the YAML itself, instead of reading ``path``.

    Raises:
        RecipeError: with one line per problem, each naming its YAML path (and line).
    """
    file = str(path)
    if text is None:
        p = Path(path)
        if not p.is_file():
            names = ", ".join(bundled_names())
            hint = f"bundled: {names}; copy one with 'mla-convert init-recipe NAME'"
            raise RecipeError(file, [f"no such recipe file ({hint})"])
        text = p.read_text()
    doc = _read(file, text)
    _override(doc, overrides)
    _retired(doc)
    recipe, failed, fo = _validate(doc)
    raw: dict[str, Any] = doc.raw
    src = None
    source = raw.get("source")
    if check_source and isinstance(source, str) and source and ("source",) not in failed:
        src = _open(doc, ("source",), source)
    resolution = None
    if fo is not None and src is not None and recipe is not None:  # the one resolution factor and inspect run too
        from mla_convert.convert.options.options import OptionsError
        from mla_convert.convert.options.resolve import resolve_options

        target = recipe.export.target if recipe.export is not None else "transformers"
        try:
            fraw = raw.get("factor")
            given = {k for k, v in fraw.items() if v is not None} if isinstance(fraw, dict) else set()  # null: not given
            export = recipe.export.format if recipe.export is not None else None
            resolution = resolve_options(fo, src, target, given, export)
            fo = recipe.factor = resolution.options
        except OptionsError as exc:
            doc.add(("factor",), _recipe_words(str(exc)))
    if fo is not None:
        bad = _failed_factor_keys(failed)
        for key, msg in problems(fo, src):  # the conversion's own option rules, each at its key
            if key not in bad:
                doc.add(("factor", key), msg)
    if recipe is not None and recipe.export is not None and src is not None:  # exact or not, before any work
        from mla_convert.engines.precheck import export_problems
        from mla_convert.engines.registry import export_target

        for msg in export_problems(src, recipe.factor, export_target(recipe.export.target), recipe.export.format):
            doc.add(("export", "target"), _recipe_words(msg))
    if recipe is not None:
        _check_stages(recipe, doc)
        a = recipe.adapt
        if check_source and a is not None and a.source and a.source != recipe.source:
            _open(doc, ("adapt", "source"), a.source)
    output = raw.get("output")
    if check_source and isinstance(output, str) and output and ("output",) not in failed:
        _check_output(output, src, doc)
    if doc.problems:
        raise RecipeError(file, doc.render())
    assert recipe is not None
    return Resolved(recipe, file, list(overrides), src, resolution)


def resolved_yaml(res: Resolved) -> str:
    """The resolved recipe as YAML (every default filled in), with a header naming its origin."""
    from mla_convert import __version__

    head = f"# resolved by mla-convert {__version__} from {res.file}"
    if res.overrides:
        head += " with " + " ".join(res.overrides)
    body = yaml.safe_dump(res.recipe.dump(), sort_keys=False, default_flow_style=False, width=100)
    return head + "\n" + body
