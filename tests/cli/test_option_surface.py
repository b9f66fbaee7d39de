"""The user-facing options (issue 49): retired ones refused in one line that says what replaces them; defaults in
one home.

An option stays on the user-facing surface only where a measurement in docs/results.md shows a use. The library's
:class:`~mla_convert.convert.options.options.ConvertOptions` keeps every value (the oracle and exactness tests, the
benchmarks' anchor rows), so the refusals live in the CLI (hidden flags that only refuse) and the recipe loader,
both read from the fields' ``json_schema_extra``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mla_convert.cli.commands import app
from mla_convert.cli.flags import option_parameters
from mla_convert.convert.options.fields import offered_choices, retired, retired_fields
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.recipes.load import load_recipe, resolved_yaml
from mla_convert.recipes.schema import RecipeError

RUNNER = CliRunner()

#: Every retired flag or value, a way to type it, and the words of what replaces it.
RETIRED = [
    (["--rope-mode", "per-head"], "--rope-mode per-head: removed; a conversion has one shared rope head"),
    (["--rope-mode", "shared"], "--rope-mode shared: removed;"),  # one way to say each thing: the default too
    (["--rope-basis", "real"], "--rope-basis real: removed; the shared rope head's PCA is complex"),
    (["--factorization", "split"], "--factorization split: removed; K and V share one latent"),
    (
        ["--objective", "activation"],
        "--objective activation: removed; the latent is output-aware (activation measured",
    ),
    (["--objective", "weight"], "--objective weight: removed;"),
    (["--no-kv-balance"], "--no-kv-balance: removed; K and V are always balanced (off measured x5.46"),
    (["--kv-balance"], "--kv-balance: removed;"),
    (
        ["--calib-windows", "3", "--window", "64"],
        "--calib-windows 3: removed; use --calib-tokens 192 (3 windows of --window 64)",
    ),
    (["--calib-windows", "2"], "use --calib-tokens 1024"),  # the default window, 512
    (
        ["--refit-o-proj", "none"],
        "--refit-o-proj none: retired; no refit measured x21.12 against teacher's x4.49",
    ),
    (
        ["--rope-strategy", "low"],
        "--rope-strategy low: retired; never measured: use 2-norm, rotation or high",
    ),
    (["--rope-strategy", "uniform"], "--rope-strategy uniform: retired; never measured"),
]


def _error_line(output: str) -> str:
    """The output as one line (rich wraps long lines at the terminal width)."""
    return " ".join(output.split())


@pytest.mark.parametrize("command", ["factor", "inspect"])
@pytest.mark.parametrize(("flags", "words"), RETIRED, ids=[" ".join(f) for f, _ in RETIRED])
def test_a_retired_option_is_refused_with_what_replaces_it(
    command: str, flags: list[str], words: str, tmp_path: Path
):
    """Exit 2 (as every option error), one ``error:`` line, nothing written, before the source is opened."""
    out = tmp_path / "out"
    args = [command, "/nonexistent/model", *([str(out)] if command == "factor" else []), *flags]
    res = RUNNER.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert res.output.count("error:") == 1 and words in _error_line(res.output), res.output
    assert "not found" not in res.output  # refused before the source is looked for
    assert not out.exists()


def test_every_retired_option_is_named_at_once():
    res = RUNNER.invoke(
        app, ["factor", "smollm2-135m", "/tmp/never", "--objective", "weight", "--refit-o-proj", "none"]
    )
    line = _error_line(res.output)
    assert (
        res.exit_code == 2
        and "--objective weight: removed" in line
        and "--refit-o-proj none: retired" in line
    )


def test_help_lists_only_the_kept_options():
    """``factor --help`` has no retired flag and lists no retired value among a kept flag's choices."""
    res = RUNNER.invoke(app, ["factor", "--help"], env={"COLUMNS": "250"})
    assert res.exit_code == 0
    text = _error_line(res.output)
    for gone in (
        "--rope-basis",
        "--factorization",
        "--objective",
        "--kv-balance",
        "--calib-windows",
        "│ --rope-mode",
    ):
        assert gone not in text, gone
    helps = {p.name: p.default.help for p in option_parameters(ConvertOptions) if not p.default.hidden}
    assert not set(helps) & set(retired_fields())
    assert "2-norm | rotation" in helps["rope_strategy"] and "| low" not in helps["rope_strategy"]
    assert offered_choices("refit_o_proj", ("none", "teacher", "sequential")) == ("teacher", "sequential")
    res = RUNNER.invoke(app, ["factor", "smollm2-135m", "/tmp/never", "--rope-strategy", "lowest"])
    assert res.exit_code == 2 and "'lowest' is not one of high, 2-norm, rotation" in _error_line(res.output)


def test_the_library_keeps_every_value():
    """The oracles, the exactness path (per-head, every pair) and the anchors build them in Python."""
    opts = ConvertOptions(
        rope_mode="per-head",
        rope_basis="real",
        factorization="split",
        objective="activation",
        kv_balance=False,
        calib_windows=3,
        refit_o_proj="none",
        rope_strategy="uniform",
    )
    assert opts.calibration_windows() == 3
    assert set(retired_fields()) == {
        "rope_mode",
        "rope_basis",
        "factorization",
        "objective",
        "kv_balance",
        "calib_windows",
    }
    # None is "not given" (the CLI passes None for a retired flag not typed, a recipe may say null)
    assert (
        retired(
            {"calib_windows": None, "rope_mode": None, "refit_o_proj": "teacher", "rope_strategy": "high"}
        )
        == []
    )


RECIPE = """\
name: t
source: smollm2-135m
output: {out}
factor:
  rope_mode: shared
  objective: activation
  kv_balance: false
  calib_windows: 4
  window: 64
  refit_o_proj: none
  rope_strategy: uniform
  rope_basis: null
  eval_windows: 2
validate: {{enabled: false}}
"""


def test_a_recipe_refuses_retired_keys_and_values_at_their_lines(tmp_path: Path):
    with pytest.raises(RecipeError) as exc:
        load_recipe("t.yaml", text=RECIPE.format(out=tmp_path / "job"), check_source=False)
    problems = exc.value.problems
    assert len(problems) == 6, problems  # rope_basis: null is "not given", and dropped
    expect = [
        "factor.rope_mode: removed; a conversion has one shared rope head",
        "factor.objective: removed; the latent is output-aware",
        "factor.kv_balance: removed; K and V are always balanced",
        "factor.calib_windows: removed; use factor.calib_tokens 256 (4 windows of factor.window 64) (line 8)",
        "factor.refit_o_proj: none: retired; no refit measured x21.12",
        "factor.rope_strategy: uniform: retired; never measured",
    ]
    for p, e in zip(problems, expect, strict=True):
        assert p.startswith(e), (p, e)
    assert all("--" not in p for p in problems)  # in the recipe's own keys
    with pytest.raises(RecipeError) as exc:  # an override is refused the same way
        load_recipe(
            "t.yaml",
            text="name: t\nsource: smollm2-135m\noutput: x\n",
            overrides=["factor.calib_windows=2"],
            check_source=False,
        )
    assert exc.value.problems == [
        "factor.calib_windows: removed; use factor.calib_tokens 1024 (2 windows of "
        "factor.window 512) (set on the command line)"
    ]


def test_the_resolved_recipe_says_no_retired_key_and_runs_again(tmp_path: Path):
    text = (
        "name: t\nsource: smollm2-135m\noutput: job\nfactor: {calib_tokens: 256, window: 64, rope_basis: null}\n"
        "validate: {enabled: false}\n"
    )
    res = load_recipe("t.yaml", text=text, check_source=False)
    resolved = resolved_yaml(res)
    factor = yaml.safe_load(resolved)["factor"]
    assert not set(factor) & set(retired_fields()) and factor["calib_tokens"] == 256
    again = load_recipe("r.yaml", text=resolved, check_source=False)
    assert again.recipe.factor == res.recipe.factor


def test_the_defaults_outside_the_option_models_have_one_home():
    """``--target`` and ``--max-shard-size`` default once for every command (``cli/flags.py``), equal to the library's."""
    import inspect

    from mla_convert.artifacts.shards import DEFAULT_MAX_SHARD_SIZE
    from mla_convert.cli.defaults import SHARD_SIZE_DEFAULT, TARGET_DEFAULT
    from mla_convert.convert.options.resolve import resolve_options

    assert SHARD_SIZE_DEFAULT == DEFAULT_MAX_SHARD_SIZE
    assert inspect.signature(resolve_options).parameters["target"].default == TARGET_DEFAULT
    import typer.main

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    for name in ("inspect", "factor", "export", "adapt"):
        params = {p.name: p.default for p in commands[name].params}
        assert params.get("target", TARGET_DEFAULT) == TARGET_DEFAULT, name
        assert params.get("max_shard_size", SHARD_SIZE_DEFAULT) == SHARD_SIZE_DEFAULT, name
