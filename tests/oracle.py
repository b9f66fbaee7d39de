"""Oracles for the lossy conversion steps, computed from the source weights without mla-convert's assembly.

The converted model must equal, to float tolerance, the *source model* changed in exactly the way the
conversion says it changes it:

* **Partial RoPE at full latent rank** = the source whose un-kept rotary components are simply not
  rotated. For frequency ``k`` the plan chose a unitary ``U_k`` (``G x G``, rows = components) and a set
  of kept components ``D_k``; treating the key pair of KV head ``g`` as ``K_g = k[k] + i k[k + d/2]``,
  the rotated part is ``P_k K`` with ``P_k = U_kᴴ D_k U_k`` and the rest ``(I - P_k) K`` is scored
  without rotation (same RoPE attention factor).
* **Low rank** = the source whose unrotated key part and values are replaced by their reconstruction
  from the latent ``c = A x`` (``A`` = the saved ``kv_a_proj_with_mqa`` latent rows), i.e. their
  least-squares projection on the latent subspace under the calibration metric ``C``:
  ``W_hat = W C Aᵀ (A C Aᵀ)⁺ A``, rows fitted independently (so any row weighting and K/V balance of
  the objective drop out). With ``split`` factorization keys use the first ``rk`` latent rows, values
  the rest.

Nothing here reads ``q_proj``/``kv_b_proj`` rows, NoPE indices or the plan's row maps: only the plan's
*choice* (``basis`` and ``slots``), the source weights, HF's own ``cos``/``sin`` and the saved latent rows.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# The causal mask is the one shared piece: what is under test (rotation, projection, scale) is the source's own
# (HF's cos/sin, rotate_half and the source attention's own scaling), never mla_convert's algebra.
from mla_convert.mla.algebra import causal_mask


@dataclass
class LayerOracle:
    """What the oracle needs of one converted layer.

    Attributes:
        p_rot: ``[d/2, G, G]`` complex128 projector on the kept RoPE components per frequency.
        latent: ``[d_c, hidden]`` float64 latent rows ``A`` (None: full rank, no projection).
        metric: ``[hidden, hidden]`` float64 ``C`` of the least-squares projection (identity for ``weight``).
        key_latent_rows: with ``split`` factorization, the first this many latent rows serve keys only.
        o_proj: optional ``[hidden, H*d_v]`` replacement of the source ``o_proj`` weight (a refit).
    """

    p_rot: torch.Tensor
    latent: torch.Tensor | None = None
    metric: torch.Tensor | None = None
    key_latent_rows: int | None = None
    o_proj: torch.Tensor | None = None


def rotation_projector(basis: torch.Tensor, slots: list[list[tuple[int, int]]]) -> torch.Tensor:
    """``P_k = U_kᴴ D_k U_k`` ``[d/2, G, G]`` from a plan's per-frequency ``basis`` and kept ``slots``."""
    half, g, _ = basis.shape
    mask = torch.zeros(half, g, dtype=torch.complex128)
    for head in slots:
        for k, m in head:
            mask[k, m] = 1
    u = basis.to(torch.complex128)
    return u.conj().transpose(1, 2) @ (mask[:, :, None] * u)


def _split_pairs(w: torch.Tensor, g: int, d: int) -> torch.Tensor:
    """Rows ``[G*d, ...]`` -> complex ``[G, d/2, ...]`` (pair k = rows k, k + d/2 of each head)."""
    w = w.reshape(g, d, *w.shape[1:])
    return torch.complex(w[:, : d // 2], w[:, d // 2 :])


def _join_pairs(c: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_split_pairs`: complex ``[G, d/2, ...]`` -> real ``[G*d, ...]``."""
    return torch.cat([c.real, c.imag], dim=1).reshape(-1, *c.shape[2:])


def _project(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Apply ``P_k`` across KV heads: ``c [G, d/2, ...]`` -> ``[G, d/2, ...]``."""
    flat = c.reshape(c.shape[0], c.shape[1], -1)
    out = torch.einsum("kab,bkx->akx", p, flat)
    return out.reshape(c.shape)


def _reconstruct(w: torch.Tensor, a: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """Row-wise least squares ``W C Aᵀ (A C Aᵀ)⁺ A``: each row of ``w`` projected on the row space of ``a``."""
    gram = a @ metric @ a.T
    return w @ metric @ a.T @ torch.linalg.pinv(gram, hermitian=True) @ a


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def oracle_attention(attn: torch.nn.Module, layer: LayerOracle, scaling_factor: float):  # noqa: ANN201
    """A replacement ``forward`` for a transformers Llama/Qwen2/Mistral attention module."""

    def forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: Any = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        cfg = self.config
        h, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim
        f64 = torch.float64
        wq, wk, wv = (m.weight.to(f64) for m in (self.q_proj, self.k_proj, self.v_proj))
        bq, bk, bv = (
            m.bias.to(f64) if m.bias is not None else torch.zeros(m.weight.shape[0], dtype=f64)
            for m in (self.q_proj, self.k_proj, self.v_proj)
        )
        kc, bkc = _split_pairs(wk, g, d), _split_pairs(bk, g, d)
        k_rot, bk_rot = _join_pairs(_project(layer.p_rot, kc)), _join_pairs(_project(layer.p_rot, bkc))
        k_flat, bk_flat = k_rot, bk_rot
        k_un, bk_un = wk - k_flat, bk - bk_flat
        if layer.latent is not None:
            a = layer.latent
            metric = layer.metric if layer.metric is not None else torch.eye(a.shape[1], dtype=f64)
            if layer.key_latent_rows is None:
                both = _reconstruct(torch.cat([k_un, wv]), a, metric)
                k_un, wv = both[: k_un.shape[0]], both[k_un.shape[0] :]
            else:
                rk = layer.key_latent_rows
                k_un = _reconstruct(k_un, a[:rk], metric) if rk else torch.zeros_like(k_un)
                wv = _reconstruct(wv, a[rk:], metric)
        x = hidden_states.to(f64)
        b, t, _ = x.shape
        q = (x @ wq.T + bq).view(b, t, h, d).transpose(1, 2)
        kr = (x @ k_flat.T + bk_flat).view(b, t, g, d).transpose(1, 2)
        ku = (x @ k_un.T + bk_un).view(b, t, g, d).transpose(1, 2)
        v = (x @ wv.T + bv).view(b, t, g, -1).transpose(1, 2)
        cos, sin = (e.to(f64)[:, None] for e in position_embeddings)
        rep = h // g
        kr, ku, v = (z.repeat_interleave(rep, dim=1) for z in (kr, ku, v))
        scores = _rotate(q, cos, sin) @ _rotate(kr, cos, sin).transpose(-1, -2)
        scores = scores + scaling_factor**2 * (q @ ku.transpose(-1, -2))
        scores = scores * self.scaling
        probs = torch.softmax(scores + causal_mask(b, t, dtype=f64), dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, t, -1)
        wo = layer.o_proj.to(f64) if layer.o_proj is not None else self.o_proj.weight.to(f64)
        bo = self.o_proj.bias.to(f64) if self.o_proj.bias is not None else 0.0
        return (out @ wo.T + bo).to(hidden_states.dtype), None

    return types.MethodType(forward, attn)


@contextlib.contextmanager
def oracle_model(source: torch.nn.Module, layers: list[LayerOracle]) -> Iterator[torch.nn.Module]:
    """The source model with every attention layer replaced by its oracle (restored on exit)."""
    scaling_factor = float(getattr(source.model.rotary_emb, "attention_scaling", 1.0))
    mods = [layer.self_attn for layer in source.model.layers]
    try:
        for mod, lo in zip(mods, layers, strict=True):
            mod.forward = oracle_attention(mod, lo, scaling_factor)
        yield source
    finally:
        for mod in mods:
            mod.__dict__.pop("forward", None)


def layer_oracles(
    mla: torch.nn.Module,
    plans: list[Any],
    stats: list[Any] | None,
    objective: str = "output",
    factorization: str = "joint",
    full_rank: bool = False,
    o_proj_from_mla: bool = False,
) -> list[LayerOracle]:
    """One :class:`LayerOracle` per layer from the plans' choice and the converted model's saved latent rows.

    ``stats`` give the metric ``C = E[x xᵀ]`` of the ``activation``/``output`` objectives (``weight``: identity).
    """
    out = []
    for i, plan in enumerate(plans):
        attn = mla.model.layers[i].self_attn
        p_rot = rotation_projector(plan.basis, plan.slots)
        lo = LayerOracle(p_rot)
        if not full_rank:
            rank = attn.kv_lora_rank
            lo.latent = attn.kv_a_proj_with_mqa.weight.detach().double()[:rank]
            hidden = lo.latent.shape[1]
            lo.metric = (
                torch.eye(hidden, dtype=torch.float64)
                if objective == "weight" or stats is None
                else stats[i].xx
            )
            if factorization == "split":
                n_key = plan.key_nope.shape[0]
                lo.key_latent_rows = min(rank // 2 if n_key else 0, n_key)
        if o_proj_from_mla:
            lo.o_proj = attn.o_proj.weight.detach().double()
        out.append(lo)
    return out
