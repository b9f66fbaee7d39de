"""What a converted attention's biases carry, and what a bias-free MLA graph loses without them.

A Qwen2-style source has q/k/v biases. The conversion (docs/math.md, "Biases (exact)") keeps all of their effect,
and drops exactly what the softmax removes:

* **key NoPE part**: adds ``q_nope[h, t] . b`` to every score of query ``(h, t)``, the same for every key, so the
  softmax cancels it. Dropped at conversion, exactly.
* **query** (``q_proj.bias``, ``[H (d_N + d_R)]``): ``b_qN . k_nope[j]`` and ``RoPE_t(b_qR) . k_rope[j]`` differ per
  key ``j``: they move the attention probabilities.
* **rope key** (``kv_a_proj_with_mqa.bias``, non-zero on the rope rows only): ``RoPE_j(b_R)`` turns with the key's
  position ``j``, so its score term differs per key.
* **output** (``o_proj.bias``): the value bias passed through attention (each query's probabilities sum to one, so
  ``sum_j p_j (v_j + b_v) = sum_j p_j v_j + b_v``) plus the source's own output bias: a constant ``W_O b_v + b_O``
  added to the residual stream, whose next RMSNorm is not linear in it.

llama.cpp's ``deepseek2`` graph (and stock vLLM / SGLang DeepSeek attention) has none of these three tensors and no
constant input channel to hold them, so no export of a biased conversion to it is exact. ``export --format gguf
--drop-attention-biases`` writes the conversion without them (:func:`drop_attention_biases`: the function the file
computes), and the export's check measures both what llama.cpp computes against that function (held to the
thresholds) and what dropping costs against the conversion (printed). ``benchmarks/gguf_biases.py`` measures each
part's cost on a real model.
"""

from __future__ import annotations

from typing import Any

import torch

#: Part name -> (the converted checkpoint's bias tensor, config flag, what it does): the biases a bias-free graph drops.
BIAS_PARTS: dict[str, tuple[str, str, str]] = {
    "query": ("q_proj.bias", "q_bias", "the query bias: changes each key's score"),
    "rope_key": ("kv_a_proj_with_mqa.bias", "kv_a_bias", "the rope key's bias: turns with the key's position"),
    "output": ("o_proj.bias", "o_bias", "the value bias passed through attention, plus any o_proj bias of the "
               "source: a constant added to the residual stream"),
}


def attention_bias_parts(config: Any) -> list[str]:
    """The :data:`BIAS_PARTS` a converted checkpoint's config says it carries (empty: a bias-free export is exact).

    Args:
        config: an :class:`~mla_convert.mla.configuration.MLAConfig` (or anything with ``q_bias``, ``kv_a_bias``,
            ``o_bias``).
    """
    return [part for part, (_, flag, _) in BIAS_PARTS.items() if getattr(config, flag, False)]


def bias_free_config(config: Any) -> Any:
    """A shallow copy of ``config`` with every attention bias flag off: what a bias-free export maps."""
    import copy

    out = copy.copy(config)
    for _, flag, _ in BIAS_PARTS.values():
        setattr(out, flag, False)
    return out


@torch.no_grad()
def drop_attention_biases(model: torch.nn.Module, parts: list[str] | None = None) -> list[str]:
    """Zero the attention biases of ``parts`` (default: all of :data:`BIAS_PARTS`) in every layer of an
    :class:`~mla_convert.mla.modeling.MLAForCausalLM`, in place: the function a bias-free export of it computes.

    Returns:
        The parts that were present and zeroed.

    Raises:
        ValueError: a part name not in :data:`BIAS_PARTS`.
    """
    wanted = list(BIAS_PARTS) if parts is None else parts
    unknown = [p for p in wanted if p not in BIAS_PARTS]
    if unknown:
        raise ValueError(f"unknown attention bias part(s) {unknown}; the parts are {', '.join(BIAS_PARTS)}")
    dropped: list[str] = []
    for part in wanted:
        tensor = BIAS_PARTS[part][0]
        for name, param in model.named_parameters():
            if name.endswith(f"self_attn.{tensor}"):
                param.zero_()
                if part not in dropped:
                    dropped.append(part)
    return dropped


def bias_note(parts: list[str]) -> str:
    """One clause naming ``parts`` and what each does (for refusals and the export's line)."""
    return "; ".join(f"{BIAS_PARTS[p][0]} ({BIAS_PARTS[p][2]})" for p in parts)
