"""Calibration statistics of a source layer's attention input on real text (accumulated by the streamed
conversion, :mod:`mla_convert.convert.pipeline.stream`, as the windows pass through each source layer).

For each layer ``l`` the attention input ``x`` (the output of ``input_layernorm``, ``[tokens, hidden]``)
gives everything the conversion needs, since queries, keys and values are linear in ``x``:

* ``xx = E[x xᵀ]`` and ``x_mean = E[x]`` (float64): activation-aware and output-aware factorization
  (docs/math.md §Low-rank factorization) and the complex key covariance of the shared rope key (RoRoPE).
* ``q_pair_norm [H, d/2]`` and ``k_pair_norm [G, d/2]``: ``E_t ‖pair‖`` of each RoPE pair, the
  MHA2MLA 2-norm statistic (arXiv:2502.14837), measured pre-rotation (rotation keeps norms).

Held-out windows are captured separately (inputs and source attention outputs) so the report can
measure each converted layer's attention error on tokens the statistics never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerStats:
    """Second-moment statistics of one layer's attention input over ``tokens`` calibration tokens."""

    xx: torch.Tensor  # [hidden, hidden] float64, E[x xᵀ]
    x_mean: torch.Tensor  # [hidden] float64
    q_pair_norm: torch.Tensor  # [H, d/2] float64, E‖q pair‖
    k_pair_norm: torch.Tensor  # [G, d/2] float64, E‖k pair‖
    tokens: int
    x: torch.Tensor | None = None  # [N, T, hidden] float32 calibration inputs (keep_calibration only)
    out: torch.Tensor | None = None  # [N, T, hidden] float32 source attention outputs (keep_calibration only)
    moments: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # projection_moment's memo


@dataclass
class HeldOut:
    """Held-out attention inputs and source outputs of one layer: ``x``, ``out`` ``[N, T, hidden]`` float32."""

    x: torch.Tensor
    out: torch.Tensor


def _pair_norms(y: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """``E‖pair‖`` per head and pair of ``y [N, heads*d]`` (pair k = dims k, k + d/2) -> ``[heads, d/2]``."""
    y = y.view(-1, heads, d)
    return torch.sqrt(y[..., : d // 2] ** 2 + y[..., d // 2 :] ** 2).mean(0)


class StatsAccumulator:
    """Running second moments of one layer's attention input (the sums behind :class:`LayerStats`).

    Args:
        weights: the layer's source weights (``q``, ``k`` and optional ``bq``, ``bk``; any float dtype): the
            second moments are summed in float64, the pair norms from float32 projections.
        num_heads, num_kv_heads, head_dim: ``H``, ``G``, ``d``.
        device: where the sums live (the device the inputs arrive on).
    """

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
    ) -> None:
        hid = weights["q"].shape[1]
        self.h, self.g, self.d, self.hid = num_heads, num_kv_heads, head_dim, hid
        # the pair norms are ranking statistics: float32 projections (a float64 one cost ~2/3 of these sums)
        self.w = {k: v.to(device, torch.float32) for k, v in weights.items() if k in ("q", "k", "bq", "bk")}
        self.xx = torch.zeros(hid, hid, dtype=torch.float64, device=device)
        self.sum = torch.zeros(hid, dtype=torch.float64, device=device)
        self.q = torch.zeros(num_heads, head_dim // 2, dtype=torch.float64, device=device)
        self.k = torch.zeros(num_kv_heads, head_dim // 2, dtype=torch.float64, device=device)
        self.n = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Add the attention inputs ``x [..., hidden]`` (any float dtype) to the sums (in float64 and float32 even
        inside the calibration's bfloat16 autocast)."""
        with torch.autocast(x.device.type, enabled=False):
            self._add(x)

    def _add(self, x: torch.Tensor) -> None:
        x32 = x.detach().reshape(-1, self.hid).float()
        x64 = x32.double()
        w = self.w
        self.xx += x64.T @ x64
        self.sum += x64.sum(0)
        q = x32 @ w["q"].T + (w["bq"] if "bq" in w else 0)
        k = x32 @ w["k"].T + (w["bk"] if "bk" in w else 0)
        self.q += _pair_norms(q, self.h, self.d).double() * x64.shape[0]
        self.k += _pair_norms(k, self.g, self.d).double() * x64.shape[0]
        self.n += x64.shape[0]

    def finish(self, x: torch.Tensor | None = None, out: torch.Tensor | None = None) -> LayerStats:
        """The means as :class:`LayerStats` on the CPU (``x``/``out``: kept calibration inputs/outputs).

        Raises:
            ValueError: when no token was added.
        """
        if self.n == 0:
            raise ValueError("no calibration tokens")
        n = self.n
        return LayerStats(
            xx=(self.xx / n).cpu(),
            x_mean=(self.sum / n).cpu(),
            q_pair_norm=(self.q / n).cpu(),
            k_pair_norm=(self.k / n).cpu(),
            tokens=int(n),
            x=x,
            out=out,
        )


def second_moment(w: torch.Tensor, b: torch.Tensor | None, st: LayerStats) -> torch.Tensor:
    """``E[y yᵀ]`` for ``y = W x + b`` from the layer's input moments: ``W xx Wᵀ + W μ bᵀ + b μᵀ Wᵀ + b bᵀ``.

    Args:
        w: ``[out, hidden]`` float64.
        b: ``[out]`` or None.
    Returns:
        ``[out, out]`` float64.
    """
    m = w @ st.xx @ w.T
    if b is not None:
        wm = w @ st.x_mean
        m = m + torch.outer(wm, b) + torch.outer(b, wm) + torch.outer(b, b)
    return m


def projection_moment(w: dict[str, torch.Tensor], which: str, st: LayerStats) -> torch.Tensor:
    """``E[y yᵀ]`` of the layer's source projection ``which`` (``"k"``: ``y = W_k x + b_k``, ``[G*d, G*d]``
    float64), computed once per layer and kept in ``st.moments``."""
    if which not in st.moments:
        st.moments[which] = second_moment(w[which], w.get(f"b{which}"), st)
    return st.moments[which]


def head_moments(w: dict[str, torch.Tensor], which: str, heads: int, st: LayerStats) -> torch.Tensor:
    """Per-head blocks ``E[y_h y_hᵀ]`` ``[heads, d, d]`` (float64) of projection ``which`` (``"q"``), bias
    included, computed once per layer (``st.moments``). Only the diagonal blocks: the RoPE plan reads their
    diagonals, the output-aware factorization the blocks; the full ``[H*d, H*d]`` matrix would cost another
    ``2 (H d)² hidden`` flops (140 GFLOP for an 8B layer)."""
    key = f"{which}_heads"
    if key not in st.moments:
        wt, b = w[which], w.get(f"b{which}")
        d = wt.shape[0] // heads
        blocks = []
        for h in range(heads):
            rows = slice(h * d, (h + 1) * d)
            blocks.append(second_moment(wt[rows], b[rows] if b is not None else None, st))
        st.moments[key] = torch.stack(blocks)
    return st.moments[key]
