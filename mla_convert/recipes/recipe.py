"""Recipes: one YAML file describes a whole job (source, RoPE selection, factorization, adaptation,
validation); ``mla-convert run RECIPE [key=value ...]`` executes it stage by stage.

A recipe is a :class:`Recipe` (pydantic, unknown keys refused at every level). ``factor`` takes every
:class:`~mla_convert.convert.ConvertOptions` key, ``adapt`` every :class:`~mla_convert.adapt.AdaptOptions`
key (``adapt: null`` skips the stage), ``validate`` the ladder's settings. Loading collects *every*
problem at once, each with its dotted YAML path (and line): schema errors, values outside their choices,
and ranks or RoPE pairs impossible for the source's shapes (read from its config and safetensors
headers, never its weights).

Stages write ``<output>/factor`` and ``<output>/adapt``; the resolved recipe goes to
``<output>/recipe.resolved.yaml``. A stage is skipped when its folder already holds a manifest whose
options (and source, or parent canonical id) match the recipe; ``run`` always ends with ``validate``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mla_convert.adapt.train import AdaptOptions
from mla_convert.convert.build import REFITS, ConvertOptions
from mla_convert.convert.factorize import FACTORIZATIONS, OBJECTIVES
from mla_convert.convert.rope import BASES, MODES, STRATEGIES

if TYPE_CHECKING:
    from mla_convert.sources.checkpoint import SourceModel

#: Folder of the bundled recipes (``mla_convert/recipes/*.yaml``).
#: The bundled recipes: the repository's top-level ``recipes/``, installed as ``mla_convert.recipes.bundled``.
BUNDLED_DIR = Path(str(resources.files("mla_convert.recipes.bundled")))
RESOLVED_NAME = "recipe.resolved.yaml"
STAGES = ("factor", "adapt", "validate")


class RecipeError(ValueError):
    """A recipe that cannot run. ``problems`` holds one line per problem (``path: message``)."""

    def __init__(self, file: str, problems: list[str]) -> None:
        self.file = file
        self.problems = problems
        super().__init__(self.lines()[0] if len(problems) == 1 else "\n".join(self.lines()))

    def lines(self) -> list[str]:
        """The report: one line for one problem; a count then one indented line each for several."""
        if len(self.problems) == 1:
            return [f"{self.file}: {self.problems[0]}"]
        return [f"{self.file} has {len(self.problems)} problems:"] + [
            f"  {self.file}: {p}" for p in self.problems
        ]


class ValidateSettings(BaseModel):
    """Settings of the final ``validate`` stage (the five-rung ladder)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="run the validation ladder at the end")
    prompt_tokens: int = Field(61, ge=2, description="prefill tokens of rungs 2-3")
    new_tokens: int = Field(16, ge=2, description="decode steps of rung 3")
    page_size: int = Field(16, ge=1, le=128, description="paged-cache page size")
    backend: Literal["triton", "absorbed"] = Field("triton", description="decode backend of rung 3")


class Recipe(BaseModel):
    """One job: source -> factor -> (adapt) -> validate, written under ``output``."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, description="a short name for the job")
    description: str = ""
    source: str = Field(..., min_length=1, description="HF folder, .gguf file or 'smollm2-135m'")
    output: str = Field(..., min_length=1, description="root output folder of the stages")
    factor: ConvertOptions = Field(default_factory=ConvertOptions)  # type: ignore[arg-type]
    adapt: AdaptOptions | None = None
    validation: ValidateSettings = Field(default_factory=ValidateSettings, alias="validate")  # type: ignore[arg-type]

    @property
    def out(self) -> Path:
        return Path(self.output).expanduser()

    def dump(self) -> dict[str, Any]:
        """Plain JSON-compatible dict with the YAML key names."""
        return self.model_dump(mode="json", by_alias=True)


#: Section path -> model that validates it (for "unknown key" suggestions).
SECTIONS: dict[tuple[str, ...], type[BaseModel]] = {
    (): Recipe,
    ("factor",): ConvertOptions,
    ("adapt",): AdaptOptions,
    ("validate",): ValidateSettings,
}


def allowed_keys(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


# ------------------------------------------------------------------------------------------- loading
@dataclass
class Resolved:
    """A checked recipe: the model, where it came from, and (when checked against it) its source."""

    recipe: Recipe
    file: str
    overrides: list[str]
    src: SourceModel | None = None


@dataclass
class _Doc:
    """Parsing state: the raw mapping, YAML lines of each key path, override paths, problems."""

    file: str
    raw: Any = None
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)
    overridden: set[tuple[str, ...]] = field(default_factory=set)
    problems: list[tuple[tuple[Any, ...], str]] = field(default_factory=list)

    def add(self, path: tuple[Any, ...], msg: str) -> None:
        self.problems.append((tuple(path), msg))

    def render(self) -> list[str]:
        """One line per problem, ordered by position in the file (command-line ones last)."""
        rows = []
        for i, (path, msg) in enumerate(self.problems):
            where = ".".join(str(p) for p in path)
            spath = tuple(str(p) for p in path)
            line = None
            if path and any(spath[: len(o)] == o or o[: len(spath)] == spath for o in self.overridden):
                note = " (set on the command line)"
            else:
                line = next(
                    (self.lines[spath[:n]] for n in range(len(spath), 0, -1) if spath[:n] in self.lines), None
                )
                note = f" (line {line})" if line is not None else ""
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


def parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    """``a.b=c`` -> ``(("a", "b"), value)`` with the value read as YAML (``16`` int, ``null`` None).

    Raises:
        ValueError: no ``=``, an empty key part, or a value that is not valid YAML.
    """
    key, sep, value = item.partition("=")
    key = key.strip()
    path = tuple(key.split("."))
    if not sep or not key or any(not p.strip() for p in path):
        raise ValueError(f"override {item!r} is not key=value (e.g. factor.rope_pairs=16, adapt=null)")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"override {item!r}: the value is not valid YAML ({_yaml_reason(exc)})") from exc
    return tuple(p.strip() for p in path), parsed


def apply_override(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set ``raw[a][b]... = value``, creating (or replacing a null) section on the way.

    Raises:
        ValueError: when a part of the path names a value that is not a section.
    """
    node = raw
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            where = ".".join(path[: i + 1])
            raise ValueError(f"{where} is {nxt!r}, not a section, so {'.'.join(path)} cannot be set")
        node = nxt
    node[path[-1]] = value


def _yaml_reason(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return str(problem)


def _read_yaml(text: str, doc: _Doc) -> None:
    try:
        doc.raw = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{doc.file}:{mark.line + 1}" if mark is not None else doc.file
        col = f" (column {mark.column + 1})" if mark is not None else ""
        raise RecipeError(where, [f"invalid YAML: {_yaml_reason(exc)}{col}"]) from None
    _walk(node, (), doc)


def _pydantic_problems(exc: ValidationError, doc: _Doc) -> set[tuple[Any, ...]]:
    """Add every pydantic error with its YAML path; returns the paths that failed."""
    bad = set()
    for e in exc.errors():
        loc = tuple(e["loc"])
        bad.add(loc)
        if e["type"] == "extra_forbidden":
            model = SECTIONS.get(tuple(str(p) for p in loc[:-1]))
            msg = "unknown key"
            if model is not None:
                keys = allowed_keys(model)
                close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
                msg += f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(keys)}"
        elif e["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = str(e["msg"]).removeprefix("Value error, ")
            if not isinstance(e.get("input"), dict):
                msg += f" (got {e.get('input')!r})"
        doc.add(loc, msg)
    return bad


def _choice(doc: _Doc, key: str, value: str, choices: tuple[str, ...]) -> bool:
    if value not in choices:
        doc.add(("factor", key), f"{value!r} is not one of {', '.join(choices)}")
        return False
    return True


def _factor_problems(fo: ConvertOptions, bad: set[str], src: SourceModel | None, doc: _Doc) -> None:
    """Range checks of ``factor`` (the same formulas as :func:`~mla_convert.pipeline.check_options`),
    each reported at its own key; keys that already failed the schema are not checked again."""
    before = len(doc.problems)
    ok: dict[str, bool] = {}
    for key, choices in (
        ("rope_mode", MODES),
        ("rope_strategy", STRATEGIES),
        ("rope_basis", BASES),
        ("objective", OBJECTIVES),
        ("factorization", FACTORIZATIONS),
        ("refit_o_proj", REFITS),
    ):
        ok[key] = key not in bad and _choice(doc, key, getattr(fo, key), choices)
    for key in ("calib_windows", "window", "eval_windows", "rope_context"):
        if key not in bad and getattr(fo, key) < 1:
            doc.add(("factor", key), f"must be at least 1 (got {getattr(fo, key)})")
    if src is None or "rope_pairs" in bad:
        return
    half, g = src.head_dim // 2, src.num_kv_heads
    # a mode or strategy that is itself wrong counts as the most permissive choice
    shared = fo.rope_mode == "shared" or not ok["rope_mode"]
    rotation = shared and (fo.rope_strategy == "rotation" or not ok["rope_strategy"])
    limit = half * g if rotation else half
    pairs = fo.rope_pairs
    if not 0 <= pairs <= limit:
        doc.add(
            ("factor", "rope_pairs"),
            f"{pairs} is impossible for {fo.rope_mode}/{fo.rope_strategy} on this source: allowed 0..{limit} "
            f"(head_dim {src.head_dim} has {half} RoPE pairs)",
        )
        pairs = min(max(pairs, 0), limit)
    heads = 1 if shared else g
    rope_width = heads * 2 * pairs
    n_nope = 2 * (half * g) - 2 * pairs * heads
    max_rank = min(src.hidden_size, n_nope + g * src.head_dim)
    if fo.kv_lora_rank is not None and "kv_lora_rank" not in bad:
        if not 1 <= fo.kv_lora_rank <= max_rank:
            doc.add(
                ("factor", "kv_lora_rank"),
                f"{fo.kv_lora_rank} is impossible for this source: allowed 1..{max_rank} "
                f"(at most the non-RoPE key width {n_nope} + value width {g * src.head_dim}, and the hidden size "
                f"{src.hidden_size})",
            )
    elif fo.kv_lora_rank is None and "cache_budget" not in bad:
        if fo.cache_budget is None:
            doc.add(("factor", "cache_budget"), "give cache_budget or kv_lora_rank")
        elif fo.cache_budget - rope_width < 1:
            doc.add(
                ("factor", "cache_budget"),
                f"{fo.cache_budget:g} leaves no latent after {rope_width} RoPE values per token; lower "
                "factor.rope_pairs or raise the budget",
            )
        elif fo.cache_budget - rope_width > max_rank:
            doc.add(
                ("factor", "cache_budget"),
                f"{fo.cache_budget:g} asks for a latent of {fo.cache_budget - rope_width:g} after {rope_width} "
                f"RoPE values; at most {max_rank} is possible (source cache {src.kv_cache_width} values)",
            )
    if len(doc.problems) == before and not bad:
        from mla_convert.convert.factorize import FactorError
        from mla_convert.convert.job import check_options
        from mla_convert.convert.rope import RopeError

        try:  # anything the per-key checks above do not cover
            check_options(fo, src)
        except (RopeError, FactorError) as exc:
            doc.add(("factor",), str(exc))


def _origin_name(source: str) -> str:
    """How a manifest records a source: the built-in name as given, a path by its last component."""
    return source if not Path(source).exists() else Path(source).name


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

    Raises:
        RecipeError: with one line per problem, each naming its YAML path.
    """
    file = str(path)
    if text is None:
        p = Path(path)
        if not p.is_file():
            names = ", ".join(bundled_names())
            raise RecipeError(
                file,
                [f"no such recipe file (bundled: {names}; copy one with 'mla-convert init-recipe NAME')"],
            )
        text = p.read_text()
    doc = _Doc(file)
    _read_yaml(text, doc)
    if doc.raw is None:
        doc.raw = {}
    if not isinstance(doc.raw, dict):
        raise RecipeError(
            file,
            [
                f"the file must hold a mapping (name, source, output, factor, ...), not {type(doc.raw).__name__}"
            ],
        )
    raw: dict[str, Any] = doc.raw
    for item in overrides:
        try:
            opath, value = parse_override(item)
            apply_override(raw, opath, value)
            doc.overridden.add(opath)
        except ValueError as exc:
            doc.add((), str(exc))
    # normalization: kv_lora_rank replaces cache_budget (as on the factor command line); adapt.source
    # defaults to the recipe's source
    fraw = raw.get("factor")
    if isinstance(fraw, dict) and fraw.get("kv_lora_rank") is not None:
        fraw["cache_budget"] = None
    araw = raw.get("adapt")
    if isinstance(araw, dict) and araw.get("source") is None and isinstance(raw.get("source"), str):
        araw["source"] = raw["source"]

    recipe: Recipe | None = None
    failed: set[tuple[Any, ...]] = set()
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        failed = _pydantic_problems(exc, doc)
    bad_factor = {str(p[1]) for p in failed if len(p) >= 2 and p[0] == "factor"}
    factor_ok = ("factor",) not in failed
    fo: ConvertOptions | None = None
    if recipe is not None:
        fo = recipe.factor
    elif factor_ok:
        fvals = fraw if isinstance(fraw, dict) else {}
        try:
            fo = ConvertOptions.model_validate({k: v for k, v in fvals.items() if k not in bad_factor})
        except ValidationError:
            fo = None

    src = None
    source = raw.get("source")
    if check_source and isinstance(source, str) and source and ("source",) not in failed:
        from mla_convert.sources.checkpoint import SourceError, open_source

        try:
            src = open_source(source)
        except SourceError as exc:
            doc.add(("source",), str(exc))
    if fo is not None:
        _factor_problems(fo, bad_factor, src, doc)
    # the validate stage reads the conversion's evaluation windows
    if recipe is not None and recipe.validation.enabled:
        v, f = recipe.validation, recipe.factor
        if f.eval_windows < 2:
            doc.add(("factor", "eval_windows"), "the validate stage needs at least 2 evaluation windows")
        if v.prompt_tokens + v.new_tokens > f.window:
            doc.add(
                ("validate", "prompt_tokens"),
                f"prompt_tokens + new_tokens = {v.prompt_tokens + v.new_tokens} exceeds factor.window "
                f"({f.window}), the evaluation windows validate reads",
            )
    if check_source and recipe is not None:
        a = recipe.adapt
        if a is not None and a.source and a.source != recipe.source:
            from mla_convert.sources.checkpoint import SourceError, open_source

            try:
                open_source(a.source)
            except SourceError as exc:
                doc.add(("adapt", "source"), str(exc))
    output = raw.get("output")
    if check_source and isinstance(output, str) and output and ("output",) not in failed:
        out = Path(output).expanduser().resolve()
        if out.exists() and not out.is_dir():
            doc.add(("output",), f"{out} exists and is a file; give a folder")
        if src is not None:
            sdir = src.path.resolve()
            if out == sdir or sdir in out.parents:
                doc.add(("output",), f"{out} is inside the source folder {sdir}; write it somewhere else")
    if doc.problems:
        raise RecipeError(file, doc.render())
    assert recipe is not None
    return Resolved(recipe, file, list(overrides), src)


def resolved_yaml(res: Resolved) -> str:
    """The resolved recipe as YAML (every default filled in), with a header naming its origin."""
    from mla_convert import __version__

    head = f"# resolved by mla-convert {__version__} from {res.file}"
    if res.overrides:
        head += " with " + " ".join(res.overrides)
    body = yaml.safe_dump(res.recipe.dump(), sort_keys=False, default_flow_style=False, width=100)
    return head + "\n" + body


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------- bundled
def bundled_names() -> list[str]:
    """Names of the bundled recipes (``mla_convert/recipes/NAME.yaml``)."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.yaml"))


def bundled_path(name: str) -> Path | None:
    """The bundled recipe file for ``name`` (with or without ``.yaml``), or None."""
    stem = name[:-5] if name.endswith(".yaml") else name
    p = BUNDLED_DIR / f"{stem}.yaml"
    return p if stem and "/" not in stem and p.is_file() else None


def bundled_description(name: str) -> str:
    p = bundled_path(name)
    try:
        raw = yaml.safe_load(p.read_text()) if p else None
    except yaml.YAMLError:
        return ""
    return str(raw.get("description", "")) if isinstance(raw, dict) else ""


# ------------------------------------------------------------------------------------------- plan
@dataclass
class Stage:
    """One stage of the plan: ``run``, ``skip`` or ``off``, its folder, and why."""

    name: str
    action: str
    folder: Path
    why: str
    replaces: bool = False  # an existing folder would be replaced (needs --overwrite)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _norm(x: Any) -> Any:
    return json.loads(json.dumps(x))


def _diff(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "no options recorded"
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    shown = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:3])
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _occupied(folder: Path) -> bool:
    return folder.exists() and (not folder.is_dir() or any(folder.iterdir()))


def factor_stage(recipe: Recipe) -> tuple[Stage, str | None]:
    """Whether ``<output>/factor`` is up to date; returns the stage and its canonical id when it is."""
    from mla_convert.artifacts.manifest import MANIFEST, canonical_id

    folder = recipe.out / "factor"
    if not _occupied(folder):
        return Stage("factor", "run", folder, "no output yet"), None
    m = _read_json(folder / MANIFEST)
    if not isinstance(m, dict) or "canonical_id" not in m:
        return Stage("factor", "run", folder, f"the folder holds no readable {MANIFEST}", True), None
    if canonical_id(m) != m["canonical_id"]:
        return Stage("factor", "run", folder, f"{MANIFEST} does not match its canonical id", True), None
    missing = [name for name in m.get("outputs", {}) if not (folder / name).is_file()]
    if missing:
        return Stage("factor", "run", folder, f"{missing[0]} listed in the manifest is missing", True), None
    want = _norm(recipe.factor.model_dump())
    if m.get("options") != want:
        return Stage("factor", "run", folder, "options differ: " + _diff(m.get("options"), want), True), None
    origin = (m.get("source") or {}).get("origin")
    if origin != _origin_name(recipe.source):
        return Stage("factor", "run", folder, f"converted from {origin!r}, not {recipe.source!r}", True), None
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
    rep = _read_json(folder / "adapt_report.json")
    m = _read_json(folder / MANIFEST)
    if not isinstance(rep, dict) or not isinstance(m, dict):
        return Stage(
            "adapt", "run", folder, f"the folder holds no readable adapt_report.json / {MANIFEST}", True
        )
    want = _norm(recipe.adapt.model_dump())
    if rep.get("options") != want:
        return Stage("adapt", "run", folder, "options differ: " + _diff(rep.get("options"), want), True)
    parent = (m.get("parent") or {}).get("canonical_id")
    if parent != factor_cid:
        return Stage("adapt", "run", folder, "adapted from a different factor output", True)
    return Stage("adapt", "skip", folder, f"up to date (parent {factor_cid[:12]})")


def make_plan(recipe: Recipe) -> list[Stage]:
    """The three stages with run/skip/off and the reason, from what ``<output>`` holds now."""
    fstage, cid = factor_stage(recipe)
    astage = adapt_stage(recipe, cid if fstage.action == "skip" else None)
    target = astage.folder if astage.action != "off" else fstage.folder
    v = recipe.validation
    vstage = (
        Stage("validate", "run", target, f"5-rung ladder on the last stage's output, {v.backend} backend")
        if v.enabled
        else Stage("validate", "off", target, "validate.enabled is false")
    )
    return [fstage, astage, vstage]


def blocked(plan: list[Stage]) -> list[Stage]:
    """Stages that would replace an existing folder (allowed only with ``--overwrite``)."""
    return [s for s in plan if s.action == "run" and s.replaces]


def plan_lines(plan: list[Stage], overwrite: bool) -> list[str]:
    out = []
    for s in plan:
        why = s.why
        if s.replaces:
            why += "; replaces the folder" + ("" if overwrite else " (needs --overwrite)")
        out.append(f"  {s.name:<9} {s.action:<5} {s.folder}  ({why})")
    return out


# ------------------------------------------------------------------------------- shapes and memory
def shape_lines(recipe: Recipe, src: SourceModel) -> list[str]:
    """Per-layer cache shapes of the conversion, from the config alone (the ``inspect`` formulas)."""
    fo = recipe.factor
    g, d, n = src.num_kv_heads, src.head_dim, src.num_layers
    heads = g if fo.rope_mode == "per-head" else 1
    rope = heads * 2 * fo.rope_pairs
    base = src.kv_cache_width
    if fo.kv_lora_rank is not None:
        latent = f"{fo.kv_lora_rank} in every layer (kv_lora_rank)"
        width = float(fo.kv_lora_rank + rope)
    else:
        assert fo.cache_budget is not None
        total = round(fo.cache_budget * n) - rope * n
        latent = (
            f"{total / n:g} on average ({total} over {n} layers, allocated per layer by marginal error "
            "when converting)"
        )
        width = (total + rope * n) / n
    mode = f"{fo.rope_mode}: {heads} rope head{'s' if heads > 1 else ''} x {fo.rope_pairs} pairs"
    return [
        f"  source K + V             {base} values/token/layer ({g} KV heads x {d} x 2), {4 * base} bytes float32",
        f"  RoPE kept                {rope} values ({mode}, {fo.rope_strategy})",
        f"  latent d_c               {latent}",
        f"  MLA cache [c_kv|k_rope]  {width:g} values/token/layer, {4 * width:g} bytes float32",
        f"  ratio to source          {width / base:.4f} ({width:g} / {base})",
        f"  whole model              {width * n:g} values/token over {n} layers (source {base * n})",
    ]


def _params(src: SourceModel) -> int:
    return sum(math.prod(src.shape(name)) for name in src.weight_map)


def memory_estimate(recipe: Recipe, src: SourceModel) -> dict[str, Any]:
    """A rough peak-memory estimate per stage in bytes (float32 models), from the config and the
    safetensors headers: ``{"stages": {stage: [(item, bytes), ...]}, "params": ..., "disk": ...}``."""
    fo = recipe.factor
    h, g, d, n, hid = src.num_heads, src.num_kv_heads, src.head_dim, src.num_layers, src.hidden_size
    vocab = int(src.config.vocab_size)
    inter = int(getattr(src.config, "intermediate_size", None) or 4 * hid)
    heads = g if fo.rope_mode == "per-head" else 1
    d_r = 2 * fo.rope_pairs
    # NoPE query/key width per head: per-head mode drops the kept pairs; shared mode at most every
    # non-kept component of all KV heads (mixed frequencies are read by every head)
    d_nope = d - d_r if fo.rope_mode == "per-head" else 2 * ((d // 2) * g - fo.rope_pairs)
    if fo.kv_lora_rank is not None:
        d_c = fo.kv_lora_rank
    else:
        d_c = max(1, round((fo.cache_budget or 0) - heads * d_r))
    src_attn = 2 * h * d * hid + 2 * g * d * hid
    mla_attn = hid * h * (d_nope + d_r) + hid * (d_c + heads * d_r) + d_c * g * (d_nope + d) + h * d * hid
    p_src = _params(src)
    p_mla = p_src + n * (mla_attn - src_attn)
    runtime = 0.5e9  # python, torch, transformers, tokenizer
    calib = fo.calib_windows if fo.refit_o_proj != "none" else 0
    eval_logits = 48 * fo.window * vocab  # float64 logits, log-softmax and probabilities of two models
    stages: dict[str, list[tuple[str, float]]] = {
        "factor": [
            ("source model", 4 * p_src),
            ("converted model", 4 * p_mla),
            ("float64 attention weights", 8 * n * src_attn),
            ("calibration statistics", n * (8 * hid * hid + 4 * 2 * hid * fo.window * (calib + 1))),
            ("evaluation logits", eval_logits),
            ("runtime", runtime),
        ]
    }
    a = recipe.adapt
    if a is not None:
        trainable = {"attention": n * mla_attn, "attention+norms": n * (mla_attn + 2 * hid), "all": p_mla}
        tokens = a.batch_size * a.seq_len
        per_layer = 4 * tokens * (10 * hid + 4 * inter + 2 * h * a.seq_len)
        acts = per_layer + 4 * n * tokens * hid if a.gradient_checkpointing else per_layer * n
        stages["adapt"] = [
            ("student", 4 * p_mla),
            ("teacher", 4 * p_src),
            ("grads + AdamW", 12 * trainable[a.trainable]),
            ("activations", acts),
            ("logits", 6 * 4 * tokens * vocab),
            ("runtime", runtime),
        ]
    if recipe.validation.enabled:
        stages["validate"] = [
            ("converted model", 4 * p_mla),
            ("source model", 4 * p_src),
            ("evaluation logits", eval_logits),
            ("runtime", runtime),
        ]
    return {
        "stages": stages,
        "params_source": p_src,
        "params_converted": p_mla,
        "disk_per_checkpoint": 4 * p_mla,
        "checkpoints": 2 if a is not None else 1,
    }


def memory_lines(recipe: Recipe, src: SourceModel) -> list[str]:
    """:func:`memory_estimate` as text lines (GB = 1e9 bytes)."""
    est = memory_estimate(recipe, src)
    gb = 1e9
    out = []
    peak = 0.0
    for stage, parts in est["stages"].items():
        total = sum(b for _, b in parts)
        peak = max(peak, total)
        inner = ", ".join(f"{k} {b / gb:.2f}" for k, b in parts)
        out.append(f"  {stage:<9} ~{total / gb:.1f} GB peak ({inner})")
    k, per = est["checkpoints"], est["disk_per_checkpoint"]
    out.append(
        f"  disk      ~{k * per / gb:.1f} GB ({k} float32 checkpoint{'s' if k > 1 else ''} of ~{per / gb:.2f} GB)"
    )
    out.append(
        f"  rough estimate (not measured) from the config and safetensors headers: "
        f"{est['params_source'] / 1e6:.1f} M source parameters, ~{est['params_converted'] / 1e6:.1f} M converted"
    )
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return out
    note = "" if peak < ram else " (less than the estimated peak)"
    out.append(f"  this machine has {ram / gb:.1f} GB of memory{note}")
    return out


# ------------------------------------------------------------------------------------------- run
@dataclass
class RunResult:
    """What ``run`` did: per stage ``ran`` / ``skipped`` / ``off``, and the validation result."""

    stages: dict[str, str]
    target: Path
    validation: Any = None


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
    from mla_convert.convert import job as pipeline
    from mla_convert.validate import ladder as validate_mod

    recipe = res.recipe
    stop = blocked(make_plan(recipe))
    if stop and not overwrite:
        raise RecipeError(
            res.file,
            [
                f"{s.name} stage: {s.folder} is not empty ({s.why}); pass --overwrite to replace it"
                for s in stop
            ],
        )
    if res.src is None:
        from mla_convert.sources.checkpoint import open_source

        res.src = open_source(recipe.source)
    write_atomic(recipe.out / RESOLVED_NAME, resolved_yaml(res))
    say(f"wrote {recipe.out / RESOLVED_NAME}")
    done: dict[str, str] = {}

    fstage, cid = factor_stage(recipe)
    if fstage.action == "run":
        say(f"factor: running ({fstage.why})")
        with factor_progress() if factor_progress else nullcontext(None) as cb:
            pipeline.run_factor(res.src, fstage.folder, recipe.factor, overwrite=overwrite, progress=cb)
        m = _read_json(fstage.folder / MANIFEST) or {}
        cid = m.get("canonical_id")
        done["factor"] = "ran"
    else:
        say(f"factor: skipped, {fstage.why}")
        done["factor"] = "skipped"
    target = fstage.folder

    astage = adapt_stage(recipe, cid)
    if astage.action == "run":
        assert recipe.adapt is not None
        say(f"adapt: running ({astage.why})")
        adapt_mod.run_adapt(
            fstage.folder, astage.folder, recipe.adapt, overwrite=overwrite, progress=adapt_progress
        )
        done["adapt"] = "ran"
        target = astage.folder
    elif astage.action == "skip":
        say(f"adapt: skipped, {astage.why}")
        done["adapt"] = "skipped"
        target = astage.folder
    else:
        done["adapt"] = "off"

    result = RunResult(done, target)
    v = recipe.validation
    if not v.enabled:
        done["validate"] = "off"
        return result
    say(f"validate: {target}")
    f = recipe.factor
    vres = validate_mod.validate(
        target,
        source=recipe.source,
        text=f.text,
        window=f.window,
        windows=f.eval_windows,
        prompt_tokens=v.prompt_tokens,
        new_tokens=v.new_tokens,
        page_size=v.page_size,
        backend=v.backend,
        progress=validate_progress,
    )
    validate_mod.write_validation(target, vres)
    done["validate"] = "passed" if vres.passed else "failed"
    result.validation = vres
    return result
