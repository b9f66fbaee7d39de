"""How long ``mla-convert factor`` will take on the reference machine, before it runs, from the config, the
tensor headers and the options (no weight is read): the time half of :mod:`mla_convert.convert.estimate.estimate`.

:func:`factor_time`: FLOPs of each stage divided by throughputs measured on the reference machine
(:data:`FP32_GFLOPS` and the constants after it); an estimate for that machine, not a promise. Sizes come from
:func:`~mla_convert.convert.estimate.estimate.factor_shape`, the files written and read back from
:func:`~mla_convert.convert.estimate.estimate.factor_disk`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from mla_convert.convert.estimate.estimate import GB, factor_shape, peak
from mla_convert.convert.estimate.estimate_memory import factor_disk, factor_phases
from mla_convert.convert.options.options import ConvertOptions, refit_stride

# ---- throughput of the reference machine (the 2-core CPU the README's timings come from) ----
# Measured with torch 2.13 CPU while other jobs loaded the machine (load average ~4 on 2 cores), one thread:
#: float32 matmul GFLOP/s of one thread (2048 x 2048 ``a @ b``; 74 with two threads under the same load).
FP32_GFLOPS = 60.0
#: float64 matmul GFLOP/s of one thread (same measurement; 28.5 with two threads under load).
FP64_GFLOPS = 30.0
#: Seconds per ``n³`` of ``torch.linalg.eigh`` (float64, one thread): 0.062 s at n = 576 (3.2e-10), 3.3 s at
#: n = 2048 (3.8e-10).
EIGH_S_PER_N3 = 3.8e-10
# Fitted to the bundled model's default conversion with two threads (``mla-convert factor smollm2-135m OUT
# --device cpu``: 16384 calibration tokens in bfloat16 autocast, SDPA prefill; 137 s wall on a 2-core AMD EPYC where
# the 8192-token float32 default of commit 156b868 took 142 s, so each stage is scaled by 133/142 to the reference
# machine's 133 s for that default): source forward 33 s, plan 4.3 s, factor 4.6 s, assemble + refit 34 s,
# held-out forward 17 s, evaluation forward 10.5 s, score 5 s, with the FLOP counts of :func:`factor_time`:
#: Fraction of the one-thread float64 predictions above that two threads took (plan 4.6 s of 7.2 s predicted,
#: factor 2.6 s of 5.0 s).
FLOAT64_TWO_THREADS = 0.6
#: Effective GFLOP/s of the source layers' float32 forward (held-out, evaluation and probe windows: 1.55 TFLOP
#: in 11 s; also the float32 pair-norm projections of the statistics).
SOURCE_FORWARD_GFLOPS = 137.0
#: Effective GFLOP/s of the source layers' forward over the calibration windows in bfloat16 autocast
#: (``--calib-precision bfloat16``, the default: 4.06 TFLOP in 12.3 s; 2.4x the float32 rate above, which was
#: fitted under load, where one layer alone timed 1.8x on an idle machine).
CALIB_BF16_GFLOPS = 330.0
#: Effective GFLOP/s of the MLA layers' forward, absorbed path with the SDPA prefill (1.80 TFLOP in 16.8 s,
#: 1.21 in 10.5 s).
CONVERTED_FORWARD_GFLOPS = 110.0
#: Effective GFLOP/s of assemble + refit (3.22 TFLOP in 34 s).
REFIT_GFLOPS = 94.0
#: Effective GFLOP/s of the LM-head scoring (0.69 TFLOP of the evaluation and held-out windows in 5 s).
SCORE_GFLOPS = 139.0
#: Bytes written per second to the work folder and the output (1.7 GB of pass-1 files in 2.3 s).
IO_BYTES_PER_S = 0.73e9
#: Seconds besides the layers: imports, source checks, text and embedding (5 s), shards, sample, report (4 s).
SETUP_S = 9.0
#: Effective GFLOP/s of the fitted reconstruction (``--reconstruct-steps``: Adam on the converted attention, forward
#: and backward about 3x the forward's FLOPs): SmolLM2-135M's 30 layers at 50 steps of 4 windows of 512 took 636 s
#: on one thread beside other jobs (benchmarks/reconstruct.py; 41.8 TFLOP by :func:`factor_time`'s count).
RECONSTRUCT_GFLOPS = 66.0
#: Windows per Adam step of the reconstruction (``mla_convert.convert.layer.reconstruct.BATCH``; this module imports
#: no torch).
RECONSTRUCT_BATCH = 4


@dataclass(frozen=True)
class Machine:
    """The effective throughputs :func:`factor_time` divides each stage's work by (GFLOP/s unless named otherwise).

    Attributes:
        name: what the machine is, for the lines ``inspect`` prints.
        float64_gflops: float64 matrix products (statistics, plans, factorization).
        eigh_s_per_n3: seconds per ``n³`` of one float64 eigendecomposition.
        source_forward_gflops, calib_bf16_gflops: the source layers' forward in float32 (held-out, evaluation) and
            over the calibration windows in bfloat16 autocast.
        converted_forward_gflops, refit_gflops, score_gflops, reconstruct_gflops: the MLA layers' forward, the
            assembly and ``o_proj`` refit, the LM-head scoring, the fitted reconstruction.
        io_bytes_per_s: the work folder's and the output's files written and read back.
        setup_s: seconds besides the layers.
    """

    name: str
    float64_gflops: float
    eigh_s_per_n3: float
    source_forward_gflops: float
    calib_bf16_gflops: float
    converted_forward_gflops: float
    refit_gflops: float
    score_gflops: float
    reconstruct_gflops: float
    io_bytes_per_s: float
    setup_s: float


#: The reference CPU: every rate measured or fitted there (the constants above).
REFERENCE_CPU = Machine(
    "the reference CPU", FP64_GFLOPS / FLOAT64_TWO_THREADS, EIGH_S_PER_N3 * FLOAT64_TWO_THREADS,
    SOURCE_FORWARD_GFLOPS, CALIB_BF16_GFLOPS, CONVERTED_FORWARD_GFLOPS, REFIT_GFLOPS, SCORE_GFLOPS,
    RECONSTRUCT_GFLOPS, IO_BYTES_PER_S, SETUP_S,
)
#: Fraction of a GPU's published peak its stages are assumed to reach (never measured here: no GPU was lent;
#: ``scripts/gpu_check.sh --parts factor8b`` measures an 8B-shaped conversion on CUDA).
GPU_EFFICIENCY = 0.5
#: One NVIDIA H100 SXM by its published dense peaks (TFLOP/s): float64 on tensor cores 67, float32 67 (``factor``
#: leaves TF32 off), bfloat16 989; each at :data:`GPU_EFFICIENCY`. Its float64 eigendecomposition (cuSOLVER
#: ``syevd``, bound by the tridiagonal reduction's memory traffic, not by the peak) is assumed 1 s at n = 4096. Files
#: go to the same disk as on the reference CPU.
H100 = Machine(
    "one H100", 67e3 * GPU_EFFICIENCY, 1.0 / 4096**3, 67e3 * GPU_EFFICIENCY, 989e3 * GPU_EFFICIENCY,
    67e3 * GPU_EFFICIENCY, 67e3 * GPU_EFFICIENCY, 67e3 * GPU_EFFICIENCY, 67e3 * GPU_EFFICIENCY, IO_BYTES_PER_S,
    SETUP_S,
)


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds per stage on one :class:`Machine` (by default the reference CPU's fitted throughputs)."""

    stages: dict[str, float]

    @property
    def total(self) -> float:
        """Seconds of all stages."""
        return sum(self.stages.values())


def factor_time(
    options: ConvertOptions, src: Any, candidates: int = 1, measured: int | None = None,
    machine: Machine = REFERENCE_CPU,
) -> TimeEstimate:
    """Seconds of each stage of a conversion on ``machine`` (the reference CPU: measured throughputs; the
    :data:`H100`: assumed ones): FLOPs / throughput.

    ``candidates``: RoPE pairs on the source's candidate ladder (:mod:`mla_convert.convert.pipeline.rope_split`; 1: none):
    each other one's plan and spectrum in pass 1; ``measured`` (default: ``candidates``): the splits the search
    converts (plan, factorization, held-out forward and scoring each).

    Forward passes: ``2 x parameters`` per token and layer, plus ``4 T H h`` for the source attention's scores
    and values (the masked full ``T x T``), or ``2 T H (2 d_c + d_R)`` on the MLA absorbed path. Statistics,
    plan, factorization and refit: their float64 matrix products at :data:`FP64_GFLOPS`, eigendecompositions and
    SVDs by the measured ``c n³`` constants. I/O: the work folder's files written and read back, and the output.
    """
    s = factor_shape(options, src)
    d, h, g, hd, t, n_l = s.hidden, s.heads, s.kv_heads, s.head_dim, s.window, s.layers
    tok = s.tokens
    r, d_n, d_c, d_r = s.rows, s.d_nope, s.latent, s.d_rope
    giga = 1e9
    m = machine
    f64 = 1.0 / (m.float64_gflops * giga)  # seconds per float64 FLOP of a matrix product

    def f_src(ctx: int) -> float:
        return 2.0 * s.layer_params + 4.0 * ctx * h * hd

    conv_layer = s.layer_params - s.attn_params + s.conv_attn_params
    absorbed = 2.0 * h * d_n * d_c + 2.0 * h * d_c * hd  # absorb the queries, expand the values

    def f_conv(ctx: int, attention_only: bool = False) -> float:
        params = s.conv_attn_params if attention_only else conv_layer
        return 2.0 * params + absorbed + 2.0 * ctx * h * (2 * d_c + d_r)

    fwd_calib = n_l * tok["calib"] * f_src(t)
    fwd_src = n_l * ((tok["held"] + tok["eval"]) * f_src(t) + tok["probe"] * f_src(tok["probe"]))
    calib_rate = m.calib_bf16_gflops if options.calib_precision == "bfloat16" else m.source_forward_gflops
    stats64 = n_l * tok["calib"] * 2.0 * d * d  # E[x xᵀ]; the pair norms' projections run in float32
    stats32 = n_l * tok["calib"] * 2.0 * d * (h + g) * hd
    hq, gk = h * hd, g * hd
    plan64 = 2.0 * hq * d * d + 2.0 * hq * hq * d + 2.0 * gk * d * d + 2.0 * gk * gk * d
    plan_la = 0.0
    if s.objective == "output":
        # its square root is block-diagonal (linalg.psd_sqrt): G NoPE-key blocks of about nope_width / G rows and G
        # value blocks of head_dim rows, each its own eigendecomposition
        nw = r - g * hd
        blocks3 = nw**3 / g**2 + g * hd**3
        plan64 += h * (2.0 * d_n * d * d + 2.0 * d_n * d_n * d + 2.0 * hd * hd * d) + 4.0 * blocks3
        plan_la += m.eigh_s_per_n3 * blocks3
    # the Gram matrix L W C Wᵀ Lᵀ of the weighted K/V matrix (factorize.gram_eig): L W, (L W) C, then (L W C) (L W)ᵀ
    gram = 4.0 * r * r * d + 2.0 * r * d * d
    plan64 += 2.0 * r * r * d + 2.0 * r * d * d  # the balance's weighted energies
    if s.budget:  # the spectrum: the Gram's eigendecomposition, kept with the target for the factorization
        plan64 += gram
        plan_la += m.eigh_s_per_n3 * r**3
    # the two error traces and solve(L, U); the Gram and its eigendecomposition where no spectrum was taken
    factor64 = 2.0 * (2.0 * r * d * d + 2.0 * r * r * d) + (2.0 / 3.0) * r**3 + (0.0 if s.budget else gram)
    factor_la = 0.0 if s.budget else m.eigh_s_per_n3 * r**3
    windows_calib = tok["calib"] // max(1, t)
    nt = -(-windows_calib // refit_stride(windows_calib, t)) * t if s.refit else 0  # REFIT_TOKENS at most
    refit_fwd = n_l * nt * f_conv(t, attention_only=True)
    seq_fwd = n_l * nt * f_conv(t) if s.sequential else 0.0  # the refit windows through each converted layer
    refit64 = n_l * (2.0 * nt * hq * hq + 4.0 * nt * hq * d + (2.0 / 3.0 + 2.0) * hq**3) if s.refit else 0.0
    assemble64 = n_l * 2.0 * h * (d_n + d_r) * hd * d
    variants = 2 if s.refit else 1
    held_fwd = n_l * (
        variants * tok["held"] * (f_conv(t) + f_conv(t, attention_only=True))
        + tok["probe"] * f_conv(tok["probe"])
    )
    eval_fwd = n_l * tok["eval"] * f_conv(t)
    scored = (t - 1) * (2 * s.evaluation + (2 * s.held if s.refit else 0))
    score = 2.0 * s.vocab * d * scored
    disk = factor_disk(options, src)
    # every file once, and the stream state after every layer of each pass (pass 1's streams, then the later ones)
    state1 = next(b for what, b in disk.items if what == "stream state")
    state2 = 4.0 * d * (2 * tok["eval"] + tok["held"] * (2 if s.refit else 1) + tok["probe"] + (nt if s.sequential else 0))
    io = sum(b for what, b in disk.items if what != "stream state") + n_l * (state1 + 2 * state2)
    stages = {
        "setup and finish": m.setup_s,
        "source forward": (fwd_src + stats32) / (m.source_forward_gflops * giga)
        + fwd_calib / (calib_rate * giga)
        + stats64 * f64,
        "plan": n_l * (plan64 * f64 + plan_la),
        "factor": n_l * (factor64 * f64 + factor_la),
        "assemble + refit": (refit_fwd + refit64 + assemble64) / (m.refit_gflops * giga),
        "held-out forward": (held_fwd + seq_fwd) / (m.converted_forward_gflops * giga),
        "eval forward": eval_fwd / (m.converted_forward_gflops * giga),
        "score": score / (m.score_gflops * giga),  # decide_refit's held-out windows too
        "files": io / m.io_bytes_per_s,
    }
    if (options.reconstruct_steps or 0) > 0 and s.refit:  # every lossy layer fitted on its refit windows, 4 per step
        fit_tokens = (options.reconstruct_steps or 0) * RECONSTRUCT_BATCH * t
        stages["reconstruct"] = n_l * 3.0 * fit_tokens * f_conv(t, attention_only=True) / (m.reconstruct_gflops * giga)
    if candidates > 1:  # each candidate converted as pass 2 does, on the held-out windows (and the refit's)
        plan_s = n_l * (plan64 * f64 + plan_la)
        factor_s = n_l * (factor64 * f64 + factor_la)
        refit_s = (refit_fwd + refit64 + assemble64) / (m.refit_gflops * giga)
        held_s = (n_l * variants * tok["held"] * f_conv(t) + seq_fwd) / (m.converted_forward_gflops * giga)
        score_s = 2.0 * s.vocab * d * (t - 1) * s.held * variants / (m.score_gflops * giga)
        # the source's side of every candidate's KL, once per search: its logits and two float64 [T, C] x [C, d]
        # products (metrics.reference_scores), about three model passes
        reference_s = 3.0 * score_s / variants
        runs = candidates if measured is None else measured
        stages["rope split"] = (
            (candidates - 1) * plan_s + runs * (plan_s + factor_s + refit_s + held_s + score_s) + reference_s
        )
    return TimeEstimate(stages)


def fmt_seconds(seconds: float) -> str:
    """``"45 s"``, ``"12 min"`` or ``"3.1 h"``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def factor_lines(
    options: ConvertOptions, src: Any, max_shard_size: str | int | None = None, candidates: int = 1,
    measured: int | None = None, refit_modes: Collection[str] = (),
) -> list[str]:
    """Lines for ``inspect``: peak memory (its phase and largest items), disk, the time estimate (``candidates``
    and ``measured``: RoPE pairs on the search's ladder and the splits it is expected to convert, as
    :func:`factor_time` takes them), and where this machine runs the default bfloat16 calibration emulated
    (a GPU without bfloat16), that note (its calibrate stage takes several times the estimate).

    Raises:
        ValueError: a ``max_shard_size`` huggingface_hub cannot read.
    """
    from mla_convert.convert.pipeline.device import calib_precision_note
    from mla_convert.convert.pipeline.stream import resolve_device

    top = peak(factor_phases(options, src, max_shard_size, refit_modes))
    items = ", ".join(f"{k} {b / GB:.2f}" for k, b in top.largest(4))
    disk = factor_disk(options, src, refit_modes)
    parts = ", ".join(f"{k} {b / GB:.2f}" for k, b in sorted(disk.items, key=lambda kv: -kv[1])[:3])
    tim = factor_time(options, src, candidates, measured)
    gpu_tim = factor_time(options, src, candidates, measured, machine=H100)
    slow = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in sorted(tim.stages.items(), key=lambda kv: -kv[1])[:3])
    device = resolve_device(options.device)
    gpu = device.type != "cpu"
    emulated = calib_precision_note(options.calib_precision, device)
    where = " (a CPU run; on a GPU the streams and layers move to its memory)" if gpu else ""
    return [
        f"peak memory: ~{top.total / GB:.1f} GB resident, in {top.name}{where} (GB: {items})",
        f"disk: output ~{disk.output / GB:.2f} GB; the work folder .OUT.factor next to OUT grows to "
        f"~{disk.work_peak / GB:.1f} GB with the output staged in it, removed at the end (GB: {parts})",
        f"time: ~{fmt_seconds(tim.total)}, an estimate for the reference CPU (2 cores, {FP32_GFLOPS:.0f} GFLOP/s float32 "
        f"matmul per core, where the bundled model converts in about 128 s without the RoPE split search)"
        f" (largest stages: {slow}); ~{fmt_seconds(gpu_tim.total)} on {H100.name} (assumed: half its published "
        "peak rates, the same disk; not measured)",
    ] + ([f"this machine: {emulated}"] if emulated else [])
