"""The NoPE-width reduction (issue 34): its optimum and exact cases on synthetic forms, the widths the options and
``--target`` choose, and the precheck's message. The oracle on a converted model is in test_nope_oracle.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mla_convert.convert.layer.nope_rank import query_nope_moment, reduce_nope
from mla_convert.convert.options.options import ConvertOptions, geometry, problems
from mla_convert.engines.vllm.shape import shape_for_engine

F64 = torch.float64


def _layer(h=4, g=2, d_n=12, d_r=4, d_c=10, d_v=6, hidden=16, seed=0, bias=False):
    """Random assembled MLA tensors of one layer and input moments from real samples ``x [N, hidden]``."""
    gen = torch.Generator().manual_seed(seed)
    t = {
        "q_proj.weight": torch.randn(h * (d_n + d_r), hidden, generator=gen, dtype=F64),
        "kv_a_proj_with_mqa.weight": torch.randn(d_c + d_r, hidden, generator=gen, dtype=F64),
        "kv_b_proj.weight": torch.randn(g * (d_n + d_v), d_c, generator=gen, dtype=F64),
        "o_proj.weight": torch.randn(hidden, h * d_v, generator=gen, dtype=F64),
    }
    if bias:
        t["q_proj.bias"] = torch.randn(h * (d_n + d_r), generator=gen, dtype=F64)
    # anisotropic inputs with a mean: the weighting matters
    x = torch.randn(400, hidden, generator=gen, dtype=F64) * torch.linspace(0.2, 3.0, hidden, dtype=F64) + 0.5
    return t, x, (x.T @ x / x.shape[0], x.mean(0))


def _scores(t, x, h, g, d_n, d_r, d_c):
    """NoPE scores ``[H, N, N]`` of every (query, key) token pair, read off the tensors by plain slicing."""
    q = (x @ t["q_proj.weight"].T + t.get("q_proj.bias", 0.0)).view(len(x), h, d_n + d_r)[..., :d_n]
    c = x @ t["kv_a_proj_with_mqa.weight"][:d_c].T
    wb = t["kv_b_proj.weight"]
    k = (c @ wb.T).view(len(x), g, -1)[..., :d_n].repeat_interleave(h // g, dim=1)
    return torch.einsum("thn,jhn->htj", q, k)


@pytest.mark.parametrize("bias", [False, True])
def test_rank_n_form_is_the_weighted_optimum(bias):
    """Lossy (n < min(d_N, d_c)): the measured mean squared score error over all token pairs equals the dropped
    energy (Eckart–Young, computed here from the left Gram ``Q^{1/2} W C_c W^T Q^{1/2}``, not the code's right one),
    and any other rank-n form with the same key map does worse."""
    h, g, d_n, d_r, d_c, d_v, n = 4, 2, 12, 4, 10, 6, 3
    t, x, (xx, mean) = _layer(bias=bias)
    out, rec = reduce_nope(t, h, g, d_n, d_r, n, xx, mean)
    assert out["q_proj.weight"].shape == (h * (n + d_r), 16) and out["kv_b_proj.weight"].shape == (h * (n + d_v), d_c)
    before = _scores(t, x, h, g, d_n, d_r, d_c)
    after = _scores(out, x, h, h, n, d_r, d_c)
    err = (before - after).square().mean((1, 2))
    # independent route: per head, eigenvalues of the left Gram (d_N x d_N) of N = Q^{1/2} W C_c^{1/2}
    wa = t["kv_a_proj_with_mqa.weight"][:d_c]
    c = x @ wa.T
    cc = c.T @ c / len(x)
    q_all = (x @ t["q_proj.weight"].T + t.get("q_proj.bias", 0.0)).view(len(x), h, d_n + d_r)[..., :d_n]
    for hi in range(h):
        w = t["kv_b_proj.weight"].view(g, d_n + d_v, d_c)[hi // (h // g), :d_n]
        qq = q_all[:, hi].T @ q_all[:, hi] / len(x)
        ev, evec = torch.linalg.eigh(qq)
        root = (evec * ev.clamp_min(0).sqrt()) @ evec.T
        s2 = torch.linalg.eigvalsh(root @ w @ cc @ w.T @ root).flip(0)
        assert float(err[hi]) == pytest.approx(float(s2[n:].sum()), rel=1e-6)
        assert float(rec.dropped[hi]) == pytest.approx(float(s2[n:].sum()), rel=1e-6)
        assert float(rec.kept[hi]) == pytest.approx(float(s2[:n].sum() / s2.sum()), rel=1e-6)
    assert float(err.min()) > 1e-3  # a real loss, so the checks above can fail
    # a perturbed query map (same new key map) is worse for every head
    worse = dict(out)
    worse["q_proj.weight"] = out["q_proj.weight"] + 1e-3 * torch.randn_like(out["q_proj.weight"])
    assert bool(((before - _scores(worse, x, h, h, n, d_r, d_c)).square().mean((1, 2)) > err).all())


@pytest.mark.parametrize(("d_n", "d_c", "n"), [(12, 10, 12), (12, 10, 16), (12, 10, 10), (6, 10, 8)])
def test_exact_when_the_rank_allows(d_n, d_c, n):
    """n >= d_N or n >= d_c: every NoPE score reproduced to rounding, rope rows and values untouched."""
    h, g, d_r, d_v = 4, 2, 4, 6
    t, x, (xx, mean) = _layer(d_n=d_n, d_c=d_c, bias=True)
    out, rec = reduce_nope(t, h, g, d_n, d_r, n, xx, mean)
    before, after = _scores(t, x, h, g, d_n, d_r, d_c), _scores(out, x, h, h, n, d_r, d_c)
    assert float((before - after).abs().max()) < 1e-10 * float(before.abs().max())
    assert bool((rec.kept == 1).all()) and bool((rec.dropped == 0).all())
    q_in, q_out = t["q_proj.weight"].view(h, d_n + d_r, -1), out["q_proj.weight"].view(h, n + d_r, -1)
    assert torch.equal(q_in[:, d_n:], q_out[:, n:])
    v_in = t["kv_b_proj.weight"].view(g, d_n + d_v, d_c)[:, d_n:].repeat_interleave(h // g, 0)
    assert torch.equal(v_in, out["kv_b_proj.weight"].view(h, n + d_v, d_c)[:, n:])


def test_exact_at_the_query_rank_through_the_decomposition():
    """d_N = 12 > n = 8 and d_c = 10 > n, but every head's NoPE query is a function of 8 source values (as the
    mixed RoPE components are of head_dim): the form has rank 8 and the eigen route keeps it to rounding."""
    h, g, d_n, d_r, d_c = 4, 2, 12, 4, 10
    t, x, (xx, mean) = _layer()
    q = t["q_proj.weight"].view(h, d_n + d_r, -1)
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(h, 8, 16, generator=gen, dtype=F64)
    q[:, :d_n] = torch.randn(h, d_n, 8, generator=gen, dtype=F64) @ base  # rank-8 NoPE query maps
    out, rec = reduce_nope(t, h, g, d_n, d_r, 8, xx, mean)
    before, after = _scores(t, x, h, g, d_n, d_r, d_c), _scores(out, x, h, h, 8, d_r, d_c)
    assert float((before - after).abs().max()) < 1e-8 * float(before.abs().max())
    assert float(rec.kept.min()) > 1 - 1e-12


@pytest.mark.parametrize("bias", [False, True])
def test_query_moments_from_the_source_rows_are_the_assembled_ones(bias):
    """:func:`query_nope_moment` (the D x D moment taken on the source head's d rows, then mapped) gives what
    :func:`reduce_nope` computes from the assembled ``d_N``-wide rows, and so the same reduced layer (issue 51: the
    cheaper route ``factor`` takes)."""
    h, g, d, d_n, d_r, d_c, hidden, n, scale = 4, 2, 8, 12, 4, 10, 16, 3, 1.3
    t, _, (xx, mean) = _layer(h=h, g=g, d_n=d_n, d_r=d_r, d_c=d_c, hidden=hidden, bias=bias)
    gen = torch.Generator().manual_seed(2)
    w_q = torch.randn(h * d, hidden, generator=gen, dtype=F64)
    b_q = torch.randn(h * d, generator=gen, dtype=F64) if bias else None
    a_nope = torch.randn(h, d_n, d, generator=gen, dtype=F64)
    q = t["q_proj.weight"].view(h, d_n + d_r, hidden)
    q[:, :d_n] = scale * a_nope @ w_q.view(h, d, hidden)  # the assembled rows: scale * A_h W_h
    if bias:
        assert b_q is not None
        t["q_proj.bias"].view(h, d_n + d_r)[:, :d_n] = scale * (a_nope @ b_q.view(h, d, 1))[..., 0]
    direct, rec = reduce_nope(t, h, g, d_n, d_r, n, xx, mean)
    fast, rec_fast = reduce_nope(
        t, h, g, d_n, d_r, n, xx, mean, lambda hi: query_nope_moment(w_q, b_q, a_nope, scale, xx, mean, hi)
    )
    for k in direct:
        assert torch.allclose(direct[k], fast[k], rtol=1e-9, atol=1e-9 * float(direct[k].abs().max())), k
    assert torch.allclose(rec.dropped, rec_fast.dropped, rtol=1e-9)
    assert float(rec.dropped.min()) > 0  # lossy: the moments decide what is dropped


LLAMA3_8B = SimpleNamespace(head_dim=128, num_kv_heads=8, hidden_size=4096, num_layers=32, num_heads=32)


@pytest.mark.parametrize(
    ("head_dim", "g", "pairs", "width"),
    [(128, 8, 32, 512), (64, 8, 32, 448), (128, 4, 32, 256), (64, 3, 24, 112), (64, 1, 8, 48)],
)
def test_query_nope_width(head_dim, g, pairs, width):
    """d + 2r(G-2) with one shared rope head (Llama-3-8B 512, Llama-3.2-1B 448, Qwen2.5-7B 256, SmolLM2 112; MQA
    d - 2r); per-head: d - 2r."""
    src = SimpleNamespace(head_dim=head_dim, num_kv_heads=g, hidden_size=4096, num_layers=2, num_heads=32)
    assert geometry(ConvertOptions(rope_pairs=pairs, rope_strategy="high"), src).query_nope_width == width
    assert geometry(ConvertOptions(rope_pairs=pairs, rope_mode="per-head"), src).query_nope_width == head_dim - 2 * pairs


def test_option_is_checked():
    found = dict(problems(ConvertOptions(rope_pairs=32, qk_nope_head_dim=0), LLAMA3_8B))
    assert found["qk_nope_head_dim"].startswith("0 is too small")
    found = dict(problems(ConvertOptions(rope_pairs=32, qk_nope_head_dim=513), LLAMA3_8B))
    assert "over the query's NoPE width 512" in found["qk_nope_head_dim"]
    assert problems(ConvertOptions(rope_pairs=32, qk_nope_head_dim=512), LLAMA3_8B) == []


def test_engine_targets_choose_a_width_they_take():
    """Llama-3-8B shape: 512 is over every width vLLM takes; 128 >= min(head_dim, kv_lora_rank) is exact, on GPU
    and CPU. A head_dim-256 source (rank up to 256): 192 on GPU, the widest (lossy). SmolLM2's 112 fits: none. A
    width given is kept."""
    shaped, why = shape_for_engine(ConvertOptions(), LLAMA3_8B, "vllm")
    assert shaped.qk_nope_head_dim == 128 and why and "--qk-nope-head-dim 128" in why and "exact" in why
    assert shape_for_engine(ConvertOptions(), LLAMA3_8B, "vllm-cpu")[0].qk_nope_head_dim == 128
    wide = SimpleNamespace(head_dim=256, num_kv_heads=4, hidden_size=4096, num_layers=2, num_heads=16)
    shaped, why = shape_for_engine(ConvertOptions(), wide, "vllm")
    assert shaped.qk_nope_head_dim == 192 and why and "lossy" in why
    smol = SimpleNamespace(head_dim=64, num_kv_heads=3, hidden_size=576, num_layers=30, num_heads=9)
    assert shape_for_engine(ConvertOptions(), smol, "vllm")[0].qk_nope_head_dim is None
    given = shape_for_engine(ConvertOptions(qk_nope_head_dim=64), LLAMA3_8B, "vllm", ["qk_nope_head_dim"])[0]
    assert given.qk_nope_head_dim == 64
