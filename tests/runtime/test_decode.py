"""The latent-cache path: absorbed == naive, cached greedy == recomputation, cache size as promised."""

from __future__ import annotations

import pytest
import torch
from tiny import convert

from mla_convert.metrics import measure_cache
from mla_convert.mla.modeling import latent_cache_bytes
from mla_convert.runtime.decode import greedy, greedy_recompute


@pytest.fixture(scope="module")
def lossy(smol_head, smol_windows):
    """A real lossy conversion at 31.25 % cache (120 values per token per layer) of SmolLM2's first layers."""
    conv = convert(
        smol_head[0], *smol_windows, rope_mode="shared", rope_strategy="high", rope_pairs=32, cache_budget=120
    )
    return conv.model, conv.config, conv.layers


def test_absorbed_matches_naive(lossy, eval_ids):
    model, _, _ = lossy
    with torch.no_grad():
        model.set_attention_path("naive")
        naive = model(input_ids=eval_ids, use_cache=False).logits.double()
        model.set_attention_path("absorbed")
        absorbed = model(input_ids=eval_ids, use_cache=False).logits.double()
    rel = ((absorbed - naive).norm() / naive.norm()).item()
    assert rel < 1e-5, rel


def test_greedy_through_latent_cache_equals_recomputation(lossy, eval_ids):
    model, _, _ = lossy
    model.set_attention_path("absorbed")
    prompt = eval_ids[:, :16]
    cached = greedy(model, prompt, 32, ignore_eos=True)
    recomputed = greedy_recompute(model, prompt, 32, ignore_eos=True)
    assert cached.shape == (1, 48)
    assert torch.equal(cached, recomputed)


def test_measured_cache_is_latent_plus_rope(lossy, smol, smol_head, eval_ids):
    smol_model = smol_head[1]
    model, cfg, records = lossy
    model.set_attention_path("absorbed")
    got = measure_cache(model, eval_ids[:, :64])
    expected = sum(r.cache_width for r in records) / len(records)
    assert got["values_per_token_per_layer"] == pytest.approx(expected)
    assert expected == pytest.approx(120, abs=0.5)
    assert got["bytes_per_token_per_layer"] == pytest.approx(4 * expected)
    src = measure_cache(smol_model, eval_ids[:, :64])
    assert src["values_per_token_per_layer"] == smol.kv_cache_width == 384
    # Each layer holds exactly [c_kv | k_rope]: d_c values in the key slot, rope width in the value slot.
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=eval_ids[:, :10], past_key_values=cache, use_cache=True)
    for layer, rank in zip(cache.layers, cfg.kv_lora_rank, strict=True):
        assert layer.keys.shape == (1, 1, 10, rank)
        assert layer.values.shape == (1, 1, 10, cfg.num_rope_heads * cfg.qk_rope_head_dim)
    assert latent_cache_bytes(cache)[1] == 10 * sum(cfg.cache_width)


def test_conversion_is_deterministic(tmp_path):
    """Two conversions of the same source on the same windows give the same tensors bit for bit (the reference
    pin, tests/convert/test_reference.py, holds the real model's to its pinned canonical id)."""
    from tiny import copy_tokenizer, write_tiny_llama

    from mla_convert.sources.checkpoint import open_source

    folder = write_tiny_llama(tmp_path / "src", num_hidden_layers=3)
    copy_tokenizer(folder)
    src = open_source(folder)
    ids = torch.randint(0, 49152, (5, 48), generator=torch.Generator().manual_seed(0))
    opts = dict(rope_mode="per-head", rope_strategy="2-norm", rope_pairs=4, objective="output", cache_budget=28)
    a = convert(src, ids[:4], ids[4:], **opts).model.state_dict()
    b = convert(src, ids[:4], ids[4:], **opts).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_o_proj_refit_lowers_held_out_attention_error(reference_ckpt):
    """The refit is fitted on calibration tokens and must help on tokens it never saw: the reference conversion's
    held-out attention-output error per layer with the kept refit against the assembled ``o_proj``."""
    import json

    report = json.loads((reference_ckpt / "report.json").read_text())
    assert report["model"]["o_proj_refit"]["kept"]
    layers = report["layers"]
    fit = sum(r["attn_rel_error"] for r in layers) / len(layers)
    plain = sum(r["attn_rel_error_no_refit"] for r in layers) / len(layers)
    assert fit < 0.9 * plain, (fit, plain)
