"""Rung 6: the decode kernel over the shape matrix phase x cache dtype x history, on a layer's real rows.

One request of real text: layer 0's attention input (embeddings, input norm) for the first ``max(histories)``
tokens gives real queries (absorbed ``q_abs``, ``q_rope`` at their absolute positions) and real cache rows
``[c_kv | k_rope]``. The rows go into a paged cache with shuffled pages once per cache kind (float32, bfloat16,
FP8 rows of :mod:`mla_convert.kernels.fp8`); each cell then asks the last ``s_q`` tokens of a ``history``-row
prefix (``s_q`` from :data:`~mla_convert.validate.spec.MATRIX_PHASES`, causal inside the block) and compares:

- the kernel against the float64 oracle on the very same stored rows, where the kernel can run that cache on
  this machine (the Triton interpreter has no bfloat16; E4M3 needs sm_89 or newer on a GPU), else the oracle
  alone, and the cell records which ran;
- what the format costs, the oracle on the cache's rows against the oracle on float32 rows (and FP8 against
  bfloat16), with the same queries: the error a user of that cache dtype buys, measured on real data.

Queries are float32 where the cache is float32, and where the kernel runs in the interpreter; on a GPU a
bfloat16 or FP8 cache is read with bfloat16 queries (what a bfloat16 model sends), :func:`query_dtype`. The
kernel check's tolerances follow the cell's query dtype (:func:`~mla_convert.validate.spec.matrix_tolerances`):
the kernel rounds what it reads to the query dtype (an FP8 row's dequantised latent too), the float64 oracle
does not.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from mla_convert.runtime.paged_cache import PagedLatentCache
from mla_convert.validate.measure import kernel_device, rel_err, timed
from mla_convert.validate.result import Rung
from mla_convert.validate.spec import (
    MATRIX,
    MATRIX_CACHES,
    MATRIX_HISTORIES,
    MATRIX_PHASES,
    matrix_tolerances,
)

if TYPE_CHECKING:
    from mla_convert.mla.modeling import MLAForCausalLM


def layer_inputs(model: MLAForCausalLM, ids: torch.Tensor, layer: int = 0) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s real queries and rows for one request ``ids [1, T]`` (positions ``0..T-1``).

    Returns:
        ``q_abs [T, H, d_c]``, ``q_rope [T, H, d_R]`` and ``rows [T, d_c + R*d_R]`` (float32), and
        ``head_to_rope [H]``.

    Raises:
        ValueError: ``layer`` is not 0 (only layer 0's input is computed without running earlier layers).
    """
    if layer != 0:
        raise ValueError("the matrix reads layer 0, whose input needs no earlier layer")
    block = model.model.layers[0]
    attn = block.self_attn
    x = block.input_layernorm(model.model.embed_tokens(ids))
    pos = torch.arange(ids.shape[1])[None]
    q_nope, q_rope, c_kv, k_rope = attn.project(x, pos)
    rows = torch.cat([c_kv, k_rope.reshape(1, ids.shape[1], -1)], dim=-1)[0]
    return {
        "q_abs": attn.absorb_query(q_nope)[0].float(),
        "q_rope": q_rope[0].float(),
        "rows": rows.float(),
        "head_to_rope": attn.head_to_rope(),
        "softmax_scale": torch.tensor(attn.softmax_scale),
    }


def _paged(rows: torch.Tensor, kind: str, page_size: int, d_c: int, device: torch.device) -> PagedLatentCache:
    """One request holding ``rows [T, width]`` as ``kind`` rows, pages in a shuffled order."""
    from mla_convert.kernels import fp8

    t, width = rows.shape
    layouts = [fp8.layout(d_c, width - d_c)] if kind == "fp8" else None
    dtype = torch.float32 if kind == "fp8" else getattr(torch, kind)
    pages = -(-t // page_size) + 2
    cache = PagedLatentCache([width], page_size, pages, dtype, device, shuffle_pages=True, fp8=layouts)
    cache.bind([cache.add_request()])
    cache.begin_step(t)
    cache.write(0, rows[None].to(device))
    cache.commit(t)
    return cache


def query_dtype(kind: str) -> torch.dtype:
    """The queries' dtype for a ``kind`` cache: bfloat16 for bfloat16 and FP8 rows where the kernel runs natively
    (what a bfloat16 model sends), float32 for float32 rows and in the Triton interpreter (no bfloat16)."""
    from mla_convert.kernels import kernel_backend

    return torch.bfloat16 if kind != "float32" and kernel_backend() == "triton-cuda" else torch.float32


def why_not_kernel(kind: str) -> str | None:
    """Why the kernel cannot read a ``kind`` cache on this machine, or None."""
    from mla_convert.kernels import kernel_backend

    if kernel_backend() != "triton-cuda":
        return "the Triton interpreter has no bfloat16" if kind == "bfloat16" else None
    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        return "E4M3 needs sm_89 or newer"
    return None


@timed
def rung_matrix(
    model: MLAForCausalLM,
    ids: torch.Tensor,
    page_size: int,
    data: str,
    max_history: int = MATRIX_HISTORIES[-1],
) -> Rung:
    """Rung 6 on ``ids [1, T]`` (real text, ``T >= 1``): every cell of phase x cache x history up to
    ``min(max_history, T)``; ``rung.cells`` holds one dict per cell (``phase``, ``cache``, ``history``, ``s_q``,
    ``queries`` (their dtype), ``backend``, ``kernel_out_rel``, ``kernel_lse_rel``, ``format_rel_vs_float32``,
    ``format_rel_vs_bfloat16``; None where not measured). The kernel check of each cache uses the tolerances of
    its queries' dtype (:func:`~mla_convert.validate.spec.matrix_tolerances`)."""
    from mla_convert.kernels import kernel_backend, latent_decode_reference, load_kernel

    rung = Rung.of(MATRIX, data)
    histories = [h for h in MATRIX_HISTORIES if h <= min(max_history, ids.shape[1])]
    skipped = [h for h in MATRIX_HISTORIES if h not in histories]
    real = layer_inputs(model, ids[:, : max(histories)])
    d_c = model.model.layers[0].self_attn.kv_lora_rank
    device = kernel_device()
    kernel = load_kernel()
    scale = float(real["softmax_scale"])
    caches = {kind: _paged(real["rows"], kind, page_size, d_c, device) for kind in MATRIX_CACHES}
    worst: dict[str, dict[str, float]] = {k: {"out": 0.0, "lse": 0.0} for k in MATRIX_CACHES}
    for history in histories:
        for phase, want_sq in MATRIX_PHASES.items():
            s_q = min(want_sq, history)
            lo = history - s_q
            refs: dict[str, torch.Tensor] = {}
            for kind, cache in caches.items():
                qdtype = query_dtype(kind)
                q_abs = real["q_abs"][lo:history][None].to(device, qdtype)
                q_rope = real["q_rope"][lo:history][None].to(device, qdtype)
                lay = cache.fp8[0] if cache.fp8 is not None else None
                args = (
                    q_abs,
                    q_rope,
                    cache.pages[0],
                    cache.block_table(device),
                    torch.tensor([history], dtype=torch.int32, device=device),
                    real["head_to_rope"].to(device),
                )
                ref_out, ref_lse = latent_decode_reference(*args, softmax_scale=scale, fp8=lay)
                refs[kind] = ref_out.cpu()
                cell: dict[str, Any] = {
                    "phase": phase,
                    "cache": kind,
                    "history": history,
                    "s_q": s_q,
                    "queries": _name(qdtype),
                }
                why = why_not_kernel(kind)
                if why is None:
                    out, lse = kernel.latent_decode(*args, softmax_scale=scale, fp8=lay)
                    cell["backend"] = kernel_backend()
                    cell["kernel_out_rel"] = rel_err(out.cpu(), ref_out.cpu())
                    lse_rel = (lse.double().cpu() - ref_lse.cpu()) / ref_lse.cpu().abs().clamp_min(1.0)
                    cell["kernel_lse_rel"] = float(lse_rel.abs().max())
                    worst[kind]["out"] = max(worst[kind]["out"], cell["kernel_out_rel"])
                    worst[kind]["lse"] = max(worst[kind]["lse"], cell["kernel_lse_rel"])
                else:
                    cell["backend"] = f"float64 oracle only ({why})"
                    cell["kernel_out_rel"] = cell["kernel_lse_rel"] = None
                cell["format_rel_vs_float32"] = (
                    rel_err(refs[kind], refs["float32"]) if kind != "float32" else 0.0
                )
                cell["format_rel_vs_bfloat16"] = (
                    rel_err(refs[kind], refs["bfloat16"]) if kind == "fp8" else None
                )
                rung.cells.append(cell)
    for kind in MATRIX_CACHES:
        ran = [c for c in rung.cells if c["cache"] == kind and c["kernel_out_rel"] is not None]
        if not ran:
            why = why_not_kernel(kind)
            rung.record(
                f"{kind} cache: kernel", f"not run here ({why}); the oracle alone measured the format"
            )
            continue
        queries = _name(query_dtype(kind))
        tol_out, tol_lse = matrix_tolerances(queries)
        name = (
            f"{kind} cache, {queries} queries: kernel vs float64 oracle on the same rows, max rel. error over "
            f"{len(ran)} cells"
        )
        rung.check(f"{name}: latent_out", worst[kind]["out"], tol_out)
        rung.check(f"{name}: lse", worst[kind]["lse"], tol_lse)
    for kind, versus in (("bfloat16", "float32"), ("fp8", "float32"), ("fp8", "bfloat16")):
        err = max(c[f"format_rel_vs_{versus}"] for c in rung.cells if c["cache"] == kind)
        name = f"{kind} rows vs {versus} rows: oracle latent_out, max rel. error over cells"
        if math.isfinite(err):
            rung.record(name, err)
        else:  # a NaN or infinite output fails the rung
            rung.check(name, err, math.inf)
    layouts = caches["fp8"].fp8 or []
    for lay in layouts:
        parts = ", ".join(f"{k} {v}" for k, v in lay.ledger().items())
        rung.record("fp8 row bytes", f"{parts} (float32 row: {4 * real['rows'].shape[1]} bytes)")
    if skipped:
        rung.record(
            "histories not measured", f"{', '.join(map(str, skipped))} (text or --matrix-max-history shorter)"
        )
    return rung


def _name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def matrix_rows(cells: list[dict[str, Any]]) -> list[list[str]]:
    """The matrix as table rows ``phase, cache, history, s_q, queries, backend, kernel out, kernel lse, vs
    float32, vs bfloat16`` (values to 3 significant digits, ``-`` where not measured)."""

    def fmt(v: Any) -> str:
        return "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))

    keys = (
        "phase",
        "cache",
        "history",
        "s_q",
        "queries",
        "backend",
        "kernel_out_rel",
        "kernel_lse_rel",
        "format_rel_vs_float32",
        "format_rel_vs_bfloat16",
    )
    return [[fmt(c.get(k)) for k in keys] for c in cells]


MATRIX_HEADER = (
    "phase",
    "cache",
    "history",
    "s_q",
    "queries",
    "backend",
    "kernel out rel.",
    "kernel lse rel.",
    "format vs float32",
    "fp8 vs bfloat16",
)
