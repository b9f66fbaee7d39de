"""DeepSeek-V3 export (issue 13): stock transformers' DeepseekV3ForCausalLM computes what our MLA model computes.

Oracle: our MLA model (itself tested against the source and its own oracles) on real text; at full keep the
source itself. Tiny random Llama (GQA and MHA), Mistral and Qwen2 (random q/k/v biases) sources show the
mapping of each family; the bundled SmolLM2 shows it on real weights, through the CLI and a clean process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import convert
from tiny import write_tiny_family as _write
from typer.testing import CliRunner

import mla_convert  # noqa: F401
from mla_convert.cli.commands import app
from mla_convert.export.deepseek_v3 import (
    DS_NORM_EPS,
    ExportError,
    export_state_dict,
    latent_bound,
    norm_constants,
    plan_export,
)
from mla_convert.sources.checkpoint import load_source_model, open_source

TOL = 1e-4  # float32 logits
FULL = dict(rope_mode="shared", rope_strategy="rotation", rope_pairs=16, cache_budget=None, kv_lora_rank=32)
LOSSY = dict(cache_budget=24, rope_pairs=4)  # the default strategy (2-norm, per-layer ranks) at a small cache


@pytest.fixture(scope="module", params=["llama", "mha", "mistral", "qwen2"])
def tiny(request, tmp_path_factory, calib_windows):
    folder = _write(tmp_path_factory.mktemp(request.param), request.param)
    src = open_source(folder)
    model = load_source_model(src)
    return request.param, src, model, calib_windows[:2]


def _stock(model, dtype=torch.float32):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    plan, state = export_state_dict(model, dtype)
    stock = DeepseekV3ForCausalLM(DeepseekV3Config(**plan.config)).eval()
    result = stock.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return plan, state, stock


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("options", [FULL, LOSSY], ids=["full-keep", "lossy-default"])
def test_stock_deepseek_equals_our_model(tiny, options, eval_ids):
    family, src, source_model, calib = tiny
    if options is FULL:  # every (frequency, component) of every KV head, full rank
        g, half = src.num_kv_heads, src.head_dim // 2
        options = {**FULL, "rope_pairs": g * half, "kv_lora_rank": min(src.hidden_size, g * src.head_dim), "x": 1}
    full = options.pop("x", None) is not None
    mla = convert(src, calib, **options).model
    plan, _, stock = _stock(mla.eval())
    ours = _logits(mla, eval_ids)
    assert (_logits(stock, eval_ids) - ours).abs().max().item() < TOL
    if full:  # full keep: the export is the source
        assert (_logits(source_model, eval_ids) - ours).abs().max().item() < TOL
    assert (plan.q_lora_rank is not None) == (family == "qwen2")  # the query bias goes through q_a/q_b
    assert plan.config["num_key_value_heads"] == plan.config["num_attention_heads"]
    assert plan.config["first_k_dense_replace"] == src.num_layers  # dense MLPs everywhere
    assert plan.query_scale == pytest.approx(mla.config.softmax_scale * math.sqrt(
        plan.qk_nope_head_dim + plan.config["qk_rope_head_dim"]))


def test_latent_rms_is_constant_on_real_hidden_states(tiny, eval_ids):
    """The constant channel makes kv_a_layernorm's RMS constant to < 1e-6 relative on every token (the bound
    from the weights guarantees it for any input)."""
    _, src, source_model, calib = tiny
    mla = convert(src, calib, **LOSSY).model
    plan, _, stock = _stock(mla.eval())
    seen = []
    layer = stock.model.layers[1].self_attn
    hook = layer.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    _logits(stock, eval_ids)
    hook.remove()
    x, out = seen[0]
    latent = out[..., : plan.kv_lora_rank].double()
    rms = latent.pow(2).mean(-1).add(DS_NORM_EPS).sqrt()
    k, _ = plan.latent_norm
    want = math.sqrt(k * k / plan.kv_lora_rank + DS_NORM_EPS)
    assert (rms / want - 1).abs().max().item() < 1e-6
    c = mla.model.layers[1].self_attn.kv_a_proj_with_mqa
    r = mla.config.kv_lora_rank[1]
    norms = (x @ c.weight[:r].T).norm(dim=-1)
    gamma = stock.model.layers[1].input_layernorm.weight
    assert norms.max().item() <= latent_bound(c.weight[:r].detach(), None, gamma.detach())  # the bound holds on real tokens


def test_bf16_export_rounds_to_the_stored_weights(tiny, eval_ids):
    """In 16-bit dtypes every folded factor is a power of two (or within 1e-4 of one): the exported tensors
    are the stored MLA tensors times powers of two, so the export adds no rounding of its own."""
    family, src, source_model, calib = tiny
    mla = convert(src, calib, **LOSSY).model
    mla = mla.to(torch.bfloat16).eval()
    for layer in mla.model.layers:  # rope frequencies stay float32 in a checkpoint
        layer.self_attn.rope_inv_freq = layer.self_attn.rope_inv_freq.float()
    plan, state, stock = _stock(mla, torch.bfloat16)
    assert math.log2(plan.query_scale) == round(math.log2(plan.query_scale))
    kv_b = state["model.layers.0.self_attn.kv_b_proj.weight"].float()
    ours = mla.model.layers[0].self_attn.kv_b_proj.weight.float()
    r, g, h = mla.config.kv_lora_rank[0], mla.config.num_key_value_heads, mla.config.num_attention_heads
    blocks = kv_b[:, :r].view(h, -1, r)
    first = blocks[0][: mla.config.qk_nope_head_dim]
    scale = first.abs().max() / ours[: mla.config.qk_nope_head_dim].abs().max()
    assert math.log2(scale.item()) == round(math.log2(scale.item()))
    assert torch.equal(first, ours[: mla.config.qk_nope_head_dim] * scale)
    assert (_logits(stock, eval_ids) - _logits(mla.float(), eval_ids)).abs().max().item() < TOL
    del g


def test_rope_table(tiny):
    """shared/high keeps the same geometric frequencies in every layer: a plain rope_theta (what vLLM reads);
    the data-driven default keeps different pairs per layer: their union, exact through longrope factors."""
    _, src, source_model, calib = tiny
    theta = src.config.rope_theta if hasattr(src.config, "rope_theta") else src.config.rope_parameters["rope_theta"]
    mla = convert(src, calib, rope_strategy="high", rope_pairs=4, cache_budget=None, kv_lora_rank=16).model
    plan = plan_export(mla.config, torch.float32)
    assert plan.rope.kind == "default" and len(plan.rope.inv_freq) == 4
    assert plan.rope.parameters["rope_theta"] == pytest.approx(theta ** (8 / 16), rel=1e-6)
    assert plan.rope.max_rel_error < 1e-6
    assert plan.cache_values_per_token == {"mla": 24.0, "deepseek_v3": 25.0}  # + the constant channel
    mla = convert(src, calib, **LOSSY).model
    plan = plan_export(mla.config, torch.float32)
    kept = {f for layer in mla.config.rope_inv_freq for f in layer[0]}
    assert len(plan.rope.inv_freq) >= len(kept) and plan.rope.max_rel_error < 1e-6


def test_norm_constants_are_exact_in_their_dtype():
    for dtype, tol in ((torch.float32, 1e-7), (torch.bfloat16, 1e-4), (torch.float16, 1e-6)):
        for width in (17, 93, 513):
            k, w = norm_constants(width, dtype)
            assert torch.tensor(k).to(dtype).item() == k and torch.tensor(w).to(dtype).item() == w
            assert abs(math.sqrt(k * k / width + DS_NORM_EPS) / w - 1) < tol


def test_per_head_checkpoint_is_refused(tiny):
    _, src, source_model, calib = tiny
    opts = dict(rope_mode="per-head", rope_strategy="high", rope_pairs=2, cache_budget=None, kv_lora_rank=8)
    mla = convert(src, calib, **opts).model
    if mla.config.num_rope_heads == 1:
        pytest.skip("one KV head: per-head is shared")
    with pytest.raises(ExportError, match="convert with --rope-mode shared"):
        plan_export(mla.config, torch.float32)


# ------------------------------------------------------------------------------------------ CLI, real model
CLEAN_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
assert not any(m.startswith("mla_convert") for m in sys.modules), "mla_convert was imported"
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64)
    logits = model(input_ids=ids).logits
torch.save({"tokens": out, "logits": logits, "cls": type(model).__module__}, sys.argv[3])
"""


@pytest.fixture(scope="module")
def exported(reference_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "smollm2-ds3"
    res = CliRunner().invoke(app, ["export", str(reference_ckpt), str(out), "--dtype", "float32"])
    assert res.exit_code == 0, res.output + str(res.exception)
    return out, res.output


def test_cli_export_of_the_reference_loads_in_a_clean_process(exported, reference_ckpt, eval_ids, tmp_path):
    out, output = exported
    manifest = json.loads((out / "mla_manifest.json").read_text())
    e = manifest["export"]
    assert e["parity"]["max_abs_logit_diff"] < TOL and e["parity"]["greedy_tokens_equal"] == 64
    assert manifest["parent"]["canonical_id"] == json.loads((reference_ckpt / "mla_manifest.json").read_text())[
        "canonical_id"]
    assert "parity max |dlogit|" in output and "64/64 greedy tokens equal" in output
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    ids = eval_ids[:, :24]
    dump = tmp_path / "stock.pt"
    subprocess.run([sys.executable, "-c", CLEAN_LOAD, str(out), json.dumps(ids.tolist()), str(dump)], check=True,
                   timeout=600, cwd=Path(__file__).resolve().parents[2])  # from the repository root, as the README
    got = torch.load(dump)
    assert got["cls"] == "transformers.models.deepseek_v3.modeling_deepseek_v3"
    from mla_convert.mla.checkpoint import load_checkpoint

    ours = load_checkpoint(reference_ckpt)
    assert (got["logits"] - _logits(ours, ids)).abs().max().item() < TOL
    with torch.no_grad():
        want = ours.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64)
    assert torch.equal(got["tokens"], want)  # 64 greedy tokens through stock generate() after save/load


def test_manifest_verify_eval_and_generate_take_the_export(exported):
    out, _ = exported
    runner = CliRunner()
    res = runner.invoke(app, ["manifest", "verify", str(out)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["eval", str(out), "--window", "64", "--windows", "1"])
    assert res.exit_code == 0, res.output + str(res.exception)
    assert "perplexity" in res.output
    res = runner.invoke(app, ["generate", str(out), "The capital of France is", "--max-new-tokens", "4"])
    assert res.exit_code == 0, res.output + str(res.exception)
    assert "stock transformers DeepseekV3ForCausalLM" in res.output
    res = runner.invoke(app, ["generate", str(out), "The capital of France is", "--max-new-tokens", "2",
                              "--backend", "triton"])
    assert res.exit_code == 0 and "triton" in res.output, res.output + str(res.exception)


def test_validate_reads_the_export_back_as_mla(exported, tmp_path):
    """The ladder (kernel, decode vs recompute, cache ledger, scale, quality vs source) on the export's geometry."""
    import shutil

    out, _ = exported
    copy = tmp_path / "ds3"
    shutil.copytree(out, copy)
    res = CliRunner().invoke(app, ["validate", str(copy), "--source", "smollm2-135m", "--window", "64",
                                   "--windows", "2", "--new-tokens", "2",
                                   "--matrix-max-history", "129", "--backend", "absorbed", "--prompt-tokens", "24"])
    assert res.exit_code == 0, res.output + str(res.exception)
    report = json.loads((copy / "validation.json").read_text())
    assert all(r["passed"] for r in report["rungs"])
    res = CliRunner().invoke(app, ["manifest", "verify", str(copy)])  # validation files are addenda
    assert res.exit_code == 0, res.output


def test_export_refuses_bad_inputs(exported, reference_ckpt, tmp_path):
    out, _ = exported
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(reference_ckpt), str(out)])
    assert res.exit_code == 2 and "pass --overwrite" in res.output
    res = runner.invoke(app, ["export", str(out), str(tmp_path / "again")])
    assert res.exit_code == 2 and "is already a DeepSeek-V3 export" in res.output  # an export is not re-exported
    res = runner.invoke(app, ["export", str(reference_ckpt), str(tmp_path / "x"), "--format", "gguf"])
    assert res.exit_code == 2 and "--format 'gguf' is not one of deepseek-v3" in res.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "again").exists()


# ------------------------------------------------------------------------------------------ factor / recipes
SMALL_FLAGS = ["--calib-windows", "2", "--window", "64", "--eval-windows", "1", "--cache-budget", "24",
               "--rope-pairs", "4"]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from tiny import copy_tokenizer

    folder = _write(tmp_path_factory.mktemp("qwen2-src"), "qwen2")
    copy_tokenizer(folder)
    return folder


def test_factor_ends_with_an_export(tiny_qwen2, tmp_path):
    out = tmp_path / "mla"
    runner = CliRunner()
    res = runner.invoke(app, ["--quiet", "factor", str(tiny_qwen2), str(out), *SMALL_FLAGS, "--export", "deepseek-v3"])
    assert res.exit_code == 0, res.output + str(res.exception)
    dest = tmp_path / "mla-deepseek-v3"
    manifest = json.loads((dest / "mla_manifest.json").read_text())
    parent = json.loads((out / "mla_manifest.json").read_text())
    assert manifest["parent"]["canonical_id"] == parent["canonical_id"]
    assert manifest["export"]["parity"]["max_abs_logit_diff"] < 1e-2  # bfloat16 weights run in float32 both sides
    assert manifest["export"]["q_lora_rank"] == 65  # the Qwen2 query bias
    assert f"wrote {dest}" in res.output
    # the export folder is checked before any work: occupied -> refused, OUT untouched
    res = runner.invoke(app, ["factor", str(tiny_qwen2), str(tmp_path / "ph"), *SMALL_FLAGS, "--rope-mode", "per-head",
                              "--export", "deepseek-v3"])
    assert res.exit_code == 2 and "needs one shared rope head" in res.output and not (tmp_path / "ph").exists()
    res = runner.invoke(app, ["export", str(out), str(tmp_path / "x"), "--dtype", "int8"])
    assert res.exit_code == 2 and "--dtype 'int8' is not one of" in res.output
    res = runner.invoke(app, ["factor", str(tiny_qwen2), str(tmp_path / "third"), *SMALL_FLAGS, "--export", "onnx"])
    assert res.exit_code == 2 and "--export 'onnx' is not one of deepseek-v3" in res.output
    (tmp_path / "fourth-deepseek-v3").mkdir()
    (tmp_path / "fourth-deepseek-v3" / "x").write_text("keep")
    res = runner.invoke(app, ["factor", str(tiny_qwen2), str(tmp_path / "fourth"), *SMALL_FLAGS, "--export",
                              "deepseek-v3"])
    assert res.exit_code == 2 and "pass --overwrite" in res.output and not (tmp_path / "fourth").exists()


def test_recipe_export_stage_runs_then_skips(tiny_qwen2, tmp_path):
    import yaml

    recipe = {
        "name": "tiny-export",
        "source": str(tiny_qwen2),
        "output": str(tmp_path / "job"),
        "factor": {"calib_windows": 2, "window": 64, "eval_windows": 1, "cache_budget": 24, "rope_pairs": 4},
        "validate": {"enabled": False},
        "export": {"format": "deepseek-v3", "dtype": "float32"},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 0, res.output + str(res.exception)
    assert "export ran" in res.output
    m = json.loads((tmp_path / "job" / "export" / "mla_manifest.json").read_text())
    assert m["export"]["dtype"] == "float32" and m["export"]["parity"]["max_abs_logit_diff"] < TOL
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 0 and "export skipped" in res.output, res.output


def test_smollm2_full_keep_export_is_the_source(smol_st, smol_model, smol_windows, eval_ids):
    """Real weights, every RoPE component and full rank: stock DeepSeek-V3 = our MLA model = SmolLM2 (float32)."""
    opts = dict(rope_mode="shared", rope_strategy="rotation", rope_pairs=96, cache_budget=None, kv_lora_rank=192)
    mla = convert(smol_st, *smol_windows, **opts).model
    plan, _, stock = _stock(mla.eval())
    got = _logits(stock, eval_ids)
    assert (got - _logits(mla, eval_ids)).abs().max().item() < TOL
    assert (got - _logits(smol_model, eval_ids)).abs().max().item() < TOL
    assert plan.rope.kind == "longrope"  # 96 components of 32 frequencies: repeated frequencies
