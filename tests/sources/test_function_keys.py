"""A Hugging Face folder whose config.json states something that changes the function, but that transformers'
Llama/Mistral/Qwen2 (and so the conversion) would not do, is refused by name before any work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mla_convert.sources.checkpoint import open_source
from mla_convert.sources.locate import SourceError

SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


def _folder(tmp_path: Path, model_type: str = "llama", **edit: Any) -> Path:
    """A tiny random checkpoint whose config.json gets ``edit`` (a value None deletes the key)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SHAPE), dtype=torch.float32)
    model.save_pretrained(str(tmp_path))
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    for key, value in edit.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return tmp_path


def _refused(folder: Path) -> str:
    with pytest.raises(SourceError) as info:
        open_source(folder)
    message = str(info.value)
    assert "\n" not in message and str(folder / "config.json") in message, message
    return message


@pytest.mark.parametrize(
    "model_type, key, value, said",
    [
        ("llama", "attn_logit_softcapping", 50.0, "attention logit soft-capping"),
        ("llama", "final_logit_softcapping", 30.0, "final logit soft-capping"),
        ("mistral", "logit_scale", 0.25, "scaled output logits"),
        ("qwen2", "embedding_multiplier", 12.0, "scaled input embeddings"),
        ("llama", "query_pre_attn_scalar", 144, "attention scale"),
        ("llama", "use_qk_norm", True, "QK-norm"),
        ("llama", "partial_rotary_factor", 0.5, "partial rotary"),
        ("llama", "mlp_bias", True, "MLP biases"),
        ("llama", "num_local_experts", 8, "mixture of experts"),
    ],
)
def test_function_key_refused(tmp_path: Path, model_type: str, key: str, value: Any, said: str) -> None:
    message = _refused(_folder(tmp_path, model_type, **{key: value}))
    assert f"{key} = {value!r}" in message and said in message, message


def test_llama_sliding_window_refused(tmp_path: Path) -> None:
    message = _refused(_folder(tmp_path, sliding_window=128))
    assert "sliding_window = 128 on a Llama" in message
    assert (
        open_source(_folder(tmp_path / "long", sliding_window=512)).num_layers == 1
    )  # >= context: no effect


@pytest.mark.parametrize(
    "rope, said",
    [
        (
            {
                "rope_type": "linear",
                "factor": 2.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 128,
            },
            "'original_max_position_embeddings' = 128 is not read for rope_type 'linear'",
        ),
        ({"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 4]}, "'mrope_section'"),
        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial rotary"),
    ],
)
def test_unread_rope_keys_refused(tmp_path: Path, rope: dict[str, Any], said: str) -> None:
    message = _refused(_folder(tmp_path, rope_parameters=rope, rope_theta=None, rope_scaling=None))
    assert said in message, message


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_plain_configs_open(tmp_path: Path, model_type: str) -> None:
    src = open_source(_folder(tmp_path, model_type))
    assert src.family.name == model_type
