"""Greedy completions in a real llama.cpp (llama-cpp-python's ``Llama``), one JSON line per prompt as each finishes.

Run with the python of a llama.cpp venv (``scripts/llamacpp_env.sh``); it imports only ``llama_cpp`` and ``numpy``::

    python complete.py REQUEST.json

``REQUEST.json``: ``{"model": GGUF, "prompts": [str, ...], "max_new_tokens": N, "stop": [str, ...], "threads": T,
"n_ctx": C, "cache_type": "f16"}``. Each prompt is tokenized by llama.cpp (the model's BOS rule, no special-token
parsing), evaluated, then continued by argmax of llama.cpp's logits one decode step at a time until EOS, ``N``
tokens, or the decoded continuation holds one of ``stop``. Standard output gets ``{"index": i, "text": str,
"tokens": n, "seconds": s}`` per prompt, flushed, in prompt order.
"""

from __future__ import annotations

import json
import sys
import time

#: ``cache_type`` -> ggml type of the K and V caches (ggml.h); a quantized cache runs with flash attention.
CACHE_TYPES = {"f16": 1, "q8_0": 8}


def main(request_path: str) -> None:
    """Load the model, complete every prompt of ``request_path``, print a JSON line per prompt."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    request = json.loads(open(request_path, encoding="utf-8").read())
    cache = CACHE_TYPES[request.get("cache_type", "f16")]
    threads = int(request.get("threads", 1))
    llm = Llama(
        model_path=request["model"],
        n_ctx=int(request.get("n_ctx", 2048)),
        n_batch=512,
        logits_all=False,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
        type_k=cache,
        type_v=cache,
        flash_attn=cache != 1,
    )
    eos = llm.token_eos()
    vocab = llm.n_vocab()
    stop = list(request["stop"])
    for index, prompt in enumerate(request["prompts"]):
        started = time.perf_counter()
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
        llm.reset()
        llm.eval(ids)
        new: list[int] = []
        text = ""
        for _ in range(int(request["max_new_tokens"])):
            if llm.n_tokens >= llm.n_ctx():
                break
            # the last position's logits (only it has an output when logits_all is off; llama.h llama_get_logits_ith)
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            tok = int(np.argmax(row))
            if tok == eos:
                break
            new.append(tok)
            text = llm.detokenize(new).decode("utf-8", errors="ignore")
            if any(s in text for s in stop):
                break
            llm.eval([tok])
        line = {
            "index": index,
            "text": text,
            "tokens": len(new),
            "seconds": round(time.perf_counter() - started, 2),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python complete.py REQUEST.json")
    main(sys.argv[1])
