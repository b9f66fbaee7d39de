"""Each supported family converts exactly at full rank: biases (Qwen2), static RoPE scalings (YaRN's
attention factor, linear, llama3), Mistral. Tiny random models: the bundled real model has no biases
and no RoPE scaling, so it cannot show these properties."""

from __future__ import annotations

import pytest
import torch
from tiny import convert
from transformers import AutoConfig, AutoModelForCausalLM

from mla_convert.sources.checkpoint import load_source_model, open_source

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
)


def _tiny(tmp_path, model_type: str, shard: str | None = None, **extra):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **TINY, **extra)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # non-zero biases so their handling is visible
    model.save_pretrained(str(tmp_path), max_shard_size=shard) if shard else model.save_pretrained(
        str(tmp_path)
    )
    src = open_source(tmp_path)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists() and len(set(src.weight_map.values())) > 1
    return src


CASES = {
    "qwen2-bias": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "llama-yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "llama-linear": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    "llama-bias": ("llama", {"attention_bias": True}),
    "llama-sharded": ("llama", {"shard": "100KB"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode,pairs", [("per-head", 8), ("shared", 16)])
def test_family_full_rank_is_exact(tmp_path, case, mode, pairs):
    model_type, extra = CASES[case]
    src = _tiny(tmp_path, model_type, **extra)
    source = load_source_model(src)
    ids = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    opts = dict(
        rope_mode=mode,
        rope_strategy="rotation" if mode == "shared" else "high",
        rope_pairs=pairs,
        kv_lora_rank=src.num_kv_heads * src.head_dim,
        cache_budget=None,
    )
    model = convert(src, ids[:2], **opts).model
    with torch.no_grad():
        ref = source(input_ids=ids[2:], use_cache=False).logits
        for path in ("absorbed", "naive"):
            model.set_attention_path(path)
            got = model(input_ids=ids[2:], use_cache=False).logits
            assert (got - ref).abs().max().item() < 1e-4, (case, mode, path)
    if "bias" in case:
        cfg = model.config
        assert cfg.o_bias  # the value bias moved past attention into o_proj
