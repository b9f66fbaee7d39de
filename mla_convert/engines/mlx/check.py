"""Load a DeepSeek-V3 export in a real MLX-LM and compare with our MLA model: the proof that an export is exact there.

``python -m mla_convert.engines.mlx.check CKPT EXPORT --mlx-python PY [--json OUT.json] [--table OUT.md]``

MLX-LM (:func:`check_mlx`, ``PY`` from ``scripts/mlx_env.sh``): :mod:`mla_convert.engines.mlx.probe` loads EXPORT with
``mlx_lm.load`` and scores :data:`MLX_WINDOWS` x :data:`MLX_WINDOW` tokens (one forward: MLX-LM's prefill path) and
:data:`MLX_NEW_TOKENS` greedy tokens per prompt through its prompt cache (its absorbed decode path), in the export's
dtype; the same comparison with our model as vLLM's (:mod:`mla_convert.engines.vllm.check`; the request, the running
of the probe and the thresholds are :mod:`mla_convert.engines.probing`'s), with :data:`MLX_FLOAT32` for a float32
export (the bfloat16 thresholds otherwise), and the keys MLX-LM resolved (``rope_theta``, ``kv_a_layernorm`` eps, no
MoE layer) and the cache it holds (latent + rope key per token per layer) checked against the export's record.
Raises nothing on a mismatch: the record says ``passed: false`` and why.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from mla_convert.engines.probing import (
    against_ours,
    agreement_record,
    allowed_margin,
    allowed_max,
    allowed_mean,
    build_request,
    floor_record,
    floor_text,
    report,
    run_probe,
)

#: MLX-LM's text (:func:`check_mlx`): fewer tokens than vLLM's, since MLX's Linux CPU wheel multiplies matrices with
#: the reference BLAS (~1 GFLOP/s here: one 128-token forward of the 135M reference takes ~35 s).
MLX_WINDOW = 64
MLX_WINDOWS = 2
MLX_NEW_TOKENS = 16
#: Thresholds of a float32 export in MLX-LM (float32 on its CPU). Measured on the SmolLM2 reference export (mlx 0.32.4,
#: mlx-lm 0.32.2): mean 1.3e-4 / max 2.5e-4 over 126 tokens, 32/32 greedy tokens our argmax; the same files without the
#: top-level rope_theta (MLX-LM's default 10000) gave mean 0.23 / max 2.04 and 2 greedy tokens off our argmax.
MLX_FLOAT32 = {"mean": 1e-3, "max": 1e-2, "greedy_margin": 1e-3}


def compare_mlx(ckpt: Path, export: Path, request: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """Our model (``ckpt``, float32) against MLX-LM's ``result`` (:mod:`~mla_convert.engines.mlx.probe`) on
    ``request``: the record of :func:`check_mlx` (figures, thresholds, ``passed``, ``reasons``).

    Besides the numbers, the keys MLX-LM resolved are checked against the export's record: ``rope_theta`` (MLX-LM
    reads only the top-level key), the latent norm's epsilon (MLX-LM hard-codes 1e-6), no MoE layer, and its cache:
    one latent head of ``kv_lora_rank`` (keys) and one rope key of ``qk_rope_head_dim`` (values) per token per layer.
    """
    record = json.loads((export / "mla_manifest.json").read_text())["export"]
    diff, bf16, src_bf16, margins = against_ours(ckpt, request, result)
    worst = max(max(m) for m in margins)
    model, rope = result["model"], 2 * record["rope"]["slots"]
    float32 = model["dtype"] == "float32"
    limits = (
        dict(MLX_FLOAT32)
        if float32
        else {
            "mean": allowed_mean(src_bf16),
            "max": allowed_max(src_bf16, bf16),
            "greedy_margin": allowed_margin(src_bf16),
        }
    )
    reasons = []
    if float(diff.mean()) > limits["mean"] or float(diff.max()) > limits["max"]:
        reasons.append(
            f"prompt log-probabilities differ by mean {float(diff.mean()):.3g} / max {float(diff.max()):.3g} "
            f"(allowed {limits['mean']:g} / {limits['max']:.3g})"
        )
    if worst > limits["greedy_margin"]:
        reasons.append(
            f"a greedy token MLX-LM picked is {worst:.3g} logits below our argmax "
            f"(allowed {limits['greedy_margin']:g})"
        )
    theta = float(record["rope"]["parameters"]["rope_theta"])
    if abs(model["rope_theta"] - theta) > 1e-9 * theta:
        reasons.append(
            f"MLX-LM applies rope_theta {model['rope_theta']:g}, the export's is {theta:g} (the top-level "
            "rope_theta key of config.json)"
        )
    if model["kv_a_layernorm_eps"] != record["latent_norm"]["eps"]:
        reasons.append(
            f"MLX-LM's kv_a_layernorm eps is {model['kv_a_layernorm_eps']:g}, the export's latent norm is "
            f"exact for {record['latent_norm']['eps']:g} only"
        )
    if model["moe_layers"]:
        reasons.append(f"MLX-LM built {model['moe_layers']} MoE layers for a dense export")
    layers = result["kv_cache"]["layers"]
    shape = {
        "class": "KVCache",
        "keys": {"heads": 1, "width": record["kv_lora_rank"]},
        "values": {"heads": 1, "width": rope},
    }
    if not layers or any({k: x.get(k) for k in shape} != shape for x in layers):
        reasons.append(
            f"MLX-LM's cache is not one latent of {record['kv_lora_rank']} and one rope key of {rope} "
            f"per token per layer: {layers[:1]}"
        )
    return {
        "engine": f"MLX-LM {result['mlx_lm']} (MLX {result['mlx']}, {result['device']})",
        "dtype": model["dtype"],
        **agreement_record(request, result, diff, margins, worst),
        **floor_record(bf16, src_bf16),
        "model": model,
        "kv_cache": {"layers": len(layers), "per_layer": layers[0] if layers else None},
        "kv_cache_values_per_token_per_layer": record["kv_lora_rank"] + rope,
        "thresholds": {k: round(v, 6) for k, v in limits.items()},
        "mlx_load_s": result["load_s"],
        "mlx_wall_s": result["wall_s"],
        "passed": not reasons,
        "reasons": reasons,
    }


def check_mlx(ckpt: Path, export: Path, python: str, dtype: str | None = None) -> dict[str, Any]:
    """Load ``export`` (written from ``ckpt``) with ``mlx_lm.load`` in the MLX-LM venv of ``python`` and compare
    (:func:`compare_mlx`) on :data:`MLX_WINDOWS` x :data:`MLX_WINDOW` tokens and :data:`MLX_NEW_TOKENS` greedy
    tokens per prompt; ``dtype`` casts MLX's parameters (None: the export's own).

    Raises:
        RuntimeError: MLX-LM failed to run (not a mismatch: that is ``passed: false``).
    """
    from transformers import AutoTokenizer

    from mla_convert import register

    register()  # the checkpoint's config type, before its tokenizer is read (else transformers warns about `mla`)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    request = build_request(tokenizer, MLX_WINDOW, MLX_WINDOWS, MLX_NEW_TOKENS, dtype)
    result, _ = run_probe(python, Path(__file__).with_name("probe.py"), export, request, "MLX-LM")
    record = compare_mlx(ckpt, export, request, result)
    record["wall_s"] = round(time.perf_counter() - started, 1)
    return record


def mlx_table(record: dict[str, Any], what: str) -> str:
    """The parity table (markdown) of a :func:`check_mlx` record; ``what`` names the checkpoint and command."""
    d, f, g, m = record["logprob_abs_diff"], record["ours_bf16_abs_diff"], record["greedy"], record["model"]
    layer = record["kv_cache"]["per_layer"] or {}
    cache = (
        f"{layer.get('class')}: latent {layer['keys']['width']} + rope key {layer['values']['width']} "
        f"({layer['dtype']}) per token, {record['kv_cache']['layers']} layers"
        if "keys" in layer
        else "not read"
    )
    t = record["thresholds"]
    rows = [
        ("engine", f"{record['engine']}, {record['dtype']}"),
        ("text", f"{record['text']} ({record['tokens_scored']} tokens scored)"),
        ("prompt log-prob vs ours (float32): mean / max abs diff", f"{d['mean']:.2e} / {d['max']:.2e}"),
        ("ours in bfloat16 vs ours in float32", f"{f['mean']:.3f} / {f['max']:.3f}"),
        ("source in bfloat16 vs source in float32 (rounding floor)", floor_text(record)),
        (
            "greedy tokens (MLX-LM's cached decode) that are our argmax",
            f"{g['argmax_equal']} / {g['count']} (worst margin {g['max_margin']:.2e})",
        ),
        (
            "keys MLX-LM resolved",
            f"rope_theta {m['rope_theta']:.6g}, kv_a_layernorm eps {m['kv_a_layernorm_eps']:g}, "
            f"{m['moe_layers']} MoE layers",
        ),
        ("cache MLX-LM holds", cache),
        (
            "thresholds",
            f"mean <= {t['mean']:g}, max <= {t['max']:g}, greedy within {t['greedy_margin']:g} logits",
        ),
        ("result", "passed" if record["passed"] else "FAILED: " + "; ".join(record["reasons"])),
    ]
    lines = [f"Measured by `{what}`.", "", "| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); exit 1 when the export does not match."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m mla_convert.engines.mlx.check", description=__doc__.splitlines()[0]
    )
    p.add_argument("ckpt", type=Path)
    p.add_argument("export", type=Path, help="the DeepSeek-V3 export of CKPT")
    p.add_argument(
        "--mlx-python", required=True, help="the python of scripts/mlx_env.sh: check the export in MLX-LM"
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--table", type=Path)
    p.add_argument("--what", default="bash scripts/serve_check.sh")
    a = p.parse_args(argv)
    record = check_mlx(a.ckpt, a.export, a.mlx_python)
    return report(record, mlx_table(record, a.what), a.json, a.table)


if __name__ == "__main__":
    sys.exit(main())
