"""The contract: with every RoPE pair kept and full rank, the converted model is the same function."""

from __future__ import annotations

import pytest
import torch
from tiny import convert

import mla_convert  # noqa: F401
from mla_convert.sources.checkpoint import load_source_model, open_source

#: float32 logits, 30 layers (the GQA test; the others run SmolLM2's first 6): the accumulated rounding of two float32
#: computations (1.1e-4 on an AMX Xeon). README.md, docs/math.md and docs/validation.md state this bound.
EXACT_TOL = 2e-4


def _logits(model, ids, path=None):
    if path:
        model.set_attention_path(path)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _exact_options(**kw):
    base = dict(
        rope_mode="per-head", rope_strategy="high", rope_pairs=32, cache_budget=None, kv_lora_rank=192
    )
    base.update(kw)
    return base


@pytest.fixture(scope="module")
def exact(smol_st, smol_windows):
    """Every RoPE pair kept and full rank (192 = the 3 KV heads' 64 value rows; no NoPE key is left)."""
    return convert(smol_st, *smol_windows, **_exact_options())


@pytest.mark.parametrize("path", ["absorbed", "naive"])
def test_gqa_full_rank_all_pairs_is_exact(exact, smol_model, eval_ids, path, tmp_path):
    model, records = exact.model, exact.layers
    ref = _logits(smol_model, eval_ids)
    got = _logits(model, eval_ids, path)
    assert (got - ref).abs().max().item() < EXACT_TOL
    assert all(r.rel_error < 1e-6 for r in records)
    # Softmax scale is the source's 1/sqrt(head_dim), not 1/sqrt(latent width).
    assert model.config.softmax_scale == pytest.approx(64**-0.5)
    if path == "absorbed":
        model.save_pretrained(str(tmp_path))
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
        assert type(loaded).__name__ == "MLAForCausalLM"
        assert (_logits(loaded, eval_ids) - ref).abs().max().item() < EXACT_TOL


def test_shared_rope_every_component_is_exact(smol_head, smol_windows, eval_ids):
    """RoRoPE with a complex PCA basis is a change of basis: keeping every component is exact."""
    smol_st, smol_model = smol_head  # SmolLM2's first layers (the whole model: the GQA test above)
    opts = _exact_options(rope_mode="shared", rope_strategy="rotation", rope_pairs=96)
    conv = convert(smol_st, *smol_windows, **opts)
    model, cfg = conv.model, conv.config
    assert cfg.num_rope_heads == 1 and cfg.qk_rope_head_dim == 192
    assert (_logits(model, eval_ids) - _logits(smol_model, eval_ids)).abs().max().item() < EXACT_TOL


def test_mha_expansion_full_rank_is_exact(mha_folder, smol_head, calib_windows, eval_ids):
    smol_model = smol_head[1]  # the expansion is of SmolLM2's first layers
    src = open_source(mha_folder)
    assert src.num_kv_heads == 9
    mha = load_source_model(src)
    ref = _logits(smol_model, eval_ids)
    assert (_logits(mha, eval_ids) - ref).abs().max().item() < EXACT_TOL  # the expansion itself is exact
    model = convert(src, calib_windows[:1], **_exact_options(kv_lora_rank=576)).model
    for path in ("absorbed", "naive"):
        assert (_logits(model, eval_ids, path) - ref).abs().max().item() < EXACT_TOL


# That these tests can fail: tests/convert/test_oracle.py checks that partial RoPE at full rank moves the
# real model's logits by > 0.1 (its oracle is not the source) while the conversion equals that oracle.
