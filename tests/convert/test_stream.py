"""The streamed ``factor`` (layer by layer, bounded memory) against the in-memory conversion, the lossless
contract, dtypes, shards and ``--resume``.

A tiny random Llama shows the properties that need many runs (resume at every stage, shards, dtypes); the
real model's streamed conversion is the reference conversion (tests/convert/test_reference.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tiny import copy_tokenizer, write_tiny_llama

from mla_convert.convert.build import build_mla
from mla_convert.convert.calibration import collect_stats
from mla_convert.convert.job import prepare_text, run_factor
from mla_convert.convert.options import ConvertOptions
from mla_convert.convert.workdir import ResumeError, work_dir
from mla_convert.mla.checkpoint import load_checkpoint
from mla_convert.sources.checkpoint import load_source_model, open_source
from mla_convert.metrics import evaluate

SMALL = {"window": 32, "calib_windows": 4, "eval_windows": 2, "text": "news"}
LOSSY = {**SMALL, "rope_pairs": 4, "cache_budget": 28.0}


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "src"
    write_tiny_llama(folder, num_hidden_layers=3)
    copy_tokenizer(folder)
    return folder


def _convert(src: Path, out: Path, **kw: Any) -> dict[str, Any]:
    opts = {k: v for k, v in kw.items() if k in ConvertOptions.model_fields}
    run = {k: v for k, v in kw.items() if k not in ConvertOptions.model_fields}
    return run_factor(open_source(src), out, ConvertOptions(**opts), sample_prompt=None, **run)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    return tensors


def _digest(out: Path) -> str:
    return hashlib.sha256(b"".join(f.read_bytes() for f in sorted(out.glob("*.safetensors")))).hexdigest()


def test_streamed_equals_in_memory(tiny_src: Path, tmp_path: Path) -> None:
    """Same options, same text: the streamed checkpoint's tensors and the report's figures are the in-memory
    conversion's (cache budget spread over layers, o_proj refit with its held-out decision)."""
    report = _convert(tiny_src, tmp_path / "out", **LOSSY)
    src = open_source(tiny_src)
    options = ConvertOptions(**LOSSY)
    from transformers import AutoTokenizer

    text = prepare_text(AutoTokenizer.from_pretrained(str(src.path)), options)
    source_model = load_source_model(src)
    stats, _ = collect_stats(source_model, src, text.calibration, text.held_out, keep_calibration=True)
    model, config, _, _ = build_mla(src, source_model, stats, options, check_ids=text.held_out)
    assert report["layers"][0]["rank"] == config.kv_lora_rank[0]
    written = _weights(tmp_path / "out")
    for name, ref in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        torch.testing.assert_close(written[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    ev = evaluate(model, text.evaluation, source_model)
    got = report["model"]["eval"]
    assert got["perplexity"] == pytest.approx(ev.perplexity, rel=1e-5)
    assert got["reference_perplexity"] == pytest.approx(ev.reference_perplexity, rel=1e-5)
    assert got["kl"] == pytest.approx(ev.kl, rel=1e-3, abs=1e-7)
    assert got["top1"] == pytest.approx(ev.top1)
    refit = json.loads((tmp_path / "out" / "config.json").read_text())["source"]["o_proj_refit"]
    assert refit["kept"] == config.source["o_proj_refit"]["kept"]


def test_lossless_stream_is_the_same_function(tiny_src: Path, tmp_path: Path) -> None:
    """All RoPE pairs and full rank, float32: the written checkpoint's logits are the source's."""
    report = _convert(tiny_src, tmp_path / "out", **SMALL, rope_mode="per-head", rope_pairs=8, kv_lora_rank=32, dtype="float32")
    ids = torch.randint(0, 49152, (2, 40), generator=torch.Generator().manual_seed(0))
    src_model = load_source_model(open_source(tiny_src))
    mla = load_checkpoint(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(mla(input_ids=ids).logits, src_model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert report["model"]["eval"]["kl"] < 1e-9


def test_bfloat16_output_and_shards(tiny_src: Path, tmp_path: Path) -> None:
    """``--dtype bfloat16``: every weight is bf16 except the exact RoPE frequencies (float32); a small
    ``--max-shard-size`` gives several shards and an index that loads."""
    out = tmp_path / "out"
    report = _convert(tiny_src, out, **LOSSY, dtype="bfloat16", max_shard_size="200KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {f.name for f in shards}
    for name, t in _weights(out).items():
        assert t.dtype == (torch.float32 if name.endswith("rope_inv_freq") else torch.bfloat16), name
    assert report["model"]["dtype"] == "bfloat16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = load_checkpoint(out)
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


class Stop(Exception):
    pass


@pytest.mark.parametrize("stage", ["calibrate", "convert", "evaluate"])
def test_resume_gives_the_uninterrupted_result(tiny_src: Path, tmp_path: Path, stage: str) -> None:
    """Stopped after the first layer of either pass, ``--resume`` finishes with byte-identical weights."""
    _convert(tiny_src, tmp_path / "whole", **LOSSY)
    out = tmp_path / "out"
    seen = {"n": 0}

    def stop(name: str, n: int, total: int) -> None:
        if name == stage:
            seen["n"] += n
            if seen["n"] == 1:
                raise Stop

    with pytest.raises(Stop):
        _convert(tiny_src, out, **LOSSY, progress=stop)
    assert not out.exists() and (work_dir(out) / "progress.json").is_file()
    with pytest.raises(ResumeError, match="--resume"):
        _convert(tiny_src, out, **LOSSY)  # a fresh start would drop the stopped job
    with pytest.raises(ResumeError, match="--rope-pairs 4 -> 3"):
        _convert(tiny_src, out, **{**LOSSY, "rope_pairs": 3}, resume=True)
    report = _convert(tiny_src, out, **LOSSY, resume=True)
    assert report["run"]["resumed_after"]["layer"] == 0
    assert _digest(out) == _digest(tmp_path / "whole")
    assert not work_dir(out).exists()
    with pytest.raises(ResumeError, match="nothing to resume"):
        _convert(tiny_src, tmp_path / "other", **LOSSY, resume=True)


def test_overwrite_drops_a_stopped_job(tiny_src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"

    def stop(name: str, n: int, total: int) -> None:
        if name == "convert":
            raise Stop

    with pytest.raises(Stop):
        _convert(tiny_src, out, **LOSSY, progress=stop)
    _convert(tiny_src, out, **LOSSY, overwrite=True)
    assert (out / "model.safetensors").is_file() and not work_dir(out).exists()
    shutil.rmtree(out)
