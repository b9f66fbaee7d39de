"""The bfloat16 check (mla_convert/precision.py): it measures what it says and it can fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import copy_tokenizer, write_tiny_family

from mla_convert.precision import (
    SHORT_PROMPTS,
    TIE,
    PrecisionProbe,
    precision_gate,
    probe,
    probe_tokens,
    to_bfloat16,
)


@pytest.fixture(scope="module")
def tiny_qwen2_mla(tmp_path_factory) -> Path:
    """A tiny Qwen2 (random q/k/v biases) converted with ``factor``'s defaults."""
    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.convert.pipeline.job import run_factor
    from mla_convert.sources.checkpoint import open_source

    root = tmp_path_factory.mktemp("precision")
    src = write_tiny_family(root / "src", "qwen2", initializer_range=0.2)
    copy_tokenizer(src)
    run_factor(open_source(str(src)), root / "mla", ConvertOptions(calib_tokens=2048, eval_windows=2),
               sample_prompt=None)
    return root / "mla"


def _tokens(ckpt: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    gen = torch.Generator().manual_seed(0)
    return probe_tokens(tok, torch.randint(0, 49152, (1, 64), generator=gen))


def test_probe_tokens_cover_chat_code_and_prose():
    from tiny import bundled_model_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir()))
    tokens = probe_tokens(tok, torch.zeros(2, 16, dtype=torch.long))
    assert len(tokens["long"]) == 2 and len(tokens["short"]) == len(SHORT_PROMPTS)
    assert set(tokens["kinds"]) == {"chat", "code", "prose"}
    chat = tokens["short"][0]
    assert tok.convert_tokens_to_ids("<|im_start|>") in chat  # through SmolLM2's chat template
    assert all(2 <= len(s) for s in tokens["short"])


def test_to_bfloat16_keeps_rope_frequencies_float32(tiny_qwen2_mla):
    from mla_convert.mla.checkpoint import load_checkpoint
    from mla_convert.sources.checkpoint import load_source_model, open_source

    model = to_bfloat16(load_checkpoint(tiny_qwen2_mla))
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if n.endswith("rope_inv_freq"))
    src = to_bfloat16(load_source_model(open_source(str(tiny_qwen2_mla.parent / "src"))))
    bufs = [b for n, b in src.named_buffers() if n.endswith("inv_freq")]
    assert bufs and all(b.dtype == torch.float32 for b in bufs)


def _spoil_latent_bias(model, size: float) -> None:
    """An exact-in-float32 rewrite that bfloat16 cannot hold: a constant ``size`` added to every latent row (a
    NoPE key offset, constant per query, cancels in softmax; its value part is taken back through ``o_proj``'s
    bias). In float32 the function is the same; in bfloat16 the latent's own signal drowns in the offset."""
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            d_c = att.kv_lora_rank
            offset = torch.full((d_c,), size, dtype=torch.float32)
            att.kv_a_proj_with_mqa.bias[:d_c] += offset
            _, w_uv = att.up_weights()  # [G, d_V, d_c]
            heads = att.num_heads // att.num_kv_heads
            v_shift = torch.einsum("gvc,c->gv", w_uv, offset).repeat_interleave(heads, 0).reshape(-1)
            att.o_proj.bias -= att.o_proj.weight @ v_shift


def test_gate_passes_the_conversion_and_fails_a_bfloat16_fragile_copy(tiny_qwen2_mla):
    from mla_convert.mla.checkpoint import load_checkpoint
    from mla_convert.sources.checkpoint import load_source_model, open_source

    tokens = _tokens(tiny_qwen2_mla)
    src = load_source_model(open_source(str(tiny_qwen2_mla.parent / "src")))
    src.set_attn_implementation("sdpa")
    source = probe(src, tokens)
    good = precision_gate(probe(load_checkpoint(tiny_qwen2_mla), tokens), source)
    fragile_model = load_checkpoint(tiny_qwen2_mla)
    with torch.no_grad():
        reference = fragile_model(input_ids=torch.tensor([tokens["short"][2]])).logits
    _spoil_latent_bias(fragile_model, 2048.0)
    with torch.no_grad():
        same = fragile_model(input_ids=torch.tensor([tokens["short"][2]])).logits
    assert float((same - reference).abs().max()) < 1e-2 * float(reference.abs().max())  # the same in float32
    bad = precision_gate(probe(fragile_model, tokens), source)
    assert good["passed"], good
    assert not bad["passed"]
    assert bad["long"]["ratio"] > 5 * good["long"]["ratio"], (bad["long"], good["long"])


def test_first_token_rule_excuses_near_ties_only():
    base = dict(long=[0.01], short=[0.01], first_f32=[1, 1], first_bf16=[1, 1], first_deficit=[0.0, 0.0])
    source = PrecisionProbe(**base)
    tie = PrecisionProbe(**{**base, "first_bf16": [2, 1], "first_deficit": [TIE / 2, 0.0]})
    lost = PrecisionProbe(**{**base, "first_bf16": [1, 3], "first_deficit": [0.0, 11.5]})
    assert precision_gate(tie, source)["passed"]
    record = precision_gate(lost, source)
    assert not record["passed"] and record["first_token"]["lost"] == [1]
    both = PrecisionProbe(**{**base, "first_bf16": [1, 3], "first_deficit": [0.0, 2.0]})
    assert precision_gate(lost, both)["first_token"]["lost"] == []  # the source loses it too


def test_export_refuses_bfloat16_for_a_conversion_that_failed_the_check(tiny_qwen2_mla, tmp_path):
    import json
    import shutil

    from mla_convert.engines.deepseek_v3.write import ExportError
    from mla_convert.engines.llamacpp.gguf_file import export_gguf
    from mla_convert.precision import bfloat16_refusal

    assert bfloat16_refusal(tiny_qwen2_mla) is None  # its own report: passed
    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen2_mla, bad)
    report = json.loads((bad / "report.json").read_text())
    report["model"]["bfloat16"]["passed"] = False
    (bad / "report.json").write_text(json.dumps(report))
    why = bfloat16_refusal(bad)
    assert why is not None and "not bfloat16-safe" in why and "--dtype float32" in why
    with pytest.raises(ExportError, match="not bfloat16-safe"):
        export_gguf(bad, tmp_path / "bad.gguf", dtype="bfloat16")
