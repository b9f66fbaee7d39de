"""The export's parity at every size (issue 34): above ``PARITY_MAX_BYTES`` the export is checked layer by layer
(each stock ``DeepseekV3DecoderLayer`` holding the exported tensors against our layer holding the checkpoint's, on
our hidden state, then the final norm and ``lm_head``), never skipped.

Oracle: the whole-model check (stock ``DeepseekV3ForCausalLM`` loaded by ``from_pretrained``, our
``MLAForCausalLM`` loaded by ``load_checkpoint``), run independently of the layer-by-layer code: the logits of both
streams equal the whole models' logits. A deliberately corrupted exported layer is refused with the layer named.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny import convert, copy_tokenizer, write_tiny_llama
from typer.testing import CliRunner

import mla_convert  # noqa: F401
from mla_convert.engines.deepseek_v3 import write
from mla_convert.engines.deepseek_v3.layerwise import layerwise
from mla_convert.engines.deepseek_v3.mapping import ExportError
from mla_convert.sources.checkpoint import open_source

#: Layer-by-layer logits against the whole models' (float32): the same operations in the same order, so equal to
#: rounding of reordered sums (measured 0.0 on the tiny models).
SAME = 1e-5
#: Two tiny sources: the usual tiny Llama (head_dim 16, 2 KV heads) and a Llama-3-8B-shaped one in miniature
#: (8 KV heads of head_dim 128, 32 of its 64 frequencies kept in one shared rope head: qk_nope 128 + 2*32*6 = 512).
SOURCES = {
    "tiny": ({}, dict(cache_budget=24, rope_pairs=4)),
    "g8-hd128": (
        dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=128, intermediate_size=256),
        dict(rope_mode="shared", rope_strategy="high", rope_pairs=32, cache_budget=None, kv_lora_rank=128),
    ),
}


@pytest.fixture(scope="module", params=list(SOURCES))
def mla_ckpt(request, tmp_path_factory, calib_windows):
    """A converted checkpoint folder (float32, with the bundled tokenizer) of a tiny random Llama-shaped source."""
    overrides, options = SOURCES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = open_source(write_tiny_llama(root / "src", **overrides))
    model = convert(src, calib_windows[:2], **options).model
    model.save_pretrained(str(root / "mla"))
    copy_tokenizer(root / "mla")
    return root / "mla"


def _whole_logits(ckpt, export, ids):
    """Both whole models' logits ``[N, T, vocab]`` (ours, stock), each window alone, as :func:`write.parity` runs."""
    from transformers import AutoModelForCausalLM

    from mla_convert.mla.checkpoint import load_checkpoint

    ours = load_checkpoint(ckpt)
    stock = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    with torch.no_grad():
        return (torch.cat([ours(input_ids=w[None]).logits for w in ids]),
                torch.cat([stock(input_ids=w[None]).logits for w in ids]))


def _check_layer_by_layer(ckpt, out, manifest):
    """The layer-by-layer record of ``manifest`` and its logits equal the whole-model check's."""
    p = manifest["export"]["parity"]
    assert p["mode"] == "layer-by-layer" and p["tokens"] == write.PARITY_WINDOW * write.PARITY_WINDOWS
    assert "wikipedia evaluation split" in p["text"] and "not run" in p["greedy"]
    assert "greedy_tokens_equal" not in p
    assert p["stock_class"] == "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer"
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert [r["layer"] for r in p["layers"]] == list(range(layers))
    assert all(r["relative"] < 1e-5 for r in p["layers"])  # float32: exact to rounding, layer by layer
    whole = write.parity(ckpt, out, ckpt)  # the independent oracle: both whole models, from_pretrained
    assert whole["mode"] == "whole-model" and whole["greedy_tokens_equal"] == write.PARITY_GREEDY
    assert abs(p["max_abs_logit_diff"] - whole["max_abs_logit_diff"]) < SAME
    ids = write.parity_windows(ckpt)
    _, (lo, ls) = layerwise(ckpt, out, ids, torch.float32, manifest["export"]["residual_scale"], keep_logits=True)
    wo, ws = _whole_logits(ckpt, out, ids)
    assert (lo - wo).abs().max().item() < SAME  # our stream's logits are our whole model's
    assert (ls - ws).abs().max().item() < SAME  # the stock stream's logits are stock DeepseekV3ForCausalLM's
    assert p["argmax_equal"] == int((wo.argmax(-1) == ws.argmax(-1)).sum())
    assert ws.abs().max().item() > 0.1  # real logits, not zeros


def test_layer_by_layer_equals_the_whole_model_check(mla_ckpt, tmp_path):
    out = tmp_path / "ds3"
    manifest = write.export_checkpoint(mla_ckpt, out, dtype="float32", parity_mode="layer-by-layer")
    _check_layer_by_layer(mla_ckpt, out, manifest)
    card = (out / "README.md").read_text()
    assert "layer-by-layer" in card and "greedy generation not run" in card


def test_a_corrupted_exported_layer_is_named(mla_ckpt, tmp_path, monkeypatch):
    """o_proj of layer 1 off by 1 %: the logits move little (the tiny model's stay under PARITY_FAIL), the layer check
    refuses the export naming layer 1, and nothing is written."""
    real = write.export_attention

    def corrupt(plan, config, i, attn, gamma):
        out = real(plan, config, i, attn, gamma)
        if i == 1:
            out["o_proj.weight"] = out["o_proj.weight"] * 1.01
        return out

    monkeypatch.setattr(write, "export_attention", corrupt)
    dest = tmp_path / "bad"
    with pytest.raises(ExportError, match=r"^layer 1 of the export of .* differs from the checkpoint's") as exc:
        write.export_checkpoint(mla_ckpt, dest, dtype="float32", parity_mode="layer-by-layer")
    assert "\n" not in str(exc.value) and "nothing was written" in str(exc.value)
    assert not dest.exists()


def test_size_picks_layer_by_layer_above_the_threshold(mla_ckpt, tmp_path, monkeypatch):
    """``auto`` (the CLI's): whole-model at or under PARITY_MAX_BYTES, layer-by-layer above (threshold lowered, no
    big model built); the printed line says which ran."""
    from mla_convert.cli.commands import app

    monkeypatch.setattr(write, "PARITY_MAX_BYTES", 1024)
    out = tmp_path / "auto"
    res = CliRunner().invoke(app, ["export", str(mla_ckpt), str(out), "--dtype", "float32"])
    assert res.exit_code == 0, res.output + str(res.exception)
    p = json.loads((out / "mla_manifest.json").read_text())["export"]["parity"]
    assert p["mode"] == "layer-by-layer" and p["max_abs_logit_diff"] < 1e-4
    assert "layer by layer" in res.output and "no greedy tokens" in res.output
    with pytest.raises(ExportError, match="parity mode 'sample' is not one of auto, whole-model, layer-by-layer"):
        write.export_checkpoint(mla_ckpt, tmp_path / "x", parity_mode="sample")


def test_a_check_that_cannot_run_fails_with_its_reason(mla_ckpt, tmp_path, monkeypatch):
    import mla_convert.engines.deepseek_v3.layerwise as lw

    def broken(*_a, **_k):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\ndetails")

    monkeypatch.setattr(lw, "layerwise", broken)
    dest = tmp_path / "broken"
    with pytest.raises(ExportError, match=r"the layer-by-layer parity check of the export of .* could not run "
                                          r"\(mat1 and mat2 shapes cannot be multiplied\); nothing was written"):
        write.export_checkpoint(mla_ckpt, dest, dtype="float32", parity_mode="layer-by-layer")
    assert not dest.exists()


def test_reference_layer_by_layer_equals_the_whole_model_check(reference_ckpt, tmp_path):
    """The real SmolLM2 reference conversion (30 layers, real weights): layer by layer = whole model."""
    out = tmp_path / "ref-ds3"
    manifest = write.export_checkpoint(reference_ckpt, out, dtype="float32", parity_mode="layer-by-layer")
    _check_layer_by_layer(reference_ckpt, out, manifest)


@pytest.mark.parametrize("own, corrupt, refused", [
    (40.0, 1.0, None),  # chaotic checkpoint, exact layers: written, the layers recorded
    (40.0, 1.2, "^layer 1 of the export"),  # chaotic checkpoint, a wrong layer: the layer check names it
    (0.1, 1.0, r"differs from it by max \|dlogit\| 30"),  # a stable checkpoint: the logits limit as ever
])
def test_a_chaotic_checkpoint_is_decided_layer_by_layer(mla_ckpt, tmp_path, monkeypatch, own, corrupt, refused):
    """A 16-bit whole-model check over PARITY_FAIL where the checkpoint's own rounding moves the logits by more too (a
    conversion with spurious attention sinks: 47 logits from bfloat16 weights alone, measured) is decided by the
    layer-by-layer check; the logits are then allowed PARITY_FLOOR_FACTOR x the own rounding. The whole-model figures
    are faked here (a tiny model is not chaotic); the layer check and the mapping are real."""
    real_parity, real_attention = write.parity, write.export_attention

    def chaotic(*args, **kwargs):
        record = real_parity(*args, **kwargs)
        return {**record, "max_abs_logit_diff": 30.0, "own_rounding_max_abs_logit_diff": own}

    def maybe_corrupt(plan, config, i, attn, gamma):
        out = real_attention(plan, config, i, attn, gamma)
        if i == 1:
            out["o_proj.weight"] = out["o_proj.weight"] * corrupt
        return out

    monkeypatch.setattr(write, "parity", chaotic)
    monkeypatch.setattr(write, "export_attention", maybe_corrupt)
    said: list[str] = []
    dest = tmp_path / "bf16"
    if refused:
        with pytest.raises(ExportError, match=refused):
            write.export_checkpoint(mla_ckpt, dest, dtype="bfloat16", parity_mode="whole-model", note=said.append)
        assert not dest.exists()
        return
    manifest = write.export_checkpoint(mla_ckpt, dest, dtype="bfloat16", parity_mode="whole-model", note=said.append)
    p = manifest["export"]["parity"]
    assert p["mode"] == "whole-model" and len(p["layers"]) == 2 and all(r["relative"] < 2e-2 for r in p["layers"])
    assert any("measuring parity layer by layer" in s for s in said)
    assert any(s.startswith("warning: rounding") and "moves its logits by up to 40" in s for s in said)
    assert "largest difference at layer" in (dest / "README.md").read_text()
