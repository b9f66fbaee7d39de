"""``--target vllm`` on the shapes users convert (issue 34 item 3): a tiny random Llama with 32 query heads, 8 KV
heads and head_dim 128 (Llama-3-8B's query NoPE width 512 with one shared rope head of 32 frequencies) converts and
exports with head dims vLLM's GPU prefill takes, through the CLI; ``inspect`` says the setting before any work."""

from __future__ import annotations

import json

import pytest
from tiny import copy_tokenizer, write_tiny_llama
from typer.testing import CliRunner

import mla_convert  # noqa: F401
from mla_convert.cli.commands import app
from mla_convert.engines.deepseek_v3.mapping import VLLM_GPU_HEAD_DIMS

SHAPE = {"hidden_size": 256, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "intermediate_size": 256}
FLAGS = ["--calib-tokens", "128", "--window", "64", "--eval-windows", "1"]


@pytest.fixture(scope="module")
def g8(tmp_path_factory):
    folder = write_tiny_llama(tmp_path_factory.mktemp("g8-src"), **SHAPE)
    copy_tokenizer(folder)
    return folder


def test_factor_target_vllm_exports_head_dims_vllm_takes(g8, tmp_path):
    out = tmp_path / "mla"
    res = CliRunner().invoke(app, ["factor", str(g8), str(out), *FLAGS, "--target", "vllm", "--export", "deepseek-v3"])
    assert res.exit_code == 0, res.output + str(res.exception)
    assert "--qk-nope-head-dim 128" in res.output and "query's NoPE width 512" in res.output
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["qk_nope_head_dim"], cfg["num_key_value_heads"], cfg["qk_rope_head_dim"]) == (128, 32, 64)
    assert json.loads((out / "mla_manifest.json").read_text())["options"]["qk_nope_head_dim"] == 128
    dest = tmp_path / "mla-deepseek-v3"
    ds = json.loads((dest / "config.json").read_text())
    shape = (ds["qk_nope_head_dim"], ds["qk_rope_head_dim"], ds["v_head_dim"])
    assert shape in VLLM_GPU_HEAD_DIMS and shape == (128, 64, 128)
    assert ds["kv_lora_rank"] == 512
    export = json.loads((dest / "mla_manifest.json").read_text())["export"]
    assert export["qk_nope_head_dim"] == 128 and export["kv_lora_rank"] == 512
    # the source's cache (2 x 8 KV heads x 128), not the reduced MLA config's 32 key groups
    assert export["cache_values_per_token_per_layer"] == {"deepseek_v3": 576.0, "mla": 320.0, "source": 2048.0}
    assert export["parity"]["max_abs_logit_diff"] < 0.25  # bf16 (the vLLM targets' default), as for SmolLM2


def test_inspect_says_the_setting_before_any_work(g8):
    runner = CliRunner()
    for target in ("vllm", "vllm-cpu"):
        res = runner.invoke(app, ["inspect", str(g8), "--target", target], env={"COLUMNS": "400"})
        assert res.exit_code == 0, res.output
        assert "--qk-nope-head-dim 128" in res.output and "exact" in res.output
        assert f"--target {target}: exact; engine cache 576" in res.output
    # 12.5 % (256 values): the tiny's hidden size 256 bounds the latent below the 31.25 % default. By default the
    # query's NoPE width 488 (8 KV heads) is bounded at head_dim, exactly, which vLLM's prefill takes
    flags = ["inspect", str(g8), "--rope-strategy", "high", "--rope-pairs", "30", "--cache-fraction", "0.125"]
    res = runner.invoke(app, flags, env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "the query's NoPE width 488 (head_dim 128 + 2 x 30 pairs x (8 KV heads - 2)) is bounded at" in res.output
    assert "--target vllm: exact" in res.output
    # the width given unbounded: inspect says vLLM's prefill does not take it, and what does
    res = runner.invoke(app, [*flags, "--qk-nope-head-dim", "488"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "--target vllm: not exact: the query's NoPE width 488" in res.output
    assert "use --qk-nope-head-dim 128" in res.output
    res = runner.invoke(app, ["inspect", str(g8), "--target", "vllm", "--qk-nope-head-dim", "513"])
    assert res.exit_code == 2 and "--qk-nope-head-dim 513 is over the query's NoPE width 512" in res.output
