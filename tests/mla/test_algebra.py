"""The MLA algebra (mla_convert.mla.algebra) against independent formulas: HF Llama's own RoPE, and the naive
per-head attention the absorbed form must equal (float64, random weights: the property is algebraic)."""

from __future__ import annotations

import pytest
import torch

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before anything imports triton)
from mla_convert.mla import algebra


def test_apply_rope_is_hf_rotate_half() -> None:
    # transformers' Llama module imports triton: after mla_convert (TRITON_INTERPRET=1 on a CPU host)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    b, t, heads, p = 2, 7, 3, 4
    x = torch.randn(b, t, heads, 2 * p, dtype=torch.float64)
    inv_freq = torch.rand(1, p, dtype=torch.float64)
    pos = torch.arange(5, 5 + t)[None].expand(b, t)
    cos, sin = algebra.rope_angles(pos, inv_freq)  # [B, T, 1, P]
    ours = algebra.apply_rope(x, cos.double(), sin.double())
    emb = (pos[..., None].double() * inv_freq[0]).repeat(1, 1, 2)  # HF: cat(freqs, freqs)
    hf, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), emb.cos(), emb.sin())
    assert torch.allclose(ours, hf.transpose(1, 2), atol=1e-6)  # rope_angles works in float32, like HF


@pytest.mark.parametrize(("heads", "groups", "rope_heads"), [(8, 2, 1), (8, 2, 2), (6, 6, 3), (4, 1, 1)])
def test_absorbed_equals_naive(heads: int, groups: int, rope_heads: int) -> None:
    torch.manual_seed(heads + groups + rope_heads)
    b, t, d_c, d_n, d_r, d_v = 2, 5, 12, 6, 4, 5
    q_nope = torch.randn(b, t, heads, d_n, dtype=torch.float64)
    q_rope = torch.randn(b, t, heads, d_r, dtype=torch.float64)
    c_kv = torch.randn(b, t, d_c, dtype=torch.float64)
    k_rope = torch.randn(b, t, rope_heads, d_r, dtype=torch.float64)
    w_uk, w_uv = algebra.split_up_weights(
        torch.randn(groups * (d_n + d_v), d_c, dtype=torch.float64), groups, d_n
    )
    mask = algebra.causal_mask(b, t, dtype=torch.float64)
    # naive, written out per head: key of head h = [W_UK[g] c | k_rope[r]], value = W_UV[g] c
    g_of, r_of = algebra.head_to_group(heads, groups), algebra.head_to_group(heads, rope_heads)
    out_ref = torch.empty(b, t, heads, d_v, dtype=torch.float64)
    for h in range(heads):
        keys = torch.cat([c_kv @ w_uk[g_of[h]].T, k_rope[:, :, r_of[h]]], dim=-1)
        scores = (
            torch.cat([q_nope[:, :, h], q_rope[:, :, h]], dim=-1) @ keys.transpose(1, 2) * 0.3 + mask[:, 0]
        )
        out_ref[:, :, h] = scores.softmax(-1) @ (c_kv @ w_uv[g_of[h]].T)
    # absorbed
    q_abs = algebra.absorb_query(q_nope, w_uk)
    scores = algebra.latent_scores(q_abs, q_rope, c_kv, k_rope.reshape(b, t, -1), rope_heads)
    probs = algebra.attention_probs(scores, 0.3, mask)
    absorbed = algebra.latent_output(algebra.attend_latent(probs, c_kv), w_uv)
    # the library's naive expansion
    keys, values = algebra.expand_kv(c_kv, k_rope, w_uk, w_uv)
    naive = algebra.naive_output(
        algebra.attention_probs(algebra.naive_scores(q_nope, q_rope, keys), 0.3, mask), values
    )
    # attention_probs takes the softmax in float32 (as the model does): agreement to float32 rounding
    assert torch.allclose(absorbed, out_ref.reshape(b, t, -1), atol=1e-5)
    assert torch.allclose(naive, out_ref.reshape(b, t, -1), atol=1e-5)
    assert torch.allclose(absorbed, naive, atol=1e-5)


def test_causal_mask_with_padding_and_past() -> None:
    pad = torch.tensor([[0, 1, 1, 1, 1]])  # first key is padding
    mask = algebra.causal_mask(1, 2, past=3, attention_mask=pad)
    visible = (mask[0, 0] == 0).tolist()
    assert visible == [[False, True, True, True, False], [False, True, True, True, True]]


def test_scale_width_and_head_maps() -> None:
    assert algebra.source_softmax_scale(64) == 0.125
    assert algebra.cache_width(96, 1, 24) == 120
    assert algebra.head_to_group(9, 3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="do not divide"):
        algebra.head_to_group(9, 2)


@pytest.mark.parametrize(
    "b, t, heads, d_c, rope_heads, d_r, past",
    [(2, 1, 9, 70, 1, 48, 300), (1, 5, 6, 24, 2, 8, 15), (2, 3, 8, 16, 4, 0, 4), (1, 4, 12, 33, 3, 16, 0)],
)
def test_fused_latent_attention_equals_the_einsum_form(b, t, heads, d_c, rope_heads, d_r, past) -> None:
    """The product's one-call SDPA form of scores -> softmax -> latent sum is the three-einsum form (which the
    ladder's rung 1 and the oracles use), for several rope heads, no rope part, decode and masked prefill."""
    g = torch.Generator().manual_seed(t + heads)
    s = past + t
    q_abs, q_rope = torch.randn(b, t, heads, d_c, generator=g), torch.randn(b, t, heads, d_r, generator=g)
    c_kv, k_rope = torch.randn(b, s, d_c, generator=g), torch.randn(b, s, rope_heads * d_r, generator=g)
    pad = torch.ones(b, s, dtype=torch.long)
    pad[0, 0] = 0  # a padded first slot in the first row
    mask = algebra.causal_mask(b, t, past, pad, torch.float32, torch.device("cpu"))
    for m in (mask, None):
        scores = algebra.latent_scores(q_abs, q_rope, c_kv, k_rope, rope_heads)
        ref = algebra.attend_latent(algebra.attention_probs(scores, 0.125, m), c_kv)
        out = algebra.attend_latent_fused(q_abs, q_rope, c_kv, k_rope, rope_heads, 0.125, m)
        assert out.shape == ref.shape == (b, t, heads, d_c)
        assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5
    wrong = algebra.attend_latent_fused(q_abs, q_rope, c_kv, k_rope, rope_heads, 0.25, None)
    assert float((wrong - ref).abs().max() / ref.abs().max()) > 1e-2  # the scale is the one passed
