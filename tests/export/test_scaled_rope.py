"""Scaled-RoPE sources export where the kept frequencies allow (issue 34, item 4).

llama3 and YaRN leave the fastest RoPE pairs at their plain frequency ``rope_theta^(-2k/d)``; a prefix of that table
is itself a plain table, so a conversion keeping only those pairs exports to DeepSeek-V3 exactly (one plain
rope_theta, ``rope_type: default``). ``factor --export`` steers to that prefix when the user did not choose the
selection; other selections, and ``linear`` (no pair unscaled), are refused before any work with the fix.

Oracle: our MLA checkpoint (itself tested against the source) and stock transformers' ``DeepseekV3ForCausalLM``
loading the export, float32, on real text; the unscaled pairs are counted against the Llama-3 formula
(wavelength ``2 pi / f`` below ``original_max_position_embeddings / high_freq_factor``), not with our code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny import convert, copy_tokenizer, write_tiny_llama
from typer.testing import CliRunner

import mla_convert  # noqa: F401
from mla_convert.cli.commands import app
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.engines.deepseek_v3.mapping import export_state_dict, plan_export
from mla_convert.engines.precheck import export_lines, export_problems, plain_pairs, steer_for_export
from mla_convert.engines.vllm.shape import shape_for_engine
from mla_convert.sources.checkpoint import open_source

TOL = 1e-4  # float32 logits, as tests/export/test_deepseek_v3.py
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama-3.1-8B's
#: Llama-3-8B's attention shape at a tiny width: head_dim 128, 16 query / 8 KV heads (GQA 2).
WIDE = {"hidden_size": 256, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
SMALL = ["--calib-tokens", "128", "--window", "64", "--eval-windows", "1"]


def _source(root: Path, name: str, rope: dict, **over) -> Path:
    folder = write_tiny_llama(root / name, rope_parameters=rope, **over)
    copy_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scaled")
    return {
        "wide": _source(root, "wide", LLAMA3, **WIDE),
        "wide-g2": _source(root, "wide-g2", LLAMA3, **{**WIDE, "num_key_value_heads": 2}),
        "llama3": _source(root, "llama3", LLAMA3, max_position_embeddings=131072),  # head_dim 16
        "yarn": _source(root, "yarn", YARN, max_position_embeddings=16384),
        "linear": _source(root, "linear", LINEAR),
    }


def _llama3_unscaled(head_dim: int) -> int:
    """Pairs whose wavelength is below original_max / high_freq_factor (Llama 3.1's rule, written out)."""
    high = LLAMA3["original_max_position_embeddings"] / LLAMA3["high_freq_factor"]
    return sum(2 * math.pi * LLAMA3["rope_theta"] ** (2 * k / head_dim) < high for k in range(head_dim // 2))


def test_unscaled_pairs_and_steering(sources):
    """The unscaled prefix of each scaling; --target vllm's 32 high pairs of a Llama-3-8B-shaped llama3 source are
    brought to the 29 unscaled ones, with the reason; given levers are kept and refused with the fix."""
    wide = open_source(sources["wide"])
    assert plain_pairs(wide) == _llama3_unscaled(128) == 29
    assert plain_pairs(open_source(sources["llama3"])) == _llama3_unscaled(16) == 4
    assert plain_pairs(open_source(sources["yarn"])) == 3  # YaRN's ramp starts at floor(2.6) = 2: pairs 0..2 exact
    assert plain_pairs(open_source(sources["linear"])) == 0
    shaped, _ = shape_for_engine(ConvertOptions(), wide, "vllm")
    assert (shaped.rope_strategy, shaped.rope_pairs) == ("high", 32)
    assert export_problems(wide, shaped, "vllm")[0].endswith("use --rope-strategy high --rope-pairs 29 (or fewer)")
    steered, why = steer_for_export(wide, shaped, (), "vllm")
    assert (steered.rope_strategy, steered.rope_pairs, steered.kv_lora_rank) == ("high", 29, shaped.kv_lora_rank)
    assert why and "--rope-pairs 29" in why and "llama3 leaves only pairs 0..28 of 64" in why
    assert export_problems(wide, steered, "vllm") == []
    # the default selection (2-norm, any pair) at the transformers target: high, the pair count kept
    steered, why = steer_for_export(wide, ConvertOptions(rope_pairs=16), (), "transformers")
    assert (steered.rope_strategy, steered.rope_pairs) == ("high", 16) and why
    # explicit --rope-strategy 2-norm: kept as given, refused with the fix in one line
    given, why = steer_for_export(wide, ConvertOptions(rope_pairs=16), ("rope_strategy",), "transformers")
    assert given.rope_strategy == "2-norm" and why is None
    (problem,) = export_problems(wide, given)
    assert "llama3-scaled" in problem and problem.endswith("--rope-strategy high --rope-pairs 16 (or fewer)")
    assert "\n" not in problem
    # an unscaled source is never steered
    plain = open_source(write_tiny_llama(sources["wide"].parent / "plain"))
    assert steer_for_export(plain, ConvertOptions(), (), "transformers") == (ConvertOptions(), None)


@pytest.mark.parametrize(("target", "name"), [("transformers", "wide"), ("vllm", "wide-g2")])
def test_llama3_source_exports_through_factor(sources, target, name, tmp_path, eval_ids):
    """``factor --export deepseek-v3`` on a head_dim-128 llama3 source: the steering is said, the export is a plain
    rope_theta table (no scaling anywhere in its config) and stock DeepseekV3 computes our checkpoint's function.

    ``--target vllm`` runs on 2 KV heads: with 8 the query's NoPE width d + 2r(G - 2) = 476 exceeds every head shape
    vLLM's prefill takes, a limit of its own (issue 34 item 3), refused the same with or without scaling."""
    out = tmp_path / "mla"
    # 12.5 % (256 of 2048 values): the tiny's hidden size 256 bounds the latent, so 31.25 % cannot be had here
    flags = ["--target", target] if target != "transformers" else ["--dtype", "float32", "--cache-fraction", "0.125"]
    res = CliRunner().invoke(app, ["factor", str(sources[name]), str(out), *SMALL, "--export", "deepseek-v3", *flags])
    assert res.exit_code == 0, res.output + str(res.exception)
    text = " ".join(res.output.split())
    assert "--export of a llama3-scaled source: --rope-strategy high --rope-pairs" in text
    cfg = json.loads((out / "config.json").read_text())
    kept = {f for layer in cfg["rope_inv_freq"] for f in layer[0]}
    pairs = len(kept)
    assert pairs == 29  # vllm: 32 high pairs steered to 29; transformers: the budget's split (>= 29) likewise
    theta = LLAMA3["rope_theta"]
    assert sorted(kept, reverse=True) == pytest.approx([theta ** (-2 * k / 128) for k in range(pairs)], rel=1e-6)
    dest = tmp_path / "mla-deepseek-v3"
    ds = json.loads((dest / "config.json").read_text())
    assert "rope_scaling" not in ds and ds["rope_parameters"]["rope_type"] == "default"
    slots = 32 if target == "vllm" else pairs  # the engine's 32 slots, or the kept prefix itself
    assert ds["rope_parameters"]["rope_theta"] == pytest.approx(theta ** (2 * slots / 128), rel=1e-5)
    assert ds["qk_rope_head_dim"] == 2 * slots
    export = json.loads((dest / "mla_manifest.json").read_text())["export"]
    assert export["rope"]["max_rel_error"] < 1e-6 and export["rope"]["slots_used"] == pairs
    assert export["parity"]["greedy_tokens_equal"] == export["parity"]["greedy_tokens"]
    assert export["parity"]["max_abs_logit_diff"] < (TOL if target == "transformers" else 0.25)
    # float32 parity of the mapping itself, at the target's shapes: stock DeepseekV3 against our checkpoint
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from mla_convert.mla.checkpoint import load_checkpoint

    ours = load_checkpoint(out).float().eval()
    plan, state = export_state_dict(ours, torch.float32, target)
    stock = DeepseekV3ForCausalLM(DeepseekV3Config(**plan.config)).eval()
    stock.load_state_dict(state, strict=True)
    with torch.no_grad():
        diff = (stock(input_ids=eval_ids).logits - ours(input_ids=eval_ids).logits).abs().max().item()
    assert diff < TOL
    if target == "transformers":  # the conversion itself passes the validation ladder
        res = CliRunner().invoke(app, ["validate", str(out), "--source", str(sources[name]), "--window", "64",
                                       "--windows", "2", "--prompt-tokens", "24",
                                       "--new-tokens", "8", "--matrix-max-history", "129"])
        assert res.exit_code == 0, res.output + str(res.exception)
        report = json.loads((out / "validation.json").read_text())
        assert all(r["passed"] for r in report["rungs"])


def test_yarn_source_exports_with_its_attention_factor(sources, calib_windows, eval_ids):
    """YaRN: the steered selection (its 3 unscaled pairs) exports exactly; the attention factor (1 + 0.1 ln 4) lives
    in q_proj, so the export's plain rope computes the same scores."""
    src = open_source(sources["yarn"])
    assert src.attention_scaling == pytest.approx(1 + 0.1 * math.log(4.0))
    opts, why = steer_for_export(src, ConvertOptions(cache_budget=40, rope_pairs=6), (), "transformers")
    assert (opts.rope_strategy, opts.rope_pairs) == ("high", 3) and why and "yarn leaves only pairs 0..2" in why
    assert export_problems(src, opts) == []
    mla = convert(src, calib_windows[:2], **opts.model_dump(exclude={"dtype"})).model.eval()
    plan, state = export_state_dict(mla, torch.float32)
    assert plan.config["rope_parameters"] == {"rope_type": "default",
                                              "rope_theta": pytest.approx(YARN["rope_theta"] ** (6 / 16), rel=1e-5)}
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    stock = DeepseekV3ForCausalLM(DeepseekV3Config(**plan.config)).eval()
    stock.load_state_dict(state, strict=True)
    with torch.no_grad():
        diff = (stock(input_ids=eval_ids).logits - mla(input_ids=eval_ids).logits).abs().max().item()
    assert diff < TOL
    # a selection with a scaled pair: plan_export refuses the finished checkpoint too
    from mla_convert.engines.deepseek_v3.mapping import ExportError

    bad = convert(src, calib_windows[:2], rope_strategy="high", rope_pairs=5, cache_budget=40).model
    with pytest.raises(ExportError, match="not powers of one ratio"):
        plan_export(bad.config, torch.float32)


def test_refusals_come_before_any_work(sources, tmp_path):
    """linear (no pair unscaled) and an explicit --rope-strategy 2-norm are refused before anything is written."""
    runner = CliRunner()
    out = tmp_path / "lin"
    res = runner.invoke(app, ["factor", str(sources["linear"]), str(out), *SMALL, "--cache-budget", "40",
                              "--export", "deepseek-v3"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "linear-scaled and none of its 8 pairs keeps its plain frequency" in text
    assert "convert without --export and use the MLA checkpoint as is" in text
    assert "through mla-convert's plugin, with no export" in text and "vllm serve CKPT" in text  # issue 36
    assert not out.exists() and not (tmp_path / "lin-deepseek-v3").exists()
    out = tmp_path / "twonorm"
    res = runner.invoke(app, ["factor", str(sources["llama3"]), str(out), *SMALL, "--cache-budget", "40", "--export",
                              "deepseek-v3",
                              "--rope-strategy", "2-norm"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "llama3-scaled: only pairs 0..3 keep their plain frequency" in text
    assert "use --rope-strategy high --rope-pairs 4 (or fewer)" in text and not out.exists()
    assert "vLLM serves the MLA checkpoint itself exactly through mla-convert's plugin" in text


def test_inspect_and_recipes_say_the_steering(sources, tmp_path):
    res = CliRunner().invoke(app, ["inspect", str(sources["llama3"]), "--cache-budget", "40"])
    assert res.exit_code == 0, res.output + str(res.exception)
    text = " ".join(res.output.split())
    assert "--export deepseek-v3 --target transformers: exact with --rope-strategy high --rope-pairs" in text
    assert "which --export steers to (pairs 0..3 are the ones llama3 leaves unscaled)" in text
    *exports, plugin = export_lines(open_source(sources["linear"]), ConvertOptions())
    assert all("not exact: the source's RoPE is linear-scaled" in line for line in exports)
    assert plugin.startswith("  vLLM plugin") and "exact" in plugin and "not exact" not in plugin  # its own rotary
    from mla_convert.recipes.load import load_recipe
    from mla_convert.recipes.schema import RecipeError

    text = (f"name: t\nsource: {sources['llama3']}\noutput: {tmp_path / 'job'}\n"
            "factor: {calib_tokens: 128, window: 64, eval_windows: 2, cache_budget: 40}\nvalidate: {enabled: false}\n"
            "export: {format: deepseek-v3}\n")
    res = load_recipe("t.yaml", text=text)  # the budget's split, steered into the unscaled pairs
    assert res.recipe.factor.rope_strategy == "high" and 1 <= res.recipe.factor.rope_pairs <= 4
    for given in ("rope_pairs: 6", "rope_strategy: 2-norm"):  # a given lever that breaks it: refused with the fix
        with pytest.raises(RecipeError) as exc:
            load_recipe("t.yaml", text=text.replace("cache_budget: 40", f"cache_budget: 40, {given}"))
        (problem,) = [p for p in exc.value.problems if p.startswith("export.target")]
        assert "llama3-scaled" in problem and "use factor.rope_strategy high factor.rope_pairs" in problem
