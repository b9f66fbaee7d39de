"""Rung 6 (the kernel matrix) can fail: a kernel that is wrong only on FP8 rows, or only past a page boundary,
fails the rung and the cells name where; the histories the text cannot supply are recorded, not invented.

Each cell is held to the tolerances of its queries' dtype (``spec.matrix_tolerances``). The bfloat16 queries a
GPU sends cannot run in the Triton interpreter, so on the CPU they are tried with the kernel's arithmetic
emulated in torch (:func:`emulated_latent_decode`): the rung passes such a kernel at the bfloat16 tolerances
(the float32 ones would fail it) and still fails a wrong one.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton is imported)
import mla_convert.kernels as kernels
from mla_convert.kernels.fp8 import dequantize_rows
from mla_convert.mla.checkpoint import load_checkpoint
from mla_convert.validate import matrix
from mla_convert.validate.ladder import matrix_ids
from mla_convert.validate.matrix import rung_matrix
from mla_convert.validate.options import ValidateOptions
from mla_convert.validate.spec import TOL_KERNEL, matrix_tolerances


@pytest.fixture(scope="module")
def model_and_ids(reference_ckpt: Path):
    options = ValidateOptions(text="wikipedia", matrix_max_history=129)
    return load_checkpoint(reference_ckpt), matrix_ids(reference_ckpt, options)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _wrong_kernel(monkeypatch: pytest.MonkeyPatch, when, real=None) -> None:
    real = real or kernels.load_kernel()

    def latent_decode(*args, **kw):
        out, lse = real.latent_decode(*args, **kw)
        if when(args, kw):  # 10x the cell's tolerance: far outside it, inside any format error in float32
            out = out * (1 + 10 * matrix_tolerances(_name(args[0].dtype))[0])
        return out, lse

    monkeypatch.setattr(kernels, "load_kernel", lambda: SimpleNamespace(latent_decode=latent_decode))


def emulated_latent_decode(
    q_abs, q_rope, kv_cache, block_table, seq_lens, head_to_rope, softmax_scale, fp8=None, num_splits=None
):
    """The decode kernel's arithmetic in torch for any query dtype (one split): the rows it reads rounded to the
    queries' dtype (an FP8 row's latent dequantised in float32 first), products accumulated in float32, the
    probabilities rounded to that dtype for the value product, the output rounded to it; ``lse`` float32."""
    qdt = q_abs.dtype
    rows_all = dequantize_rows(kv_cache, fp8) if fp8 is not None else kv_cache.float()
    qa = q_abs if q_abs.dim() == 4 else q_abs[:, None]
    qr = q_rope if q_rope.dim() == 4 else q_rope[:, None]
    b, s_q, h, d_c = qa.shape
    d_r, page = qr.shape[-1], kv_cache.shape[1]
    out = torch.zeros(b, s_q, h, d_c, dtype=qdt, device=q_abs.device)
    lse = torch.full((b, s_q, h), float("-inf"), device=q_abs.device)
    for i in range(b):
        n = int(seq_lens[i])
        pages = block_table[i, : (n + page - 1) // page].long()
        rows = rows_all[pages].reshape(-1, rows_all.shape[-1])[:n]
        tile = rows[:, :d_c].to(qdt).float()
        k_rope = rows[:, d_c:].reshape(n, -1, d_r)[:, head_to_rope.long()].to(qdt).float()
        s = torch.einsum("shc,nc->shn", qa[i].float(), tile) + torch.einsum(
            "shd,nhd->shn", qr[i].float(), k_rope
        )
        visible = (
            torch.arange(n, device=s.device)[None, :]
            <= (n - s_q + torch.arange(s_q, device=s.device))[:, None]
        )
        s = (s * softmax_scale).masked_fill(~visible[:, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        total = p.sum(-1)
        out[i] = (torch.einsum("shn,nc->shc", p.to(qdt).float(), tile) / total[..., None]).to(qdt)
        lse[i] = m[..., 0] + torch.log(total)
    return (out[:, 0], lse[:, 0]) if q_abs.dim() == 3 else (out, lse)


def _as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The matrix as a GPU runs it (bfloat16 and FP8 rows read with bfloat16 queries, every cache on the
    kernel), the kernel emulated on the CPU."""
    monkeypatch.setattr(
        matrix, "query_dtype", lambda kind: torch.float32 if kind == "float32" else torch.bfloat16
    )
    monkeypatch.setattr(matrix, "why_not_kernel", lambda kind: None)
    emulated = SimpleNamespace(latent_decode=emulated_latent_decode)
    monkeypatch.setattr(kernels, "load_kernel", lambda: emulated)
    return emulated


def _kernel_check(rung, kind: str, queries: str, what: str):
    """The rung's kernel-vs-oracle check of ``kind`` rows with ``queries`` on ``what`` (latent_out, lse)."""
    prefix = f"{kind} cache, {queries} queries: kernel vs float64 oracle"
    return next(c for c in rung.checks if c.name.startswith(prefix) and c.name.endswith(f": {what}"))


def test_matrix_passes_and_measures_every_cell(model_and_ids):
    model, ids = model_and_ids
    assert ids.shape == (1, 129)
    rung = rung_matrix(model, ids, 16, "wikipedia, 129 tokens", max_history=129)
    assert rung.passed, [c for c in rung.checks if c.passed is False]
    assert len(rung.cells) == 3 * 3 * 4  # histories 1, 127, 128, 129
    skipped = next(c for c in rung.checks if c.name == "histories not measured")
    assert str(skipped.value).startswith("4096")
    for c in rung.cells:
        assert c["queries"] == _name(matrix.query_dtype(c["cache"]))


def test_matrix_fails_on_a_kernel_wrong_for_fp8_rows(model_and_ids, monkeypatch):
    model, ids = model_and_ids
    queries = _name(matrix.query_dtype("fp8"))
    _wrong_kernel(monkeypatch, lambda args, kw: kw.get("fp8") is not None)
    rung = rung_matrix(model, ids, 16, "wikipedia", max_history=129)
    failed = [c.name for c in rung.checks if c.passed is False]
    assert failed == [
        f"fp8 cache, {queries} queries: kernel vs float64 oracle on the same rows, max rel. error over 12 cells: "
        "latent_out"
    ]
    tol = matrix_tolerances(queries)[0]
    assert all(c["kernel_out_rel"] > 5 * tol for c in rung.cells if c["cache"] == "fp8")
    assert all(c["kernel_out_rel"] < 1e-5 for c in rung.cells if c["cache"] == "float32")


def test_matrix_fails_on_a_kernel_wrong_past_a_page_boundary(model_and_ids, monkeypatch):
    model, ids = model_and_ids
    _wrong_kernel(monkeypatch, lambda args, kw: int(args[4].max()) == 129)  # seq_lens: one row past 8 pages
    rung = rung_matrix(model, ids, 16, "wikipedia", max_history=129)
    assert not rung.passed
    ran = {c["cache"] for c in rung.cells if c["kernel_out_rel"] is not None}
    bad = {
        (c["history"], c["cache"])
        for c in rung.cells
        if (c["kernel_out_rel"] or 0) > matrix_tolerances(c["queries"])[0]
    }
    assert bad == {(129, kind) for kind in ran} and "float32" in ran
    assert torch.isfinite(torch.tensor([c["format_rel_vs_float32"] for c in rung.cells])).all()


def test_bf16_query_cells_use_the_bf16_tolerances(model_and_ids, monkeypatch):
    """bfloat16 queries on FP8 rows: the kernel rounds the dequantised latent to bfloat16, the oracle does not,
    so its lse differs by more than float32's 1e-5; the cell is held to the bfloat16 tolerances and passes."""
    model, ids = model_and_ids
    _as_on_a_gpu(monkeypatch)
    rung = rung_matrix(model, ids, 16, "wikipedia", max_history=129)
    assert rung.passed, [(c.name, c.value, c.tolerance) for c in rung.checks if c.passed is False]
    assert {c["queries"] for c in rung.cells if c["cache"] != "float32"} == {"bfloat16"}
    out_tol, lse_tol = matrix_tolerances("bfloat16")
    for kind in ("bfloat16", "fp8"):
        assert _kernel_check(rung, kind, "bfloat16", "latent_out").tolerance == f"<= {out_tol:g}"
        assert _kernel_check(rung, kind, "bfloat16", "lse").tolerance == f"<= {lse_tol:g}"
    assert _kernel_check(rung, "float32", "float32", "lse").tolerance == f"<= {TOL_KERNEL:g}"
    # the fault: FP8 rows read in bfloat16 move lse past the float32 tolerance (and stay inside bfloat16's)
    assert TOL_KERNEL < _kernel_check(rung, "fp8", "bfloat16", "lse").value < lse_tol


def test_bf16_query_cells_still_fail_a_wrong_kernel(model_and_ids, monkeypatch):
    model, ids = model_and_ids
    emulated = _as_on_a_gpu(monkeypatch)
    _wrong_kernel(monkeypatch, lambda args, kw: kw.get("fp8") is not None, real=emulated)
    rung = rung_matrix(model, ids, 16, "wikipedia", max_history=129)
    failed = [c.name for c in rung.checks if c.passed is False]
    assert failed == [
        "fp8 cache, bfloat16 queries: kernel vs float64 oracle on the same rows, max rel. error over 12 cells: "
        "latent_out"
    ]
