"""Oracle of the NoPE-width reduction (``--qk-nope-head-dim``, docs/math.md §NoPE-width reduction; docs/oracles.md)
on a tiny random Llama with the shapes users convert: 32 query heads, 8 KV heads, head_dim 128 (Llama-3-8B's query
NoPE width 512 with one shared rope head of 32 frequencies).

The oracle is computed without the assembly code or the reduction's module: from the *source* weights, the plan's
choice (its per-frequency basis and kept slots, :func:`oracle.rotation_projector`), the saved latent rows ``A`` and
the calibration metric ``C = E[x xᵀ]`` only. Per head the NoPE score of query token t and key token j is
``q_tᵀ R_g c_j`` with ``q = W_q,h x`` (the source query), ``c = A x`` and ``R_g = K_un,g C Aᵀ (A C Aᵀ)⁺`` (the
unrotated key part of the source, reconstructed from the latent as in tests/oracle.py). Its activation-weighted
rank-n optimum is found by another route than the code's (the left Gram ``Q^{1/2} R C_c Rᵀ Q^{1/2}``, ``[d, d]``,
and a left projection ``Q^{-1/2} U_n U_nᵀ Q^{1/2} R``; the code uses the right Gram and a right projection), and
its residual, the sum of the dropped eigenvalues, must equal the mean squared score error measured over every
(query, key) pair of calibration tokens (Eckart–Young).
"""

from __future__ import annotations

import pytest
import torch
from oracle import _join_pairs, _project, _split_pairs, rotation_projector
from tiny import convert, write_tiny_llama

from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.options.resolve import NOPE_BOUND, resolve_options
from mla_convert.convert.pipeline.build import convert_windows
from mla_convert.sources.checkpoint import load_source_model, open_source

F64 = torch.float64
SHAPE = {"hidden_size": 256, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "intermediate_size": 256, "initializer_range": 0.15}
BASE = {"rope_mode": "shared", "rope_strategy": "high", "refit_o_proj": "none", "calib_precision": "float32",
        "cache_budget": None}


@pytest.fixture(scope="module")
def g8(tmp_path_factory):
    folder = write_tiny_llama(tmp_path_factory.mktemp("g8"), **SHAPE)
    src = open_source(folder)
    return src, load_source_model(src)


def _inputs(model, ids):
    """Every layer's attention input ``[N*T, hidden]`` (float64) on ``ids``: the source's hidden states after the
    layer's ``input_layernorm``."""
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        return [layer.input_layernorm(hs[i]).reshape(-1, hs[i].shape[-1]).double()
                for i, layer in enumerate(model.model.layers)]


def _root(m, power):
    ev, evec = torch.linalg.eigh(m)
    return (evec * ev.clamp_min(1e-300) ** power) @ evec.T


@pytest.fixture(scope="module")
def reduced(g8, calib_windows):
    src, _ = g8
    return convert(src, calib_windows, keep_stats=True, rope_pairs=32, kv_lora_rank=192, qk_nope_head_dim=64, **BASE)


def test_reduced_nope_scores_equal_the_weighted_optimum(g8, reduced, calib_windows):
    """Lossy (n = 64 < rank 128): every head's NoPE scores equal the oracle's rank-64 optimum on the calibration
    tokens, and the mean squared error against the unreduced form equals the dropped weighted energy."""
    src, model = g8
    n, h, g, d = 64, src.num_heads, src.num_kv_heads, src.head_dim
    cfg = reduced.config
    assert (cfg.qk_nope_head_dim, cfg.num_key_value_heads, cfg.kv_lora_rank) == (64, 32, [192, 192])
    # the cache row is still [c_kv | k_rope] (measured on the converted model's own cache)
    assert reduced.streamed.cache_converted["values_per_token_per_layer"] == 192 + 64
    xs = [x.detach() for x in _inputs(model, calib_windows)]
    worst, lost = 0.0, []
    for i, x in enumerate(xs):
        plan, st = reduced.plans[i], reduced.stats[i]
        src_attn = model.model.layers[i].self_attn
        wq, wk = src_attn.q_proj.weight.double(), src_attn.k_proj.weight.double()
        k_rot = _join_pairs(_project(rotation_projector(plan.basis, plan.slots), _split_pairs(wk, g, d)))
        k_un = wk - k_rot
        attn = reduced.model.model.layers[i].self_attn
        a = attn.kv_a_proj_with_mqa.weight.double()[:192]
        cx = st.xx
        assert torch.allclose(cx, x.T @ x / len(x), rtol=1e-4, atol=1e-6)  # the metric is these tokens' moment
        r = k_un @ cx @ a.T @ torch.linalg.pinv(a @ cx @ a.T, hermitian=True)  # [G d, d_c]
        cc = a @ cx @ a.T
        c = x @ a.T
        q_conv = (x @ attn.q_proj.weight.double().T).view(len(x), h, n + 64)[..., :n]
        k_conv = (c @ attn.kv_b_proj.weight.double().T).view(len(x), h, n + 128)[..., :n]
        for hi in range(h):
            r_g = r[(hi // (h // g)) * d : (hi // (h // g) + 1) * d]
            q = x @ wq[hi * d : (hi + 1) * d].T  # the source query
            qs = q.T @ q / len(x)
            gram = _root(qs, 0.5) @ r_g @ cc @ r_g.T @ _root(qs, 0.5)
            ev, u = torch.linalg.eigh(gram)
            ev, u = ev.flip(0), u.flip(1)[:, :n]
            best = _root(qs, -0.5) @ u @ u.T @ _root(qs, 0.5) @ r_g  # the rank-n optimum, left route
            s_full, s_best = q @ r_g @ c.T, q @ best @ c.T
            s_conv = q_conv[:, hi] @ k_conv[:, hi].T
            scale = float(s_full.abs().max().detach())
            worst = max(worst, float((s_conv - s_best).abs().max()) / scale)
            err = float((s_full - s_conv).square().mean())
            assert err == pytest.approx(float(ev[n:].sum()), rel=2e-3)
            lost.append(float((s_full - s_best).abs().max()) / scale)
    assert worst < 1e-4
    assert min(lost) > 1e-3  # the reduction is lossy here: the checks above can fail


def test_exact_reduction_keeps_the_conversion(g8, calib_windows, eval_ids):
    """The engine shape (32 of 64 frequencies on one shared rope head, query NoPE width 512) at the widest latent
    (256 = hidden): reduced to 128 = min(head_dim, kv_lora_rank), every head's NoPE form keeps its rank (through the
    decomposition: d_N = 512 and d_c = 256 are both over 128) and the logits equal the unreduced conversion's
    (float32). The full-width contract without a reduction is tests/convert/test_exact.py's."""
    src, model = g8
    opts = {**BASE, "rope_pairs": 32, "kv_lora_rank": 256}
    plain = _unbounded(src, calib_windows, **opts)
    exact = convert(src, calib_windows, qk_nope_head_dim=128, **opts)
    assert (plain.config.qk_nope_head_dim, plain.config.num_key_value_heads) == (512, 8)
    assert (exact.config.qk_nope_head_dim, exact.config.num_key_value_heads) == (128, 32)
    with torch.no_grad():
        lp, le, ref = plain.model(eval_ids).logits, exact.model(eval_ids).logits, model(input_ids=eval_ids).logits
    assert float((le - lp).abs().max()) < 1e-4
    assert float((lp - ref).abs().max()) > 1e-2  # the partial RoPE is lossy: a wrong form would show


def _unbounded(src, calibration, **options):
    """:func:`tiny.convert` with the query's NoPE width kept as the plan gives it (``qk_nope_head_dim`` counted as given,
    None: the default bound of a source with 4 or more KV heads is not applied)."""
    opts = ConvertOptions(**{"dtype": "float32", **options})
    given = {k for k in opts.model_fields_set if getattr(opts, k) is not None}
    res = resolve_options(opts, src, given={*given, "qk_nope_head_dim"})
    assert res.options.qk_nope_head_dim is None
    return convert_windows(src, opts, calibration, resolution=res)


def test_the_default_bound_keeps_the_conversion(g8, calib_windows, eval_ids):
    """The default bound (issue 51) on 8 KV heads: at 64 of 64 frequencies on the shared rope head and full rank
    (256 = hidden) the query's NoPE width 128 + 2 x 64 x (8 - 2) = 896 is bounded at head_dim 128 by the resolution
    ``factor`` runs, and the logits equal the unbounded conversion's (float32). Keeping every component (the rotation
    strategy's 8 x 64 pairs: the source's function, tests/convert/test_exact.py) leaves no NoPE width to bound."""
    src, _ = g8
    opts = {**BASE, "rope_pairs": 64, "kv_lora_rank": 256}
    res = resolve_options(ConvertOptions(**opts), src)
    assert res.options.qk_nope_head_dim == 128 and res.choices["qk_nope_head_dim"] == NOPE_BOUND
    bounded, plain = convert(src, calib_windows, **opts), _unbounded(src, calib_windows, **opts)
    assert (bounded.config.qk_nope_head_dim, bounded.config.num_key_value_heads) == (128, 32)
    assert (plain.config.qk_nope_head_dim, plain.config.num_key_value_heads) == (896, 8)
    with torch.no_grad():
        got, ref = bounded.model(eval_ids).logits, plain.model(eval_ids).logits
    assert float((got - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    every = resolve_options(ConvertOptions(**{**opts, "rope_strategy": "rotation", "rope_pairs": 512}), src)
    assert every.options.qk_nope_head_dim is None and every.choices["qk_nope_head_dim"] == "default"
