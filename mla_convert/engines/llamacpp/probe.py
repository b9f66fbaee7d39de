"""Run a GGUF in a real llama.cpp (llama-cpp-python's ``Llama``) and write what it computed, as JSON.

Run with the python of a llama.cpp venv (``scripts/llamacpp_env.sh``); it imports only ``llama_cpp`` and ``numpy``::

    python probe.py MODEL.gguf REQUEST.json RESULT.json

``REQUEST.json``: ``{"score": [[token ids], ...], "greedy": [[token ids], ...], "new_tokens": N, "texts": [str],
"n_ctx": 1024, "cache_type": "f16"}`` (``cache_type`` one of :data:`CACHE_TYPES`). ``RESULT.json``: for each ``score`` sequence the log-probability llama.cpp gives each token after
the first (from its logits of every position, ``logits_all``, float64 log-softmax here); for each ``greedy`` prompt
the ``N`` tokens of its argmax, one decode step at a time; llama.cpp's own tokenization of each ``texts`` entry (no
BOS, special tokens parsed); the GGUF metadata llama.cpp read; the llama.cpp version and wall times (seconds). The
caller reads the KV cache llama.cpp allocated from its log (stderr, ``llama_kv_cache: ... K (f16): X MiB, V (f16): Y
MiB``). One thread (two OpenMP threads spin at every barrier on a shared two-core machine: 10-100 x slower
here); an f16 cache with flash attention off (llama-cpp-python's defaults), a quantized cache
(``type_k`` = ``type_v``) with it on.
"""

from __future__ import annotations

import json
import sys
import time

#: ``cache_type`` -> ggml type of the K and V caches (ggml.h). A quantized cache runs with flash attention, which
#: llama.cpp requires for a quantized V (and an MLA model's K and V types must match).
CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}


def main(model: str, request_path: str, result_path: str) -> None:
    """Load ``model`` in llama.cpp, score and continue what ``request_path`` asks, write ``result_path``."""
    import numpy as np

    request = json.loads(open(request_path).read())
    started = time.perf_counter()
    import llama_cpp
    from llama_cpp import Llama

    cache = CACHE_TYPES[request.get("cache_type", "f16")]
    llm = Llama(model_path=model, n_ctx=int(request.get("n_ctx", 1024)), n_batch=512, logits_all=True, n_threads=1,
                n_threads_batch=1, seed=0, verbose=True, type_k=cache, type_v=cache, flash_attn=cache != 1)
    loaded = time.perf_counter()

    def logprobs(rows: np.ndarray) -> np.ndarray:
        x = rows.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    prompt_logprobs = []
    for ids in request["score"]:
        llm.reset()
        llm.eval(ids)
        lp = logprobs(np.array(llm.scores[: len(ids) - 1]))
        prompt_logprobs.append([float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)])
    greedy = []
    for ids in request["greedy"]:
        llm.reset()
        llm.eval(ids)
        tokens, lps = [], []
        for _ in range(int(request.get("new_tokens", 16))):
            row = logprobs(np.array(llm.scores[llm.n_tokens - 1 : llm.n_tokens]))[0]
            tok = int(row.argmax())
            tokens.append(tok)
            lps.append(float(row[tok]))
            llm.eval([tok])
        greedy.append({"tokens": tokens, "logprobs": lps})
    tokenized = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in request.get("texts", [])]
    result = {
        "llama_cpp": llama_cpp.__version__,
        "prompt_logprobs": prompt_logprobs,
        "greedy": greedy,
        "tokenized": tokenized,
        "metadata": {k: v for k, v in llm.metadata.items() if not k.startswith("tokenizer.ggml.")},
        "n_ctx": llm.n_ctx(),
        "load_s": round(loaded - started, 1),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python probe.py MODEL.gguf REQUEST.json RESULT.json")
    main(*sys.argv[1:])
