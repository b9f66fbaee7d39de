"""Rung 6 (the kernel matrix) can fail: a kernel that is wrong only on FP8 rows, or only past a page boundary,
fails the rung and the cells name where; the histories the text cannot supply are recorded, not invented."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton is imported)
import mla_convert.kernels as kernels
from mla_convert.mla.checkpoint import load_checkpoint
from mla_convert.validate.ladder import matrix_ids
from mla_convert.validate.matrix import rung_matrix
from mla_convert.validate.options import ValidateOptions


@pytest.fixture(scope="module")
def model_and_ids(reference_ckpt: Path):
    options = ValidateOptions(text="wikipedia", matrix_max_history=129)
    return load_checkpoint(reference_ckpt), matrix_ids(reference_ckpt, options)


def _wrong_kernel(monkeypatch: pytest.MonkeyPatch, when) -> None:
    real = kernels.load_kernel()

    def latent_decode(*args, **kw):
        out, lse = real.latent_decode(*args, **kw)
        if when(args, kw):
            out = out * 1.001  # 1e-3 relative: far inside any format error, far outside the kernel tolerance
        return out, lse

    monkeypatch.setattr(kernels, "load_kernel", lambda: SimpleNamespace(latent_decode=latent_decode))


def test_matrix_passes_and_measures_every_cell(model_and_ids):
    model, ids = model_and_ids
    assert ids.shape == (1, 129)
    rung = rung_matrix(model, ids, 16, "wikipedia, 129 tokens", max_history=129)
    assert rung.passed, [c for c in rung.checks if c.passed is False]
    assert len(rung.cells) == 3 * 3 * 4  # histories 1, 127, 128, 129
    skipped = next(c for c in rung.checks if c.name == "histories not measured")
    assert str(skipped.value).startswith("4096")


def test_matrix_fails_on_a_kernel_wrong_for_fp8_rows(model_and_ids, monkeypatch):
    model, ids = model_and_ids
    _wrong_kernel(monkeypatch, lambda args, kw: kw.get("fp8") is not None)
    rung = rung_matrix(model, ids, 16, "wikipedia", max_history=129)
    failed = [c.name for c in rung.checks if c.passed is False]
    assert failed == [
        "fp8 cache: kernel vs float64 oracle on the same rows, max rel. error over 12 cells: latent_out"
    ]
    assert all(c["kernel_out_rel"] > 5e-4 for c in rung.cells if c["cache"] == "fp8")
    assert all(c["kernel_out_rel"] < 1e-5 for c in rung.cells if c["cache"] == "float32")


def test_matrix_fails_on_a_kernel_wrong_past_a_page_boundary(model_and_ids, monkeypatch):
    model, ids = model_and_ids
    _wrong_kernel(monkeypatch, lambda args, kw: int(args[4].max()) == 129)  # seq_lens: one row past 8 pages
    rung = rung_matrix(model, ids, 16, "wikipedia", max_history=129)
    assert not rung.passed
    bad = {(c["history"], c["cache"]) for c in rung.cells if (c["kernel_out_rel"] or 0) > 1e-5}
    assert bad == {(129, "float32"), (129, "fp8")}
    assert torch.isfinite(torch.tensor([c["format_rel_vs_float32"] for c in rung.cells])).all()
