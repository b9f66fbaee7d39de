"""What vLLM accepts, decided from a config before any work: the row its MLA kernels allocate, the head widths its
prefill takes, the widths it runs a checkpoint at (:func:`served_shape`) and what an export refusal names instead
(:data:`PLUGIN_ROUTE`).

vLLM's MLA kernels allocate one fixed row per token per layer whatever the checkpoint holds: ``kv_lora_rank`` 512
plus one shared rope head of 64 dims (FlashMLA on GPU, ``AMX_MLA`` on CPU; its GPU prefill needs a rope head of 64),
and one ``kv_lora_rank`` for every layer. The conversion steers by these (:mod:`~mla_convert.engines.vllm.shape`,
:mod:`~mla_convert.engines.precheck`), the DeepSeek-V3 export enforces them
(:mod:`~mla_convert.engines.deepseek_v3.mapping`) and the plugin serves by them (:mod:`~mla_convert.engines.vllm.plugin`):
this module sits below all of them (scripts/imports.py), and imports nothing but the standard library, since the
plugin imports it inside vLLM's environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Engine targets that fix the served row: target -> (kv_lora_rank, qk_rope_head_dim) the engine allocates.
ENGINE_ROWS = {"vllm": (512, 64), "vllm-cpu": (512, 64)}
#: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) each engine target's prefill accepts, smallest first (vLLM's GPU
#: MLA prefill on Hopper; its CPU backends AMX_MLA, CPU_SDPA_MLA): the export pads to the smallest holding the
#: checkpoint's widths, the conversion reduces a wider query NoPE width (``--qk-nope-head-dim``).
ENGINE_HEAD_DIMS = {"vllm": ((64, 64, 128), (128, 64, 128), (192, 64, 256)), "vllm-cpu": ((128, 64, 128),)}
#: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) vLLM's GPU MLA prefill accepts on Hopper (smallest first).
VLLM_GPU_HEAD_DIMS = ENGINE_HEAD_DIMS["vllm"]
#: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) of vLLM's CPU MLA backends (AMX_MLA, CPU_SDPA_MLA).
VLLM_CPU_HEAD_DIMS = ENGINE_HEAD_DIMS["vllm-cpu"]
#: The latent width vLLM's FlashMLA (GPU) and AMX_MLA (CPU) decode take.
VLLM_KV_LORA_RANK = ENGINE_ROWS["vllm"][0]  # the latent width of the engine row
#: The route an export refusal names for what no DeepSeek-V3 file holds (biases, scaled RoPE): serve the checkpoint.
PLUGIN_ROUTE = (
    "vLLM serves the MLA checkpoint itself exactly through mla-convert's plugin, with no export (pip install "
    "--no-deps mla-convert into vLLM's environment, then vllm serve CKPT; docs/serving.md)"
)


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


def engine_nope_width(target: str, head_dim: int, kv_lora_rank: int | None) -> int | None:
    """The ``--qk-nope-head-dim`` for ``target`` (``vllm`` | ``vllm-cpu``): the smallest engine NoPE width at least
    ``min(head_dim, kv_lora_rank)`` (the reduction is then exact), else the widest; None when no engine shape
    holds a ``head_dim``-wide value head."""
    widths = [n for n, _, v in ENGINE_HEAD_DIMS[target] if head_dim <= v]
    if not widths:
        return None
    exact = [n for n in widths if n >= min(head_dim, kv_lora_rank or head_dim)]
    return min(exact) if exact else max(widths)
