"""The weights ledger (issue 51 item 1, ``mla_convert/convert/estimate/weights.py``).

Oracles, none of them the ledger's own arithmetic: the parameters of the loaded models (our converted model and the
source, ``sum(p.numel())``); the tensors the exporters themselves produce (``export_state_dict`` for each DeepSeek-V3
``--target``; ``gguf_plan`` / ``_tensor_plan`` / ``_ggml_type``, the list ``write_gguf`` writes tensor by tensor, for
GGUF); the widths vLLM's plugin allocates, written out by hand from engines/vllm/model.py; a real conversion's config
for the estimate before conversion; and a break-even worked by hand.

Sources: tiny random Llama (GQA, tied), Qwen2 (q/k/v biases) and Llama-3-8B's KV shape (8 KV heads, head_dim 128;
untied, with a NoPE-width reduction), converted through the library (the passes ``factor`` runs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import convert, write_tiny_family, write_tiny_llama

from mla_convert.convert.estimate.weights import (
    BYTES,
    Place,
    WeightsLedger,
    break_even,
    estimate_ledger,
    estimated_config,
    weights_ledger,
)
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.options.resolve import resolve_options
from mla_convert.engines.deepseek_v3.mapping import TARGETS, export_state_dict
from mla_convert.engines.llamacpp.gguf_file import _ggml_type, _tensor_plan, gguf_plan
from mla_convert.errors import ExportError
from mla_convert.sources.checkpoint import load_source_model, open_source

FAST: dict[str, Any] = {"refit_o_proj": "none", "calib_precision": "float32"}
#: name -> (source writer, conversion options): per-layer ranks with the default strategy; biases at a fixed rank;
#: Llama-3-8B's KV shape (8 KV heads of 128; 16 query heads, one layer: the conversion's per-frequency work grows with
#: both), untied, at a fixed rank with a NoPE-width reduction (kv_b_proj per query head).
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any]]] = {
    "llama": (lambda f: write_tiny_llama(f), {"cache_budget": 24, "rope_pairs": 4}),
    "qwen2": (lambda f: write_tiny_family(f, "qwen2"), {"kv_lora_rank": 12, "rope_pairs": 3, "rope_strategy": "high"}),
    "g8": (
        lambda f: write_tiny_llama(f, hidden_size=128, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                   intermediate_size=256, num_hidden_layers=1, tie_word_embeddings=False),
        {"kv_lora_rank": 96, "rope_pairs": 8, "rope_strategy": "high", "qk_nope_head_dim": 64},
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, calib_windows):
    """``(name, source, options as given, the conversion)``."""
    write, opts = CASES[request.param]
    src = open_source(write(tmp_path_factory.mktemp(request.param)))
    return request.param, src, opts, convert(src, calib_windows[:2], **opts, **FAST)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_mla_and_source_rows_are_the_loaded_models(case):
    """Per layer, the ``mla`` row is the parameters of the converted model's attention modules and the source row the
    source's; whole models: every parameter (a tied head once); bytes at float32 are 4 per parameter; the caches are
    the config's ``cache_width`` and ``2 G d`` per layer."""
    _, src, _, conv = case
    ledger = weights_ledger(conv.config, src, "float32")
    mla, source = ledger.place("mla"), ledger.source
    model = conv.model
    assert list(mla.attention_params) == [_numel(layer.self_attn) for layer in model.model.layers]
    assert mla.model_params == _numel(model) and mla.model_bytes == 4 * mla.model_params
    assert mla.cache_values == sum(conv.config.cache_width)
    src_model = load_source_model(src)
    assert list(source.attention_params) == [_numel(layer.self_attn) for layer in src_model.model.layers]
    assert source.model_params == _numel(src_model)
    assert source.cache_values == 2 * src.num_kv_heads * src.head_dim * src.num_layers
    assert mla.refused is None


def test_config_json_and_source_config_give_the_same_ledger(case, tmp_path):
    """``weights_ledger`` of the written ``config.json`` dict and of the source's ``config.json`` dict equals the one of
    the objects; ``as_dict`` is JSON."""
    _, src, _, conv = case
    conv.config.save_pretrained(str(tmp_path))
    as_json = json.loads((tmp_path / "config.json").read_text())
    source_json = json.loads((src.path / "config.json").read_text())
    assert weights_ledger(as_json, source_json) == weights_ledger(conv.config, src)
    json.dumps(weights_ledger(conv.config, src).as_dict())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepseek_v3_rows_are_the_exported_tensors(case, dtype):
    """Every ``--target``: the row's attention per layer and whole model are the element counts of the tensors
    ``export_state_dict`` writes (``lm_head`` included), its cache the plan's; where ``plan_export`` refuses, the row
    says so (and counts what its rules would store)."""
    name, _, _, conv = case
    ledger = weights_ledger(conv.config, case[1], dtype)
    for target in TARGETS:
        row = ledger.place(f"deepseek-v3:{target}")
        try:
            plan, state = export_state_dict(conv.model, getattr(torch, dtype), target)
        except ExportError:
            assert name == "qwen2" and row.refused and "biases" in row.refused
            continue
        assert row.refused is None
        per_layer = [sum(t.numel() for k, t in state.items() if k.startswith(f"model.layers.{i}.self_attn."))
                     for i in range(conv.config.num_hidden_layers)]
        assert list(row.attention_params) == per_layer
        assert row.model_params == sum(t.numel() for t in state.values())
        assert row.model_bytes == sum(t.numel() * t.element_size() for t in state.values())
        assert row.cache_values == plan.cache_values_per_token["deepseek_v3"] * conv.config.num_hidden_layers


class _Shapes:
    """The tensor reader ``_tensor_plan`` takes (names and shapes), over an in-memory state dict."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def names(self) -> list[str]:
        return list(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gguf_row_is_the_files_tensor_list(case, dtype):
    """The GGUF row: the tensors ``write_gguf`` writes (``_tensor_plan``: ``attn_k_b`` / ``attn_v_b`` split, the latent
    padded to 32, ``output.weight`` always) with the ggml types it writes them in (``_ggml_type``: float32 1-D tensors,
    ``attn_kv_a_mqa`` float32 in a float16 file); Qwen2's biases are refused, and counted as the rules would."""
    name, src, _, conv = case
    row = weights_ledger(conv.config, src, dtype).place("gguf")
    if name == "qwen2":
        with pytest.raises(ExportError):
            gguf_plan(conv.config, dtype)
        assert row.refused and "biases" in row.refused
        return
    plan = gguf_plan(conv.config, dtype)
    order = _tensor_plan(plan, conv.config, _Shapes(dict(conv.model.state_dict())))
    size = {g: math.prod(shape) for g, _, shape in order}
    nbytes = {g: size[g] * (4 if _ggml_type(g, shape, dtype) == 0 else BYTES[dtype]) for g, _, shape in order}
    attn = [g for g, ds_name, _ in order if ".self_attn." in ds_name]
    per_layer = [sum(size[g] for g in attn if g.startswith(f"blk.{i}.")) for i in range(conv.config.num_hidden_layers)]
    assert list(row.attention_params) == per_layer and row.refused is None
    assert row.model_params == sum(size.values()) and row.model_bytes == sum(nbytes.values())
    d_r = 2 * len(plan.rope.inv_freq)
    assert row.cache_values == (plan.kv_lora_rank + d_r) * conv.config.num_hidden_layers


def test_vllm_plugin_rows_are_the_served_widths(case):
    """The plugin's tensors (engines/vllm/model.py ``MLAPluginAttention``, written out here): ``q_proj [H (n + 64),
    D]``, ``kv_a_proj_with_mqa [512 + 64, D]``, ``kv_b_proj [H (n + v), 512]``, ``o_proj [D, H v]`` and the
    checkpoint's biases, with (n, v) the backend's head widths: vLLM GPU's smallest holding the checkpoint's, CPU
    128 / 128; caches 576 a layer; a tied head stays tied."""
    _, src, _, conv = case
    c = conv.config
    ledger = weights_ledger(c, src, "float32")
    d, h, n_layers = c.hidden_size, c.num_attention_heads, c.num_hidden_layers
    for target in ("vllm", "vllm-cpu"):
        n, v = (64, 128) if target == "vllm" and c.qk_nope_head_dim <= 64 else (128, 128)
        bias = c.q_bias * h * (n + 64) + c.kv_a_bias * 576 + c.o_bias * d
        layer = h * (n + 64) * d + 576 * d + h * (n + v) * 512 + d * h * v + bias
        row = ledger.place(f"vllm-plugin:{target}")
        assert list(row.attention_params) == [layer] * n_layers and row.refused is None
        mla = ledger.place("mla")
        assert row.model_params - sum(row.attention_params) == mla.model_params - sum(mla.attention_params)
        assert row.cache_values == 576 * n_layers


def test_estimate_before_conversion_is_the_conversion(case):
    """The estimate from the source and the resolved options: at a fixed rank (and the ``high`` strategy's kept
    pairs) the config's widths, biases and rope frequencies are the conversion's and every row equals the exact
    ledger's; with per-layer ranks, the ``mla`` row's totals and cache (the ranks' sum is the budget's)."""
    name, src, opts, conv = case
    options = resolve_options(ConvertOptions(dtype="float32", **opts, **FAST), src).options
    est, real = estimated_config(src, options), conv.config
    fields = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_rope_heads", "num_key_value_heads",
              "q_bias", "kv_a_bias", "o_bias", "latent_norm", "tie_word_embeddings", "intermediate_size", "vocab_size")
    assert {k: getattr(est, k) for k in fields} == {k: getattr(real, k) for k in fields}
    assert sum(est.kv_lora_rank) == sum(real.kv_lora_rank)
    estimate, exact = estimate_ledger(src, options, "bfloat16"), weights_ledger(real, src, "bfloat16")
    assert estimate.estimate and exact.estimate is None
    if "kv_lora_rank" in opts:
        assert est.kv_lora_rank == real.kv_lora_rank
        assert torch.allclose(torch.tensor(est.rope_inv_freq), torch.tensor(real.rope_inv_freq))
        assert estimate.places == exact.places and estimate.source == exact.source
    else:
        e, x = estimate.place("mla"), exact.place("mla")
        assert (sum(e.attention_params), e.model_params, e.model_bytes, e.cache_values) == (
            sum(x.attention_params), x.model_params, x.model_bytes, x.cache_values)
    if name == "g8":  # kv_b_proj per query head: H (d_N + d_V) x rank, the reduction's width
        assert exact.place("mla").attention_params[0] == (
            16 * (64 + 16) * 128 + (96 + 16) * 128 + 96 * 16 * (64 + 128) + 128 * 16 * 128)


def test_break_even_by_hand():
    """Weights 100 against 40 bytes, caches 2 against 5 bytes a token: equal at 20 tokens, less above; 101 bytes: more
    at 20 (141 against 140), less at 21; 0 when the weights are not larger; None when the cache is not smaller."""
    assert break_even(100, 2, 40, 5) == 20
    assert break_even(101, 2, 40, 5) == 20  # 61 / 3 = 20.3
    assert break_even(30, 2, 40, 5) == 0 and break_even(40, 2, 40, 5) == 0
    assert break_even(30, 5, 40, 5) is None and break_even(100, 6, 40, 5) is None
    for w, c, sw, sc in [(100, 2, 40, 5), (101, 2, 40, 5), (10**9, 3, 10, 7)]:  # more or equal at n, less above
        n = break_even(w, c, sw, sc)
        assert n is not None and w + n * c >= sw + n * sc and w + (n + 1) * c < sw + (n + 1) * sc


def test_ledger_lines_and_record():
    """A ledger of hand-made rows: the break-even of the whole models (bfloat16 caches: 2 bytes a value), its lines
    and its JSON record."""
    source = Place("source", (10, 10), (20, 20), 1000, 2000, 400)
    mla = Place("mla", (30, 30), (60, 60), 1040, 2080, 100)
    gguf = Place("gguf", (30, 30), (60, 60), 1040, 2080, 500, "attention biases")
    ledger = WeightsLedger("bfloat16", source, (mla, gguf))
    assert ledger.break_even("mla") == 0  # 80 more bytes of weights, 600 bytes a token saved: less from the first
    assert ledger.break_even("gguf") is None
    lines = ledger.lines()
    assert lines[0].startswith("attention weights: 60 params (3.00x the source's 20); whole model 1.0K (1.04x")
    assert "from the first cached token" in lines[1] and "25.0% of the source's 400" in lines[1]
    assert "never" in lines[2] and "refused: attention biases" in lines[2]
    record = json.loads(json.dumps(ledger.as_dict()))
    assert record["places"]["mla"]["attention_params"] == [30, 30] and record["places"]["mla"]["attention_ratio"] == 3
    assert record["places"]["gguf"]["break_even_tokens"] is None and record["bytes_per_value"] == 2
