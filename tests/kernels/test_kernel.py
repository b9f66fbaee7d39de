"""The Triton paged latent-cache decode kernel against its float64 oracle.

Without a GPU the kernel runs in the Triton interpreter (``import mla_convert`` sets ``TRITON_INTERPRET=1``),
which executes the same kernel code, masks and address arithmetic with numpy; on a CUDA machine the same
tests run natively on CUDA tensors (``DEVICE``).

Every case is built the hard way: pages come from a ``torch.randperm`` (a request's pages are neither
contiguous nor ordered), valid slots hold random rows, and every other slot -- the tail of a request's
last page, spare pages, and the page that unused block-table entries point to -- holds NaN, so a read
past a request's length cannot go unnoticed: it should come out as NaN, and (because the kernel currently
turns a NaN split into an empty one, see ``test_nan_in_a_read_row_propagates``) at least shows up as
zeros / ``lse = -inf`` / a dropped split, which the comparison with the oracle and the finiteness checks
catch.

Error measures (over requests with at least one token; length-0 requests must give exact zeros and
``lse = -inf``):

* ``latent_out``: relative error ``max|kernel - ref| / max|ref|``.
* ``lse``: absolute error ``max|kernel - ref|`` (it is a logarithm: an absolute error ``e`` in ``lse`` is a
  relative error ``e`` in the softmax denominator).

Tolerances:

* float32: ``FP32_TOL = 1e-5`` for both. The kernel computes in IEEE float32 (no TF32), so its error is a
  few units of float32 roundoff (``u = 6e-8``) accumulated over dot products of <= 576 terms, an online
  softmax rescale per tile and the log-sum-exp merge of the splits: measured <= 4e-7 relative and <= 7e-7
  in ``lse`` across this grid. 1e-5 leaves ~20x headroom for other backends (a GPU's different summation
  order) while a wrong page, a missing or extra row, a wrong rope head or a wrong scale is off by 1e-2 or
  more (or NaN).
* float16 inputs: ``FP16_TOL = 2e-3`` relative for ``latent_out`` (about 4 fp16 units, ``u = 2**-11 = 4.9e-4``):
  the probabilities are rounded to float16 for the value product (FlashAttention practice) and the output
  is stored in float16, each costing up to ``u/2`` relative; measured ~1.6e-4. ``lse`` stays in float32
  from fp16 x fp16 products accumulated in float32, so ``FP16_LSE_TOL = 1e-4``. The oracle reads the same
  float16 values (upcast), so only the kernel's arithmetic is measured.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 before triton is imported, on CPU)
from mla_convert.kernels import kernel_backend, latent_decode_reference, load_kernel
from mla_convert.kernels import launch as L

K = load_kernel()

#: the kernel runs natively on a CUDA GPU and in the interpreter (CPU tensors) otherwise
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

FP32_TOL = 1e-5
FP16_TOL = 2e-3
FP16_LSE_TOL = 1e-4
#: lse relative to its magnitude (|lse| floored at 1): float32 scores round at ~6e-8 of their size
FP16_LSE_REL_TOL = 1e-5


@dataclass
class Case:
    q_abs: torch.Tensor
    q_rope: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    head_to_rope: torch.Tensor
    softmax_scale: float

    def args(self) -> tuple:
        return (
            self.q_abs,
            self.q_rope,
            self.kv_cache,
            self.block_table,
            self.seq_lens,
            self.head_to_rope,
            self.softmax_scale,
        )


def make_case(
    lengths: list[int],
    page_size: int,
    heads: int,
    d_c: int,
    rope_heads: int = 1,
    d_r: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    scale: float | None = None,
    perm_seed: int | None = None,
) -> Case:
    """A batch of requests with ``lengths`` tokens over a NaN-filled paged cache with permuted pages.

    The rows of request ``b`` depend on ``seed`` only; which pages hold them depends on ``perm_seed``
    (default: ``seed``). Two spare pages stay all-NaN; unused block-table entries point at one of them.
    """
    gen = torch.Generator().manual_seed(seed)
    perm_gen = torch.Generator().manual_seed(seed if perm_seed is None else perm_seed)
    need = [-(-n // page_size) for n in lengths]
    num_pages = sum(need) + 2
    perm = torch.randperm(num_pages, generator=perm_gen)
    width = d_c + rope_heads * d_r
    cache = torch.full((num_pages, page_size, width), float("nan"), dtype=dtype)
    block_table = torch.full((len(lengths), max(need + [0]) + 1), int(perm[-1]), dtype=torch.int32)
    used = 0
    for b, (n, k) in enumerate(zip(lengths, need, strict=True)):
        pages = perm[used : used + k]
        used += k
        block_table[b, :k] = pages.int()
        pos = torch.arange(n)
        cache[pages[pos // page_size], pos % page_size] = torch.randn(n, width, generator=gen).to(dtype)
    bsz = len(lengths)
    q_abs = torch.randn(bsz, heads, d_c, generator=gen).to(dtype)
    q_rope = torch.randn(bsz, heads, d_r, generator=gen).to(dtype)
    if d_r:
        assert heads % rope_heads == 0
        head_to_rope = (torch.arange(heads) // (heads // rope_heads)).int()
    else:
        head_to_rope = torch.zeros(heads, dtype=torch.int32)
    # score std ~1.5: softmaxes neither flat nor one-hot
    scale = 1.5 / math.sqrt(width) if scale is None else scale
    lens = torch.tensor(lengths, dtype=torch.int32)
    return Case(
        q_abs.to(DEVICE),
        q_rope.to(DEVICE),
        cache.to(DEVICE),
        block_table.to(DEVICE),
        lens.to(DEVICE),
        head_to_rope.to(DEVICE),
        scale,
    )


def errors(case: Case, out: torch.Tensor, lse: torch.Tensor) -> tuple[float, float]:
    """(relative latent_out error, absolute lse error) over requests with tokens, after checking that
    nothing is NaN and that length-0 requests give exact zeros and ``-inf``."""
    ref_out, ref_lse = latent_decode_reference(*case.args())
    assert out.shape == case.q_abs.shape and out.dtype == case.q_abs.dtype
    assert lse.shape == case.q_abs.shape[:2] and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    empty = case.seq_lens == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert bool((lse[empty] == float("-inf")).all())
    valid = ~empty
    if not valid.any():
        return 0.0, 0.0
    a, b = out[valid].double(), ref_out[valid]
    assert torch.isfinite(lse[valid]).all()
    rel = ((a - b).abs().max() / b.abs().max()).item()
    lse_err = (lse[valid].double() - ref_lse[valid]).abs().max().item()
    return rel, lse_err


def check(
    case: Case, tol: float = FP32_TOL, lse_tol: float = FP32_TOL, **kw
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = K.latent_decode(*case.args(), **kw)
    rel, lse_err = errors(case, out, lse)
    assert rel < tol, f"relative error {rel:.3g} >= {tol}"
    assert lse_err < lse_tol, f"lse error {lse_err:.3g} >= {lse_tol}"
    return out, lse


# ------------------------------------------------------------------------------------ the grid


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
def test_lengths_around_page_boundaries(page_size):
    """Lengths 0, 1, page-1, page, page+1 and several pages, mixed in one batch, on permuted pages."""
    p = page_size
    lengths = [p + 1, 0, 3 * p + 5, 1, p, p - 1]
    check(make_case(lengths, page_size, heads=9, d_c=72, seed=page_size))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 50])
def test_single_request_lengths(page_size, length):
    check(make_case([length], page_size, heads=4, d_c=64, seed=length))


@pytest.mark.parametrize(
    "heads,rope_heads",
    [(1, 1), (9, 3), (16, 2), (20, 4), (33, 3)],
    ids=["H1", "H9-R3", "H16-R2", "H20-R4", "H33-R3"],
)
def test_head_counts_not_dividing_head_block(heads, rope_heads):
    """BLOCK_M = 16 query rows (heads here) per program, as compiled for a GPU: H = 1, 9 (partial block), 16, 20
    and 33 (2-3 blocks, last partial), each rope head shared by H / R query heads (``h // (H / R)``); and the
    interpreter's default of one program per request's rows, which must give the same rows to float rounding."""
    assert L.BLOCK_M == 16
    case = make_case([37, 0, 100], 16, heads, d_c=64, rope_heads=rope_heads, d_r=8, seed=heads)
    out16, lse16 = check(case, block_m=16)
    assert L.default_block_m(heads, "triton-cuda") == 16
    assert L.default_block_m(heads, kernel_backend()) == max(16, 1 << (heads - 1).bit_length())
    out, lse = check(case)
    assert torch.equal(lse.isinf(), lse16.isinf())  # the empty request on both
    seen = case.seq_lens > 0
    assert (out - out16).abs().max() <= 1e-6 * out16.abs().max()
    assert (lse[seen] - lse16[seen]).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "d_c,rope_heads,d_r,heads",
    [
        (64, 3, 8, 9),  # several rope heads, narrow (rope width 24: masked to 32)
        (96, 1, 0, 9),  # no rope at all
        (72, 1, 48, 9),  # non-power-of-two d_c, one wide rope head
        (96, 2, 32, 4),  # non-power-of-two d_c, two rope heads
        (16, 1, 64, 16),  # latent narrower than rope
        (100, 2, 2, 6),  # one rope pair per rope head
    ],
    ids=["dc64-R3x8", "dc96-norope", "dc72-R1x48", "dc96-R2x32", "dc16-R1x64", "dc100-R2x2"],
)
def test_latent_and_rope_widths(d_c, rope_heads, d_r, heads):
    check(make_case([0, 1, 23, 70], 16, heads, d_c, rope_heads, d_r, seed=d_c + d_r))


def test_rope_heads_are_read_per_query_head():
    """Each query head reads only its own rope head: permuting head_to_rope changes the result."""
    case = make_case([40], 16, heads=6, d_c=32, rope_heads=3, d_r=8, seed=3)
    out, _ = check(case)
    case.head_to_rope = case.head_to_rope.flip(0).contiguous()
    swapped, _ = check(case)
    assert (swapped - out).abs().max() > 1e-2


def test_wide_latent_512():
    """d_c = 512 (DeepSeek's width; default tile 32 rows) with a small grid."""
    check(make_case([45, 0, 130], 64, heads=16, d_c=512, rope_heads=1, d_r=64, seed=512))
    check(make_case([45, 0, 130], 64, heads=16, d_c=512, rope_heads=1, d_r=64, seed=512), block_n=16)


def test_page_size_128_many_pages():
    check(make_case([128 * 3 + 1, 127, 129], 128, heads=9, d_c=64, seed=128))


# ------------------------------------------------------------------------------------ splits and tiles


def test_one_split_equals_many_splits():
    """The split-KV partials are merged through their log-sum-exp: any split count gives the same result
    (within float32 roundoff of each other and of the oracle), including splits that hold no tokens."""
    case = make_case([0, 1, 70, 300], 16, heads=9, d_c=64, seed=11)
    outs = {ns: check(case, num_splits=ns, block_n=16) for ns in (1, 2, 5, 16, 40)}
    one_out, one_lse = outs[1]
    scale = one_out.abs().max()
    for ns, (out, lse) in outs.items():
        assert ((out - one_out).abs().max() / scale).item() < FP32_TOL, ns
        valid = case.seq_lens > 0
        assert (lse[valid] - one_lse[valid]).abs().max().item() < FP32_TOL, ns


@pytest.mark.parametrize("num_splits", [3, 8])
def test_empty_splits_are_harmless(num_splits):
    """More splits than tiles: lengths 0, 1 and 20 (2 tiles of 16) leave most splits empty; they carry
    ``lse = -inf``, weigh nothing and never put NaN in the merge."""
    case = make_case([0, 1, 20], 16, heads=9, d_c=64, seed=num_splits)
    check(case, num_splits=num_splits, block_n=16)


def test_all_requests_empty():
    case = make_case([0, 0], 16, heads=9, d_c=64)
    out, lse = K.latent_decode(*case.args(), num_splits=4)
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((lse == float("-inf")).all())


@pytest.mark.parametrize("block_n", [16, 32, 128])
def test_block_n_variants(block_n):
    check(make_case([0, 5, 129, 200], 16, heads=9, d_c=64, seed=block_n), block_n=block_n)


def _splits(batch, heads, length, d_c=512, d_r=64, elem=2, sms=132, s_q=1):
    return L.default_num_splits(
        batch, s_q * heads, length, d_c, (d_c + d_r) * elem, sms, L.default_block_n(d_c)
    )


def test_default_num_splits_fill_the_device():
    """Splits come from batch x row blocks x SMs x length (the old rule, one per 256 tokens up to 16, gave
    B = 1 at most 16 programs on 132 SMs and <= 256 tokens one): DeepSeek's shape on an H200 (132 SMs)."""
    assert _splits(1, 128, 32768) == 16  # 8 row blocks x 16 splits = 128 programs
    assert _splits(16, 128, 4096) == 2  # 128 x 2: the partials cap stops it at 2
    assert _splits(64, 128, 4096) == 1  # 512 row blocks fill the device already
    assert _splits(1, 16, 256, d_c=96, d_r=32) == 2  # short context, one row block: split, partials cap at 2
    assert _splits(1, 9, 2048, d_c=96, d_r=32) == 32  # SmolLM2-shaped: 32 tiles of 64, 32 splits
    assert _splits(1, 128, 32) == 1  # one tile: nothing to split
    assert _splits(0, 128, 4096) == 1
    for batch, heads, length in [(1, 9, 513), (2, 128, 100_000), (3, 16, 2048), (1, 128, 64)]:
        s = _splits(batch, heads, length)
        assert s & (s - 1) == 0 and 1 <= s <= L.MAX_SPLITS  # powers of two: few distinct launch shapes
    # the CPU interpreter runs programs one after another: splitting only adds merge work there
    assert _splits(1, 9, 4096, sms=1) == 1


def test_split_partials_stay_below_a_quarter_of_the_cache_bytes():
    """fp32 partials (rows x d_c x 4 bytes per split) must not double the traffic: at H = 128, d_c = 512 one
    split's partials already equal ~455 bf16 cache rows."""
    for batch, heads, length, d_c in [(1, 128, 4096, 512), (4, 128, 32768, 512), (1, 9, 2048, 96)]:
        s = _splits(batch, heads, length, d_c=d_c)
        partials = s * heads * d_c * 4
        assert partials <= L.PARTIAL_BYTES_FRACTION * length * (d_c + 64) * 2 or s == 1


# ------------------------------------------------------------------------------------ addressing


def test_page_order_does_not_change_result():
    """The same rows on two different page permutations give bit-identical results: every read goes
    through the block table."""
    a = make_case([0, 3, 40, 77], 8, heads=9, d_c=48, seed=5, perm_seed=1)
    b = make_case([0, 3, 40, 77], 8, heads=9, d_c=48, seed=5, perm_seed=2)
    assert not torch.equal(a.block_table, b.block_table)
    out_a, lse_a = check(a)
    out_b, lse_b = check(b)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


def test_mixed_batch_equals_requests_alone():
    case = make_case([5, 0, 33, 64], 16, heads=9, d_c=64, seed=9)
    out, lse = check(case)
    for b in range(4):
        alone = K.latent_decode(
            case.q_abs[b : b + 1],
            case.q_rope[b : b + 1],
            case.kv_cache,
            case.block_table[b : b + 1],
            case.seq_lens[b : b + 1],
            case.head_to_rope,
            case.softmax_scale,
        )
        assert torch.allclose(alone[0][0], out[b], rtol=0, atol=FP32_TOL * out.abs().max().item())
        assert torch.equal(alone[1][0].isinf(), lse[b].isinf())


def test_strided_queries():
    """Queries may be views with padded head strides (only the last dimension must be contiguous)."""
    case = make_case([7, 50], 16, heads=9, d_c=64, rope_heads=3, d_r=8, seed=4)
    case.q_abs = torch.cat([case.q_abs, torch.randn(2, 9, 5, device=DEVICE)], dim=-1)[..., :64]
    case.q_rope = torch.cat([case.q_rope, torch.randn(2, 9, 3, device=DEVICE)], dim=-1)[..., :8]
    assert not case.q_abs.is_contiguous() and case.q_abs.stride(2) == 1
    check(case)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("which", ["block_table", "seq_lens"])
def test_strided_block_table_or_seq_lens(which):
    """A non-contiguous block table or seq_lens must be read correctly or refused, never misread."""
    case = make_case([37, 0, 100], 16, heads=9, d_c=64, seed=2)
    if which == "block_table":
        case.block_table = case.block_table.t().contiguous().t()  # same values, column-major
    else:
        case.seq_lens = case.seq_lens.repeat_interleave(2)[::2]  # same values, stride 2
    try:
        out, lse = K.latent_decode(*case.args())
    except ValueError:
        return
    rel, lse_err = errors(case, out, lse)
    assert rel < FP32_TOL and lse_err < FP32_TOL


def test_empty_batch():
    case = make_case([], 16, heads=9, d_c=64)
    out, lse = K.latent_decode(*case.args())
    assert out.shape == (0, 9, 64) and lse.shape == (0, 9)


# ------------------------------------------------------------------------------------ float16


def test_float16_inputs():
    """float16 queries and cache: fp16 dots accumulated in float32, probabilities rounded to fp16 for the
    value product, fp16 output (tolerance: module docstring)."""
    case = make_case([0, 1, 17, 100, 300], 16, heads=9, d_c=72, rope_heads=3, d_r=8, dtype=torch.float16)
    out, _ = check(case, tol=FP16_TOL, lse_tol=FP16_LSE_TOL)
    assert out.dtype == torch.float16
    check(case, tol=FP16_TOL, lse_tol=FP16_LSE_TOL, num_splits=4, block_n=32)


def test_float16_wide_latent():
    case = make_case([0, 40, 129], 64, heads=16, d_c=512, rope_heads=1, d_r=64, dtype=torch.float16, seed=7)
    check(case, tol=FP16_TOL, lse_tol=FP16_LSE_TOL)


# ------------------------------------------------------------------------------------ the scale


def test_softmax_scale_is_required():
    """No default scale: deriving it from the latent width would silently be wrong for converted models."""
    case = make_case([5], 16, heads=2, d_c=32)
    args = case.args()[:-1]
    with pytest.raises(TypeError):
        K.latent_decode(*args)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        latent_decode_reference(*args)  # type: ignore[call-arg]


def test_wrong_scale_is_detected():
    """A converted model's scale is the source's ``1/sqrt(d_N + d_R)`` (here d_N = 16, d_R = 16); using
    ``1/sqrt(d_c + d_R)`` instead moves the result far beyond the tolerance."""
    d_c, d_r, d_n = 64, 16, 16
    true_scale = 1 / math.sqrt(d_n + d_r)
    wrong_scale = 1 / math.sqrt(d_c + d_r)
    case = make_case([0, 9, 40, 120], 16, heads=9, d_c=d_c, d_r=d_r, scale=true_scale, seed=21)
    check(case)
    out, lse = K.latent_decode(*case.args()[:-1], wrong_scale)
    rel, lse_err = errors(case, out, lse)
    assert rel > 1000 * FP32_TOL, rel
    assert lse_err > 1000 * FP32_TOL, lse_err


# ------------------------------------------------------------------------------------ bad inputs


def _bad(case: Case, what: str) -> tuple:
    q_abs, q_rope, cache, bt, lens, h2r, scale = case.args()
    if what == "block_table int64":
        bt = bt.long()
    elif what == "seq_lens int64":
        lens = lens.long()
    elif what == "block_table 1-D":
        bt = bt[0]
    elif what == "seq_lens too long":
        lens = lens.clone()
        lens[0] = bt.shape[1] * cache.shape[1] + 1
    elif what in ("page id past the pool", "page id -1"):
        bt = bt.clone()
        bt[1, 1] = cache.shape[0] + 5 if what == "page id past the pool" else -1  # request 1 reads 2 pages
    elif what == "rope head out of range":
        h2r = h2r.clone()
        h2r[-1] = 1
    elif what == "head_to_rope wrong length":
        h2r = h2r[:-1]
    elif what == "rope width mismatch":
        q_rope = q_rope[..., :6]
    elif what == "rope missing in cache":
        cache = cache[..., : q_abs.shape[2]]
    elif what == "q_abs 2-D":
        q_abs = q_abs[0]
    elif what == "q_rope batch mismatch":
        q_rope = q_rope[:1]
    elif what == "page size 129":
        cache = torch.zeros(2, 129, cache.shape[2], device=DEVICE)
    elif what.startswith("scale "):
        scale = {"scale 0": 0.0, "scale negative": -0.125, "scale nan": float("nan"), "scale None": None,
                 "scale str": "0.125"}[what]  # fmt: skip
    else:
        raise AssertionError(what)
    return q_abs, q_rope, cache, bt, lens, h2r, scale


BAD_BOTH = {
    "block_table int64": "block_table must be int32",
    "seq_lens int64": "seq_lens must be int32",
    "block_table 1-D": "block_table must be int32",
    "seq_lens too long": "exceeds block_table capacity",
    "rope head out of range": "head_to_rope values must lie in",
    "page id past the pool": "block_table[1, 1] = ",
    "page id -1": "block_table[1, 1] = -1 is not a page id",
    "head_to_rope wrong length": "head_to_rope must be",
    "rope width mismatch": "kv_cache rows are 48 wide",
    "rope missing in cache": "kv_cache rows are 32 wide",
    "q_abs 2-D": "q_abs must be",
    "q_rope batch mismatch": "q_rope must be",
    "page size 129": "page size 129",
    "scale 0": "softmax_scale must be a positive float",
    "scale negative": "softmax_scale must be a positive float",
    "scale nan": "softmax_scale must be a positive float",
    "scale None": "softmax_scale must be a positive float",
    "scale str": "softmax_scale must be a positive float",
}


@pytest.mark.parametrize("what", sorted(BAD_BOTH))
def test_bad_inputs_raise_value_error(what):
    """Kernel and oracle refuse the same inconsistent inputs with a ValueError naming the problem."""
    args = _bad(make_case([5, 20], 16, heads=4, d_c=32), what)
    with pytest.raises(ValueError, match=re.escape(BAD_BOTH[what])):
        K.latent_decode(*args)
    with pytest.raises(ValueError, match=re.escape(BAD_BOTH[what])):
        latent_decode_reference(*args)


def test_kernel_only_input_errors():
    case = make_case([5, 20], 16, heads=4, d_c=32)
    q_abs, q_rope, cache, bt, lens, h2r, scale = case.args()
    with pytest.raises(ValueError, match="dtype"):  # float64 is the oracle's, not the kernel's
        K.latent_decode(q_abs.double(), q_rope.double(), cache.double(), bt, lens, h2r, scale)
    with pytest.raises(ValueError, match="share a dtype"):
        K.latent_decode(q_abs.half(), q_rope.half(), cache, bt, lens, h2r, scale)
    with pytest.raises(ValueError, match="contiguous"):
        strided_cache = cache.transpose(1, 2).contiguous().transpose(1, 2)
        K.latent_decode(q_abs, q_rope, strided_cache, bt, lens, h2r, scale)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_nan_in_a_read_row_propagates(num_splits):
    """The cache fills unused slots with NaN so that a read of one poisons the result; the kernel must
    let that NaN through (like the oracle), not turn it into an empty request or a dropped split."""
    case = make_case([300], 16, heads=2, d_c=32)
    case.kv_cache[int(case.block_table[0, 5]), 3] = float("nan")  # token 83 of the request
    ref_out, ref_lse = latent_decode_reference(*case.args())
    assert ref_out.isnan().all() and ref_lse.isnan().all()
    out, lse = K.latent_decode(*case.args(), num_splits=num_splits, block_n=16)
    # every head's output and lse, as the oracle: a NaN that reaches one head only, or the lse but not the
    # output, is a kernel that drops part of the poisoned split
    assert out.isnan().all() and lse.isnan().all(), (out.isnan().float().mean(), lse.isnan().float().mean())


# ------------------------------------------------------------------------------------ issue 14: the GPU product


def make_sq_case(lengths: list[int], s_q: int, heads: int = 9, d_c: int = 48, seed: int = 0, **kw) -> Case:
    """:func:`make_case` with ``s_q`` query tokens per request: queries ``[B, s_q, H, d]``."""
    case = make_case(lengths, 16, heads=heads, d_c=d_c, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    b, d_r = len(lengths), case.q_rope.shape[-1]
    case.q_abs = torch.randn(b, s_q, heads, d_c, generator=gen).to(case.q_abs.dtype).to(DEVICE)
    case.q_rope = torch.randn(b, s_q, heads, d_r, generator=gen).to(case.q_abs.dtype).to(DEVICE)
    return case


def sq_errors(case: Case, out: torch.Tensor, lse: torch.Tensor) -> tuple[float, float]:
    """(relative latent_out error, relative lse error) of a multi-token case over rows that see a cached row."""
    ref_out, ref_lse = latent_decode_reference(*case.args())
    assert out.shape == case.q_abs.shape and lse.shape == case.q_abs.shape[:3]
    seen = ref_lse > float("-inf")
    assert bool((lse[~seen] == float("-inf")).all()) and not out[~seen].any()
    a, b = out[seen].double(), ref_out[seen]
    rel = float((a - b).abs().max() / b.abs().max())
    lse_rel = float(((lse[seen].double() - ref_lse[seen]).abs() / ref_lse[seen].abs().clamp_min(1.0)).max())
    return rel, lse_rel


@pytest.mark.parametrize("s_q", [2, 4, 7])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_multi_token_queries_are_causal(s_q, num_splits):
    """``s_q > 1`` (speculative verification, chunked prefill): query ``i`` sees rows ``<= n - s_q + i``; mixed
    lengths (one page, several pages, exactly s_q, empty) and splits that cut through the query block; row
    blocks of 16 as on a GPU."""
    case = make_sq_case([s_q, 40, 0, 17 + s_q], s_q, seed=s_q)
    out, lse = K.latent_decode(*case.args(), num_splits=num_splits, block_m=16)
    rel, lse_rel = sq_errors(case, out, lse)
    assert rel < FP32_TOL and lse_rel < FP32_TOL
    # causality is real: the first query token of a request does not see the block's later rows
    single = make_sq_case([s_q, 40, 0, 17 + s_q], s_q, seed=s_q)
    single.q_abs, single.q_rope = case.q_abs[:, :1].contiguous(), case.q_rope[:, :1].contiguous()
    single.seq_lens = (case.seq_lens - (s_q - 1)).clamp_min(0)
    single.seq_lens[case.seq_lens == 0] = 0
    first, _ = K.latent_decode(*single.args())
    assert torch.allclose(first[[0, 1, 3], 0], out[[0, 1, 3], 0], rtol=1e-5, atol=1e-6)


def test_multi_token_queries_float16():
    case = make_sq_case([5, 70, 33], 5, heads=16, d_c=64, dtype=torch.float16, seed=3)
    out, lse = K.latent_decode(*case.args())
    rel, lse_rel = sq_errors(case, out, lse)
    assert rel < FP16_TOL and lse_rel < FP16_LSE_REL_TOL


def test_multi_token_rows_span_head_blocks():
    """s_q x H rows tile 16 at a time: with H = 9 a row block holds two query tokens and several rope heads."""
    case = make_sq_case([12, 30], 3, heads=9, d_c=40, rope_heads=3, d_r=8, seed=5)
    out, lse = K.latent_decode(*case.args(), num_splits=2, block_m=16)
    rel, lse_rel = sq_errors(case, out, lse)
    assert rel < FP32_TOL and lse_rel < FP32_TOL


@pytest.mark.parametrize("num_splits", [1, 3])
def test_interpreter_row_block_covers_a_prefill(num_splits):
    """A 61-token chunk of 9 heads (549 query rows) is one program per split in the interpreter (block 1024)
    and 35 at BLOCK_M = 16; both agree with the float64 reference, causal inside the chunk, whatever the
    splits."""
    case = make_sq_case([200, 61], 61, heads=9, d_c=64, rope_heads=3, d_r=8, seed=61)
    assert L.default_block_m(61 * 9, "triton-interpreter") == 1024
    out16, lse16 = K.latent_decode(*case.args(), num_splits=num_splits, block_m=16)
    out, lse = K.latent_decode(*case.args(), num_splits=num_splits, block_m=1024)
    for o, ls in ((out16, lse16), (out, lse)):
        rel, lse_rel = sq_errors(case, o, ls)
        assert rel < FP32_TOL and lse_rel < FP32_TOL
    assert (out - out16).abs().max() <= 1e-6 * out16.abs().max()
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        K.latent_decode(*case.args(), block_m=24)


def test_seq_lens_below_s_q_refused():
    case = make_sq_case([3, 20], 4)
    with pytest.raises(ValueError, match="request 0 has 3 rows for 4 query tokens"):
        K.latent_decode(*case.args())
    with pytest.raises(ValueError, match="request 0 has 3 rows for 4 query tokens"):
        latent_decode_reference(*case.args())


def test_padded_row_stride():
    """Rows may sit in a wider row stride (the paged cache pads to 16 elements for aligned vector loads)."""
    case = make_case([5, 40, 17], 16, heads=9, d_c=88, rope_heads=1, d_r=32)  # row 120, stride 128
    padded = torch.full((*case.kv_cache.shape[:2], 128), float("nan"), device=DEVICE)
    padded[..., :120] = case.kv_cache
    case.kv_cache = padded[..., :120]
    assert case.kv_cache.stride(1) == 128
    check(case)


def test_block_n_below_16_refused():
    """block_n = 8 runs in the interpreter but tl.dot cannot compile it for sm_80/sm_90 in fp16/bf16."""
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        K.latent_decode(*make_case([5], 16, heads=4, d_c=32).args(), block_n=8)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's bfloat16 fault")
def test_bfloat16_refused_in_the_interpreter():
    """The interpreter reads bfloat16 as int16 (outputs ~1e8, LSE ~1e10 where the oracle gives 0.004 / 4.6):
    refused with the fix, never computed."""
    case = make_case([5, 9], 16, heads=4, d_c=32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 cannot run in the Triton interpreter"):
        K.latent_decode(*case.args())


def test_inputs_on_different_devices_refused():
    """Every input must be on the kernel's device (on a CUDA host a CPU pointer makes the launch fail)."""
    case = make_case([5, 9], 16, heads=4, d_c=32)
    args = list(case.args())
    args[2] = torch.empty(args[2].shape, device="meta")
    with pytest.raises(ValueError, match="all inputs must be on one device; .*kv_cache on meta"):
        K.latent_decode(*args)
    with pytest.raises(ValueError, match="all inputs must be on one device"):
        latent_decode_reference(*args)


def test_host_side_reads_no_device_value(monkeypatch):
    """The kernel call's host work (checks, split choice, buffers, launch) reads no tensor value: with every
    input on the meta device (tensors without values) it reaches both launches; on a GPU it therefore never
    synchronises and can be captured in a CUDA graph."""
    launches: list[tuple[int, ...]] = []

    class Stub:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(grid)

            return launch

    monkeypatch.setattr(K, "_split_kernel", Stub("split"))
    monkeypatch.setattr(K, "_merge_kernel", Stub("merge"))
    meta = [
        torch.empty(t.shape, dtype=t.dtype, device="meta")
        for t in make_case([5, 40], 16, heads=20, d_c=32).args()[:6]
    ]
    out, lse = K.latent_decode(*meta, softmax_scale=0.1, max_seq_len=40, block_m=L.BLOCK_M)  # as on a GPU
    assert out.device.type == "meta" and out.shape == (2, 20, 32) and lse.shape == (2, 20)
    assert launches[0][1:] == (1, 2) and launches[0][0] == 2 and launches[1] == (2, 2)  # 2 row blocks
    launches.clear()
    K.latent_decode(*meta, softmax_scale=0.1, max_seq_len=40)  # the interpreter's default: one row block
    assert launches[0][0] == -(-20 // L.default_block_m(20, kernel_backend()))


def test_large_score_scale_lse_relative():
    """Queries x100 push LSE to hundreds of nats; a correct fp16 result then misses by ~1e-3 absolute but stays
    ~1e-6 relative, so lse is judged relatively where magnitudes vary."""
    case = make_case([50, 300], 16, heads=16, d_c=64, dtype=torch.float16, seed=9)
    case.q_abs = (case.q_abs.float() * 100).half()
    out, lse = K.latent_decode(*case.args())
    ref_out, ref_lse = latent_decode_reference(*case.args())
    assert float(ref_lse.abs().min()) > 100
    rel = float(((lse.double() - ref_lse).abs() / ref_lse.abs()).max())
    assert rel < FP16_LSE_REL_TOL


# ------------------------------------------------------------------------------------ FP8 latent rows

from mla_convert.kernels import fp8 as F8  # noqa: E402


def test_fp8_row_layout_matches_deepseek():
    """DeepSeek-V3 / FlashMLA "FP8 with scale": 512 E4M3 + 4 float32 scales + 64 bfloat16 = 656 bytes."""
    lay = F8.layout(512, 64)
    assert lay.group == 128 and lay.row_bytes == 656 and lay.stride_bytes == 656
    assert lay.ledger() == {"latent": 512, "scales": 16, "rope": 128, "padding": 0}
    small = F8.layout(96, 32)  # SmolLM2-shaped: groups of 32
    assert small.group == 32 and small.row_bytes == 96 + 12 + 64 and small.stride_bytes == 176
    odd = F8.layout(18, 48)  # a per-layer rank of the bundled conversion: latent zero-padded to 32 bytes
    assert (odd.latent_bytes, odd.group, odd.scale_offset, odd.row_bytes, odd.stride_bytes) == (
        32,
        32,
        32,
        132,
        144,
    )
    assert odd.ledger() == {"latent": 18, "scales": 4, "rope": 96, "padding": 144 - 18 - 4 - 96}
    with pytest.raises(ValueError, match="must be 16, 32, 64 or 128"):
        F8.layout(96, 16, group=64)


@pytest.mark.parametrize("d_c", [18, 75, 96])
def test_fp8_latent_widths_not_multiple_of_16(d_c):
    """Padded latent parts: the kernel reads the scales at the padded offset and never the zero padding."""
    case, lay, packed = _fp8_case([5, 40, 17], heads=9, d_c=d_c, d_r=16, rope_heads=3)
    assert lay.latent_bytes % 16 == 0 and lay.latent_bytes >= d_c
    deq = F8.dequantize_rows(packed, lay)
    valid = case.kv_cache.isfinite()
    err = (deq - case.kv_cache.nan_to_num(0.0))[valid].abs().max() / case.kv_cache[valid].abs().max()
    assert 0 < float(err) < 2**-4
    args = (
        case.q_abs,
        case.q_rope,
        packed,
        case.block_table,
        case.seq_lens,
        case.head_to_rope,
        case.softmax_scale,
    )
    out, lse = K.latent_decode(*args, fp8=lay, num_splits=2)
    ref_out, ref_lse = latent_decode_reference(*args, fp8=lay)
    assert float((out.double() - ref_out).abs().max() / ref_out.abs().max()) < FP32_TOL
    assert float(((lse.double() - ref_lse) / ref_lse.abs().clamp_min(1)).abs().max()) < FP32_TOL


def _fp8_case(lengths, heads=16, d_c=64, d_r=16, rope_heads=1, seed=0):
    case = make_case(lengths, 16, heads=heads, d_c=d_c, rope_heads=rope_heads, d_r=d_r, seed=seed)
    lay = F8.layout(d_c, rope_heads * d_r)
    rows = case.kv_cache.nan_to_num(0.0)  # free slots: zeros (NaN has no E4M3 scale); never read anyway
    return case, lay, F8.quantize_rows(rows, lay)


@pytest.mark.parametrize("s_q", [1, 3])
def test_fp8_cache_kernel_matches_reference(s_q):
    """The kernel's in-register dequantization equals the reference's (same values), so the only error is
    float32 arithmetic."""
    case, lay, packed = _fp8_case([5, 70, 0, 33], rope_heads=2, heads=8)
    if s_q > 1:
        sq = make_sq_case([5, 70, 0, 33], s_q, heads=8, d_c=64, rope_heads=2)
        case.q_abs, case.q_rope = sq.q_abs, sq.q_rope
    args = (
        case.q_abs,
        case.q_rope,
        packed,
        case.block_table,
        case.seq_lens,
        case.head_to_rope,
        case.softmax_scale,
    )
    out, lse = K.latent_decode(*args, fp8=lay, num_splits=2)
    ref_out, ref_lse = latent_decode_reference(*args, fp8=lay)
    seen = ref_lse > float("-inf")
    assert float((out.double() - ref_out)[seen].abs().max() / ref_out[seen].abs().max()) < FP32_TOL
    assert float((lse.double() - ref_lse)[seen].abs().max()) < FP32_TOL


def test_fp8_format_error_is_measured():
    """What the format costs (E4M3's 3 mantissa bits per latent value, bfloat16 rope) against the unquantized
    rows: a few percent of the output on random rows."""
    case, lay, packed = _fp8_case([300, 200], heads=16, d_c=128, d_r=32, seed=4)
    deq = F8.dequantize_rows(packed, lay)
    valid = case.kv_cache.isfinite()
    rel_rows = float(
        (deq - case.kv_cache.nan_to_num(0.0))[valid].abs().max() / case.kv_cache[valid].abs().max()
    )
    assert 0 < rel_rows < 2**-4  # E4M3 rounding: half a unit of 3 mantissa bits at the group's top
    args = (
        case.q_abs,
        case.q_rope,
        packed,
        case.block_table,
        case.seq_lens,
        case.head_to_rope,
        case.softmax_scale,
    )
    out, _ = K.latent_decode(*args, fp8=lay)
    ref, _ = latent_decode_reference(*case.args())
    rel = float((out.double() - ref).abs().max() / ref.abs().max())
    assert 1e-4 < rel < 0.1, rel  # measured 0.055 on these random rows (max-normalised)


def test_fp8_needs_its_layout():
    case, lay, packed = _fp8_case([5])
    args = (
        case.q_abs,
        case.q_rope,
        packed,
        case.block_table,
        case.seq_lens,
        case.head_to_rope,
        case.softmax_scale,
    )
    with pytest.raises(ValueError, match="uint8 rows together with its layout"):
        K.latent_decode(*args)
    with pytest.raises(ValueError, match="do not fit"):
        K.latent_decode(*args, fp8=F8.layout(64, 32))
