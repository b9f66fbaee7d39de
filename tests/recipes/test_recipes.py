"""Recipes: schema and every-problem-at-once errors with YAML paths, overrides, ``run --dry-run``,
``init-recipe``, and stage skipping.

Fast: the only source opened is the bundled SmolLM2-135M (config and safetensors headers) or a tiny random
model; the stages themselves (``run_factor``, ``run_adapt``, ``validate``) are replaced by fakes that
write what the real ones write for the skip logic (manifest with options, source and canonical id;
``adapt_report.json`` with options, manifest with the parent's canonical id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from mla_convert.cli.commands import app
from mla_convert.recipes.catalog import BUNDLED_DIR, bundled_names
from mla_convert.recipes.load import load_recipe, resolved_yaml
from mla_convert.recipes.overrides import apply_override, parse_override
from mla_convert.recipes.plan import make_plan
from mla_convert.recipes.schema import RESOLVED_NAME, RecipeError

RUNNER = CliRunner()
QUICKSTART = BUNDLED_DIR / "smollm2-135m-quickstart.yaml"
FAMILIES = ("llama", "mistral", "qwen2")


def run(*args: str) -> Any:
    return RUNNER.invoke(app, [str(a) for a in args])


def write(tmp_path: Path, raw: dict[str, Any], name: str = "recipe.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    return p


def small_recipe(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    raw = {
        "name": "test",
        "source": "smollm2-135m",
        "output": str(tmp_path / "out"),
        "factor": {"rope_pairs": 24, "cache_budget": 120},
        "adapt": {"tokens": 4096, "seq_len": 128},
        "validate": {"new_tokens": 4},
    }
    raw.update(changes)
    return raw


# ------------------------------------------------------------------------------------- bundled recipes
def test_bundled_recipes_parse_and_round_trip():
    names = bundled_names()
    assert {"smollm2-135m-quickstart", *FAMILIES} <= set(names)
    for name in names:
        res = load_recipe(BUNDLED_DIR / f"{name}.yaml", check_source=False)
        r = res.recipe
        assert r.name and r.output and r.adapt is not None and r.validation.enabled
        assert r.adapt.source == r.source  # adapt.source defaults to the recipe's source
        # the resolved recipe is itself a valid recipe with the same content
        again = load_recipe("resolved.yaml", check_source=False, text=resolved_yaml(res)).recipe
        assert again.dump() == r.dump()
    for fam in FAMILIES:  # the factor defaults that measured best, at 31.25 % of the cache
        f = load_recipe(BUNDLED_DIR / f"{fam}.yaml", check_source=False).recipe.factor
        assert (f.rope_mode, f.rope_strategy, f.rope_basis, f.objective, f.factorization) == (
            "shared",
            "2-norm",
            "complex",
            "output",
            "joint",
        )
        assert f.kv_balance and f.refit_o_proj == "teacher"


def test_quickstart_is_the_readme_job():
    res = load_recipe(QUICKSTART)  # opens the bundled source (config only) and checks ranks
    r = res.recipe
    assert r.source == "smollm2-135m" and res.src is not None
    f = r.factor
    assert (f.rope_mode, f.rope_strategy, f.rope_pairs, f.objective, f.cache_budget) == (
        "shared",
        "2-norm",
        24,
        "output",
        120,
    )
    a = r.adapt
    assert a is not None
    assert (a.objective, a.trainable, a.tokens, a.seq_len, a.batch_size, a.lr) == (
        "distill",
        "attention",
        100_000,
        512,
        4,
        3e-4,
    )
    assert r.validation.enabled


def _tiny_source(folder: Path, model_type: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    extra = {"sliding_window": None} if model_type == "mistral" else {}
    cfg = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=512,
        **extra,
    )
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_family_recipe_dry_run_on_a_tiny_model(tmp_path, family):
    """The family recipes check out against a real (tiny, random) checkpoint of their family once the
    placeholder source is replaced; head_dim 16 and 2 KV heads need smaller RoPE and budget values."""
    src = _tiny_source(tmp_path / f"tiny-{family}", family)
    out = tmp_path / "out"
    r = run(
        "run",
        BUNDLED_DIR / f"{family}.yaml",
        f"source={src}",
        f"output={out}",
        "factor.rope_pairs=4",
        "factor.cache_budget=24",
        "--dry-run",
    )
    assert r.exit_code == 0, r.stderr
    assert f"source {src}: {family}" in r.stdout
    assert "ratio to source          0.3750 (24 / 64)" in r.stdout
    assert not out.exists()


def test_family_recipe_placeholder_source_is_reported(tmp_path):
    r = run("run", BUNDLED_DIR / "llama.yaml", f"output={tmp_path / 'out'}", "--dry-run")
    assert r.exit_code == 2
    assert "llama.yaml: source: source './path/to/Llama-3.2-1B' not found" in r.stderr


# ------------------------------------------------------------------------------------- errors
def test_every_problem_is_listed_with_its_yaml_path(tmp_path):
    raw = small_recipe(tmp_path)
    raw["factor"].update({"window": "long", "colour": "red"})  # wrong type, unknown key
    raw["adapt"]["lr"] = "fast"
    raw["validate"]["page_size"] = 500
    p = write(tmp_path, raw)
    r = run(
        "run", p, "factor.kv_lora_rank=100000", "factor.rope_pairs=64", "factor.rope_strategy=both", "--dry-run"
    )
    assert r.exit_code == 2
    err = r.stderr
    lines = err.strip().splitlines()
    assert lines[0] == f"error: {p} has 7 problems:", err
    expected = [
        "factor.window: Input should be a valid integer",  # wrong type
        "factor.colour: unknown key",  # unknown key
        "adapt.lr: Input should be a valid number",
        "validate.page_size: Input should be less than or equal to 128",
        "factor.rope_strategy: 'both' is not one of high, 2-norm, rotation",
        "factor.rope_pairs: 64 is impossible",  # head_dim 64 has 32 pairs
        "factor.kv_lora_rank: 100000 is impossible for this source: allowed 1..",
    ]
    for e in expected:
        assert sum(e in line for line in lines[1:]) == 1, (e, err)
    assert all(line.startswith(f"  {p}: ") for line in lines[1:])
    assert "(line " in err and "(set on the command line)" in err
    assert not (tmp_path / "out").exists()


def test_impossible_ranks_on_their_own(tmp_path):
    """Without schema errors, each range problem is still reported at its own key, all at once."""
    p = write(tmp_path, small_recipe(tmp_path))
    with pytest.raises(RecipeError) as exc:
        load_recipe(p, ["factor.kv_lora_rank=100000", "factor.rope_pairs=64"])
    probs = exc.value.problems
    assert len(probs) == 2
    assert probs[0].startswith("factor.rope_pairs: 64 is impossible for shared/2-norm")
    assert probs[1].startswith("factor.kv_lora_rank: 100000 is impossible")
    with pytest.raises(RecipeError) as exc:
        load_recipe(p, ["factor.cache_budget=40"])  # 48 RoPE values leave no latent
    assert exc.value.problems[0].startswith("factor.cache_budget: 40 leaves no latent after 48 RoPE values")
    with pytest.raises(RecipeError) as exc:
        load_recipe(p, ["factor.cache_budget=5000"])
    assert "factor.cache_budget: 5000 asks for a latent of 4952" in exc.value.problems[0]
    with pytest.raises(RecipeError) as exc:
        load_recipe(p, ["validate.prompt_tokens=500", "factor.window=256"])
    assert "validate.prompt_tokens: prompt_tokens + new_tokens = 504 exceeds factor.window (256)" in str(
        exc.value
    )


def test_yaml_syntax_error_is_one_line_with_the_line_number(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("name: x\nsource: smollm2-135m\nfactor:\n  rope_pairs: [16\n  window: 3\n")
    r = run("run", p, "--dry-run")
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {p}:") and "invalid YAML" in lines[0]
    assert lines[0].split(":")[2].strip().isdigit()  # file:LINE


def test_not_a_mapping_missing_keys_and_duplicates(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="must hold a mapping"):
        load_recipe(p, check_source=False)
    p.write_text("name: a\nname: b\nfactor: {}\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(p, check_source=False)
    probs = exc.value.problems
    assert any(x.startswith("name: duplicate key (lines 1 and 2)") for x in probs)
    assert any(x.startswith("source: required key is missing") for x in probs)
    assert any(x.startswith("output: required key is missing") for x in probs)
    r = run("run", tmp_path / "nope.yaml")
    assert r.exit_code == 2 and "no such recipe file" in r.stderr and "smollm2-135m-quickstart" in r.stderr


# ------------------------------------------------------------------------------------- overrides
def test_parse_override_values_are_yaml():
    assert parse_override("factor.rope_pairs=16") == (("factor", "rope_pairs"), 16)
    assert parse_override("adapt.lr=1.0e-4") == (("adapt", "lr"), 1e-4)
    assert parse_override("factor.kv_balance=false") == (("factor", "kv_balance"), False)
    assert parse_override("adapt=null") == (("adapt",), None)
    assert parse_override("adapt=") == (("adapt",), None)
    assert parse_override("name=a=b") == (("name",), "a=b")
    assert parse_override("factor.text=news") == (("factor", "text"), "news")
    for bad in ("factor.rope_pairs", "=3", "a..b=1", "a=[1"):
        with pytest.raises(ValueError):
            parse_override(bad)
    raw: dict[str, Any] = {"adapt": None, "name": "x"}
    apply_override(raw, ("adapt", "tokens"), 10)  # a null section becomes a section
    assert raw["adapt"] == {"tokens": 10}
    with pytest.raises(ValueError, match="not a section"):
        apply_override(raw, ("name", "x"), 1)


def test_overrides_apply_before_validation(tmp_path):
    p = write(tmp_path, small_recipe(tmp_path))
    res = load_recipe(p, ["factor.rope_pairs=16", "adapt.lr=1.0e-4", "validate.backend=absorbed"])
    r = res.recipe
    assert r.factor.rope_pairs == 16 and isinstance(r.factor.rope_pairs, int)
    assert r.adapt is not None and r.adapt.lr == 1e-4
    assert r.validation.backend == "absorbed"
    assert "factor.rope_pairs=16" in resolved_yaml(res).splitlines()[0]
    # a quoted number coerces to the field's type; kv_lora_rank replaces cache_budget
    r = load_recipe(p, ["factor.rope_pairs='20'", "factor.kv_lora_rank=64"]).recipe
    assert r.factor.rope_pairs == 20 and r.factor.kv_lora_rank == 64 and r.factor.cache_budget is None
    # adapt=null disables the stage; validate then reads the factor output
    r = load_recipe(p, ["adapt=null"]).recipe
    assert r.adapt is None
    plan = make_plan(r)
    assert [s.action for s in plan] == ["run", "off", "run"]
    assert plan[2].folder == plan[0].folder
    # unknown keys named on the command line are errors like any other, with their path
    with pytest.raises(RecipeError) as exc:
        load_recipe(p, ["factor.rope_pair=16", "serve.format=gguf", "export.format=onnx", "name.x=1", "oops"])
    probs = exc.value.problems
    assert any(x.startswith("factor.rope_pair: unknown key; did you mean 'rope_pairs'?") for x in probs)
    assert any(x.startswith("serve: unknown key") and "set on the command line" in x for x in probs)
    assert any(x.startswith("export.format") and "onnx" in x for x in probs)  # deepseek-v3 or gguf only
    assert any("name is 'test', not a section" in x for x in probs)
    assert any("override 'oops' is not key=value" in x for x in probs)


# ------------------------------------------------------------------------------------- dry run
def test_dry_run_quickstart_prints_plan_and_shapes_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loaded: list[str] = []
    import mla_convert.sources.checkpoint as sources

    monkeypatch.setattr(sources, "load_source_model", lambda *a, **k: loaded.append("model"))
    r = run("run", QUICKSTART, "--dry-run")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "name: smollm2-135m-quickstart" in out  # the resolved recipe
    assert "plan (output out/smollm2-quickstart):" in out
    assert "  factor    run   out/smollm2-quickstart/factor  (no output yet)" in out
    assert "  adapt     run   out/smollm2-quickstart/adapt  (no output yet)" in out
    assert "  validate  run   out/smollm2-quickstart/adapt" in out
    assert "source K + V             384 values/token/layer (3 KV heads x 64 x 2)" in out
    assert "RoPE kept                48 values (shared: 1 rope head x 24 pairs, 2-norm)" in out
    assert "latent d_c               72 on average (2160 over 30 layers" in out
    assert "MLA cache [c_kv|k_rope]  120 values/token/layer, 480 bytes float32" in out
    assert "ratio to source          0.3125 (120 / 384)" in out
    assert "factor    ~" in out and "GB peak" in out and "estimate" in out
    assert "dry run:" in out
    assert not loaded and list(tmp_path.iterdir()) == []
    # by bundled name too, and with a fixed rank
    r = run("run", "smollm2-135m-quickstart", "factor.kv_lora_rank=96", "--dry-run")
    assert r.exit_code == 0, r.stderr
    assert "latent d_c               96 in every layer" in r.stdout
    assert "ratio to source          0.3750 (144 / 384)" in r.stdout
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- init-recipe
def test_init_recipe_copies_and_refuses_overwrite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run("init-recipe", "smollm2-135m-quickstart")
    assert r.exit_code == 0, r.stderr
    dest = tmp_path / "smollm2-135m-quickstart.yaml"
    assert dest.read_text() == QUICKSTART.read_text()
    dest.write_text("# mine\n")
    r = run("init-recipe", "smollm2-135m-quickstart")
    assert r.exit_code == 2 and "exists; pass --overwrite" in r.stderr
    assert dest.read_text() == "# mine\n"
    r = run("init-recipe", "smollm2-135m-quickstart", "--overwrite")
    assert r.exit_code == 0 and dest.read_text() == QUICKSTART.read_text()
    (tmp_path / "sub").mkdir()
    r = run("init-recipe", "qwen2", tmp_path / "sub")
    assert (
        r.exit_code == 0
        and (tmp_path / "sub" / "qwen2.yaml").read_text() == (BUNDLED_DIR / "qwen2.yaml").read_text()
    )
    r = run("init-recipe", "llama", tmp_path / "my.yaml")
    assert r.exit_code == 0 and (tmp_path / "my.yaml").exists()
    r = run("init-recipe", "gpt2")
    assert r.exit_code == 2 and "no bundled recipe 'gpt2'" in r.stderr
    for n in bundled_names():
        assert n in r.stderr
    r = run("init-recipe", tmp_path / "mine.yaml")  # a destination where the name goes
    assert r.exit_code == 2 and "NAME comes first, then DEST" in r.stderr
    assert not (tmp_path / "mine.yaml").exists()
    r = run("init-recipe")
    assert r.exit_code == 0 and all(n in r.stdout for n in [*bundled_names(), "accelerate-fsdp"])
    # the FSDP launch configuration ships with the package too (an installed wheel has no recipes/ folder)
    r = run("init-recipe", "accelerate-fsdp", tmp_path)
    fsdp = (BUNDLED_DIR / "accelerate" / "fsdp.yaml").read_text()
    assert r.exit_code == 0 and (tmp_path / "accelerate-fsdp.yaml").read_text() == fsdp
    assert "accelerate launch --config_file" in r.stdout and "accelerate-fsdp" not in bundled_names()
    r = run("init-recipe", "accelerate-fsdp", tmp_path / "new")  # a new path without .yaml is a folder
    assert r.exit_code == 0 and (tmp_path / "new" / "accelerate-fsdp.yaml").read_text() == fsdp


# ------------------------------------------------------------------------------------- stage skipping
#: the measured parts of a factor report.json and an adapt report (values of the quick-start run)
FACTOR_REPORT = {
    "model": {
        "eval": {"perplexity": 31.032, "reference_perplexity": 14.229, "tokens": 4088},
        "cache": {"converted": {"values_per_token_per_layer": 120.0}, "ratio": 0.3125},
    },
    "text": {"name": "wikipedia"},
}
_EVAL = {"source_perplexity": 14.229, "eval_tokens": 4088, "other_text": "news"}
ADAPT_REPORT = {
    "before": {**_EVAL, "perplexity": 31.032, "kl": 0.8034, "other_perplexity": 70.38, "chat_kl": 1.458},
    "after": {**_EVAL, "perplexity": 21.636, "kl": 0.5087, "other_perplexity": 50.28, "chat_kl": 1.049},
    "tokens_trained": 100352,
}


class Fakes:
    """Stand-ins for the three stages that write what the skip logic reads, and count their calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_rung: int | None = None
        self.settings: dict[str, Any] = {}

    def run_factor(
        self, src: Any, out: Path, options: Any, overwrite: bool = False, progress: Any = None,
        resolution: Any = None,
    ) -> dict:
        from mla_convert.artifacts.manifest import recorded_options, write_manifest
        from mla_convert.artifacts.output import check_output
        from mla_convert.files import atomic_folder

        self.calls.append("factor")
        out = check_output(out, overwrite, src.path)
        with atomic_folder(out) as tmp:
            (tmp / "config.json").write_text(json.dumps({"model_type": "mla"}))
            (tmp / "report.json").write_text(json.dumps(FACTOR_REPORT))
            manifest = {
                "source": {"origin": src.origin, "family": src.family.name},
                "options": recorded_options(options.model_dump()),  # as conversion_manifest records them
                "ranks": [7],
            }
            write_manifest(tmp, manifest, ["config.json", "report.json"])
        return {}

    def run_adapt(self, ckpt: Path, out: Path, options: Any, overwrite: bool = False, **kw: Any) -> dict:
        from mla_convert.artifacts.manifest import write_manifest
        from mla_convert.artifacts.output import check_output
        from mla_convert.files import atomic_folder

        self.calls.append("adapt")
        check_output(out, overwrite, ckpt)
        parent = json.loads((ckpt / "mla_manifest.json").read_text())
        report = {"options": options.model_dump(), **ADAPT_REPORT}
        with atomic_folder(out) as tmp:
            (tmp / "adapt_report.json").write_text(json.dumps(report))
            manifest = {
                "parent": {"canonical_id": parent["canonical_id"]},
                "adaptation": {"tokens": options.tokens},
            }
            write_manifest(tmp, manifest, ["adapt_report.json"])
        return report

    def validate(self, ckpt: Path, source: Any = None, *args: Any, **kw: Any) -> Any:
        from mla_convert.validate.ladder import Check, Rung, ValidationResult

        self.calls.append(f"validate:{Path(ckpt).name}")
        rungs = [
            Rung(
                n,
                name,
                "fake",
                [Check("x", 1e-7 if n != self.fail_rung else 1.0, "<= 1e-05", n != self.fail_rung)],
            )
            for n, name in enumerate(
                ["naive-vs-absorbed", "kernel-vs-reference", "decode-vs-recompute"], start=1
            )
        ]
        self.settings = {"source": source, **{k: v for k, v in kw.items() if k != "progress"}}
        env = {"kernel_backend": "fake", "triton": "-", "torch": torch.__version__}
        return ValidationResult(str(ckpt), rungs, self.settings, env)


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Fakes:
    import mla_convert.adapt.train
    import mla_convert.convert.pipeline.job
    import mla_convert.validate.ladder

    f = Fakes()
    monkeypatch.setattr(mla_convert.convert.pipeline.job, "run_factor", f.run_factor)
    monkeypatch.setattr(mla_convert.adapt.train, "run_adapt", f.run_adapt)
    monkeypatch.setattr(mla_convert.validate.ladder, "validate", f.validate)
    return f


def test_run_skips_stages_whose_outputs_match(tmp_path, fakes):
    p = write(tmp_path, small_recipe(tmp_path))
    out = tmp_path / "out"
    r = run("run", p)
    assert r.exit_code == 0, r.stderr
    assert fakes.calls == ["factor", "adapt", "validate:adapt"]
    assert "recipe test: factor ran, adapt ran, validate passed" in r.stdout
    # what each stage measured, from its own report, before the last line
    assert (
        "factor: perplexity 31.032 (source 14.229, x2.18) on 4088 held-out tokens of wikipedia; "
        "cache 120 values/token/layer (31.25% of the source)\n"
        "adapt: perplexity 31.032 -> 21.636 (source 14.229, x1.52) on 4088 held-out tokens; KL 0.8034 -> 0.5087; "
        "news 70.380 -> 50.280; chat KL 1.4580 -> 1.0490; 100,352 tokens trained\n"
    ) in r.stdout
    saved = (out / RESOLVED_NAME).read_text()
    assert saved.startswith("# resolved by mla-convert") and saved.rstrip() in r.stdout
    assert load_recipe(out / RESOLVED_NAME).recipe.dump() == load_recipe(p).recipe.dump()
    assert json.loads((out / "adapt" / "validation.json").read_text())["passed"] is True
    # validate reads the conversion's evaluation windows against the recipe's source
    assert fakes.settings == {
        "source": "smollm2-135m",
        "text": "wikipedia",
        "window": 512,
        "windows": 8,
        "prompt_tokens": 61,
        "new_tokens": 4,
        "page_size": 16,
        "backend": "triton",
        "matrix_max_history": 4096,
    }

    # a second run skips both stages and still ends with validate
    fakes.calls.clear()
    r = run("run", p)
    assert r.exit_code == 0, r.stderr
    assert fakes.calls == ["validate:adapt"]
    assert "  factor    skip  " in r.stdout and "  adapt     skip  " in r.stdout
    assert "recipe test: factor skipped, adapt skipped, validate passed" in r.stdout
    assert "factor: perplexity 31.032" in r.stdout and "adapt: perplexity 31.032 -> 21.636" in r.stdout

    # an adapt option changes: only adapt re-runs, and replacing its folder needs --overwrite
    fakes.calls.clear()
    r = run("run", p, "adapt.lr=3.0e-4")
    assert r.exit_code == 2 and fakes.calls == []
    assert "adapt stage:" in r.stderr and "options differ: lr 0.0001 -> 0.0003" in r.stderr
    assert "pass --overwrite" in r.stderr
    r = run("run", p, "adapt.lr=3.0e-4", "--overwrite")
    assert r.exit_code == 0, r.stderr
    assert fakes.calls == ["adapt", "validate:adapt"]

    # a factor option changes: factor and everything after it re-run
    fakes.calls.clear()
    r = run("run", p, "adapt.lr=1.0e-4", "factor.rope_pairs=20", "--overwrite")
    assert r.exit_code == 0, r.stderr
    assert "options differ: rope_pairs 24 -> 20" in r.stdout
    assert fakes.calls == ["factor", "adapt", "validate:adapt"]

    # the same again: nothing to do but validate
    fakes.calls.clear()
    r = run("run", p, "adapt.lr=1.0e-4", "factor.rope_pairs=20")
    assert r.exit_code == 0, r.stderr
    assert fakes.calls == ["validate:adapt"]


def test_run_without_adapt_validates_the_factor_output(tmp_path, fakes):
    p = write(tmp_path, small_recipe(tmp_path, adapt=None))
    r = run("run", p)
    assert r.exit_code == 0, r.stderr
    assert fakes.calls == ["factor", "validate:factor"]
    assert "adapt off" in r.stdout
    fakes.calls.clear()
    r = run("run", p, "validate.enabled=false")
    assert r.exit_code == 0, r.stderr
    assert fakes.calls == []


def test_run_adapt_reruns_when_its_parent_changed(tmp_path, fakes):
    """An adapt output made from another factor output (different canonical id) is stale."""
    p = write(tmp_path, small_recipe(tmp_path))
    assert run("run", p).exit_code == 0
    m = tmp_path / "out" / "adapt" / "mla_manifest.json"
    data = json.loads(m.read_text())
    data["parent"]["canonical_id"] = "0" * 64
    from mla_convert.artifacts.manifest import canonical_id

    data["canonical_id"] = canonical_id(data)
    m.write_text(json.dumps(data))
    plan = make_plan(load_recipe(p).recipe)
    assert [s.action for s in plan] == ["skip", "run", "run"]
    assert plan[1].why == "adapted from a different factor output" and plan[1].replaces


def test_run_exits_1_naming_the_failed_rung(tmp_path, fakes):
    fakes.fail_rung = 3
    p = write(tmp_path, small_recipe(tmp_path, adapt=None))
    r = run("run", p)
    assert r.exit_code == 1
    assert "validation failed at rung 3 (decode-vs-recompute)" in r.stderr
    assert "rung 3 decode-vs-recompute: FAIL" in r.stdout


def test_recipe_problems_stop_before_any_stage(tmp_path, fakes):
    p = write(tmp_path, small_recipe(tmp_path))
    r = run("run", p, "factor.rope_pairs=40")
    assert r.exit_code == 2 and fakes.calls == []
    assert r.stderr.startswith(f"error: {p}: factor.rope_pairs: 40 is impossible")
    assert not (tmp_path / "out").exists()


def test_export_dtype_follows_the_format(tmp_path):
    """``export.dtype``: llama.cpp's quantized weight types with ``format: gguf`` only, refused with the fix on a
    DeepSeek-V3 folder; the recipe's list is the exporter's (``gguf_file.GGUF_QUANTS``)."""
    import typing

    from mla_convert.engines.llamacpp.gguf_file import GGUF_QUANTS
    from mla_convert.recipes.schema import EXPORT_FLOATS, GGUF_QUANT_TYPES, ExportDtype

    assert set(GGUF_QUANT_TYPES) == set(GGUF_QUANTS)
    assert typing.get_args(ExportDtype) == EXPORT_FLOATS + GGUF_QUANT_TYPES
    p = write(tmp_path, small_recipe(tmp_path, export={"format": "gguf", "dtype": "q4_k_m"}))
    assert load_recipe(p).recipe.export.dtype == "q4_k_m"
    p = write(tmp_path, small_recipe(tmp_path, export={"format": "deepseek-v3", "dtype": "q8_0"}))
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    assert exc.value.problems == [
        "export.dtype: a llama.cpp weight type: use format gguf, or dtype auto / float32 / bfloat16 for a "
        "DeepSeek-V3 folder (got 'q8_0') (line 14)"
    ]
