"""Run a DeepSeek-V3 export in MLX-LM (``mlx_lm.load``) and write what MLX computed, as JSON.

Run with the python of a venv that has MLX-LM (``scripts/mlx_env.sh`` builds the CPU one); it imports nothing of
mla-convert (nor torch), so it runs beside any MLX-LM install::

    python probe.py EXPORT REQUEST.json RESULT.json

``REQUEST.json``: the request of :func:`mla_convert.engines.probing.build_request` (``score``, ``greedy``,
``new_tokens``; ``dtype``: ``float32`` / ``bfloat16`` casts MLX's parameters, ``null`` keeps the file's).
``RESULT.json``: for each ``score`` sequence the log-probability MLX gives each token after the first
(``prompt_logprobs``, one forward pass of the whole sequence: MLX-LM's prefill path, the latent expanded by
``embed_q`` / ``unembed_out``); for each ``greedy`` prompt ``N`` tokens picked at temperature 0 token by token with
MLX-LM's prompt cache (its decode path: the query absorbed into the latent, ``L == 1``); the cache MLX-LM holds
for each layer (class, heads and width of its keys and values, tokens, dtype); the model's MLX-LM class, config
(``rope_theta``, ``rope_scaling``, expert counts as MLX-LM resolved them), parameter dtype, versions and wall
times (seconds).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(folder: str, request_path: str, result_path: str) -> None:
    """Load ``folder`` in MLX-LM, score and generate what ``request_path`` asks, write ``result_path``."""
    request = json.loads(open(request_path).read())
    started = time.perf_counter()
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(folder)
    if request.get("dtype"):
        model.set_dtype(getattr(mx, request["dtype"]))
    mx.eval(model.parameters())
    loaded = time.perf_counter()

    def logprobs(logits: Any) -> Any:
        logits = logits.astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    prompt_logprobs = []
    for ids in request["score"]:
        lp = logprobs(model(mx.array([ids]))[0])  # [T, V]
        picked = mx.take_along_axis(lp[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0]
        prompt_logprobs.append([float(x) for x in picked.tolist()])
    generated, cache = [], None
    for ids in request["greedy"]:
        cache = make_prompt_cache(model)
        logits = model(mx.array([ids]), cache=cache)[0, -1]
        tokens, lps = [], []
        for _ in range(int(request.get("new_tokens", 16))):
            lp = logprobs(logits)
            tok = int(mx.argmax(lp).item())
            tokens.append(tok)
            lps.append(float(lp[tok].item()))
            logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        generated.append({"tokens": tokens, "logprobs": lps})
    args = model.args
    params = dict(tree_flatten(model.parameters()))
    result = {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
        "prompt_logprobs": prompt_logprobs,
        "greedy": generated,
        "model": {
            "class": f"{type(model).__module__}.{type(model).__name__}",
            "dtype": str(params["model.embed_tokens.weight"].dtype).replace("mlx.core.", ""),
            "rope_theta": float(args.rope_theta),
            "rope_scaling": args.rope_scaling,
            "rms_norm_eps": float(args.rms_norm_eps),
            "kv_a_layernorm_eps": float(model.model.layers[0].self_attn.kv_a_layernorm.eps),
            "scale": float(model.model.layers[0].self_attn.scale),
            "q_lora_rank": args.q_lora_rank,
            "n_routed_experts": args.n_routed_experts,
            "moe_layers": sum(type(layer.mlp).__name__ != "DeepseekV3MLP" for layer in model.model.layers),
        },
        "kv_cache": _kv_cache(cache or []),
        "load_s": round(loaded - started, 1),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)


def _kv_cache(cache: list[Any]) -> dict[str, Any]:
    """What MLX-LM's prompt cache holds after the last greedy prompt: per layer its class, the heads and width of
    its ``keys`` (DeepSeek-V3 in MLX-LM: the normalised latent) and ``values`` (the rotated rope key), the tokens
    held and the dtype."""
    layers: list[dict[str, Any]] = []
    for c in cache:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is None or values is None:
            layers.append({"class": type(c).__name__})
            continue
        layers.append({
            "class": type(c).__name__,
            "keys": {"heads": int(keys.shape[1]), "width": int(keys.shape[-1])},
            "values": {"heads": int(values.shape[1]), "width": int(values.shape[-1])},
            "tokens": int(getattr(c, "offset", 0)),
            "dtype": str(keys.dtype).replace("mlx.core.", ""),
        })
    return {"layers": layers}


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python probe.py EXPORT REQUEST.json RESULT.json")
    main(*sys.argv[1:])
