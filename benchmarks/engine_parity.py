"""The reference conversion served by llama.cpp and MLX-LM: parity with our model and the cache each engine holds.

Measures with the engines' own checks (``python -m mla_convert.engines.llamacpp.check``, the llama.cpp of
``scripts/llamacpp_env.sh``; ``python -m mla_convert.engines.mlx.check --mlx-python``, the MLX-LM of
``scripts/mlx_env.sh``), stores one row per export in ``benchmarks/results/engine_parity.json`` (each row names
the command that measured it) and writes the ``engine-parity`` block from that file:

    .venv/bin/python benchmarks/engine_parity.py --ckpt out/smollm2-mla --gguf out/smollm2-mla.gguf \\
        --source-gguf SRC.gguf --llamacpp-python PY [--q8-gguf out/smollm2-mla.q8_0.gguf] \\
        --export out/smollm2-ds3 --mlx-python PY [--readme]
    .venv/bin/python benchmarks/engine_parity.py --collect --readme      # the block again from the stored rows
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "engine_parity.json"
LLAMACPP = "python -m mla_convert.engines.llamacpp.check CKPT OUT.gguf --llamacpp-python PY --source-gguf SRC.gguf"
MLX = "python -m mla_convert.engines.mlx.check CKPT EXPORT --mlx-python PY"


def _num(x: float) -> str:
    """Two significant digits; scientific below 1e-3."""
    return f"{x:.1e}" if abs(x) < 1e-3 else f"{x:.2g}"


def llamacpp_row(record: dict[str, Any], label: str) -> dict[str, Any]:
    """A stored row from a :func:`mla_convert.engines.llamacpp.check.check_llamacpp` record."""
    g, width = record["greedy"], record["kv_cache_values_per_token_per_layer"]
    cache = f"{width} values, K only"
    if "source_kv_cache" in record:
        cache += (f" (source GGUF in llama.cpp: {record['source_kv_cache']['values_per_token_per_layer']}; "
                  f"**{record['cache_ratio']:.2f} x**)")  # fmt: skip
    return {"engine": label, "logprob_mean": record["logprob_abs_diff"]["mean"],
            "logprob_max": record["logprob_abs_diff"]["max"], "tokens_scored": record["tokens_scored"],
            "greedy_equal": g["argmax_equal"], "greedy_count": g["count"], "worst_margin": g["max_margin"],
            "cache": cache, "measured_by": LLAMACPP}  # fmt: skip


def mlx_row(record: dict[str, Any], label: str) -> dict[str, Any]:
    """A stored row from a :func:`mla_convert.engines.vllm.check.check_mlx` record."""
    g, layer = record["greedy"], record["kv_cache"]["per_layer"] or {}
    return {"engine": label, "logprob_mean": record["logprob_abs_diff"]["mean"],
            "logprob_max": record["logprob_abs_diff"]["max"], "tokens_scored": record["tokens_scored"],
            "greedy_equal": g["argmax_equal"], "greedy_count": g["count"], "worst_margin": g["max_margin"],
            "cache": f"latent {layer['keys']['width']} + rope key {layer['values']['width']}", "measured_by": MLX}  # fmt: skip


def block(results: dict[str, Any]) -> str:
    """The ``engine-parity`` block: one line per stored row."""
    lines = [
        f"Written by `python benchmarks/engine_parity.py --readme` from `benchmarks/results/engine_parity.json`; "
        f"measured by `{LLAMACPP}` and `{MLX}` (the checks `tests/export/test_llamacpp.py` and "
        "`tests/export/test_mlx.py` run in CI). Our model runs in float32.",
        "",
        "| engine (export dtype) | prompt log-prob vs ours: mean / max abs diff | greedy tokens our argmax | "
        "KV cache per token per layer |",
        "|---|---|---|---|",
    ]
    for r in results["rows"]:
        scored = f" ({r['tokens_scored']} tokens)" if r.get("tokens_scored") else ""
        greedy = f"{r['greedy_equal']} / {r['greedy_count']}"
        if r["greedy_equal"] < r["greedy_count"] and r.get("worst_margin") is not None:
            greedy += f" (worst {_num(r['worst_margin'])} logits)"
        lines.append(f"| {r['engine']} | {_num(r['logprob_mean'])} / {_num(r['logprob_max'])}{scored} | {greedy} | "
                     f"{r['cache']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collect", action="store_true", help="measure nothing: the block from the stored rows")
    ap.add_argument("--readme", action="store_true", help="write the engine-parity block")
    ap.add_argument("--ckpt", type=Path, help="the MLA checkpoint the exports were written from")
    ap.add_argument("--gguf", type=Path, help="its float32 GGUF (`mla-convert export CKPT OUT.gguf --format gguf`)")
    ap.add_argument("--q8-gguf", type=Path, help="its q8_0 GGUF (optional)")
    ap.add_argument("--source-gguf", type=Path, help="the source GGUF, for llama.cpp's cache of the source")
    ap.add_argument("--llamacpp-python", help="the python of scripts/llamacpp_env.sh")
    ap.add_argument("--export", type=Path, help="its float32 DeepSeek-V3 folder (`--format deepseek-v3`)")
    ap.add_argument("--mlx-python", help="the python of scripts/mlx_env.sh")
    a = ap.parse_args()
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    if not a.collect:
        if not a.ckpt or not (a.gguf and a.llamacpp_python or a.export and a.mlx_python):
            ap.error("give --ckpt and (--gguf with --llamacpp-python) and/or (--export with --mlx-python), or --collect")
        from mla_convert.engines.llamacpp.check import check_llamacpp
        from mla_convert.engines.vllm.check import check_mlx

        rows = []
        if a.gguf and a.llamacpp_python:
            rows.append(llamacpp_row(check_llamacpp(a.ckpt, a.gguf, a.llamacpp_python, a.source_gguf),
                                     "llama.cpp (float32 GGUF, f16 cache)"))  # fmt: skip
            if a.q8_gguf:
                rows.append(llamacpp_row(check_llamacpp(a.ckpt, a.q8_gguf, a.llamacpp_python), "llama.cpp (`q8_0` GGUF)"))
        if a.export and a.mlx_python:
            rows.append(mlx_row(check_mlx(a.ckpt, a.export, a.mlx_python), "MLX-LM (float32 DeepSeek-V3 folder)"))
        results = {"rows": rows}
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    text = block(results)
    print(text)
    if a.readme:
        from blocks import replace_block

        replace_block("engine-parity", text)


if __name__ == "__main__":
    main()
