"""Real magnitudes for tiny sources (issue 48): attention biases and activation outliers measured on the real models
we have, then generated into tiny random checkpoints of the same family.

``python tests/magnitudes.py`` measures the real models (Qwen2.5-Coder-1.5B-Instruct for Qwen2's q/k/v biases,
SmolLM2-135M-Instruct, a Llama, for its input-norm outliers: up to 7.9x the rms in layer 0) and writes ``tests/magnitudes.json``; the tests read that
file (no real model needed) through :func:`write_real_magnitude_source`.

What is kept per profiled layer (the first two layers, where Qwen2's key biases peak, and one middle layer):

* ``k_bias_pairs [G][d/2]``: each KV head's key-bias norm per RoPE pair ``k`` (dims ``k`` and ``k + d/2``, HF's
  rotate_half layout; pair 0 rotates fastest). Qwen2.5-Coder-1.5B layer 0: up to 456 on the slowest pairs.
* ``q_bias_pairs [H][d/2]`` and ``v_bias_rms``: the same for the queries (up to 29), the value bias's rms.
* ``norm_peak``: max / rms of the layer's input-norm weight (the activation outliers a Llama's norm makes).
* ``weight_rms``: rms of the q/k/v weights, to express the biases against the weights' scale.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PROFILE = Path(__file__).with_name("magnitudes.json")
#: Source layers profiled: the first two (Qwen2's key biases peak there) and one from the middle.
LAYERS = (0, 1, "middle")


def measure(name: str) -> dict[str, Any]:
    """The profile of the bundled source ``name`` (see the module docstring)."""
    import torch

    from mla_convert.sources.checkpoint import open_source

    src = open_source(name)
    h, g, d = src.num_heads, src.num_kv_heads, src.head_dim
    layers = []
    for layer in LAYERS:
        i = src.num_layers // 2 if layer == "middle" else int(layer)
        w = src.attention_weights(i)
        row: dict[str, Any] = {"layer": i}

        def pairs(b: torch.Tensor, heads: int) -> list[list[float]]:
            b = b.reshape(heads, d)
            return (b[:, : d // 2].square() + b[:, d // 2 :].square()).sqrt().round(decimals=4).tolist()

        if "bk" in w:
            row["k_bias_pairs"] = pairs(w["bk"], g)
            row["q_bias_pairs"] = pairs(w["bq"], h)
            row["v_bias_rms"] = float(w["bv"].square().mean().sqrt())
        norm = src.tensor(f"model.layers.{i}.input_layernorm.weight")
        row["norm_rms"] = float(norm.square().mean().sqrt())
        row["norm_peak"] = float(norm.abs().max() / norm.square().mean().sqrt())
        row["weight_rms"] = {p: float(w[p].square().mean().sqrt()) for p in "qkv"}
        layers.append(row)
    return {"source": name, "num_heads": h, "num_kv_heads": g, "head_dim": d, "hidden_size": src.hidden_size,
            "layers": layers}


def profile(name: str) -> dict[str, Any]:
    """The committed profile of ``name`` (``qwen2.5-coder-1.5b``)."""
    return json.loads(PROFILE.read_text())[name]


def add_real_biases(model: Any, seed: int = 0) -> Any:
    """Give the Qwen2 ``model`` (transformers, any size) q/k/v biases with Qwen2.5-Coder-1.5B's magnitudes, in place:
    layer ``i`` takes profiled layer ``i``'s per-pair bias norms (each KV head's key bias on the same RoPE pairs,
    cycling the real heads where the model has more; a head_dim other than 128 takes the slower pair of each group,
    so the slowest pairs keep the largest biases), each pair at a random angle, values at the real rms. They are
    scaled so the bias-to-signal ratio is the real model's: a projection's output on a normed input has rms about
    ``weight_rms x sqrt(hidden) x norm_rms``, so each bias is multiplied by the model's value of it over the real
    one's. Returns ``model``."""
    import torch

    prof = profile("qwen2.5-coder-1.5b")
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(seed)

    def biased(pair_norms: list[list[float]], heads: int, scale: float) -> torch.Tensor:
        real = torch.tensor(pair_norms, dtype=torch.float64)
        pairs, real_pairs = d // 2, real.shape[1]
        cols = [(k + 1) * real_pairs // pairs - 1 for k in range(pairs)]
        n = real[[h % len(real) for h in range(heads)]][:, cols] * scale  # [heads, d/2]
        angle = torch.rand(n.shape, generator=gen, dtype=torch.float64) * 2 * math.pi
        return torch.cat([n * angle.cos(), n * angle.sin()], dim=-1).reshape(-1).float()

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            row = prof["layers"][min(i, len(prof["layers"]) - 1)]
            att = layer.self_attn
            norm_rms = float(layer.input_layernorm.weight.square().mean().sqrt())
            for proj, key in ((att.q_proj, "q"), (att.k_proj, "k"), (att.v_proj, "v")):
                ours = float(proj.weight.square().mean().sqrt()) * math.sqrt(cfg.hidden_size) * norm_rms
                scale = ours / (row["weight_rms"][key] * math.sqrt(prof["hidden_size"]) * row["norm_rms"])
                if key == "v":
                    proj.bias.normal_(0, row["v_bias_rms"] * scale, generator=gen)
                else:
                    proj.bias.copy_(biased(row[f"{key}_bias_pairs"], proj.out_features // d, scale))
    return model


def write_real_magnitude_source(folder: Path, layers: int = 2, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random Qwen2 (hidden 256, 4 heads, 2 KV heads, head_dim 128 as Qwen2.5's, SmolLM2's vocabulary) with
    Qwen2.5-Coder-1.5B's bias magnitudes (:func:`add_real_biases`). Saved with ``save_pretrained`` into ``folder``,
    the bundled tokenizer beside it."""
    import torch
    from tiny import TINY, copy_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": profile("qwen2.5-coder-1.5b")["head_dim"], "num_hidden_layers": layers,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **overrides}
    torch.manual_seed(seed)
    model = add_real_biases(Qwen2ForCausalLM(Qwen2Config(**cfg)), seed)
    model.save_pretrained(str(folder))
    copy_tokenizer(folder)
    return folder


def add_norm_outliers(folder: Path, seed: int = 0) -> Path:
    """Give the tiny checkpoint in ``folder`` the input-norm outliers of a real Llama (SmolLM2-135M's profile):
    layer ``i``'s ``input_layernorm`` weight gets a few channels at the real ``norm_peak`` x its rms, so the
    attention inputs carry activation outliers of the real ratio; rewritten in place."""
    import torch
    from safetensors.torch import load_file, save_file

    prof = profile("smollm2-135m")
    (weights,) = folder.glob("*.safetensors")
    tensors, gen = load_file(str(weights)), torch.Generator().manual_seed(seed)
    i = 0
    while f"model.layers.{i}.input_layernorm.weight" in tensors:
        row = prof["layers"][min(i, len(prof["layers"]) - 1)]
        w = tensors[f"model.layers.{i}.input_layernorm.weight"]
        w = (1 + 0.2 * torch.randn(w.shape, generator=gen)).abs()
        idx = torch.randperm(w.numel(), generator=gen)[: max(1, w.numel() // 64)]
        w[idx] = row["norm_peak"] * float(w.square().mean().sqrt())
        tensors[f"model.layers.{i}.input_layernorm.weight"] = w
        i += 1
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


if __name__ == "__main__":
    PROFILE.write_text(json.dumps({n: measure(n) for n in ("qwen2.5-coder-1.5b", "smollm2-135m")}, indent=1) + "\n")
    print(f"wrote {PROFILE}")
