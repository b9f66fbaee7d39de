"""`inspect` suggests a RoPE/latent split only from measured results, and says where they come from."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mla_convert.cli import commands as cli
from mla_convert.convert.options import suggest


def test_inspect_suggests_the_measured_split(tmp_path, monkeypatch):
    measured = tmp_path / "measured_splits.json"
    measured.write_text(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct",
                "measured_by": "test",
                "splits": [
                    {"cache_budget": 72, "cache_fraction": 0.1875, "rope_pairs": 20, "rope_share": 0.5556}
                ],
            }
        )
    )
    monkeypatch.setattr(suggest, "MEASURED_SPLITS", measured)
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if "18.75%" in x)
    assert (
        "--cache-budget 72 --rope-pairs 20 (latent 32 + rope 40" in line and "SmolLM2-135M-Instruct" in line
    )
    assert "not measured" in next(x for x in res.output.splitlines() if "31.25%" in x)
    monkeypatch.setattr(suggest, "MEASURED_SPLITS", tmp_path / "absent.json")
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m"], env={"COLUMNS": "400"})
    assert res.exit_code == 0 and "--rope-pairs" not in res.output


def test_inspect_prints_memory_disk_and_time_for_the_factor_options():
    args = ["inspect", "smollm2-135m", "--dtype", "bfloat16", "--max-shard-size", "100MB"]
    res = CliRunner().invoke(cli.app, args, env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    head = lines.index("factor --dtype bfloat16 --max-shard-size 100MB would need (estimates, before any work):")
    memory, disk, time = lines[head + 1 : head + 4]
    assert memory.startswith("  peak memory: ~1.9 GB resident, in sample") and "its float32 copy 0.58" in memory
    assert disk.startswith("  disk: output ~0.29 GB;") and ".OUT.factor" in disk
    # the search converts 5 candidates: 18, 24, 30 pairs, then rotation at the best, then the sequential refit there
    assert time.startswith("  time: ~6 min, an estimate for the reference CPU") and "rope split 4 min" in time
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m"], env={"COLUMNS": "400"})
    assert "factor with the default options would need" in res.output
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", "--max-shard-size", "lots"])
    assert res.exit_code == 2 and "--max-shard-size 'lots' is not a size" in res.output


def test_the_rope_split_follows_the_budget():
    """Without --rope-pairs, factor/inspect/recipes take the split measured best for the budget (interpolated
    between the measured cache fractions); --rope-pairs or a fixed kv_lora_rank keep what is given."""
    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.sources.checkpoint import open_source

    src = open_source("smollm2-135m")
    pairs = {b: suggest.follow_budget(ConvertOptions(cache_budget=b), src, ())[0].rope_pairs
             for b in (120, 96, 72, 48, 30)}
    assert pairs == {120: 24, 96: 20, 72: 16, 48: 12, 30: 8}  # 0.40, 0.42, 0.44, 0.50, 0.50 of the row
    given = ("rope_pairs", "rope_strategy", "refit_o_proj")
    kept, why = suggest.follow_budget(ConvertOptions(cache_budget=72, rope_pairs=24), src, given)
    assert kept.rope_pairs == 24 and why is None
    assert suggest.follow_budget(ConvertOptions(kv_lora_rank=64), src, ())[0].rope_pairs == 24
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", "--cache-budget", "72"], env={"COLUMNS": "400"})
    assert res.exit_code == 0 and "takes --rope-pairs 16: the RoPE share measured best at 18.75 %" in res.output
    from mla_convert.recipes.load import load_recipe

    text = "name: t\nsource: smollm2-135m\noutput: /tmp/mla-recipe-split-test\nfactor: {cache_budget: 72}\n"
    assert load_recipe("t.yaml", text=text).recipe.factor.rope_pairs == 16
    text = text.replace("{cache_budget: 72}", "{cache_budget: 72, rope_pairs: 20}")
    assert load_recipe("t.yaml", text=text).recipe.factor.rope_pairs == 20


def test_the_levers_follow_the_budget():
    """Without --rope-strategy / --refit-o-proj, factor, inspect and recipes take the levers benchmarks/levers.py
    measured best at the nearest measured cache size (measured_splits.json); what is given stays, and a rope
    strategy is taken only for the shared rope head."""
    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.recipes.load import load_recipe
    from mla_convert.sources.checkpoint import open_source

    src = open_source("smollm2-135m")

    def levers(budget: int, given: tuple[str, ...] = (), **kw: str) -> tuple[str, str]:
        o = suggest.follow_budget(ConvertOptions(cache_budget=budget, **kw), src, given)[0]
        return o.rope_strategy, o.refit_o_proj

    # 31.25 %: no lever beat the default on dev; 18.75 %: the sequential refit; 12.5 %: rotation and sequential
    assert levers(120) == ("2-norm", "teacher") and levers(100) == ("2-norm", "teacher")
    assert levers(72) == ("2-norm", "sequential") and levers(60) == ("2-norm", "sequential")
    assert levers(48) == ("rotation", "sequential") and levers(30) == ("rotation", "sequential")
    assert levers(48, ("refit_o_proj",)) == ("rotation", "teacher")
    assert levers(48, ("rope_mode",), rope_mode="per-head") == ("2-norm", "sequential")
    _, why = suggest.follow_budget(ConvertOptions(cache_budget=120), src, ())
    assert why is not None and "--refit-o-proj" not in why  # the defaults are what was measured at 120
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", "--cache-budget", "48"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "--rope-strategy rotation, --refit-o-proj sequential: measured best at 12.50 %" in res.output
    assert "--cache-budget 48 --rope-pairs 12 --rope-strategy rotation --refit-o-proj sequential" in res.output
    # a value given equal to the option's default still overrides the budget's choice, and the printed line says so
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", "--cache-budget", "48", "--refit-o-proj", "teacher"],
                             env={"COLUMNS": "400"})  # fmt: skip
    assert "factor --rope-strategy rotation --rope-pairs 12 --refit-o-proj teacher --cache-budget 48.0" in res.output
    assert "measured together with --refit-o-proj sequential (given otherwise here)" in res.output
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", "--cache-budget", "48", "--kv-lora-rank", "8"])
    assert res.exit_code == 2 and "--cache-budget and --kv-lora-rank 8 both given" in res.output
    text = "name: t\nsource: smollm2-135m\noutput: /tmp/mla-recipe-levers-test\nfactor: {cache_budget: 48}\n"
    assert load_recipe("t.yaml", text=text).recipe.factor.refit_o_proj == "sequential"
    text = text.replace("{cache_budget: 48}", "{cache_budget: 48, refit_o_proj: teacher}")
    assert load_recipe("t.yaml", text=text).recipe.factor.refit_o_proj == "teacher"


def test_inspect_target_shows_the_engine_shaped_conversion():
    """``inspect --target vllm-cpu``: the options factor would take for vLLM's 512 + 64 row (SmolLM2: all 32
    frequencies in one rope head, the widest useful latent 3 x 64 - 64 + 3 x 64 = 320 in every layer), why, and the
    served cache next to the checkpoint's; an explicit budget keeps its own shape and says the export pads it."""
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", "--target", "vllm-cpu"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "--target vllm-cpu: one shared rope head of 32 frequencies (high) and kv_lora_rank 320" in res.output
    assert "--rope-strategy high --rope-pairs 32 --kv-lora-rank 320" in res.output
    assert "--target vllm-cpu: exact; engine cache 576 values/token/layer (MLA 384, source 384)" in res.output
    assert "saves no cache, it proves the function" in res.output  # 576 > SmolLM2's own 384
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", "--target", "vllm", "--cache-budget", "72"],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 0 and "converted as asked" in res.output and "pads the latent" in res.output
    # the split and the levers measured for the budget, as without --target
    assert "factor --rope-pairs 16 --refit-o-proj sequential --cache-budget 72.0 would need" in res.output
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", "--target", "vllm-cpu", "--rope-mode", "per-head"])
    assert res.exit_code == 2 and "--rope-mode per-head: removed" in res.output  # the library's refusal: test_deepseek_v3
    res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", "--target", "vllm", "--rope-pairs", "33"])
    assert res.exit_code == 2 and "the rope head holds 32" in res.output


def test_gguf_line_names_the_shape_llamacpp_serves_unpadded():
    """The default conversion's GGUF row is only known after it (per-layer ranks padded to the largest): the line says
    "at least" and names ``--target llama.cpp``; with that target the row is the asked size, and at a row of whole
    blocks of 32 nothing is padded at all."""

    def gguf_line(*args: str) -> str:
        res = CliRunner().invoke(cli.app, ["inspect", "smollm2-135m", *args], env={"COLUMNS": "400"})
        assert res.exit_code == 0, res.output
        (line,) = [x for x in res.output.splitlines() if "--export gguf (llama.cpp" in x]
        return line

    default = gguf_line()
    assert "at least 120 values" in default and "factor --target llama.cpp spends a 120-value row" in default
    shaped = gguf_line("--target", "llama.cpp")
    assert "at least 120 values" in shaped and "latent padded to whole blocks of 32" in shaped
    assert "--target llama.cpp spends" not in shaped
    assert "K-only cache 128 values/token/layer (MLA 128, source 384)" in gguf_line("--target", "llama.cpp", "--cache-budget", "128")
