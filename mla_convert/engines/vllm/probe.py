"""Run a DeepSeek-V3 export in vLLM's offline ``LLM`` and write what vLLM computed, as JSON.

Run with the python of a venv that has vLLM (``scripts/vllm_env.sh`` builds the CPU one); it imports nothing of
mla-convert, so it runs beside any vLLM install::

    python probe.py EXPORT REQUEST.json RESULT.json
    python probe.py --jobs JOBS.json       # [[FOLDER, REQUEST.json, RESULT.json], ...] in one process

``REQUEST.json``: ``{"score": [[token ids], ...], "greedy": [[token ids], ...], "new_tokens": N, "dtype":
"bfloat16", "custom_ops": false}``. ``RESULT.json``: for each ``score`` sequence the log-probability vLLM gives
each token after the first (``prompt_logprobs``); for each ``greedy`` prompt the ``N`` tokens vLLM picks at
temperature 0 with their log-probabilities; the model config vLLM resolved (MLA or not, the head size it caches
per token per layer), the vLLM version and the wall times (seconds). The caller reads the attention backend and
the KV cache vLLM allocated from its log (stderr).

``custom_ops: false`` (the default) passes ``compilation_config={"custom_ops": ["none"]}``: vLLM's CPU rotary
kernel is wrong for DeepSeek's shapes (mla-convert docs/serving.md); ``true`` measures the engine as shipped.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main(folder: str, request_path: str, result_path: str) -> None:
    """Load ``folder`` in vLLM, score and generate what ``request_path`` asks, write ``result_path``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the engine's config is readable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    request = json.loads(open(request_path).read())
    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if not request.get("custom_ops", False):
        kwargs["compilation_config"] = {"custom_ops": ["none"]}
    longest = max(len(s) for s in request["score"] + request["greedy"]) + int(request.get("new_tokens", 16))
    llm = LLM(
        model=folder,
        dtype=request.get("dtype", "bfloat16"),
        max_model_len=max(256, longest),
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )
    loaded = time.perf_counter()
    score = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in request["score"]],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
        use_tqdm=False,
    )
    prompt_logprobs = []
    for ids, out in zip(request["score"], score, strict=True):
        row = []
        for pos, entry in enumerate(out.prompt_logprobs or []):
            if entry is None:  # the first token has no prediction
                continue
            row.append(float(entry[ids[pos]].logprob))
        prompt_logprobs.append(row)
    greedy = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in request["greedy"]],
        SamplingParams(max_tokens=int(request.get("new_tokens", 16)), temperature=0.0, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    generated = []
    for out in greedy:
        comp = out.outputs[0]
        generated.append({
            "tokens": list(comp.token_ids),
            "logprobs": [float(step[tok].logprob) for tok, step in zip(comp.token_ids, comp.logprobs or [], strict=False)],
        })
    mc = llm.llm_engine.vllm_config.model_config
    cache = _kv_cache(llm)
    result = {
        "vllm": vllm.__version__,
        "prompt_logprobs": prompt_logprobs,
        "greedy": generated,
        "model": {
            "architecture": list(getattr(mc.hf_config, "architectures", []) or []),
            "use_mla": bool(getattr(mc, "use_mla", False)),
            "head_size": int(mc.get_head_size()),
            "num_kv_heads": int(mc.get_total_num_kv_heads()),
            "dtype": str(mc.dtype).replace("torch.", ""),
        },
        "kv_cache": cache,
        "custom_ops": bool(request.get("custom_ops", False)),
        "load_s": round(loaded - started, 1),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)


def _kv_cache(llm: Any) -> dict[str, Any] | None:
    """The KV cache vLLM allocated, from the in-process engine's scheduler (None where this vLLM has no such
    attribute): each group's spec class, heads, head size, dtype and bytes per token per layer."""
    try:
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    except AttributeError:
        return None
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append({
            "spec": type(spec).__name__,
            "layers": len(group.layer_names),
            "num_kv_heads": int(spec.num_kv_heads),
            "head_size": int(spec.head_size),
            "dtype": str(spec.dtype).replace("torch.", ""),
            "block_size": int(spec.block_size),
            "bytes_per_token_per_layer": int(spec.page_size_bytes) // int(spec.block_size),
        })
    return {"num_blocks": int(config.num_blocks), "groups": groups}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--jobs":  # [[FOLDER, REQUEST.json, RESULT.json], ...]: one process
        import gc

        for job in json.loads(open(sys.argv[2]).read()):
            main(*job)
            gc.collect()  # the previous engine and its KV cache go before the next loads
    elif len(sys.argv) != 4:
        sys.exit("usage: python probe.py EXPORT REQUEST.json RESULT.json | --jobs JOBS.json")
    else:
        main(*sys.argv[1:])
