"""Peak memory and disk of ``mla-convert factor`` (the memory and disk halves of :mod:`mla_convert.convert.estimate.estimate`,
whose docstring gives the formulas), from :func:`~mla_convert.convert.estimate.estimate.factor_shape`."""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from mla_convert.convert.estimate.estimate import (
    FINITE_BYTES,
    GB,
    RUNTIME_BYTES,
    FactorShape,
    Phase,
    factor_shape,
    parse_size,
)
from mla_convert.convert.options.options import ConvertOptions


def _chunk_windows(s: FactorShape, windows: int) -> int:
    """Windows of one chunk when ``windows`` run (:func:`~mla_convert.convert.layer.layers.chunk_rows`)."""
    from mla_convert.convert.layer.layers import chunk_rows

    return max(1, min(chunk_rows(s.heads, s.window, s.hidden, s.intermediate), windows))


def _chunk_bytes(s: FactorShape, windows: int) -> float:
    """Activations of one chunk: ``4 (3 H T² + 3 T I + 8 T d)`` bytes per window, the formula
    :data:`~mla_convert.convert.layer.layers.CHUNK_BYTES` bounds."""
    t = s.window
    per_window = 4 * (3 * s.heads * t * t + 3 * t * s.intermediate + 8 * t * s.hidden)
    return float(per_window * _chunk_windows(s, windows))


def factor_phases(
    options: ConvertOptions, src: Any, max_shard_size: str | int | None = None, refit_modes: Collection[str] = ()
) -> list[Phase]:
    """The phases of ``mla-convert factor`` (:func:`~mla_convert.convert.pipeline.job.run_factor`, CPU) in bytes; the
    module docstring lists what each holds (``refit_modes``: as :func:`factor_shape` takes them).

    Raises:
        ValueError: a ``max_shard_size`` huggingface_hub cannot read.
    """
    from mla_convert.artifacts.shards import DEFAULT_MAX_SHARD_SIZE
    from mla_convert.convert.pipeline.job import SAMPLE_MAX_BYTES
    from mla_convert.metrics import head_scores

    s = factor_shape(options, src, refit_modes)
    shard_max = parse_size(max_shard_size if max_shard_size is not None else DEFAULT_MAX_SHARD_SIZE)
    d, t, n, m, e = s.hidden, s.window, s.calib, s.held, s.evaluation
    tok = s.tokens
    row = 4.0 * d  # bytes of one token of a float32 stream
    chunk_v = int(inspect.signature(head_scores).parameters["vocab_chunk"].default)

    base: tuple[tuple[str, float], ...] = (("runtime", RUNTIME_BYTES),)
    if s.gguf_bytes:
        base += (("mapped GGUF file", float(s.gguf_bytes)),)
    seq = tok["calib"] if s.refit_windows else 0  # the sequential refit's windows, converted (a float32 stream)
    streams1 = row * (tok["calib"] + 2 * (tok["held"] + tok["eval"] + tok["probe"]) + seq)
    streams2 = row * (2 * tok["eval"] + tok["held"] * (2 if s.refit else 1) + tok["probe"] + seq)
    pass1 = base + (("streams (source and converted)", streams1),)
    pass2 = base + (("streams", streams2),)

    def layer_items(float32_params: float, what: str) -> tuple[tuple[str, float], ...]:
        """One layer in float32 and the source pages it was read from (the same pages for a float32 source)."""
        if s.layer_float32_stored:
            return ((f"{what} (float32, mapped source)", 4.0 * float32_params),)
        if s.gguf_bytes:
            return ((f"{what} (float32)", 4.0 * float32_params),)
        return (
            (f"{what} (float32)", 4.0 * float32_params),
            ("its mapped source pages", float(s.layer_stored)),
        )

    def pages_only() -> tuple[tuple[str, float], ...]:
        if s.gguf_bytes:
            return ()
        return (("layer's mapped source pages", float(s.layer_stored)),)

    emb_pages = () if s.gguf_bytes else (("embedding pages (released after layer 0)", float(s.embed_stored)),)
    attn64 = ("float64 attention weights", 8.0 * s.attn_params)
    stats = ("statistics (2 x float64 d x d)", 16.0 * d * d)
    captures = _captures(s)
    cap_name = "captures (refit + held-out)" if s.refit else "captures (held-out)"
    r = s.rows
    target = 8.0 * (r * d + 2 * r * r)  # W, L and the Gram's eigenvectors (C is the statistics')
    p1_file = 8.0 * (r * d + 2 * r * r + d * d) + captures
    stats_tmp = 8.0 * t * (d + (s.heads + s.kv_heads) * s.head_dim)  # per window: float64 x, q, k
    conv_layer = s.layer_params - s.attn_params + s.conv_attn_params
    hdv = s.heads * s.head_dim  # o_proj input width
    vocab_f = float(s.vocab)

    phases: list[Phase] = []
    if s.gguf_bytes:
        embed_items = (("embedding table (float32, dequantized twice)", 8.0 * vocab_f * d),)
    else:
        embed_items = (("embedding table pages", float(s.embed_stored)),)
    phases.append(
        Phase("factor", "embed", pass1 + embed_items + (("finiteness check (one chunk)", FINITE_BYTES),))
    )
    biggest = max(n, m, e)
    phases.append(
        Phase(
            "factor",
            "source forward (layer 0)",
            pass1
            + (("copy of the stream being run", row * biggest * t),)
            + emb_pages
            + layer_items(s.layer_params, "one source layer")
            + (attn64, stats, (cap_name, captures))
            + (("activations of one chunk", _chunk_bytes(s, biggest) + stats_tmp * _chunk_windows(s, n)),),
        )
    )
    phases.append(
        Phase(
            "factor",
            "plan (layer 0)",
            pass1
            + emb_pages
            + (
                (("layer (float32, mapped source)", 4.0 * s.layer_params),)
                if s.layer_float32_stored
                else pages_only()
            )
            + (attn64, stats, (f"{cap_name} and their concatenation", 2 * captures))
            + (
                ("weighted K/V target (float64)", target),
                ("Gram route (C + ridge, L W C, eigendecomposition)", 8.0 * (d * d + 2 * r * d + 3 * r * r)),
            ),
        )
    )
    p1 = ("pass-1 file of the layer (target, C, captures)", p1_file)
    phases.append(
        Phase(
            "factor",
            "factor",
            pass2 + (p1, ("factorization products (float64)", 8.0 * (d * d + 5 * r * d + 2 * r * r))),
        )
    )
    if s.q_reduced_params:  # reduced head by head (steps.layer_state_reduced): one head's wide rows at a time,
        # the reduced rows written in place, and the rest of the layer
        assembled = 8.0 * (s.q_conv_params / s.heads + s.q_reduced_params + s.conv_attn_params - s.q_conv_params)
    else:  # the query map written in place, then its copies
        assembled = 8.0 * (s.q_conv_params + s.conv_attn_params)
    phases.append(
        Phase(
            "factor",
            "assemble",
            pass2
            + (p1,)
            + layer_items(s.layer_params, "one source layer")
            + (attn64, ("MLA attention being assembled (float64)", assembled)),
        )
    )
    if s.refit:
        # ZᵀZ and ZᵀY accumulated one chunk of windows at a time (refit.refit_o_proj): the chunk's float32 and
        # float64 Z and float64 Y, then the Gram matrices, the right-hand side and the solve
        ct = max(1, 2**22 // max(1, s.heads * t * t)) * t
        refit_ws = ct * (4.0 * hdv + 8.0 * hdv + 8.0 * d) + 8.0 * (3 * hdv * hdv + 3 * hdv * d)
        phases.append(
            Phase(
                "factor",
                "refit",
                pass2
                + (p1,)
                + layer_items(conv_layer, "one MLA layer")
                + (("o_proj copy", 4.0 * d * hdv), ("ridge least squares (float64)", refit_ws)),
            )
        )
    phases.append(
        Phase(
            "factor",
            "held-out forward",
            pass2
            + (("copy of the stream being run", row * m * t), p1)
            + layer_items(conv_layer, "one MLA layer")
            + (("o_proj copies", 8.0 * d * hdv), ("activations of one chunk", _chunk_bytes(s, m))),
        )
    )
    phases.append(
        Phase(
            "factor",
            "eval pass",
            pass2
            + (("copy of the stream being run", row * e * t),)
            + layer_items(conv_layer, "one MLA layer")
            + (
                ("source attention read with it (float32)", 4.0 * s.attn_params),
                ("MLA attention file pages", float(s.out_itemsize) * s.conv_attn_params),
                ("activations of one chunk", _chunk_bytes(s, e)),
            ),
        )
    )
    head = (
        ("LM head (float32, dequantized)", 4.0 * vocab_f * d)
        if s.gguf_bytes
        else ("LM head pages", float(s.head_stored))
    )
    phases.append(
        Phase("factor", "score: LM head read", pass2 + (head, ("finiteness check (one chunk)", FINITE_BYTES)))
    )
    c = min(chunk_v, s.vocab)
    score_tmp = 8.0 * 5 * (t - 1) * c + 4.0 * 2 * (t - 1) * c + c * d * (8.0 + s.out_itemsize)
    phases.append(
        Phase("factor", "score: vocabulary chunks", pass2 + (head, (f"one chunk of {c} rows", score_tmp)))
    )
    largest_out = float(max(s.largest_params, s.q_conv_params)) * s.out_itemsize
    shard = min(max(float(shard_max), largest_out), s.output_bytes)
    same = s.out_itemsize == s.largest_itemsize and not s.gguf_bytes  # the shard holds the mapped tensor
    reading = () if same else (("tensor being read", float(s.largest_stored)),)
    phases.append(
        Phase(
            "factor",
            "write",
            pass2
            + (("one output shard", shard),)
            + reading
            + (("finiteness check (one chunk)", FINITE_BYTES),),
        )
    )
    if 4 * s.output_params <= SAMPLE_MAX_BYTES:
        # the sample loads the checkpoint in float32 (decoding a bf16 model on a CPU would add DECODE_GROWTH)
        upcast = 4.0 * s.output_params if s.out_itemsize < 4 else 0.0
        phases.append(
            Phase(
                "factor",
                "sample (the written checkpoint loaded in float32 for the report's greedy text)",
                pass2
                + (
                    (f"written checkpoint, mapped ({s.out_dtype})", s.output_bytes),
                    ("its float32 copy", upcast),
                ),
            )
        )
    return phases


@dataclass(frozen=True)
class Disk:
    """Bytes of the output and of the work folder ``.OUT.factor/`` at its peak (which includes the staged output)."""

    output: float
    work_peak: float
    items: tuple[tuple[str, float], ...]


def _captures(s: FactorShape) -> float:
    """Bytes of one layer's kept float32 captures: the held-out attention inputs and outputs, and the refit's
    source outputs (with the source inputs too for the teacher-forced refit)."""
    refit = 0 if not s.refit else 8 if s.teacher_inputs else 4
    return s.hidden * (refit * s.tokens["calib"] + 8.0 * s.tokens["held"])


def factor_disk(options: ConvertOptions, src: Any, refit_modes: Collection[str] = ()) -> Disk:
    """The disk a conversion writes (module docstring; ``refit_modes``: as :func:`factor_shape` takes them)."""
    s = factor_shape(options, src, refit_modes)
    d, hd, tok = s.hidden, s.head_dim, s.tokens
    n_l = s.layers
    captures = _captures(s)
    p1 = 8.0 * (s.rows * d + s.rows * s.rows + 2 * d * d) + captures
    nope_rows = s.rows - s.kv_heads * hd  # key rows at most
    plan = 8.0 * (
        s.heads * (s.d_nope + s.d_rope) * hd
        + nope_rows * s.kv_heads * hd
        + s.rope_heads * s.d_rope * s.kv_heads * hd
    )
    attn = s.out_itemsize * (s.conv_attn_params + (d * s.heads * hd if s.refit else 0))
    state = (
        4.0 * d * (tok["calib"] * (2 if s.refit_windows else 1) + 2 * (tok["held"] + tok["eval"] + tok["probe"]))
    )
    gguf_copies = 4.0 * n_l * s.layer_params if s.gguf_bytes else 0.0
    items = (
        (f"pass-1 files ({n_l} x {p1 / GB:.2f} GB)", n_l * p1),
        ("RoPE plans", n_l * plan),
        (f"MLA attention files ({s.out_dtype})", n_l * attn),
        ("stream state", state),
    ) + ((("float32 layer copies of the GGUF", gguf_copies),) if gguf_copies else ())
    # pass 2 removes each layer's pass-1 file once the layer is written: the peak is at the end of pass 1 or
    # with the output staged (the GGUF copies go in pass 3, before the output)
    end_pass1 = n_l * (p1 + plan) + state + gguf_copies
    work_peak = max(end_pass1, n_l * (plan + attn) + state + max(gguf_copies, s.output_bytes))
    return Disk(s.output_bytes, work_peak, items + (("staged output", s.output_bytes),))
