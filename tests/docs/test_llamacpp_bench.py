"""``benchmarks/llamacpp.py`` without llama.cpp: the arithmetic, the log parsing, the tables of its block, and the
per-row resumability of a measurement (the engine replaced by a stub that counts its calls and can fail midway).

Oracles: multiply-adds counted by hand from the widths (SmolLM2: 9 heads of 64, 3 KV heads; the reference's GGUF:
``kv_lora_rank`` 96 + rope 64), and llama.cpp's own ``llama_kv_cache`` log line format.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = importlib.import_module("llamacpp")

SRC_META = {"general.architecture": "llama", "llama.attention.head_count": 9, "llama.embedding_length": 576}
MLA_META = {"general.architecture": "deepseek2", "deepseek2.attention.head_count": 9,
            "deepseek2.attention.kv_lora_rank": 96, "deepseek2.rope.dimension_count": 64}  # fmt: skip
SHAPES = {
    "source-f16": {"attention_macs": 1152, "layers": 30, "matmul_params": 1_000_000, "file_mib": 258.0},
    "mla-f16": {"attention_macs": 2304, "layers": 30, "matmul_params": 900_000, "file_mib": 240.0},
}


def test_attention_arithmetic():
    """H (2 d_c + d_R) for MLA against 2 H d for the source; the whole-model ratio tends to it with the context."""
    assert bench.attention_macs(SRC_META) == 2 * 9 * 64 == 1152
    assert bench.attention_macs(MLA_META) == 9 * (2 * 96 + 64) == 2304
    src, mla = SHAPES["source-f16"], SHAPES["mla-f16"]
    assert bench.arithmetic_ratio(src, mla, 0) == pytest.approx(0.9)
    assert bench.arithmetic_ratio(src, mla, 512) == pytest.approx(
        (900_000 + 30 * 512 * 2304) / (1e6 + 30 * 512 * 1152)
    )
    assert 1.9 < bench.arithmetic_ratio(src, mla, 1e6) < 2.0


def test_kv_rows_from_the_log():
    """One row per ``llama_kv_cache`` line, in the order the contexts were created; a missing line is an error."""
    line = ("llama_kv_cache: size = {t:7.2f} MiB ({n:6d} cells,  30 layers,  1/1 seqs), K (f16): {k:7.2f} MiB, "
            "V (f16): {v:7.2f} MiB\n")  # fmt: skip
    log = (
        "noise\n"
        + line.format(t=4.69, n=512, k=4.69, v=0.0)
        + "x\n"
        + line.format(t=18.75, n=2048, k=18.75, v=0.0)
    )
    rows = bench.kv_rows(log, "mla", "f16", (512, 2048))
    assert [(r["ctx"], r["cells"], r["k_mib"], r["v_mib"]) for r in rows] == [
        (512, 512, 4.69, 0.0),
        (2048, 2048, 18.75, 0.0),
    ]
    assert rows[1]["values_per_token_per_layer"] == 160.0 and rows[0]["part"] == "kv"
    with pytest.raises(RuntimeError, match="2 KV cache lines for 3 contexts"):
        bench.kv_rows(log, "mla", "f16", (512, 2048, 8192))


def _rows() -> list[dict]:
    rows = [{"part": "ppl", "model": m, "weights": "q8_0", "cache": "f16", "tokens": 4088, "nll": 0.0, "ppl": p}
            for m, p in (("source", 14.29), ("mla", 26.0))]  # fmt: skip
    for m, k, v, vals in (("source", 11.25, 11.25, 384.0), ("mla", 4.69, 0.0, 160.0)):
        rows.append({"part": "kv", "model": m, "cache": "f16", "ctx": 512, "k_mib": k, "v_mib": v,
                     "values_per_token_per_layer": vals})  # fmt: skip
    for rep, (src, mla) in enumerate(((2.0, 4.0), (1.0, 3.5))):  # the best round of each is kept
        for m, ms in (("source", src), ("mla", mla)):
            rows.append({"part": "speed", "model": m, "weights": "f16", "cache": "f16", "ctx": 2048, "repeat": rep,
                         "prefill_ms": ms / 4, "decode_ms": ms})  # fmt: skip
    return rows


def test_block_tables():
    """Each part's table from stored rows: perplexities, cache MiB and ratio, best-of-rounds times with the measured
    ratio beside the arithmetic one; parts without rows are left out."""
    text = bench.block({"meta": {"files": SHAPES, "ppl_text": "8 x 512 tokens"}, "rows": _rows()})
    assert "| q8_0 | f16 | 14.29 | 26.00 | — | — |" in text
    assert "| f16 | 512 | 22.50 | 4.69 | 0.21 x | 384 / 160 |" in text
    ar_p = bench.arithmetic_ratio(SHAPES["source-f16"], SHAPES["mla-f16"], (2048 + 1) / 2)
    ar_d = bench.arithmetic_ratio(SHAPES["source-f16"], SHAPES["mla-f16"], 2048 + bench.DECODE_STEPS / 2)
    assert (
        f"| f16, f16 | 2048 | 0.250 / 0.875 | 3.50 x | {ar_p:.2f} x | 1.00 / 3.50 | 3.50 x | {ar_d:.2f} x |"
        in text
    )
    assert "2304 (MLA absorbed, H(2 d_c + d_R)) against 1152 (source, 2 H d), 2.00 x" in text
    assert "best of 2 interleaved rounds" in text
    only_ppl = bench.block({"meta": {}, "rows": _rows()[:2]})
    assert (
        "Perplexity on" in only_ppl
        and "KV cache llama.cpp allocates" not in only_ppl
        and "decode" not in only_ppl
    )


def test_collect_registered():
    """``benchmarks/collect.py`` knows the block (tests/docs/test_generated_blocks.py checks its text)."""
    collect = importlib.import_module("collect")
    assert "llamacpp-bench" in collect.COLLECTORS


def test_measure_is_resumable(tmp_path, monkeypatch):
    """Rows are stored as they finish: an interrupted run keeps them and a rerun measures only the missing rows;
    speed rounds alternate which model goes first."""
    calls: list[tuple[str, str, str]] = []
    fail_at = {"n": 5}

    def fake_run(python, request, timeout_s=0):
        if len(calls) == fail_at["n"]:
            raise RuntimeError("interrupted")
        calls.append((request["job"], Path(request["model"]).stem, request["cache_type"]))
        if request["job"] == "speed":
            times = {str(n): {"prefill_ms": 1.0, "decode_ms": 2.0} for n in request["contexts"]}
            return {"contexts": times, "llama_cpp": "x"}, ""
        return {"nll": 10.0, "tokens": 5, "llama_cpp": "x"}, ""

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "prepare", lambda ckpt, work, python, w: {f"{m}-{x}": tmp_path / f"{m}-{x}.gguf"
                                                                         for m in bench.MODELS for x in w})  # fmt: skip
    monkeypatch.setattr(bench, "gguf_shape", lambda p: SHAPES["source-f16"])
    monkeypatch.setattr(bench, "texts", lambda ckpt: ([[1, 2, 3]], [1] * 9000, "ppl text", "speed text"))
    results_path = tmp_path / "llamacpp.json"
    argv = ["--ckpt", str(tmp_path), "--llamacpp-python", "py", "--parts", "ppl,speed", "--repeats", "2",
            "--speed-weights", "q8_0", "--speed-caches", "f16", "--results", str(results_path)]  # fmt: skip
    a = bench.build_parser().parse_args(argv)
    with pytest.raises(RuntimeError, match="interrupted"):
        bench.measure(a, bench.load_results(results_path))
    stored = json.loads(results_path.read_text())["rows"]
    assert len(stored) == 5 and all(r["part"] == "ppl" for r in stored)
    fail_at["n"] = 10**6
    first = len(calls)
    bench.measure(a, bench.load_results(results_path))
    rows = json.loads(results_path.read_text())["rows"]
    assert (
        len(rows) == 12 + 2 * 3 * 2
    )  # 3 weights x 2 caches x 2 models, then 2 rounds x 3 contexts x 2 models
    # nothing measured twice: the 7 missing perplexity rows, then one pass per model and round (3 contexts each)
    assert len(calls) - first == 7 + 2 * 2
    speed = [c[1] for c in calls if c[0] == "speed"]
    assert speed == ["source-q8_0", "mla-q8_0", "mla-q8_0", "source-q8_0"]  # who goes first alternates
    assert len({bench.row_key(r) for r in rows}) == len(rows)
