"""Partial RoPE: choose which rotary pairs keep their rotation, and in which key basis.

Layout (HF rotate_half; docs/math.md): pair ``k`` of a head is dims ``(k, k + d/2)`` with inverse
frequency ``inv_freq[k]``. Treat the key pair of KV head ``g`` as a complex number
``K_g = k[k] + i k[k + d/2]``; RoPE multiplies it by ``e^{i θ_k t}``. For each frequency a unitary
``U`` (G x G) mixes the KV heads' pairs, ``K'_m = Σ_g U[m, g] K_g``, and query head ``h`` of group
``g`` uses ``q'_m = U[m, g] q_h``: the score ``Σ_m Re(conj(q'_m) K'_m) = Re(conj(q_h) K_g)`` is
unchanged and ``U`` commutes with the rotation (TransMLA's RoRoPE, arXiv:2502.07864). Components
kept as RoPE ("slots" ``(k, m)``) are rotated at their exact source frequency; all other components
become NoPE dims that join the low-rank latent. Keeping every component is exact.

Modes:
  * ``per-head`` (MHA2MLA, arXiv:2502.14837): ``U = I``; each KV head keeps ``r`` of its own pairs in
    its own rope head (``R = G`` rope heads).
  * ``shared``: one rope head (``R = 1``) of ``r`` components from a per-frequency PCA of the KV
    heads' keys (``complex`` unitary basis by default; ``real`` uses a real orthogonal one).

Strategies (which ``r`` pairs/components): ``high`` (pairs 0..r-1), ``low`` (last r), ``uniform``
(``floor(i d / 2r)``), ``2-norm`` (per KV head, ``Σ_{h∈g} E‖q_{h,k}‖ · E‖k_{g,k}‖``) and
``rotation`` (ours): the RMS of each component's logit contribution, ``sqrt(E|q'|² E|K'|²)``,
times ``sqrt(1 - sin(θ_k T)/(θ_k T))`` — how far the pair actually rotates, on average, over a
context of ``T`` tokens (the mean of ``|e^{iθΔ} - 1|²/2`` over ``Δ ∈ [0, T]``). A pair that barely
rotates costs little when its rotation is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mla_convert.convert.layer import linalg
from mla_convert.convert.options.options import BASES, MODES, STRATEGIES
from mla_convert.convert.stats.calibration import LayerStats, head_moments, projection_moment
from mla_convert.errors import UserError
from mla_convert.mla.algebra import head_to_group


class RopeError(UserError):
    """Impossible RoPE options (one line, with the allowed range)."""


@dataclass
class RopePlan:
    """Where each query/key dim of one layer goes after partial RoPE.

    Shapes (``H`` query heads, ``G`` KV heads, ``d`` source head dim, ``R`` rope heads, ``P`` pairs per
    rope head, ``d_R = 2P``, ``d_N`` NoPE dims per head, ``n`` unique NoPE key rows):

    Attributes:
        key_nope: ``[n, G*d]`` unique NoPE key rows as combinations of the source key rows.
        nope_index: ``[G, d_N]`` long: group ``g``'s ``k_nope = (key_nope @ k)[nope_index[g]]``.
        key_rope: ``[R*d_R, G*d]`` rope key rows, rotate_half layout inside each rope head.
        q_nope: ``[H, d_N, d]`` maps a source query head to its NoPE part.
        q_rope: ``[H, d_R, d]`` maps a source query head to its rope part.
        inv_freq: ``[R, P]`` float32 exact source frequencies of the kept pairs.
        origin: ``[R][P]`` labels such as ``"kv1.p3"`` (per-head) or ``"f3.c0"`` (frequency 3, PCA
            component 0) for reports and manifests.
        kept: per rope head the source pair (frequency) indices kept.
        basis: ``[d/2, G, G]`` complex128 unitary per frequency (rows = components ``m``); the identity
            for every frequency that keeps no RoPE component (per-head mode: the identity everywhere).
        slots: per rope head the kept components ``(k, m)`` (frequency ``k``, component ``m`` of ``basis[k]``).
            Together with ``basis`` this is the plan's whole choice; the oracle tests rebuild the function
            from these two and the source weights alone.
    """

    key_nope: torch.Tensor
    nope_index: torch.Tensor
    key_rope: torch.Tensor
    q_nope: torch.Tensor
    q_rope: torch.Tensor
    inv_freq: torch.Tensor
    origin: list[list[str]]
    kept: list[list[int]] = field(default_factory=list)
    rope_energy: float = 0.0  # share of the key's per-frequency energy kept as RoPE (shared mode)
    basis: torch.Tensor | None = None
    slots: list[list[tuple[int, int]]] = field(default_factory=list)


def rotation_weight(inv_freq: torch.Tensor, context: int) -> torch.Tensor:
    """``1 - sin(θT)/(θT)`` per pair: mean of ``|e^{iθΔ} - 1|² / 2`` over distances ``Δ ∈ [0, T]``."""
    x = inv_freq.double() * context
    return torch.where(x > 1e-8, 1 - torch.sin(x) / x.clamp_min(1e-30), x * x / 6)


def fixed_pairs(strategy: str, r: int, half: int) -> list[int]:
    """Pair indices of the data-free strategies ``high``, ``low``, ``uniform`` (sorted)."""
    if strategy == "high":
        return list(range(r))
    if strategy == "low":
        return list(range(half - r, half))
    if strategy == "uniform":
        return sorted({(i * half) // r for i in range(r)})
    raise RopeError(f"unknown fixed strategy {strategy!r}")


def _pair_moments(m: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """``E|pair|²`` ``[heads, d/2]`` from a second-moment matrix ``[heads*d, heads*d]``."""
    diag = torch.diagonal(m).view(heads, d)
    return diag[:, : d // 2] + diag[:, d // 2 :]


def _complex_cov(kk: torch.Tensor, g: int, d: int, k: int) -> torch.Tensor:
    """``E[K Kᴴ]`` ``[G, G]`` complex128 of frequency ``k`` from the real key second moment ``[G*d, G*d]``."""
    a = torch.tensor([i * d + k for i in range(g)])
    b = a + d // 2
    re = kk[a][:, a] + kk[b][:, b]
    im = kk[b][:, a] - kk[a][:, b]
    return torch.complex(re, im)


def _basis(cov: torch.Tensor, basis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Unitary ``U`` (rows = components, descending energy) and the energies ``[G]``."""
    if basis == "real":
        evals, evecs = linalg.eigh(cov.real)
        evecs = evecs.to(torch.complex128)
    else:
        evals, evecs = linalg.eigh(cov)
    order = torch.argsort(evals, descending=True)
    return evecs[:, order].conj().T.contiguous(), evals[order].clamp_min(0)


def plan_layer(
    w: dict[str, torch.Tensor],
    st: LayerStats,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    mode: str,
    strategy: str,
    pairs: int,
    context: int,
    basis: str = "complex",
) -> RopePlan:
    """Build the RoPE plan of one layer.

    Args:
        w: float64 source weights ``q [H*d, hidden]``, ``k [G*d, hidden]`` and optional biases ``bq``, ``bk``.
        st: the layer's calibration statistics.
        inv_freq: ``[d/2]`` source inverse frequencies (radians per token).
        mode: ``per-head`` or ``shared``.
        strategy: one of :data:`STRATEGIES`.
        pairs: ``r``, pairs per rope head (per KV head in ``per-head`` mode).
        context: ``T`` in tokens for the ``rotation`` strategy.
        basis: ``complex`` or ``real`` (shared mode).

    Raises:
        RopeError: unknown mode/strategy/basis, or ``pairs`` out of range.
    """
    h, g = num_heads, num_kv_heads
    d = w["q"].shape[0] // h
    half = d // 2
    if mode not in MODES:
        raise RopeError(f"unknown --rope-mode {mode!r}; choose one of {', '.join(MODES)}")
    if strategy not in STRATEGIES:
        raise RopeError(f"unknown --rope-strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if basis not in BASES:
        raise RopeError(f"unknown --rope-basis {basis!r}; choose one of {', '.join(BASES)}")
    limit = half if (mode == "per-head" or strategy != "rotation") else half * g
    if not 0 <= pairs <= limit:
        raise RopeError(
            f"--rope-pairs {pairs} is out of range: {mode} mode with strategy {strategy} allows 0..{limit} "
            f"(head_dim/2 = {half})"
        )
    kk = projection_moment(w, "k", st)
    q_diag = torch.diagonal(head_moments(w, "q", h, st), dim1=1, dim2=2)  # [H, d]: E[q_i²] per head
    eq = q_diag[:, :half] + q_diag[:, half:]  # [H, d/2]
    ek = _pair_moments(kk, g, d)  # [G, d/2]
    group = head_to_group(h, g).tolist()
    unitary = [torch.eye(g, dtype=torch.complex128) for _ in range(half)]
    mixed = [False] * half
    slots: list[list[tuple[int, int]]]  # per rope head: (frequency k, component m)
    energy_kept = 0.0
    if mode == "per-head":
        slots = []
        for gi in range(g):
            if strategy in ("high", "low", "uniform"):
                chosen = fixed_pairs(strategy, pairs, half)
            else:
                qn = st.q_pair_norm[[i for i in range(h) if group[i] == gi]]
                if strategy == "2-norm":
                    score = qn.sum(0) * st.k_pair_norm[gi]
                else:
                    qe = eq[[i for i in range(h) if group[i] == gi]].sum(0)
                    score = torch.sqrt(qe * ek[gi]) * torch.sqrt(rotation_weight(inv_freq, context))
                chosen = sorted(torch.argsort(score, descending=True)[:pairs].tolist())
            slots.append([(k, gi) for k in chosen])
    else:
        energies = []
        total_energy = 0.0
        for k in range(half):
            u, lam = _basis(_complex_cov(kk, g, d, k), basis)
            unitary[k] = u
            energies.append(lam)
            total_energy += float(lam.sum())
        if strategy == "rotation":
            rw = torch.sqrt(rotation_weight(inv_freq, context))
            cand = []
            for k in range(half):
                for m in range(g):
                    qe_sum = sum(float(abs(unitary[k][m, group[i]]) ** 2 * eq[i, k]) for i in range(h))
                    cand.append((math.sqrt(qe_sum * float(energies[k][m])) * float(rw[k]), k, m))
            cand.sort(key=lambda c: (-c[0], c[1], c[2]))
            chosen_slots = sorted((k, m) for _, k, m in cand[:pairs])
        else:
            if strategy == "2-norm":
                score = torch.stack(
                    [
                        st.q_pair_norm[[i for i in range(h) if group[i] == gi]].sum(0) * st.k_pair_norm[gi]
                        for gi in range(g)
                    ]
                ).sum(0)
                freqs = sorted(torch.argsort(score, descending=True)[:pairs].tolist())
            else:
                freqs = fixed_pairs(strategy, pairs, half)
            chosen_slots = [(k, 0) for k in freqs]
        slots = [chosen_slots]
        for k, m in chosen_slots:
            energy_kept += float(energies[k][m])
            mixed[k] = True
        energy_kept /= max(total_energy, 1e-30)
        # A frequency that keeps no RoPE component stays in the source basis: each KV group reads its own
        # pair as NoPE dims. (Its PCA basis would mix the groups' keys while only component m is read by
        # group m: a wrong score function, caught by tests/convert/test_oracle.py.)
        for k in range(half):
            if not mixed[k]:
                unitary[k] = torch.eye(g, dtype=torch.complex128)
    return _assemble(h, g, d, inv_freq, unitary, mixed, slots, group, energy_kept, mode)


def _rows(u: complex, k: int, d: int, offset: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real rows (re, im) over ``width`` dims of ``u * (x[offset+k] + i x[offset+k+d/2])``."""
    re = torch.zeros(width, dtype=torch.float64)
    im = torch.zeros(width, dtype=torch.float64)
    re[offset + k], re[offset + k + d // 2] = u.real, -u.imag
    im[offset + k], im[offset + k + d // 2] = u.imag, u.real
    return re, im


def _assemble(
    h: int,
    g: int,
    d: int,
    inv_freq: torch.Tensor,
    unitary: list[torch.Tensor],
    mixed: list[bool],
    slots: list[list[tuple[int, int]]],
    group: list[int],
    energy_kept: float,
    mode: str,
) -> RopePlan:
    half = d // 2
    r = len(slots)
    p = len(slots[0]) if slots else 0
    kept_set = {s for head in slots for s in head}
    # NoPE components: every (k, m) not kept; unmixed frequencies are read by their own group only.
    nope: list[tuple[int, int]] = [(k, m) for k in range(half) for m in range(g) if (k, m) not in kept_set]
    readers = {(k, m): (list(range(g)) if mixed[k] else [m]) for k, m in nope}
    key_nope_rows: list[torch.Tensor] = []
    for k, m in nope:
        re = torch.zeros(g * d, dtype=torch.float64)
        im = torch.zeros(g * d, dtype=torch.float64)
        for gi in range(g):
            a, b = _rows(complex(unitary[k][m, gi]), k, d, gi * d, g * d)
            re += a
            im += b
        key_nope_rows += [re, im]
    n_rows = len(key_nope_rows)
    per_group: list[list[int]] = [[] for _ in range(g)]
    for idx, comp in enumerate(nope):
        for gi in readers[comp]:
            per_group[gi] += [2 * idx, 2 * idx + 1]
    d_n = len(per_group[0])
    if any(len(x) != d_n for x in per_group):
        raise RopeError("NoPE width differs between KV heads; use the same number of pairs for every head")
    key_nope = torch.stack(key_nope_rows) if n_rows else torch.zeros(0, g * d, dtype=torch.float64)
    nope_index = torch.tensor(per_group, dtype=torch.long).view(g, d_n)
    q_nope = torch.zeros(h, d_n, d, dtype=torch.float64)
    for hi in range(h):
        gi = group[hi]
        for j, row in enumerate(per_group[gi]):
            k, m = nope[row // 2]
            re, im = _rows(complex(unitary[k][m, gi]), k, d, 0, d)
            q_nope[hi, j] = re if row % 2 == 0 else im
    d_r = 2 * p
    key_rope = torch.zeros(r * d_r, g * d, dtype=torch.float64)
    q_rope = torch.zeros(h, d_r, d, dtype=torch.float64)
    inv = torch.zeros(r, p, dtype=torch.float32)
    origin: list[list[str]] = []
    kept: list[list[int]] = []
    for ri, head in enumerate(slots):
        origin.append([])
        kept.append([k for k, _ in head])
        for pi, (k, m) in enumerate(head):
            inv[ri, pi] = inv_freq[k]
            origin[ri].append(f"kv{m}.p{k}" if mode == "per-head" else f"f{k}.c{m}")
            for gi in range(g):
                a, b = _rows(complex(unitary[k][m, gi]), k, d, gi * d, g * d)
                key_rope[ri * d_r + pi] += a
                key_rope[ri * d_r + p + pi] += b
    rope_of = head_to_group(h, r).tolist() if r else [0] * h
    for hi in range(h):
        ri = rope_of[hi]
        gi = group[hi]
        for pi, (k, m) in enumerate(slots[ri] if r else []):
            a, b = _rows(complex(unitary[k][m, gi]), k, d, 0, d)
            q_rope[hi, pi], q_rope[hi, p + pi] = a, b
    return RopePlan(
        key_nope,
        nope_index,
        key_rope,
        q_nope,
        q_rope,
        inv,
        origin,
        kept,
        energy_kept,
        torch.stack(unitary),
        [list(head) for head in slots],
    )
