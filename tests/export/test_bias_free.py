"""The attention biases a bias-free graph (llama.cpp's deepseek2) cannot hold (issue 50, Required 1): what each
part of :data:`~mla_convert.engines.bias_free.BIAS_PARTS` is, checked against stock transformers' Qwen2.

Oracle: on an exact conversion (every RoPE pair on the shared rope head, full rank) of a tiny Qwen2 with random q/k/v
biases, the conversion without a part computes what the *source* computes without its own bias: the query part is
the source's ``q_proj.bias``, the rope key's is ``k_proj.bias`` (every key row is a rope row here; the NoPE part of a
key bias drops out of the softmax), the output part is ``v_proj.bias`` (it passes through attention into ``o_proj``).
The source is run by transformers, not by our code. That each drop moves the logits shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch
from tiny import convert, write_tiny_family

import mla_convert  # noqa: F401
from mla_convert.engines.bias_free import BIAS_PARTS, attention_bias_parts, drop_attention_biases
from mla_convert.sources.checkpoint import load_source_model, open_source

#: The source bias whose removal each part's removal equals (module docstring).
SOURCE_BIAS = {"query": ["q_proj"], "rope_key": ["k_proj"], "output": ["v_proj"]}
TOL = 2e-4  # float32 logits of two computations (tests/convert/test_exact.py's EXACT_TOL)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def exact_qwen2(tmp_path_factory):
    """A tiny Qwen2 (4 heads, 2 KV heads, head_dim 16, random biases) and its exact conversion: all 2 x 8 pairs on
    the shared rope head (rotation basis), the latent the 2 x 16 value rows."""
    src = open_source(write_tiny_family(tmp_path_factory.mktemp("qwen2"), "qwen2"))
    gen = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 49152, (4, 64), generator=gen)
    conv = convert(src, calib, rope_mode="shared", rope_strategy="rotation", rope_pairs=16, cache_budget=None,
                   kv_lora_rank=32, refit_o_proj="none")
    ids = torch.randint(0, 49152, (2, 48), generator=gen)
    return src, conv.model.eval(), ids


@pytest.mark.parametrize("part", [*BIAS_PARTS, "all"])
def test_each_dropped_part_is_the_source_bias_dropped(exact_qwen2, part):
    src, model, ids = exact_qwen2
    assert attention_bias_parts(model.config) == ["query", "rope_key", "output"]
    source = load_source_model(src).eval()
    assert (_logits(model, ids) - _logits(source, ids)).abs().max() < TOL  # the conversion is exact
    parts = list(BIAS_PARTS) if part == "all" else [part]
    before = _logits(source, ids)
    with torch.no_grad():
        for layer in source.model.layers:
            for proj in (p for x in parts for p in SOURCE_BIAS[x]):
                getattr(layer.self_attn, proj).bias.zero_()
    expected = _logits(source, ids)
    assert (expected - before).abs().max() > 20 * TOL  # the bias matters: a drop that did nothing would fail below
    kept = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(".bias")}
    try:
        assert drop_attention_biases(model, parts) == parts
        assert (_logits(model, ids) - expected).abs().max() < TOL
    finally:
        params = dict(model.named_parameters())
        for n, t in kept.items():
            params[n].data.copy_(t)


def test_an_unknown_part_is_refused(exact_qwen2):
    with pytest.raises(ValueError, match="the parts are query, rope_key, output"):
        drop_attention_biases(exact_qwen2[1], ["key_nope"])
