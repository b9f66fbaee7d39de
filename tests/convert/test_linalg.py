"""The conversion's decompositions run on one thread for small matrices and restore the thread count."""

from __future__ import annotations

import pytest
import torch

from mla_convert.convert import linalg


def test_small_matrices_run_on_one_thread_and_the_count_comes_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with linalg.threads_for(torch.zeros(576, 384)):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with linalg.threads_for(torch.zeros(linalg.SERIAL_MAX + 1, 8)):
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), linalg.threads_for(torch.zeros(4, 4)):
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_wrappers_equal_torch_linalg() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 24, dtype=torch.float64, generator=g)
    m = a.T @ a
    evals, evecs = linalg.eigh(m)
    assert torch.allclose(evecs @ torch.diag(evals) @ evecs.T, m, atol=1e-10)
    u, s, vh = linalg.svd(a)
    assert u.shape == (40, 24) and vh.shape == (24, 24)
    assert torch.allclose(u * s @ vh, a, atol=1e-10)
    assert torch.allclose(linalg.svdvals(a), s, atol=1e-12)
    x = linalg.solve(m, a.T)
    assert torch.allclose(m @ x, a.T, atol=1e-8)
