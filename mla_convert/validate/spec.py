"""The ladder's one table: each rung's number, name, what it compares and its tolerances (float32).

The rungs check against the ``TOL_*`` constants; ``validation.md`` (per checkpoint) and README.md's rung
table (``benchmarks/readme.py rungs``) print :data:`RUNGS`, whose tolerance texts are built from the same
constants, so a tolerance changed here changes everywhere. The reasons for each size, and the faults each
rung catches, are in docs/validation.md. Light on purpose (no torch).

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


def tol(x: float) -> str:
    """A tolerance as written in the table: ``1e-4``, ``1e-5``; ``0.01`` and larger as is."""
    return f"{x:g}" if x >= 1e-3 else f"{x:.0e}".replace("e-0", "e-")


@dataclass(frozen=True)
class RungSpec:
    """One rung as documented: ``number``, ``name`` (as in ``validation.json``), what it compares, and its
    tolerances (text built from the ``TOL_*`` constants)."""

    number: int
    name: str
    compares: str
    tolerances: str


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
    "the kernel with 1 KV split against its default split count",
    f"`latent_out` rel. {tol(TOL_KERNEL)}; `lse` abs. {tol(TOL_KERNEL_LSE)} nats; "
    f"1 split vs many rel. {tol(TOL_KERNEL)}",
)
DECODE = RungSpec(
    3,
    "decode-vs-recompute",
    "the model's RoPE frequency buffers against the source's RoPE table at the recorded pair indices (and "
    "`config.json`); paged prefill + greedy one-token decode steps on the chosen backend against one full "
    "pass: step logits, greedy tokens; every cache row against `[c_kv | k_rope]` recomputed at its absolute "
    "position with those frequencies; committed length; decode attention calls per backend",
    f"frequencies rel. {tol(TOL_FREQ)}; logits rel. {tol(TOL_DECODE_LOGITS)}; cache rows rel. {tol(TOL_ROWS)}; "
    "tokens, length and call counts exact",
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
    "against its formula `2 x G x head_dim x element size`; records bytes with page padding and the ratio",
    "exact",
)

#: The five rungs in ladder order.
RUNGS: tuple[RungSpec, ...] = (PATHS, KERNEL, DECODE, SOURCE, LEDGER)


def spec_of(number: int) -> RungSpec | None:
    """The documented rung ``number`` (1-5), or None."""
    return next((s for s in RUNGS if s.number == number), None)
