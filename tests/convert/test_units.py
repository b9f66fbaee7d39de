"""Unit tests of the three conversion steps on their own: ``rope`` (plans), ``factorize`` (low-rank
factors, rank allocation) and ``assemble`` (MLA tensors). Real SmolLM2 layer weights and calibration
statistics where the step can be shown on them; a small random layer with biases for bias handling.

The reference for every RoPE plan is the projector ``P_k = U_kᴴ D_k U_k`` built from the plan's
choice alone (``tests/oracle.py``): its row maps must realise exactly ``P`` on the rotated side and
``I - P`` on the NoPE side.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from oracle import rotation_projector

from mla_convert.convert.layer.assemble import layer_tensors, pad_plan, query_rows
from mla_convert.convert.layer.factorize import (
    FactorError,
    allocate_ranks,
    build_target,
    factor_layer,
    spectrum,
)
from mla_convert.convert.layer.rope import RopeError, fixed_pairs, plan_layer
from mla_convert.convert.stats.calibration import LayerStats, StatsAccumulator

LAYER = 3


def real_bilinear(p: torch.Tensor, d: int) -> torch.Tensor:
    """``[G, d, G*d]``: for a query head of group ``a``, ``score = qᵀ B[a] k`` with ``k`` all KV heads' keys,
    ``score = Σ_k Re(conj(Q_k) (P_k K_k)_a)`` in the rotate_half layout."""
    half, g, _ = p.shape
    out = torch.zeros(g, d, g * d, dtype=torch.float64)
    for k in range(half):
        for a in range(g):
            for b in range(g):
                pr, pi = float(p[k, a, b].real), float(p[k, a, b].imag)
                out[a, k, b * d + k], out[a, k, b * d + k + half] = pr, -pi
                out[a, k + half, b * d + k], out[a, k + half, b * d + k + half] = pi, pr
    return out


def plan_bilinears(plan, h: int, g: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the plan's row maps compute per query head: rope and NoPE bilinear forms ``[H, d, G*d]``."""
    r = len(plan.slots)
    d_r = plan.q_rope.shape[1]
    key_nope = torch.cat([plan.key_nope, torch.zeros(1, g * d, dtype=torch.float64)])
    rope = torch.stack(
        [
            plan.q_rope[hi].T @ plan.key_rope[(hi // (h // r)) * d_r : (hi // (h // r) + 1) * d_r]
            for hi in range(h)
        ]
    )
    nope = torch.stack([plan.q_nope[hi].T @ key_nope[plan.nope_index[hi // (h // g)]] for hi in range(h)])
    return rope, nope


@pytest.fixture(scope="module")
def layer(smol, smol_default):
    return smol.attention_weights(LAYER), smol_default.stats[LAYER]


PLANS = [
    ("per-head", "high", 8, "complex"),
    ("per-head", "2-norm", 20, "complex"),
    ("shared", "2-norm", 24, "complex"),
    ("shared", "high", 10, "real"),
    ("shared", "rotation", 40, "complex"),
    ("shared", "uniform", 7, "complex"),
]


@pytest.mark.parametrize(("mode", "strategy", "pairs", "basis"), PLANS)
def test_plan_rows_realise_the_projector(smol, layer, mode, strategy, pairs, basis):
    w, st = layer
    h, g, d = smol.num_heads, smol.num_kv_heads, smol.head_dim
    plan = plan_layer(w, st, smol.inv_freq, h, g, mode, strategy, pairs, 2048, basis)
    u = plan.basis
    eye = torch.eye(g, dtype=torch.complex128).expand_as(u)
    assert torch.allclose(u @ u.conj().transpose(1, 2), eye, atol=1e-12)  # unitary per frequency
    kept_freqs = {k for head in plan.slots for k, _ in head}
    for k in range(d // 2):
        if (
            k not in kept_freqs
        ):  # the shared-mode fault: an unselected frequency must stay in the source basis
            assert torch.equal(u[k], torch.eye(g, dtype=torch.complex128)), k
    p = rotation_projector(u, plan.slots)
    want = real_bilinear(p, d)
    want_nope = real_bilinear(torch.eye(g, dtype=torch.complex128).expand_as(p) - p, d)
    rope, nope = plan_bilinears(plan, h, g, d)
    group = [hi // (h // g) for hi in range(h)]
    assert torch.allclose(rope, want[group], atol=1e-12)
    assert torch.allclose(nope, want_nope[group], atol=1e-12)
    # padding the NoPE width adds exact zeros
    r2, n2 = plan_bilinears(pad_plan(plan, plan.q_nope.shape[1] + 6), h, g, d)
    assert torch.equal(r2, rope) and torch.allclose(n2, nope, atol=0)
    # every kept pair keeps its exact source frequency
    for ri, head in enumerate(plan.slots):
        assert plan.inv_freq[ri].tolist() == [float(smol.inv_freq[k]) for k, _ in head]


@pytest.mark.parametrize("strategy", ["high", "low", "uniform"])
@pytest.mark.parametrize("mode", ["per-head", "shared"])
def test_fixed_strategies_keep_the_named_pairs(smol, layer, mode, strategy):
    w, st = layer
    plan = plan_layer(w, st, smol.inv_freq, smol.num_heads, smol.num_kv_heads, mode, strategy, 8, 2048)
    want = {"high": list(range(8)), "low": list(range(24, 32)), "uniform": [0, 4, 8, 12, 16, 20, 24, 28]}[
        strategy
    ]
    assert fixed_pairs(strategy, 8, 32) == want
    assert all(kept == want for kept in plan.kept)


@pytest.mark.parametrize("mode", ["per-head", "shared"])
def test_two_norm_keeps_the_top_product_scores(smol, layer, mode):
    w, st = layer
    h, g = smol.num_heads, smol.num_kv_heads
    plan = plan_layer(w, st, smol.inv_freq, h, g, mode, "2-norm", 12, 2048)
    scores = torch.stack(
        [st.q_pair_norm[gi * (h // g) : (gi + 1) * (h // g)].sum(0) * st.k_pair_norm[gi] for gi in range(g)]
    )
    if mode == "per-head":
        want = [sorted(torch.topk(scores[gi], 12).indices.tolist()) for gi in range(g)]
    else:
        want = [sorted(torch.topk(scores.sum(0), 12).indices.tolist())]
    assert plan.kept == want


def test_rope_energy_and_range(smol, layer):
    w, st = layer
    h, g = smol.num_heads, smol.num_kv_heads
    every = plan_layer(w, st, smol.inv_freq, h, g, "shared", "rotation", 96, 2048)
    assert every.rope_energy == pytest.approx(1.0, abs=1e-12) and every.key_nope.shape[0] == 0
    some = plan_layer(w, st, smol.inv_freq, h, g, "shared", "rotation", 24, 2048)
    assert 0.3 < some.rope_energy < 1.0
    with pytest.raises(RopeError, match="out of range"):
        plan_layer(w, st, smol.inv_freq, h, g, "shared", "2-norm", 33, 2048)


# --- factorize -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def targets(smol, layer):
    w, st = layer
    plan = plan_layer(w, st, smol.inv_freq, smol.num_heads, smol.num_kv_heads, "shared", "2-norm", 24, 2048)
    return {
        obj: build_target(w, plan, st, smol.num_heads, obj, balance=obj != "weight")
        for obj in ("weight", "activation", "output")
    }


def _right(t):
    """A right weight ``R`` with ``R Rᵀ = t.right_gram`` (Cholesky: not the code's route to its factors)."""
    return torch.linalg.cholesky(t.right_gram)


@pytest.mark.parametrize("objective", ["weight", "activation", "output"])
def test_the_spectrum_is_the_weighted_matrix_singular_values(targets, objective):
    t = targets[objective]
    oracle = torch.linalg.svdvals(t.left @ t.w @ _right(t))  # an SVD of L W R, not the Gram's eigenvalues
    s = spectrum(t)
    assert s.shape == oracle.shape
    assert torch.allclose(s[:150], oracle[:150], rtol=1e-7, atol=1e-9 * float(oracle[0]))


@pytest.mark.parametrize("objective", ["weight", "activation", "output"])
def test_joint_factors_meet_eckart_young(targets, objective):
    t = targets[objective]
    s = spectrum(t)
    for rank in (16, 72):
        f = factor_layer(t, rank, "joint")
        lu = t.left @ f.up
        assert torch.allclose(lu.T @ lu, torch.eye(rank, dtype=torch.float64), atol=1e-8)  # L·up orthonormal
        err = (t.left @ (t.w - f.up @ f.down) @ _right(t)).square().sum()
        assert float(err) == pytest.approx(float(s[rank:].square().sum()), rel=1e-6)
        assert f.energy == pytest.approx(float(s[:rank].square().sum() / s.square().sum()), rel=1e-9)
        assert 0 < f.rel_error < 1


def test_full_rank_keeps_the_rows_exactly(targets):
    t = targets["output"]
    f = factor_layer(t, t.w.shape[0], "joint")
    assert torch.equal(f.up @ f.down, t.w) and f.rel_error == 0


def test_split_factors_keys_and_values_apart(targets):
    t = targets["activation"]
    n, rank = t.n_key, 40
    f = factor_layer(t, rank, "split")
    assert torch.count_nonzero(f.up[:n, rank // 2 :]) == 0 and torch.count_nonzero(f.up[n:, : rank // 2]) == 0
    key_tail = torch.linalg.svdvals(t.left[:n, :n] @ t.w[:n] @ _right(t))[rank // 2 :].square().sum()
    err = (t.left[:n, :n] @ (t.w[:n] - f.up[:n] @ f.down) @ _right(t)).square().sum()
    assert float(err) == pytest.approx(float(key_tail), rel=1e-6)


def test_kv_balance_equalises_weighted_energy(targets):
    t = targets["activation"]
    weighted = t.left @ t.w @ _right(t)
    assert float(weighted[: t.n_key].square().sum()) == pytest.approx(
        float(weighted[t.n_key :].square().sum()), rel=1e-9
    )


def test_allocate_ranks_is_the_best_split_of_the_budget():
    torch.manual_seed(0)
    spectra = [
        torch.sort(torch.rand(6).double() * scale, descending=True).values for scale in (1.0, 3.0, 0.5)
    ]

    def kept(ranks):
        return sum(float((s[:r] ** 2).sum() / (s**2).sum()) for s, r in zip(spectra, ranks, strict=True))

    for total in (3, 7, 12, 18):
        ranks = allocate_ranks(spectra, total)
        best = max((c for c in itertools.product(range(1, 7), repeat=3) if sum(c) == total), key=kept)
        assert sum(ranks) == total and kept(ranks) == pytest.approx(kept(best), abs=1e-12)
    with pytest.raises(FactorError, match="possible: 3..18"):
        allocate_ranks(spectra, 19)


def test_statistics_accumulated_in_chunks_equal_the_float64_formulas() -> None:
    """The streamed sums (second moments in float64, pair norms from float32 projections) against the formulas
    computed at once in float64: E[x xᵀ] and E[x] to float64 rounding, E‖pair‖ to float32's."""
    g_ = torch.Generator().manual_seed(3)
    h, g, d, hid = 4, 2, 8, 32
    w = {"q": torch.randn(h * d, hid, generator=g_, dtype=torch.float64),
         "k": torch.randn(g * d, hid, generator=g_, dtype=torch.float64),
         "bk": 50 * torch.randn(g * d, generator=g_, dtype=torch.float64)}  # fmt: skip
    x = (torch.randn(3, 100, hid, generator=g_) * torch.linspace(0.1, 30.0, hid)).float()
    acc = StatsAccumulator(w, h, g, d)
    for part in x.split([1, 2]):  # two chunks of windows, as the streamed pass adds them
        acc.add(part)
    st = acc.finish()
    x64 = x.reshape(-1, hid).double()

    def pair_norm(y: torch.Tensor, heads: int) -> torch.Tensor:
        y = y.view(-1, heads, d)
        return torch.sqrt(y[..., : d // 2] ** 2 + y[..., d // 2 :] ** 2).mean(0)

    assert st.tokens == 300
    torch.testing.assert_close(st.xx, x64.T @ x64 / 300, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.x_mean, x64.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.q_pair_norm, pair_norm(x64 @ w["q"].T, h), rtol=1e-5, atol=0)
    torch.testing.assert_close(st.k_pair_norm, pair_norm(x64 @ w["k"].T + w["bk"], g), rtol=1e-5, atol=0)
    assert not torch.allclose(st.k_pair_norm, pair_norm(x64 @ w["k"].T, g), rtol=1e-3)  # the bias is counted
    with pytest.raises(ValueError, match="no calibration tokens"):
        StatsAccumulator(w, h, g, d).finish()


# --- assemble --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def biased_layer():
    """A random layer with every bias (H=4, G=2, d=8, hidden 32) and statistics of real-valued inputs."""
    torch.manual_seed(1)
    h, g, d, hid = 4, 2, 8, 32
    w = {
        "q": torch.randn(h * d, hid, dtype=torch.float64),
        "k": torch.randn(g * d, hid, dtype=torch.float64),
        "v": torch.randn(g * d, hid, dtype=torch.float64),
        "o": torch.randn(hid, h * d, dtype=torch.float64),
        "bq": torch.randn(h * d, dtype=torch.float64),
        "bk": torch.randn(g * d, dtype=torch.float64),
        "bv": torch.randn(g * d, dtype=torch.float64),
        "bo": torch.randn(hid, dtype=torch.float64),
    }
    x = torch.randn(400, hid, dtype=torch.float64)

    def pair_norm(y, heads):
        y = y.view(-1, heads, d)
        return torch.sqrt(y[..., : d // 2] ** 2 + y[..., d // 2 :] ** 2).mean(0)

    st = LayerStats(
        xx=x.T @ x / 400,
        x_mean=x.mean(0),
        q_pair_norm=pair_norm(x @ w["q"].T + w["bq"], h),
        k_pair_norm=pair_norm(x @ w["k"].T + w["bk"], g),
        tokens=400,
    )
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    return w, st, inv_freq, (h, g, d, hid), x


@pytest.mark.parametrize("mode", ["per-head", "shared"])
def test_assembled_layer_scores_values_and_biases(biased_layer, mode):
    w, st, inv_freq, (h, g, d, hid), x = biased_layer
    plan = plan_layer(w, st, inv_freq, h, g, mode, "2-norm", 2, 64)
    t = build_target(w, plan, st, h, "output", balance=True)
    factors = factor_layer(t, t.w.shape[0], "joint")  # full rank: the tensors must be exact
    out = layer_tensors(w, plan, factors, h, attention_scaling=1.0)
    d_n, d_r = plan.q_nope.shape[1], plan.q_rope.shape[1]
    rank, r = factors.rank, len(plan.slots)
    p = rotation_projector(plan.basis, plan.slots)
    rot = real_bilinear(p, d)
    unrot = real_bilinear(torch.eye(g, dtype=torch.complex128).expand_as(p) - p, d)
    xt, xj = x[:5], x[5:9]
    q_src = (xt @ w["q"].T + w["bq"]).view(5, h, d)
    k_src = xj @ w["k"].T + w["bk"]
    q = (xt @ out["q_proj.weight"].T + out["q_proj.bias"]).view(5, h, d_n + d_r)
    kv_a = xj @ out["kv_a_proj_with_mqa.weight"].T + out["kv_a_proj_with_mqa.bias"]
    assert torch.count_nonzero(out["kv_a_proj_with_mqa.bias"][:rank]) == 0  # no bias on latent rows
    latent, k_rope = kv_a[:, :rank], kv_a[:, rank:].view(4, r, d_r)
    kv = (latent @ out["kv_b_proj.weight"].T).view(4, g, d_n + d)
    for hi in range(h):
        a = hi // (h // g)
        ri = hi // (h // r)
        rope_scores = q[:, hi, d_n:] @ k_rope[:, ri].T
        assert torch.allclose(rope_scores, q_src[:, hi] @ rot[a] @ k_src.T, atol=1e-9)
        nope_scores = q[:, hi, :d_n] @ kv[:, a, :d_n].T
        # the NoPE key bias is dropped: it adds one constant per query, which softmax cancels
        want = q_src[:, hi] @ unrot[a] @ (k_src - w["bk"]).T
        assert torch.allclose(nope_scores, want, atol=1e-9)
        assert torch.allclose(kv[:, a, d_n:], xj @ w["v"][a * d : (a + 1) * d].T, atol=1e-9)
    bv_heads = torch.cat([w["bv"][(hi // (h // g)) * d : (hi // (h // g) + 1) * d] for hi in range(h)])
    assert torch.allclose(out["o_proj.bias"], w["bo"] + w["o"] @ bv_heads, atol=1e-12)
    assert torch.equal(out["o_proj.weight"], w["o"])
    # HF scales cos and sin of q and k by the attention factor: its square is folded into the queries
    scaled = layer_tensors(w, plan, factors, h, attention_scaling=1.5)
    assert torch.allclose(scaled["q_proj.weight"], 2.25 * out["q_proj.weight"], atol=0)
    assert torch.allclose(scaled["q_proj.bias"], 2.25 * out["q_proj.bias"], atol=0)


def test_a_nope_reduction_head_by_head_is_the_whole_map_reduced_bit_for_bit(biased_layer):
    """``factor`` with a NoPE-width reduction assembles the d_N-wide query one head at a time inside the reduction
    (``layer_tensors(query=False)`` + ``query_rows``; 1 GB less float64 at Llama-3-8B's shapes): the reduced layer is
    the one reducing the whole assembled map gives, bit for bit (biases, a RoPE attention factor, a lossy rank)."""
    from mla_convert.convert.layer.nope_rank import reduce_nope

    w, st, inv_freq, (h, g, d, hid), x = biased_layer
    plan = plan_layer(w, st, inv_freq, h, g, "shared", "2-norm", 2, 64)
    t = build_target(w, plan, st, h, "output", balance=True)
    factors = factor_layer(t, t.w.shape[0] - 3, "joint")
    d_n, d_r = plan.q_nope.shape[1], plan.q_rope.shape[1]
    assert d - 2 < d_n  # reduced below the assembled NoPE width: the reduction is at work
    whole = layer_tensors(w, plan, factors, h, attention_scaling=1.5)
    lean = layer_tensors(w, plan, factors, h, attention_scaling=1.5, query=False)
    assert "q_proj.weight" not in lean and "q_proj.bias" not in lean
    want, rec = reduce_nope(whole, h, g, d_n, d_r, d - 2, st.xx, st.x_mean)
    got, rec_heads = reduce_nope(
        lean, h, g, d_n, d_r, d - 2, st.xx, st.x_mean, query_rows=lambda hi: query_rows(w, plan, hi, 1.5)
    )
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(rec.dropped, rec_heads.dropped) and float(rec.dropped.max()) > 0  # lossy, as asked


# --- manifest verify -------------------------------------------------------------------------------------


def test_manifest_verify_names_files_it_does_not_cover(tmp_path):
    import json

    from mla_convert.artifacts.manifest import MANIFEST, canonical_id, sha256_file, verify

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    manifest = {
        "schema_version": 1,
        "outputs": {"model.safetensors": sha256_file(tmp_path / "model.safetensors")},
    }
    manifest["canonical_id"] = canonical_id(manifest)
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert verify(tmp_path)["uncovered"] == []
    (tmp_path / "validation.json").write_text("{}")
    res = verify(tmp_path)
    assert res["files"] == 1 and res["uncovered"] == ["validation.json"]


def test_calibration_windows_spread_across_documents():
    """The calibration windows are spread evenly across the whole split, the held-out ones interleaved and
    disjoint from them, and the report's document count is the distinct documents the windows touch (a separator
    belongs to the document it ends), not the size of the split."""
    import torch

    from mla_convert.text.windows import spread_windows

    eos = 2
    stream = torch.tensor([[5, 6, 7, 8], [9, 2, 4, 4], [4, 2, 3, 2]])
    one = spread_windows(stream, 1, 0, eos)
    assert one.calibration.tolist() == [stream[1].tolist()] and one.documents == 2  # [9, 2 | 4, 4]: docs 0 and 1
    assert spread_windows(stream[:1], 1, 0, eos).documents == 1
    assert spread_windows(stream, 3, 0, eos).documents == 3  # the final separator opens no document
    assert spread_windows(stream, 3, 0, None).documents is None
    every = torch.arange(100 * 4).view(100, 4)
    s = spread_windows(every, 16, 4, None)
    rows = [int(r[0]) // 4 for r in s.calibration]
    held = [int(r[0]) // 4 for r in s.held_out]
    assert len(rows) == 16 and len(held) == 4 and not set(rows) & set(held)
    assert rows[0] < 5 and rows[-1] > 90 and held[0] < 25 and held[-1] > 75  # both span the stream
    few = spread_windows(every[:3], 16, 4, None)  # 3 windows: 1 held out, 2 calibration
    assert few.calibration.shape[0] == 2 and few.held_out.shape[0] == 1
