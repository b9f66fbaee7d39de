"""A real engine: the reference conversion exported with ``--format deepseek-v3 --dtype float32`` and loaded by
MLX-LM (``mlx_lm.load``, MLX's Linux CPU wheels) computes what our MLA model computes (issue 35, item 0); and the
``config.json`` keys MLX-LM and llama.cpp's converter read are written the way they read them (items 0 and 2).

The MLX-LM venv comes from ``scripts/mlx_env.sh`` (``scripts/test.sh`` builds it and sets ``MLA_MLX_PYTHON``).
Without it the engine test skips, except under ``MLA_REQUIRE_MLX=1`` (CI), where it fails.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_convert.cli.commands import app

SMALL_FLAGS = ["--calib-tokens", "128", "--window", "64", "--eval-windows", "1", "--cache-budget", "24",
               "--rope-pairs", "4"]


@pytest.fixture(scope="session")  # session: set up before reference_ckpt, so a skip converts nothing
def mlx_python() -> str:
    python = os.environ.get("MLA_MLX_PYTHON", "")
    if not python or not Path(python).is_file():
        if os.environ.get("MLA_REQUIRE_MLX") == "1":
            pytest.fail("MLA_REQUIRE_MLX=1 but MLA_MLX_PYTHON names no python: run bash scripts/mlx_env.sh")
        pytest.skip("no MLX-LM venv (MLA_MLX_PYTHON): bash scripts/mlx_env.sh builds one")
    return python


@pytest.fixture(scope="module")
def f32_export(reference_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("mlx") / "smollm2-ds3-f32"
    res = CliRunner().invoke(app, ["export", str(reference_ckpt), str(out), "--dtype", "float32"])
    assert res.exit_code == 0, res.output + str(res.exception)
    return out


def test_reference_export_is_exact_in_mlx(mlx_python, f32_export, reference_ckpt):
    from mla_convert.engines.mlx.check import MLX_FLOAT32, MLX_NEW_TOKENS, check_mlx

    record = check_mlx(reference_ckpt, f32_export, mlx_python)
    assert record["passed"], record["reasons"]
    assert record["dtype"] == "float32" and record["thresholds"] == MLX_FLOAT32
    d, g = record["logprob_abs_diff"], record["greedy"]
    assert d["mean"] <= MLX_FLOAT32["mean"] and d["max"] <= MLX_FLOAT32["max"]
    assert g["count"] == 2 * MLX_NEW_TOKENS and g["max_margin"] <= MLX_FLOAT32["greedy_margin"]
    assert g["argmax_equal"] >= g["count"] - 1  # measured 32/32; one float32 near-tie may flip
    manifest = json.loads((f32_export / "mla_manifest.json").read_text())["export"]
    model = record["model"]
    assert model["rope_theta"] == pytest.approx(manifest["rope"]["parameters"]["rope_theta"], rel=1e-12)
    assert model["kv_a_layernorm_eps"] == manifest["latent_norm"]["eps"] and model["moe_layers"] == 0
    assert model["q_lora_rank"] is None and model["rope_scaling"] is None
    # MLX-LM caches the normalised latent (keys, kv_lora_rank wide) and the rotated rope key (values) per layer
    cache = record["kv_cache"]
    assert cache["layers"] == 30 and cache["per_layer"]["keys"] == {"heads": 1, "width": manifest["kv_lora_rank"]}
    assert cache["per_layer"]["values"] == {"heads": 1, "width": 64}
    assert record["kv_cache_values_per_token_per_layer"] == manifest["kv_lora_rank"] + 64


def test_config_keys_engines_read(tmp_path):
    """Without MLX: ``config.json`` has a top-level ``rope_theta`` (MLX-LM reads only it, default 10000) equal to
    the theta whose table ``theta^(-2j/d_R)`` holds every kept RoPE frequency of the checkpoint, and a dense model's
    expert counts are all 0 (llama.cpp aborts unless n_expert, n_expert_used and n_expert_groups are 0 together)."""
    from tiny import copy_tokenizer, write_tiny_llama

    from mla_convert.mla.configuration import MLAConfig

    src = write_tiny_llama(tmp_path / "src", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    copy_tokenizer(src)
    out = tmp_path / "mla"
    res = CliRunner().invoke(app, ["--quiet", "factor", str(src), str(out), *SMALL_FLAGS, "--export", "deepseek-v3"])
    assert res.exit_code == 0, res.output + str(res.exception)
    cfg = json.loads((tmp_path / "mla-deepseek-v3" / "config.json").read_text())
    theta = cfg["rope_theta"]
    assert theta == cfg["rope_parameters"]["rope_theta"] and cfg["rope_parameters"]["rope_type"] == "default"
    assert "rope_scaling" not in cfg and cfg["rope_interleave"] is True and cfg["q_lora_rank"] is None
    n = cfg["qk_rope_head_dim"] // 2
    table = [theta ** (-j / n) for j in range(n)]  # the table MLX-LM's nn.RoPE(traditional=True, base=theta) applies
    kept = [f for layer in MLAConfig.from_pretrained(str(out)).rope_inv_freq for f in layer[0]]
    assert kept and all(min(abs(t - f) / f for t in table) < 1e-6 for f in kept)
    assert not math.isclose(theta, 10000.0)  # MLX-LM's default would be another function
    experts = ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts")
    assert {k: cfg[k] for k in experts} == dict.fromkeys(experts, 0)
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"]
