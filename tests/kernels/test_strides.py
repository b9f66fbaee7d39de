"""Every input of the decode kernel is read with the strides it has, made contiguous first, or refused (issue 25,
fault 12): before, ``head_to_rope`` was read as contiguous int32, so a strided view gave wrong rope heads (wrong
output, no error) and an expanded one (stride 0) read past its storage (a segfault in the interpreter).

What the kernel assumes (``plan_launch``): a contiguous last dimension of the queries and the cache (refused
otherwise), their other strides passed; ``head_to_rope``, ``block_table`` and ``seq_lens`` copied to contiguous
int32 where they are not; FP8 rows 4-byte aligned (refused otherwise)."""

from __future__ import annotations

import pytest
import torch

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 before triton is imported, on CPU)
from mla_convert.kernels import fp8 as F8
from tests.kernels.test_kernel import DEVICE, Case, K, check, errors, make_case


def _rope_case() -> Case:
    """9 query heads over 3 rope heads: a wrong rope head moves the output by far more than the tolerance."""
    return make_case([7, 50, 23], 16, heads=9, d_c=64, rope_heads=3, d_r=8, seed=4)


def test_strided_head_to_rope_is_read_by_its_values() -> None:
    case = _rope_case()
    want = case.head_to_rope.clone()
    # the same values at stride 2 (every other entry of a wider tensor; the others name another rope head)
    wide = torch.stack([want, (want + 1) % 3], dim=1).reshape(-1)
    case.head_to_rope = wide[::2]
    assert case.head_to_rope.stride(0) == 2 and torch.equal(case.head_to_rope, want)
    check(case)


def test_expanded_head_to_rope_is_read_by_its_values() -> None:
    """One rope head for every query head as a stride-0 view of one element (before: read past the storage)."""
    case = _rope_case()
    case.head_to_rope = torch.full((1,), 2, dtype=torch.int32, device=DEVICE).expand(9)
    assert case.head_to_rope.stride(0) == 0
    check(case)
    # and it is a different function from the per-head mapping: the comparison above can fail
    other = _rope_case()
    out, lse = K.latent_decode(*other.args())
    rel, _ = errors(case, out, lse)
    assert rel > 1e-2


def test_int64_head_to_rope() -> None:
    case = _rope_case()
    case.head_to_rope = case.head_to_rope.long()
    check(case)


def test_expanded_queries_block_table_and_lengths() -> None:
    """Two requests with the same pages, lengths and queries given as stride-0 views of one request's."""
    one = make_case([37], 16, heads=9, d_c=64, rope_heads=3, d_r=8, seed=6)
    case = Case(
        one.q_abs.expand(2, -1, -1), one.q_rope.expand(2, -1, -1), one.kv_cache,
        one.block_table.expand(2, -1), one.seq_lens.expand(2), one.head_to_rope, one.softmax_scale,
    )  # fmt: skip
    assert case.q_abs.stride(0) == 0 and case.block_table.stride(0) == 0 and case.seq_lens.stride(0) == 0
    out, _ = check(case)
    assert torch.equal(out[0], out[1])


def test_expanded_cache_pages() -> None:
    """A cache whose pages are one page (page stride 0): every block-table entry reads the same rows."""
    case = make_case([5, 40], 16, heads=9, d_c=64, rope_heads=3, d_r=8, seed=7)
    page = torch.randn(case.kv_cache.shape[1:], generator=torch.Generator().manual_seed(8)).to(DEVICE)
    case.kv_cache = page.unsqueeze(0).expand(case.kv_cache.shape[0], -1, -1)
    assert case.kv_cache.stride(0) == 0
    check(case)


@pytest.mark.parametrize("which", ["q_abs", "q_rope", "kv_cache"])
def test_non_contiguous_last_dimension_refused(which: str) -> None:
    case = _rope_case()
    t = getattr(case, which)
    setattr(case, which, torch.stack([t, t], dim=-1)[..., 0])  # same values, last stride 2
    assert getattr(case, which).stride(-1) == 2
    with pytest.raises(ValueError, match="contiguous last dimension"):
        K.latent_decode(*case.args())


def test_misaligned_fp8_rows_refused() -> None:
    """FP8 rows are read as float32 scales at byte offsets: a row stride that is not a multiple of 4 bytes would
    be a misaligned load on a GPU (and wrong values in the interpreter), so it is refused."""
    case = make_case([9], 16, heads=16, d_c=64, d_r=16, seed=0)
    lay = F8.layout(64, 16)
    rows = F8.quantize_rows(case.kv_cache.nan_to_num(0.0), lay)
    odd = torch.zeros(*rows.shape[:2], lay.stride_bytes + 1, dtype=torch.uint8, device=DEVICE)
    odd[..., : lay.stride_bytes] = rows
    with pytest.raises(ValueError, match="multiples of 4"):
        K.latent_decode(
            case.q_abs, case.q_rope, odd[..., : lay.stride_bytes], case.block_table, case.seq_lens,
            case.head_to_rope, case.softmax_scale, fp8=lay,
        )  # fmt: skip
    out, _ = K.latent_decode(
        case.q_abs, case.q_rope, rows, case.block_table, case.seq_lens, case.head_to_rope,
        case.softmax_scale, fp8=lay,
    )  # fmt: skip
    assert torch.isfinite(out).all()
