"""What each export target accepts, decided from the config and the options before any work: the rules the
conversion steers by (:mod:`~mla_convert.convert.options.precheck`), the exporters enforce
(:mod:`~mla_convert.export.deepseek_v3`, :mod:`~mla_convert.export.gguf_file`) and vLLM's plugin serves by
(:mod:`~mla_convert.serve.vllm_plugin`), kept below all three so that the conversion can read them.

- DeepSeek-V3's one rope head: the kept RoPE pairs of every layer placed in one plain-theta table
  (:func:`rope_slots`, :data:`GEOMETRIC_RTOL`), and the table transformers and vLLM compute
  (:func:`transformers_inv_freq`);
- vLLM's MLA backends: the widths they run a checkpoint at (:func:`served_shape`) and what its export
  refusals name instead (:data:`PLUGIN_ROUTE`);
- llama.cpp's quantized KV caches: the latent width they store (:func:`cache_block_rank`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mla_convert.convert.options.engine import ENGINE_HEAD_DIMS, ENGINE_ROWS
from mla_convert.errors import ExportError
from mla_convert.mla.algebra import transformers_inv_freq

#: Largest relative difference between a kept frequency and the ``default`` rope's float32 table.
GEOMETRIC_RTOL = 1e-6
#: Shapes ``export --target`` writes.
#: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) vLLM's GPU MLA prefill accepts on Hopper (smallest first).
VLLM_GPU_HEAD_DIMS = ENGINE_HEAD_DIMS["vllm"]
#: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) of vLLM's CPU MLA backends (AMX_MLA, CPU_SDPA_MLA).
VLLM_CPU_HEAD_DIMS = ENGINE_HEAD_DIMS["vllm-cpu"]
#: The latent width vLLM's FlashMLA (GPU) and AMX_MLA (CPU) decode take.
VLLM_KV_LORA_RANK = ENGINE_ROWS["vllm"][0]  # the latent width of the engine row (convert/options/engine.py)
#: The route an export refusal names for what no DeepSeek-V3 file holds (biases, scaled RoPE): serve the checkpoint.
PLUGIN_ROUTE = (
    "vLLM serves the MLA checkpoint itself exactly through mla-convert's plugin, with no export (pip install "
    "--no-deps mla-convert into vLLM's environment, then vllm serve CKPT; docs/serving.md)"
)



@dataclass(frozen=True)
class RopeSlots:
    """Where each layer's kept RoPE pairs go in DeepSeek's one rope head.

    Attributes:
        inv_freq: ``[P']`` the slots' inverse frequencies (radians per token), ``theta^(-j/P')``, decreasing.
        slots: ``[L][P]`` the slot of each kept pair of each layer.
        parameters: the ``rope_parameters`` of the DeepSeek-V3 config (``rope_type: default``).
        max_rel_error: largest relative difference between a kept frequency and the table engines compute (float32)
            from ``parameters``.
    """

    inv_freq: list[float]
    slots: list[list[int]]
    parameters: dict[str, Any]
    max_rel_error: float

    @property
    def used(self) -> int:
        """Slots some layer uses."""
        return len({s for layer in self.slots for s in layer})


class ServeError(ValueError):
    """A checkpoint whose shape vLLM's MLA backends cannot take; one line: what, and the ``factor`` option to fix it."""


@dataclass(frozen=True)
class ServedShape:
    """The widths vLLM runs a checkpoint at (every padding is zero rows and columns: exact).

    Attributes:
        kv_lora_rank: the latent width vLLM caches (``>=`` every layer's rank; the rest of a row is zeros).
        qk_rope_head_dim: the rope width vLLM caches: the checkpoint's ``R`` rope heads of ``d_R`` side by side,
            then zeros; query head ``h`` fills only its rope head's block.
        qk_nope_head_dim / v_head_dim: each head's NoPE query/key and value widths (zero-padded).
        ranks: the checkpoint's per-layer ``kv_lora_rank``.
        rope_heads / rope_width: ``R`` and ``d_R`` of the checkpoint.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    ranks: tuple[int, ...]
    rope_heads: int
    rope_width: int

    @property
    def cache_width(self) -> int:
        """Values vLLM caches per token per layer (one latent head)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def served_shape(config: Any, target: str = "vllm-cpu") -> ServedShape:
    """The widths of ``config`` (an ``mla`` config) in vLLM's MLA backends of ``target`` (``vllm-cpu``: AMX_MLA and
    CPU_MLA, 512 + 64 and qk_nope / v_head 128; ``vllm``: FlashMLA's 512 + 64 and the smallest (qk_nope, v_head)
    pair its prefill accepts that holds the checkpoint's).

    Raises:
        ServeError: a rank over the engine's latent width, rope heads wider than its rope width, or NoPE / value
            widths no accepted pair holds (each names the ``factor`` option that fits the engine).
    """
    rank_cap, rope_cap = ENGINE_ROWS[target]
    given = config.kv_lora_rank
    ranks = (
        [int(r) for r in given] if isinstance(given, list) else [int(given)] * int(config.num_hidden_layers)
    )
    rope = int(config.num_rope_heads) * int(config.qk_rope_head_dim)
    if max(ranks) > rank_cap:
        raise ServeError(
            f"kv_lora_rank {max(ranks)} is over the {rank_cap} vLLM's MLA backends cache: convert with "
            f"--kv-lora-rank {rank_cap} or a smaller --cache-fraction"
        )
    if rope > rope_cap:
        raise ServeError(
            f"{config.num_rope_heads} rope head(s) of {config.qk_rope_head_dim} need {rope} rope values, "
            f"vLLM's MLA backends cache {rope_cap}: convert again with factor (one shared rope head) and --rope-pairs "
            f"{rope_cap // 2} or fewer"
        )
    nope, v = int(config.qk_nope_head_dim), int(config.v_head_dim)
    fits = [(n, vv) for n, r, vv in ENGINE_HEAD_DIMS[target] if r == rope_cap and nope <= n and v <= vv]
    if not fits:
        widest = max(n for n, _, _ in ENGINE_HEAD_DIMS[target])
        raise ServeError(
            f"qk_nope_head_dim {nope} / v_head_dim {v} fit none of the head shapes vLLM's {target} MLA "
            f"backends take {[(n, vv) for n, _, vv in ENGINE_HEAD_DIMS[target]]}: convert with "
            f"--qk-nope-head-dim {widest} (or --target {target})"
        )
    return ServedShape(
        rank_cap,
        rope_cap,
        fits[0][0],
        fits[0][1],
        tuple(ranks),
        int(config.num_rope_heads),
        int(config.qk_rope_head_dim),
    )


def cache_block_rank(kv_lora_rank: int, rope: int, block: int) -> int | None:
    """The smallest latent width ``>= kv_lora_rank`` that is a multiple of ``block`` with the K row
    ``width + rope`` one too (llama.cpp's quantized caches store whole blocks of ``block`` values and view the
    latent as V, so both must be); None when ``rope`` is not a multiple of ``block`` (no width makes both).
    ``block`` <= 1: ``kv_lora_rank`` itself."""
    if block <= 1:
        return kv_lora_rank
    if rope % block:
        return None
    return -(-kv_lora_rank // block) * block



# ------------------------------------------------------------------------------------------------ rope
def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _lattice(logs: list[float]) -> float | None:
    """The largest ``lam`` with every ``l`` in ``logs`` an integer multiple of it (to ``1e-4`` of a step)."""
    positive = sorted(x for x in logs if x > 1e-9)
    if not positive:
        return None
    for k in range(1, 257):
        lam = positive[0] / k
        steps = [round(x / lam) for x in positive]
        if all(abs(x / lam - j) < 1e-4 for x, j in zip(positive, steps, strict=True)):
            # least squares over every kept frequency: the float32 rounding of one does not set the ratio
            return sum(j * x for j, x in zip(steps, positive, strict=True)) / sum(j * j for j in steps)
    return None


def rope_slots(inv_freq: list[list[list[float]]], n_slots: int | None = None) -> RopeSlots:
    """The slots of one plain-theta table ``theta^(-j/n)`` holding every layer's kept pairs (module docstring).

    Args:
        inv_freq: ``[L][1][P]`` the checkpoint's ``rope_inv_freq`` (one rope head per layer).
        n_slots: the table length (``qk_rope_head_dim / 2``) an engine fixes; None: the fewest that hold the pairs.

    Raises:
        ExportError: a layer keeps one frequency twice, the kept frequencies are not powers of one ratio (a
            scaled source RoPE), or they need more than ``n_slots`` slots; the message says what to convert with.
    """
    per_layer = [[_f32(f) for f in layer[0]] for layer in inv_freq]
    for i, freqs in enumerate(per_layer):
        if len(set(freqs)) != len(freqs):
            raise ExportError(
                f"layer {i} keeps the same RoPE frequency for several KV heads (--rope-strategy rotation with more "
                "pairs than head_dim / 2); DeepSeek's one rope head holds each frequency once: convert with "
                "--rope-pairs at most head_dim / 2, or another --rope-strategy"
            )
    union = sorted({f for freqs in per_layer for f in freqs}, reverse=True)
    if any(f > 1.0 or f <= 0 for f in union):
        raise ExportError("a kept RoPE frequency is above 1 rad/token or not positive: no rope_theta gives it")
    logs = [-math.log(f) for f in union]
    lam = _lattice(logs)
    if lam is None and any(x > 1e-9 for x in logs):
        raise ExportError(
            "the kept RoPE frequencies are not powers of one ratio (a scaled source RoPE: llama3, YaRN, longrope); "
            "serving engines apply only a plain rope_theta to DeepSeek models, so no export is exact: convert with "
            "--rope-strategy high and no more --rope-pairs than the pairs the scaling leaves unscaled (factor --export "
            f"steers to them; inspect says how many); or, with no export, {PLUGIN_ROUTE}"
        )
    steps = {f: round(x / lam) if lam else 0 for f, x in zip(union, logs, strict=True)}
    need = max(steps.values()) + 1
    n = n_slots or need
    if need > n:
        raise ExportError(
            f"the kept RoPE frequencies span {need} steps of one geometric table; this target's rope head holds "
            f"{n} (qk_rope_head_dim {2 * n}): convert with --rope-strategy high --rope-pairs {n} or fewer pairs"
        )
    theta = math.exp((lam or 1.0) * n)
    params = {"rope_type": "default", "rope_theta": theta}
    table = transformers_inv_freq(params, n)
    err = 0.0
    for f in union:
        err = max(err, abs(float(table[steps[f]]) - f) / f)
    if err > GEOMETRIC_RTOL:
        raise ExportError(
            f"the kept RoPE frequencies are a geometric table only to {err:.1e} relative (over {GEOMETRIC_RTOL:g}); "
            "no plain rope_theta reproduces them"
        )
    return RopeSlots(table.tolist(), [[steps[f] for f in freqs] for freqs in per_layer], params, err)
