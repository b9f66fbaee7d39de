"""The conversion's decompositions run on one thread for small matrices and restore the thread count."""

from __future__ import annotations

import pytest
import torch

from mla_convert.convert.layer import linalg


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


def _dense_psd_sqrt(m: torch.Tensor, eps: float) -> torch.Tensor:
    """The oracle: one eigendecomposition of the whole matrix."""
    ridge = eps * float(torch.diagonal(m).mean())
    evals, evecs = torch.linalg.eigh(m + ridge * torch.eye(m.shape[0], dtype=m.dtype))
    return (evecs * evals.clamp_min(ridge).sqrt()) @ evecs.T


def test_psd_sqrt_by_blocks_equals_the_whole_decomposition() -> None:
    """Blocks found under a permutation (and a zero row, a rank-deficient block) give the square root of the
    whole matrix: its square is the matrix plus the ridge, and it equals the one-``eigh`` oracle."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(k, r, generator=g, dtype=torch.float64) for k, r in ((6, 9), (4, 2), (5, 5))]
    m = torch.block_diag(*[p @ p.T for p in parts], torch.zeros(1, 1, dtype=torch.float64))
    perm = torch.randperm(m.shape[0], generator=g)
    m = m[perm][:, perm]
    blocks = linalg.diagonal_blocks(m)
    assert sorted(len(b) for b in blocks) == [1, 4, 5, 6]
    assert torch.equal(torch.cat(blocks).sort().values, torch.arange(m.shape[0]))
    for eps in (1e-10, 1e-6):  # the oracle's own noise: 8e-11 between two permutations of m at eps 1e-10
        root = linalg.psd_sqrt(m, eps)
        assert torch.allclose(root, _dense_psd_sqrt(m, eps), atol=1e-9, rtol=0)
    full = (lambda a: a @ a.T)(torch.randn(7, 9, generator=g, dtype=torch.float64))
    assert len(linalg.diagonal_blocks(full)) == 1
    assert torch.allclose(linalg.psd_sqrt(full, 1e-10) @ linalg.psd_sqrt(full, 1e-10), full, atol=1e-10)


def test_a_long_chain_is_one_block_however_it_is_found() -> None:
    """A permuted tridiagonal matrix is connected: one block (found, or given up on after BLOCK_PASSES), and its
    square root is the whole decomposition's."""
    n = 400
    off = torch.diag(torch.ones(n - 1, dtype=torch.float64), 1)
    chain = torch.diag(torch.full((n,), 4.0, dtype=torch.float64)) + off + off.T
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    m = chain[perm][:, perm]
    (block,) = linalg.diagonal_blocks(m)
    assert torch.equal(block, torch.arange(n))
    assert torch.allclose(linalg.psd_sqrt(m), _dense_psd_sqrt(m, 1e-10), atol=1e-9, rtol=0)
