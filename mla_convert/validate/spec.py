"""The ladder's tables: each rung's number, name, what it compares and its tolerances (float32), and the
tolerances per dtype of the checks that compute in a float16/bfloat16 checkpoint's own dtype.

The rungs check against the ``TOL_*`` constants and :data:`TOLERANCES`; ``validation.md`` (per checkpoint)
and README.md's rung table (``benchmarks/readme.py rungs``) print :data:`RUNGS`, whose tolerance texts are
built from the same constants, so a tolerance changed here changes everywhere. The reasons for each size,
and the faults each rung catches, are in docs/validation.md. Light on purpose (no torch).

Dtypes: the ladder loads every checkpoint in float32. A float16/bfloat16 checkpoint's weights upcast
exactly, so every check of :data:`RUNGS` keeps its float32 tolerance (the figures recorded at conversion
were computed the same way: float32 math on the rounded weights). A half-precision checkpoint adds checks
that run in its own dtype (:attr:`RungSpec.in_dtype`: rung 2's kernel on inputs in that dtype, rung 3's
decode with the model and its paged cache in that dtype, rung 5's ledger of that cache); those use the
checkpoint dtype's row of :data:`TOLERANCES`.

Relative error is ``max|a - b| / max|b|`` over all compared entries.
"""

from __future__ import annotations

from dataclasses import dataclass

#: naive vs absorbed: the same float32 math re-associated through the d_c-wide latent.
TOL_PATHS = 1e-4
#: absolute, nats: log-sum-exp values are O(10); float32 leaves ~1e-6 relative.
TOL_LSE = 1e-4
#: kernel vs float64 oracle: float32 accumulation over at most a few thousand rows.
TOL_KERNEL = 1e-5
#: absolute, nats: the kernel's lse (O(10)) vs the oracle's, i.e. ~1e-5 relative.
TOL_KERNEL_LSE = 1e-4
#: one-token decode steps vs one full pass: different matmul shapes, float32.
TOL_DECODE_LOGITS = 1e-4
#: cache rows vs recomputation: the same projections, one row at a time vs batched.
TOL_ROWS = 1e-5
#: relative: RoPE inverse frequencies must be the source's exact float32 values.
TOL_FREQ = 1e-6
#: relative: the softmax scale must be the source's.
TOL_SCALE = 1e-6
#: relative: perplexity vs the figure recorded at conversion (same windows, same math).
TOL_PPL = 0.01
#: absolute, nats/token: KL vs the figure recorded at conversion.
TOL_KL = 0.01


@dataclass(frozen=True)
class DtypeTolerances:
    """One row of :data:`TOLERANCES`: the tolerances of the checks that compute in ``dtype``.

    ``kernel``: rung 2, ``latent_out`` against the float64 oracle on the same inputs in ``dtype``, and one KV
    split against many (rel.). ``kernel_lse``: rung 2, ``lse`` (abs., nats). ``logits``: rung 3, step logits
    of the decode in ``dtype`` against one full pass in ``dtype`` over the same tokens (rel.). ``rows``:
    rung 3, cache rows in ``dtype`` against their recomputation from that pass's layer inputs (rel.).
    ``unit_roundoff``: ``2**-(mantissa bits + 1)``, the relative error of one rounding to ``dtype``.
    """

    dtype: str
    kernel: float
    kernel_lse: float
    logits: float
    rows: float
    unit_roundoff: float

    def as_dict(self) -> dict[str, float | str]:
        """The row as ``validation.json`` records it."""
        return {
            "dtype": self.dtype,
            "kernel": self.kernel,
            "kernel_lse": self.kernel_lse,
            "logits": self.logits,
            "rows": self.rows,
            "unit_roundoff": self.unit_roundoff,
        }


#: Tolerances per dtype (one table). float32 is the exactness reference: its row is the ``TOL_*`` figures of
#: rungs 2-3, used by the float32 checks every checkpoint gets. float16 and bfloat16 are the float32 row's
#: checks run in that dtype: the kernel keeps float32 accumulation but rounds the probabilities and its
#: output to the cache dtype (a few units of roundoff of the attention output; lse is accumulated in float32
#: from exact products, so it keeps the float32 figure); a decode in half precision rounds every activation,
#: and one-token steps against one batched pass differ by a few roundoffs per layer (measured on
#: SmolLM2-135M, 30 layers: logits 2e-3 float16, 1.7e-2 bfloat16; cache rows 3e-3 and 1.3e-2). Each
#: half-precision figure leaves 3-8x room over what was measured; a structural fault (wrong page, row,
#: frequency or merge) shows up at order 0.1-1 and fails in every dtype.
TOLERANCES: dict[str, DtypeTolerances] = {
    "float32": DtypeTolerances("float32", TOL_KERNEL, TOL_KERNEL_LSE, TOL_DECODE_LOGITS, TOL_ROWS, 2.0**-24),
    "float16": DtypeTolerances("float16", 4e-3, TOL_KERNEL_LSE, 1e-2, 1e-2, 2.0**-11),
    "bfloat16": DtypeTolerances("bfloat16", 3e-2, TOL_KERNEL_LSE, 5e-2, 5e-2, 2.0**-8),
}


def tolerances_for(dtype: str) -> DtypeTolerances:
    """The row of :data:`TOLERANCES` for ``dtype`` (``"float32"``, ``"float16"``, ``"bfloat16"``).

    Raises:
        KeyError: another dtype.
    """
    return TOLERANCES[dtype]


def tolerance_table() -> str:
    """:data:`TOLERANCES` as a markdown table (``validation.md``)."""
    lines = [
        "| dtype | kernel `latent_out`, 1 vs many splits (rel.) | kernel `lse` (abs., nats) | decode step logits (rel.) "
        "| cache rows (rel.) | unit roundoff |",
        "|---|---|---|---|---|---|",
    ]
    for t in TOLERANCES.values():
        cells = (
            t.dtype,
            tol(t.kernel),
            tol(t.kernel_lse),
            tol(t.logits),
            tol(t.rows),
            f"{t.unit_roundoff:.1e}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tol(x: float) -> str:
    """A tolerance as written in the table: ``1e-4``, ``1e-5``; ``0.01`` and larger as is."""
    return f"{x:g}" if x >= 1e-3 else f"{x:.0e}".replace("e-0", "e-")


#: rung 6, ``lse`` rel. (``|Δlse| / max(1, |lse|)``) of a cell whose queries are 16-bit: see
#: :func:`matrix_tolerances` (bound 1.55 unit roundoffs on SmolLM2-135M; bfloat16 1e-2 = 2.6 u, float16 1e-3 = 2 u).
TOL_MATRIX_LSE: dict[str, float] = {"float16": 1e-3, "bfloat16": 1e-2}


def matrix_tolerances(query_dtype: str) -> tuple[float, float]:
    """Rung 6's kernel-check tolerances ``(latent_out rel., lse rel.)`` for a cell whose queries are
    ``query_dtype`` (``"float32"``, ``"float16"``, ``"bfloat16"``).

    float32 queries: :data:`TOL_KERNEL` for both (float32 accumulation; an FP8 row's dequantised value
    ``e4m3 x scale`` is rounded once to float32, ``2**-24``). 16-bit queries (a GPU reads bfloat16 and FP8 rows
    with bfloat16 queries): the kernel computes with every value it reads in the query dtype -- a bfloat16 row
    exactly, but an FP8 row's dequantised latent ``c`` as ``c (1 + e)``, ``|e| <= u`` (the dtype's unit
    roundoff, 2**-8 for bfloat16) -- and rounds the probabilities for the value product and its output, while
    the float64 oracle computes on the exact dequantised rows. Bound: every score moves by at most
    ``u * softmax_scale * max_j sum_k |q_k c_jk|``, and ``lse``, 1-Lipschitz in the scores, by no more; on
    SmolLM2-135M's layer 0 that is 1.55 u relative to ``max(1, |lse|)`` over rung 6's cells (6.0e-3 in
    bfloat16), measured 1.0e-3 (0.26 u) with the kernel's arithmetic emulated; bfloat16 rows with bfloat16
    queries stay at 1.2e-7 (exact products). So ``lse`` gets :data:`TOL_MATRIX_LSE` (above the worst-case bound,
    10x the measurement) and ``latent_out`` the query dtype's kernel tolerance of :data:`TOLERANCES` (measured
    4.3e-3 on FP8 rows, 3.2e-3 on bfloat16 rows, bfloat16 queries: the probabilities' and output's rounding of
    rung 2, plus the rounded rows in the value product). A structural fault (wrong page, group scale, row,
    merge) moves both by order 0.1-1.

    Raises:
        KeyError: another dtype.
    """
    if query_dtype == "float32":
        return TOL_KERNEL, TOL_KERNEL
    return TOLERANCES[query_dtype].kernel, TOL_MATRIX_LSE[query_dtype]


@dataclass(frozen=True)
class RungSpec:
    """One rung as documented: ``number``, ``name`` (as in ``validation.json``), what it compares, and its
    tolerances (text built from the ``TOL_*`` constants); ``in_dtype``: what it adds for a float16/bfloat16
    checkpoint, in that dtype (empty: nothing, the rung computes in float32 only)."""

    number: int
    name: str
    compares: str
    tolerances: str
    in_dtype: str = ""


PATHS = RungSpec(
    1,
    "naive-vs-absorbed",
    "per layer, on the model's real attention inputs: the expanded-K/V (naive) path against the absorbed "
    "latent path: scaled scores before softmax, log-sum-exp under the causal mask, attention layer output",
    f"scores and output rel. {tol(TOL_PATHS)}; LSE abs. {tol(TOL_LSE)} nats",
)
KERNEL = RungSpec(
    2,
    "kernel-vs-reference",
    "per layer, the Triton decode kernel against the float64 PyTorch oracle on the model's real queries and "
    "real paged cache rows (two requests of different lengths, shuffled pages): `latent_out`, `lse`; "
    "the kernel with 1 KV split against 4 (the split-KV merge is exact; the default count depends on the device)",
    f"`latent_out` rel. {tol(TOL_KERNEL)}; `lse` abs. {tol(TOL_KERNEL_LSE)} nats; "
    f"1 split vs many rel. {tol(TOL_KERNEL)}",
    "the same checks with the queries and cache rows rounded to the checkpoint's dtype (the dtype its "
    "paged cache holds), the oracle on the same rounded inputs, with that dtype's kernel tolerances; where "
    "the kernel cannot run that dtype (bfloat16 in the Triton interpreter) only the float32 checks run, and "
    "the rung says so",
)
DECODE = RungSpec(
    3,
    "decode-vs-recompute",
    "the model's RoPE frequency buffers against the source's RoPE table at the recorded pair indices (and "
    "`config.json`); paged prefill (on the kernel too for the triton backend: multi-token causal queries) + "
    "greedy one-token decode steps on the chosen backend against one full "
    "pass: step logits, greedy tokens, every layer's input at every cached position; every cache row against "
    "`[c_kv | k_rope]` recomputed from the layer input that wrote it (captured during the decode), `k_rope` at "
    "its absolute position with those frequencies; committed length; decode attention calls per backend",
    f"frequencies rel. {tol(TOL_FREQ)}; logits and layer inputs rel. {tol(TOL_DECODE_LOGITS)}; cache rows rel. "
    f"{tol(TOL_ROWS)}; "
    "tokens, length and call counts exact",
    "the decode again with the model's weights and its paged cache in the checkpoint's dtype (RoPE "
    "frequencies stay float32), against one full pass in that dtype over the same tokens: step logits, greedy "
    "tokens (recorded: with step logits within tolerance they can differ only at near ties), layer inputs, every cache "
    "row against its recomputation from the layer input that wrote it, committed length, decode calls; on the "
    "absorbed backend where the kernel cannot run that dtype (bfloat16 in the Triton interpreter), said so; "
    "the step logits against float32 recomputation are recorded",
)
SOURCE = RungSpec(
    4,
    "converted-vs-source",
    "`softmax_scale` against the source's (without the source: `1/sqrt(head_dim)` of the source head "
    "width, kept as `v_head_dim`); perplexity, KL(source ‖ converted) and top-1 agreement on held-out text (recorded, no "
    "threshold); with the conversion's text and windows, perplexity and KL against the figures recorded "
    "at conversion",
    f"scale rel. {tol(TOL_SCALE)}; perplexity rel. {TOL_PPL:.0%}; KL abs. {tol(TOL_KL)} nats/token",
)
LEDGER = RungSpec(
    5,
    "cache-ledger",
    "the bytes rung 3's paged cache holds: payload bytes/token/layer against `(d_c + R*d_R) x element size`, "
    "rows holding data against committed tokens x layers; the source's KV cache measured after a prefill "
    "against its formula `2 x G x head_dim x element size`; records bytes allocated (page tails and row-stride padding, the padding on its own) and the ratio",
    "exact",
    "measures the paged cache of rung 3's decode in the checkpoint's dtype (its element size); the ratio "
    "to the source compares values, the source measured in float32",
)

#: query tokens per request of each phase of rung 6's matrix: a decode step, a speculative verification of 4
#: draft tokens, a chunk of a chunked prefill (causal inside the block)
MATRIX_PHASES: dict[str, int] = {"prefill": 16, "decode": 1, "verify": 4}
#: cached rows the last query sees: one row, a tile/page boundary (127, 128, 129) and a long context
MATRIX_HISTORIES: tuple[int, ...] = (1, 127, 128, 129, 4096)
#: the cache rows of the matrix: float32, bfloat16, FP8 (E4M3 latent + float32 scales + bfloat16 rope)
MATRIX_CACHES: tuple[str, ...] = ("float32", "bfloat16", "fp8")

_PHASES_TEXT = ", ".join(f"{k} ({v} query token{'s' if v > 1 else ''})" for k, v in MATRIX_PHASES.items())

MATRIX = RungSpec(
    6,
    "kernel-matrix",
    "layer 0's real queries and cache rows (one request, shuffled pages) for every phase "
    f"{{{_PHASES_TEXT}}} x cache "
    f"{{{', '.join(MATRIX_CACHES)}}} x history {{{', '.join(map(str, MATRIX_HISTORIES))}}} rows: the kernel "
    "against the float64 oracle on the same rows where the kernel can run that cache here (float32 and FP8 in "
    "the Triton interpreter; bfloat16 on a GPU; FP8 on sm_89 or newer), else the oracle alone, recorded per "
    "cell; and what each cache format costs: the oracle's output on bfloat16 and FP8 rows against float32 rows, "
    "FP8 against bfloat16",
    f"float32 queries: `latent_out` and `lse` rel. {tol(TOL_KERNEL)}; bfloat16 queries (a GPU reading bfloat16 "
    f"or FP8 rows): `latent_out` rel. {tol(matrix_tolerances('bfloat16')[0])}, `lse` rel. "
    f"{tol(matrix_tolerances('bfloat16')[1])} (FP8 latent values rounded to bfloat16 by the kernel, not by the "
    "oracle); format errors recorded",
)

PRECISION = RungSpec(
    7,
    "bfloat16-vs-source",
    "the model in bfloat16 against itself in float32, and the source the same way (SDPA attention, RoPE "
    "frequencies float32 in both), on the same tokens: mean and max |d log p| over two evaluation windows and over "
    "short chat, code and prose prompts (each prompt's last position scored on float32's greedy token), and "
    "whether bfloat16's first greedy token after each short prompt is float32's (without the source: recorded only)",
    "converted mean |d log p| <= 2 x the source's + 0.005 nats on each set; no short prompt where the source keeps "
    "float32's first token (float32 scores bfloat16's pick within max(0.1, 2 x the source's largest short-prompt "
    "|d log p|) nats of its own) and the converted model does not",
)

#: The rungs in ladder order.
RUNGS: tuple[RungSpec, ...] = (PATHS, KERNEL, DECODE, SOURCE, LEDGER, MATRIX, PRECISION)


def spec_of(number: int) -> RungSpec | None:
    """The documented rung ``number`` (1-7), or None."""
    return next((s for s in RUNGS if s.number == number), None)
