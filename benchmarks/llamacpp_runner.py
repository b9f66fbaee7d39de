"""One measurement in a real llama.cpp, for ``benchmarks/llamacpp.py``: run by the python of a llama.cpp venv
(``scripts/llamacpp_env.sh``); it imports only ``llama_cpp`` and ``numpy``::

    python benchmarks/llamacpp_runner.py REQUEST.json RESULT.json

``REQUEST.json``: ``{"model": PATH, "cache_type": "f16"|"q8_0", "job": JOB, ...}`` with JOB one of

* ``ppl``: ``"windows": [[token ids], ...]`` (each scored alone in a fresh cache of its length): the summed negative
  log-likelihood (nats, float64 log-softmax of llama.cpp's logits) of every token after the first, and their count;
* ``kv``: ``"contexts": [512, ...]``: one context of each size is created (and freed); the caller reads the KV cache
  llama.cpp allocated from its log lines (stderr, one ``llama_kv_cache: size = ...`` line per context, in order);
* ``speed``: ``"ids": [token ids]``, ``"contexts": [N, ...]``, ``"decode": M``: after one short warm-up, one pass
  over the ids: the prompt evaluated in batches of 512 up to N tokens in the cache, then the next M ids one at a
  time (decode steps with N to N + M - 1 tokens in the cache), then on to the next N; per context, the prefill
  milliseconds per token up to N (prefill batches only) and the decode milliseconds per step.

One thread: on this shared two-core machine two OpenMP threads spin at every barrier while the other jobs hold the
cores (measured: a decode step 47 ms with one thread, 6.9 s with two, at the same time). An f16 cache runs with
flash attention off (llama-cpp-python's default); a quantized cache sets ``type_k`` = ``type_v`` (an MLA model
must) and flash attention on (llama.cpp requires it for a quantized V). ``RESULT.json`` also holds the GGUF
metadata llama.cpp read (no tokenizer arrays).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

#: cache type -> ggml type id (ggml.h)
CACHE_TYPES = {"f16": 1, "q8_0": 8}
THREADS = 1


def _llama(model: str, cache_type: str, n_ctx: int, logits_all: bool) -> Any:
    from llama_cpp import Llama

    t = CACHE_TYPES[cache_type]
    return Llama(
        model_path=model,
        n_ctx=n_ctx,
        n_batch=512,
        n_ubatch=512,
        logits_all=logits_all,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        seed=0,
        verbose=True,
        type_k=t,
        type_v=t,
        flash_attn=cache_type != "f16",
    )


def perplexity(model: str, cache_type: str, windows: list[list[int]]) -> dict[str, Any]:
    """Summed NLL (nats) and token count over ``windows`` (module docstring)."""
    import numpy as np

    llm = _llama(model, cache_type, max(len(w) for w in windows), True)
    nll, count = 0.0, 0
    for ids in windows:
        llm.reset()
        llm.eval(ids)
        x = np.array(llm.scores[: len(ids) - 1], dtype=np.float64)
        x = x - x.max(-1, keepdims=True)
        lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
        nll -= float(lp[np.arange(len(ids) - 1), ids[1:]].sum())
        count += len(ids) - 1
    return {"nll": nll, "tokens": count, "metadata": _meta(llm)}


def kv(model: str, cache_type: str, contexts: list[int]) -> dict[str, Any]:
    """Create (and free) one context of each size; the KV cache lines are in the log."""
    import gc

    meta: dict[str, Any] = {}
    for n in contexts:
        llm = _llama(model, cache_type, n, False)
        meta = _meta(llm)
        llm.close()
        del llm
        gc.collect()
    return {"contexts": contexts, "metadata": meta}


def speed(model: str, cache_type: str, ids: list[int], contexts: list[int], decode: int) -> dict[str, Any]:
    """Prefill and decode milliseconds per token at each of ``contexts`` (ascending), in one pass (module
    docstring): the prompt is evaluated up to each context, then ``decode`` steps are timed there, then the
    prompt goes on from where the decode steps left it (the prefill time up to N counts prefill batches only)."""
    llm = _llama(model, cache_type, max(contexts) + decode * len(contexts) + 256, False)
    llm.eval(ids[:16])  # warm-up: graph and buffers allocated outside the timed part
    llm.reset()
    out: dict[str, Any] = {}
    pos, prefilled, prefill_s = 0, 0, 0.0  # tokens in the cache; of them evaluated as prompt; their seconds
    for n in contexts:  # ascending, each at least the previous + decode
        t0 = time.perf_counter()
        llm.eval(ids[pos:n])
        prefill_s += time.perf_counter() - t0
        prefilled, pos = prefilled + n - pos, n
        t1 = time.perf_counter()
        for i in range(decode):
            llm.eval([ids[pos + i]])
        t2 = time.perf_counter()
        pos += decode
        out[str(n)] = {"prefill_ms": prefill_s * 1e3 / prefilled, "decode_ms": (t2 - t1) * 1e3 / decode}
    return {"contexts": out, "metadata": _meta(llm)}


def _meta(llm: Any) -> dict[str, Any]:
    return {k: v for k, v in llm.metadata.items() if not k.startswith("tokenizer.")}


def main(request_path: str, result_path: str) -> None:
    """Run the job ``request_path`` asks for and write ``result_path``."""
    import llama_cpp

    r = json.loads(open(request_path).read())
    started = time.perf_counter()
    if r["job"] == "ppl":
        out = perplexity(r["model"], r["cache_type"], r["windows"])
    elif r["job"] == "kv":
        out = kv(r["model"], r["cache_type"], r["contexts"])
    elif r["job"] == "speed":
        out = speed(r["model"], r["cache_type"], r["ids"], [int(n) for n in r["contexts"]], int(r["decode"]))
    else:
        sys.exit(f"unknown job {r['job']!r}: ppl, kv or speed")
    out.update(llama_cpp=llama_cpp.__version__, wall_s=round(time.perf_counter() - started, 2))
    with open(result_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/llamacpp_runner.py REQUEST.json RESULT.json")
    main(*sys.argv[1:])
