"""Float64 decompositions of the conversion: on the conversion's device (:func:`decompose_on`, a CUDA GPU with
``--device cuda``), else on the CPU, on one thread when the matrix is small.

Every decomposition a conversion runs (the statistics' square root, the weighted K/V SVD, the RoPE-pair
eigenvectors, the refit's solves) goes through this module, so one switch moves all of them: inside
:func:`decompose_on` an operand is copied to the device, decomposed there in its own dtype (float64: CUDA GPUs compute
it in hardware), and the results are copied back to where the caller holds the operand. The CPU path is the same code
with no copy.

The matrices a conversion decomposes are small (``hidden`` x ``hidden`` statistics, ``[G, G]`` RoPE-pair
covariances, the ``(n_nope + G d_v)`` x ``hidden`` weighted K/V target). Splitting a LAPACK call on such a
matrix across OpenMP threads gains little when the cores are idle and collapses when another process holds
one of them: measured on a 2-core machine beside one busy process, ``svdvals`` of a 576 x 384 float64
matrix took 3.9 s on 2 threads and 0.021 s on 1; ``eigh`` of a 576 x 576 one 7.5 s and 0.063 s. Matrices
whose larger side exceeds :data:`SERIAL_MAX` keep the process's thread count (a 4096-wide eigh is worth
splitting).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

SERIAL_MAX = 2048
"""Largest matrix side (elements) decomposed on one thread."""

#: The device decompositions run on (None: where each operand is).
_DEVICE: ContextVar[torch.device | None] = ContextVar("mla_convert_decompose_on", default=None)


@contextmanager
def decompose_on(device: torch.device) -> Iterator[None]:
    """Run this module's decompositions on ``device`` while the block runs (the conversion's ``--device``; a CPU
    device changes nothing). Operands and results stay where the caller holds them: each is copied to ``device`` and
    back, dtype unchanged (float64 stays float64)."""
    token = _DEVICE.set(device if device.type != "cpu" else None)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def _elsewhere(m: torch.Tensor) -> torch.device | None:
    """The device :func:`decompose_on` asks for, where ``m`` is not already on it; else None."""
    there = _DEVICE.get()
    return there if there is not None and m.device != there else None


@contextmanager
def threads_for(*tensors: torch.Tensor) -> Iterator[None]:
    """One intra-op thread while the block runs if every CPU tensor's larger side is at most
    :data:`SERIAL_MAX`; the previous thread count is restored after the block (also on error)."""
    small = all(t.device.type != "cpu" or max(t.shape, default=0) <= SERIAL_MAX for t in tensors)
    before = torch.get_num_threads()
    if not small or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of a Hermitian ``[n, n]`` matrix: eigenvalues ``[n]`` ascending, eigenvectors
    ``[n, n]`` as columns (see :func:`threads_for`)."""
    there = _elsewhere(m)
    if there is not None:
        evals, evecs = torch.linalg.eigh(m.to(there))
        return evals.to(m.device), evecs.to(m.device)
    with threads_for(m):
        evals, evecs = torch.linalg.eigh(m)
    return evals, evecs


def svd(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin ``torch.linalg.svd`` of ``[r, c]``: ``U [r, k]``, ``S [k]``, ``Vh [k, c]``, ``k = min(r, c)``."""
    there = _elsewhere(m)
    if there is not None:
        u, s, vh = torch.linalg.svd(m.to(there), full_matrices=False)
        return u.to(m.device), s.to(m.device), vh.to(m.device)
    with threads_for(m):
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
    return u, s, vh


def qr(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced ``torch.linalg.qr`` of ``[r, c]`` (``r >= c``): ``Q [r, c]`` with orthonormal columns, ``R [c, c]``
    upper triangular."""
    there = _elsewhere(m)
    if there is not None:
        q, r = torch.linalg.qr(m.to(there))
        return q.to(m.device), r.to(m.device)
    with threads_for(m):
        q, r = torch.linalg.qr(m)
    return q, r


def svdvals(m: torch.Tensor) -> torch.Tensor:
    """Singular values ``[min(r, c)]`` (descending) of ``[r, c]``."""
    there = _elsewhere(m)
    if there is not None:
        return torch.linalg.svdvals(m.to(there)).to(m.device)
    with threads_for(m):
        return torch.linalg.svdvals(m)


def solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``X`` with ``a X = b`` for square ``a [n, n]`` and ``b [n, k]``.

    Raises:
        torch.linalg.LinAlgError: ``a`` is singular.
    """
    there = _elsewhere(a)
    if there is not None:
        return torch.linalg.solve(a.to(there), b.to(there)).to(a.device)
    with threads_for(a, b):
        return torch.linalg.solve(a, b)


#: Label-propagation passes :func:`diagonal_blocks` runs before it treats the matrix as one block (dense blocks,
#: the conversion's case, settle in 2-3; a long permuted chain could take up to its length).
BLOCK_PASSES = 32


def diagonal_blocks(m: torch.Tensor) -> list[torch.Tensor]:
    """Index sets ``[k]`` (sorted, int64) of the diagonal blocks of a symmetric ``[n, n]`` matrix up to a
    permutation: the connected components of its nonzero pattern (label propagation with pointer jumping). An
    index with no nonzero entry forms its own block. A matrix with no zero entry, or whose labels have not settled
    after :data:`BLOCK_PASSES` passes, is one block (always a correct answer, only a slower one to decompose)."""
    n = m.shape[0]
    everything = [torch.arange(n, device=m.device)]
    linked = m != 0
    if bool(linked.all()):
        return everything
    linked |= torch.eye(n, dtype=torch.bool, device=m.device)
    label = torch.arange(n, device=m.device)
    for _ in range(BLOCK_PASSES):
        new = torch.where(linked, label[None, :], n).amin(dim=1)  # smallest label among each index's neighbours
        new = new[new]  # jump to that label's own label
        if torch.equal(new, label):
            return [torch.nonzero(label == root).flatten() for root in torch.unique(label).tolist()]
        label = new
    return everything


def psd_sqrt(m: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Symmetric square root of a PSD ``[n, n]`` matrix, with the ridge ``eps * mean diag`` added and eigenvalues
    clamped at it. Block-diagonal matrices (up to a permutation: :func:`diagonal_blocks`) are decomposed block by
    block, the square root being block-diagonal on the same blocks: the output objective's ``(n_nope + G d_v)``
    weight of a Llama-3-8B-shaped layer is 2G blocks of ~128, one 1,900-wide ``eigh`` (1.5 s in float64 on a 2-core
    AMD EPYC) becoming 16 small ones."""
    ridge = eps * float(torch.diagonal(m).mean().clamp_min(1e-30))
    out = torch.zeros_like(m)
    for idx in diagonal_blocks(m):
        block = m[idx[:, None], idx[None, :]]
        evals, evecs = eigh(block + ridge * torch.eye(idx.numel(), dtype=m.dtype, device=m.device))
        out[idx[:, None], idx[None, :]] = (evecs * evals.clamp_min(ridge).sqrt()) @ evecs.T
    return out
