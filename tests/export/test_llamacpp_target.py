"""``--target llama.cpp`` (issue 35 item 4): the cache size asked is llama.cpp's *served* row (one kv_lora_rank for
every layer plus the rope head, K only), spent as one rank and the fastest rope pairs, with the rank a multiple of
32 (llama.cpp's q8_0 cache block) when the row allows; what llama.cpp cannot run exactly is refused before any work.

Oracles: the row is ``kv_lora_rank + 2 x rope pairs`` by llama.cpp's own keys (``attention.kv_lora_rank`` and
``rope.dimension_count`` read back from the GGUF with the gguf package's reader; ``key_length`` = their sum), the
source's width ``2 x KV heads x head_dim`` from its config, and in ``test_target_gguf_in_llamacpp`` the KV cache
llama.cpp itself allocated (its load log, tests/export/test_llamacpp.py's check).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import copy_tokenizer, write_tiny_family, write_tiny_llama
from typer.testing import CliRunner

from mla_convert.cli.commands import app
from mla_convert.convert.options.options import ConvertOptions, OptionsError
from mla_convert.convert.options.resolve import resolve_options
from mla_convert.engines.llamacpp import gguf_vocab
from mla_convert.engines.llamacpp.shape import Q8_0_BLOCK, split_row
from mla_convert.sources.checkpoint import open_source

SMALL = ["--calib-tokens", "128", "--window", "64", "--eval-windows", "1"]
#: The shape users convert: 8 KV heads of head_dim 128 (source cache 2 x 8 x 128 = 2048 values per token per layer).
WIDE = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 128,
}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


@pytest.fixture(scope="module")
def wide_source(tmp_path_factory) -> Path:
    src = write_tiny_llama(tmp_path_factory.mktemp("wide") / "src", **WIDE)
    copy_tokenizer(src)
    return src


def test_split_row_fills_the_row_with_a_rank_of_32s():
    """Every split spends exactly the row; in a row of whole 32-blocks the rank moves to the nearest multiple of 32
    whose remainder is whole pairs the rope head holds, else it stays as the share gives it (a rope head off the
    blocks cannot be padded, so moving the rank would buy no q8_0 cache)."""
    assert split_row(120, 0.2, 32, 320) == (96, 12)
    assert split_row(120, 0.4, 32, 320) == (72, 24)  # 120 is not whole blocks: the measured share as it is
    assert split_row(128, 0.4, 32, 320) == (64, 32)  # 26 pairs + 76 -> 64 + 32 pairs
    assert split_row(640, 0.2, 64, 512) == (512, 64)
    assert split_row(72, 0.4, 32, 320) == (44, 14)  # 72 is not whole blocks
    assert split_row(121, 0.4, 32, 320) == (73, 24)  # an odd row: no rank of 32s leaves whole pairs
    assert split_row(64, 0.4, 32, 320) == (32, 16)
    assert split_row(2000, 0.4, 64, 512) == (512, 64)  # wider than the source can use: its widest
    for row in (5, 40, 64, 100, 120, 300):
        rank, pairs = split_row(row, 0.3, 32, 320)
        assert rank + 2 * pairs == row and 1 <= pairs <= 32
    with pytest.raises(OptionsError, match="at least 3"):
        split_row(2, 0.4, 32, 320)


def test_resolution_spends_the_asked_row(wide_source):
    """8 KV heads x head_dim 128: --cache-budget is the row itself, --cache-fraction of the source's 2048; a given
    --kv-lora-rank makes the row with the rope head; the choices record where each came from; the default 31.25 %
    (640) is wider than this 256-wide source can use (256 latent + 64 pairs)."""
    src = open_source(wide_source)
    for given, row in (({"cache_budget": 320}, 320), ({"cache_fraction": 0.125}, 256)):
        res = resolve_options(ConvertOptions(**given), src, "llama.cpp", set(given))
        o = res.options
        assert o.rope_mode == "shared" and o.rope_strategy == "high" and o.cache_budget is None
        assert o.kv_lora_rank + 2 * o.rope_pairs == row and o.kv_lora_rank % Q8_0_BLOCK == 0
        assert (
            res.choices["kv_lora_rank"].startswith("--target llama.cpp")
            and "served row" in res.choices["cache_budget"]
        )
        assert f"{row} values per token per layer" in (res.why or "") and "q8_0" in (res.why or "")
    res = resolve_options(ConvertOptions(), src, "llama.cpp", set())
    assert (res.options.kv_lora_rank, res.options.rope_pairs) == (256, 64)
    assert "the 640-value row asked" in (res.why or "") and "wider than this source can use" in (
        res.why or ""
    )
    res = resolve_options(
        ConvertOptions(kv_lora_rank=96, rope_pairs=16), src, "llama.cpp", {"kv_lora_rank", "rope_pairs"}
    )
    assert (res.options.kv_lora_rank, res.options.rope_pairs) == (96, 16) and "a row of 128 values" in (
        res.why or ""
    )
    res = resolve_options(
        ConvertOptions(cache_budget=320, rope_pairs=40), src, "llama.cpp", {"cache_budget", "rope_pairs"}
    )
    assert (res.options.kv_lora_rank, res.options.rope_pairs) == (240, 40) and res.choices[
        "rope_pairs"
    ] == "given"


def test_refusals_before_any_work(wide_source, tmp_path):
    """Biases, per-head RoPE, a data-driven selection, a RoPE scaling with no plain pair: one line with the fix,
    nothing written; a llama3 source keeps only its plain pairs and the rank takes the rest of the row."""
    qwen2 = write_tiny_family(tmp_path / "qwen2", "qwen2")
    res = CliRunner().invoke(
        app, ["factor", str(qwen2), str(tmp_path / "out"), "--target", "llama.cpp", *SMALL]
    )
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "llama.cpp's deepseek2 attention has no biases" in text, res.output
    assert not (tmp_path / "out").exists()
    for flags, words in ((["--rope-mode", "per-head"], "--rope-mode per-head: removed"),
                         (["--rope-strategy", "2-norm"], "drop --rope-strategy"),
                         (["--rope-pairs", "65"], "--rope-pairs 64 or fewer")):  # fmt: skip
        res = CliRunner().invoke(app, ["inspect", str(wide_source), "--target", "llama.cpp", *flags])
        assert res.exit_code == 2 and words in " ".join(res.output.split()), res.output
    linear = write_tiny_llama(tmp_path / "linear", rope_parameters=LINEAR)
    res = CliRunner().invoke(
        app, ["factor", str(linear), str(tmp_path / "out"), "--target", "llama.cpp", *SMALL]
    )
    assert res.exit_code == 2 and "linear-scaled and no pair keeps its plain frequency" in " ".join(
        res.output.split()
    )
    scaled = open_source(
        write_tiny_llama(tmp_path / "llama3", rope_parameters=LLAMA3, max_position_embeddings=131072)
    )
    from mla_convert.engines.precheck import plain_pairs

    n = plain_pairs(scaled)
    assert 0 < n < 8
    o = resolve_options(ConvertOptions(cache_budget=40), scaled, "llama.cpp", {"cache_budget"}).options
    assert o.rope_pairs <= n and o.kv_lora_rank + 2 * o.rope_pairs == 40


@pytest.fixture(scope="module")
def target_ckpt(wide_source, tmp_path_factory) -> Path:
    """``factor --target llama.cpp --cache-budget 320`` of the 8-KV-head source (a 320-value llama.cpp row)."""
    ckpt = tmp_path_factory.mktemp("target") / "mla"
    res = CliRunner().invoke(
        app,
        [
            "--quiet",
            "factor",
            str(wide_source),
            str(ckpt),
            *SMALL,
            "--target",
            "llama.cpp",
            "--cache-budget",
            "320",
        ],
    )
    assert res.exit_code == 0, res.output + str(res.exception)
    return ckpt


@pytest.fixture
def bundled_tokenizer(monkeypatch):
    """The tiny conversion's tokenizer is SmolLM2's: carry it from the bundled SmolLM2 GGUF."""
    from mla_convert.sources.assets import bundled_gguf_path

    monkeypatch.setattr(gguf_vocab, "source_gguf", lambda ckpt: bundled_gguf_path())


def test_factor_and_export_give_the_asked_row(target_ckpt, bundled_tokenizer, tmp_path):
    """One rank in every layer, recorded as the target's choice, and the GGUF's llama.cpp row (kv_lora_rank + rope
    dims, read back) is the 320 asked, with a rank that is a multiple of 32."""
    from gguf import GGUFReader

    config = json.loads((target_ckpt / "config.json").read_text())
    assert len(set(config["kv_lora_rank"])) == 1
    manifest = json.loads((target_ckpt / "mla_manifest.json").read_text())
    assert manifest["choices"]["kv_lora_rank"].startswith("--target llama.cpp")
    out = tmp_path / "m.gguf"
    res = CliRunner().invoke(
        app, ["export", str(target_ckpt), str(out), "--format", "gguf", "--target", "llama.cpp", "--no-check"]
    )
    assert res.exit_code == 0, res.output + str(res.exception)
    fields = GGUFReader(str(out)).fields

    def value(key: str) -> int:
        f = fields[key]
        return int(f.parts[f.data[0]][0])

    rank, rope = value("deepseek2.attention.kv_lora_rank"), value("deepseek2.rope.dimension_count")
    assert rank == config["kv_lora_rank"][0] and rank + rope == 320 == value("deepseek2.attention.key_length")
    assert rank % Q8_0_BLOCK == 0 and "K-only cache 320 values/token/layer" in " ".join(res.output.split())
    res = CliRunner().invoke(
        app, ["export", str(target_ckpt), str(tmp_path / "ds3"), "--target", "llama.cpp"]
    )
    assert res.exit_code == 2 and "use --format gguf" in res.output


def test_target_gguf_in_llamacpp(llamacpp_python, target_ckpt, tmp_path, monkeypatch):
    """A real llama.cpp serves the --target llama.cpp conversion's float32 GGUF as our model computes it (the export's
    own check: prompt log-probabilities and greedy tokens within engines/llamacpp/check.py's thresholds) and allocates exactly
    the 320 values per token per layer asked, K only. The source is a Hugging Face folder: the tokenizer is written
    by llama.cpp's own converter (gguf_vocab), and the check asserts llama.cpp tokenizes as the checkpoint does."""
    from mla_convert.engines.llamacpp.gguf_file import export_gguf

    monkeypatch.setenv("MLA_LLAMACPP_PYTHON", llamacpp_python)
    _, record = export_gguf(target_ckpt, tmp_path / "t.gguf", "float32", llamacpp_python=llamacpp_python)
    assert record["tokenizer"].startswith("the checkpoint's Hugging Face tokenizer, written by llama.cpp's")
    p = record["parity"]
    assert isinstance(p, dict) and p["passed"], p
    assert p["logprob_abs_diff"]["max"] <= p["thresholds"]["max"] and p["greedy"]["count"] == 32
    cache = p["kv_cache"]
    assert (
        cache["v_mib"] == 0.0
        and abs(cache["k_values_per_token_per_layer"] - 320) <= cache["resolution"] + 0.05
    )
    assert p["kv_cache_values_per_token_per_layer"] == 320


def test_inspect_and_recipe_take_the_target(wide_source, tmp_path):
    res = CliRunner().invoke(app, ["inspect", str(wide_source), "--target", "llama.cpp", "--cache-budget", "320"],
                             env={"COLUMNS": "400"})  # fmt: skip
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "--target llama.cpp: llama.cpp caches one kv_lora_rank + rope head" in text
    assert "320 values per token per layer (15.62% of the source's 2048)" in text
    from mla_convert.recipes.load import load_recipe

    yaml = (f"name: t\nsource: {wide_source}\noutput: {tmp_path / 'job'}\nfactor: {{cache_budget: 320}}\n"
            "export: {format: gguf, target: llama.cpp}\n")  # fmt: skip
    o = load_recipe("t.yaml", text=yaml).recipe.factor
    assert o.kv_lora_rank + 2 * o.rope_pairs == 320 and o.rope_strategy == "high"
