"""The test matrices of two peer MLA decode kernels, ported to this kernel's ABI.

Sources (read for their shapes, data, poisoning and thresholds; no code is taken from them):

* deepseek-ai/FlashMLA (commit 9241ae3e):
  ``tests/test_flash_mla_dense_decoding.py`` (dense decoding matrix: batch x ``s_q`` x ``s_k`` x heads x KV heads,
  varlen lengths, zero-length corner cases, 64-token blocks, d = 576 / dv = 512, NaN in every unused block and
  in the tail of each last block, unused block-table slots set to 2147480000), ``tests/test_flash_mla_sparse_decoding.py``,
  ``tests/lib.py`` and ``tests/quant.py`` (FP8 "V32" rows of 512 E4M3 + 4 float32 scales + 64 bfloat16 rope values,
  odd block sizes 2/53/61/69, invalid index sentinels such as -2147483648, -1 and 2147483647, the kernel compared
  with a reference on the dequantized cache), ``tests/ref.py`` (a query with nothing to attend: zeros, lse = +inf),
  ``tests/kernelkit/compare.py`` (the element test "absolute error below abs_tol or relative error below rel_tol"
  and the cosine difference ``1 - 2<a,b> / (|a|^2 + |b|^2)``), ``tests/kernelkit/generate.py``
  (``non_contiguousify``: inputs passed as views of larger tensors).
* flashinfer-ai/flashinfer (commit fb28d724):
  ``tests/attention/test_deepseek_mla.py`` (``test_batch_mla_page_attention``,
  ``test_batch_mla_varlen_page_attention``, ``test_batch_mla_oob_kv_nan`` and the FP8 tests
  ``test_batch_mla_fp8_kv_matches_bf16_reference``, ``test_batch_mla_fp8_kv_scale_sensitivity``,
  ``test_batch_mla_fp8_kv_zero_kv_gives_zero_output``, ``test_fp8_kv_kpe_dominant_no_row_aliasing``),
  ``tests/attention/test_mla_decode_kernel.py`` (absorbed vs unabsorbed attention judged by cosine similarity > 0.99
  and WMAPE < 0.02; ``test_mla_page_index_uint32_overflow_regression``, page ids whose element offset passes 2^32),
  ``tests/attention/test_trtllm_gen_mla.py`` (non-power-of-two head counts 3, 6, 9, 12, 17, 24, 33, 48, 63) and
  ``tests/attention/test_cute_dsl_mla_decode.py`` (packed queries: heads x ``q_len`` 1/2/4/8).

What changes in the port:

* Every case is checked against this repo's float64 oracle (:func:`latent_decode_reference`) with this suite's
  tolerances (relative to the largest reference value: 1e-5 in float32, 2e-3 in float16, 1.6e-2 in bfloat16;
  ``lse`` relative to ``max(|lse|, 1)``), and *in addition* with the peer's own check and thresholds, cosine
  included where the peer uses one.
* Our cache holds one latent head (MLA); the peers' ``h_kv`` KV heads become ``R`` rope heads sharing ``c_kv``
  (``head_to_rope``). Our kernel is always causal inside the query block, so the peers' non-causal ``s_q > 1``
  cases have no counterpart (for ``s_q = 1`` causal and non-causal coincide).
* Empty rows: FlashMLA's suite expects ``lse = +inf``, FlashInfer's ``-inf``; ours is zeros and ``-inf``
  (docs/formats.md), asserted explicitly. FlashInfer's ``lse`` is base 2: its threshold is applied to ours
  converted to base 2.
* Our FP8 rows scale each group by its own float32 ``amax / 448`` (FlashMLA rounds scales to powers of two,
  FlashInfer uses one scale per tensor); page sizes stop at 128 (FlashMLA's 576-token blocks are not ported).
* Sizes are cut so the Triton interpreter runs the CPU part in well under a minute (about 35 s on two busy
  cores): latent widths 32..128 with one DeepSeek-width (512 + 64) case per family, H from 1 to 128, tens to
  hundreds of tokens, explicit ``num_splits`` standing in for the peers' schedulers (the CPU default is one
  split). The peers' full grids, H = 128 at d_c = 512 over long contexts, and bfloat16 (which the interpreter
  refuses) are GPU-only: ``skipif`` without CUDA (tests/kernels has no ``gpu`` marker; its tests run natively on
  CUDA tensors when a GPU is present, and so do the CPU cases here).
* Page ids past 2^31 / 2^32 elements cost no memory on the CPU: the pool is one ``torch.empty`` of 6-12 GB of
  address space of which only the few pages written are ever committed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 before triton is imported, on CPU)
from mla_convert.kernels import fp8 as F8
from mla_convert.kernels import latent_decode_reference, load_kernel
from mla_convert.kernels import launch as L

K = load_kernel()

#: the kernel runs natively on a CUDA GPU and in the Triton interpreter (CPU tensors) otherwise
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = torch.cuda.is_available()

#: this suite's tolerances (tests/kernels/test_kernel.py explains the float32 and float16 ones); bfloat16 allows
#: four of its units (2^-8 each), FlashMLA's own ``2.01 / 128``, and FlashMLA's lse tolerance ``8.01 / 65536``
OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1.25e-4}

#: FlashMLA tests/test_flash_mla_dense_decoding.py (out) and tests/test_flash_mla_sparse_decoding.py (FP8 out);
#: lse from both
FLASHMLA_DENSE_OUT = {"abs_tol": 8e-4, "rel_tol": 2.01 / 128, "cos_diff_tol": 5e-6}
FLASHMLA_SPARSE_OUT = {"abs_tol": 1e-3, "rel_tol": 2.01 / 128, "cos_diff_tol": 5e-6}
FLASHMLA_LSE = {"abs_tol": 1e-6, "rel_tol": 8.01 / 65536, "cos_diff_tol": None}
#: FlashInfer tests/attention/test_deepseek_mla.py: torch.testing.assert_close tolerances
FLASHINFER_PAGE = {"rtol": 1e-3, "atol": 1e-3}
FLASHINFER_VARLEN = {"rtol": 1e-3, "atol": 2e-3}

#: what FlashMLA writes into block-table slots past a request's blocks (dense test) ...
FLASHMLA_UNUSED_BLOCK = 2147480000
#: ... and the invalid indices its sparse tests scatter (tests/lib.py), here block-table slots past the used pages
SENTINELS = (-(2**31), -123456, -1, 114514, 1919810, 2147480000, 2**31 - 1)

LOG2E = math.log2(math.e)


def gpu_only(why: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not CUDA, reason=f"GPU-only: {why}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def skip_without_e4m3() -> None:
    """The kernel refuses an FP8 cache below sm_89 (no E4M3 conversions there)."""
    if CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("an FP8 cache needs sm_89 or newer")


# ------------------------------------------------------------------------------------ building a paged batch


@dataclass
class Paged:
    """One call's inputs (on ``DEVICE``); ``fp8`` is the row layout of a uint8 cache."""

    q_abs: torch.Tensor
    q_rope: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    head_to_rope: torch.Tensor
    scale: float
    fp8: F8.Fp8Layout | None = None

    def args(self) -> tuple:
        return (
            self.q_abs,
            self.q_rope,
            self.kv_cache,
            self.block_table,
            self.seq_lens,
            self.head_to_rope,
            self.scale,
        )

    def run(self, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel with the row blocks of 16 it is compiled with on a GPU (the interpreter's default takes
        a request's rows in one program; the peers' head counts are about blocks of 16)."""
        kw.setdefault("block_m", L.BLOCK_M)
        return K.latent_decode(*self.args(), fp8=self.fp8, **kw)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        return latent_decode_reference(*self.args(), fp8=self.fp8)


def build(
    lengths: list[int],
    *,
    heads: int,
    d_c: int,
    d_r: int,
    page_size: int,
    s_q: int = 1,
    rope_heads: int = 1,
    dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype | None = None,
    data: str = "flashinfer",
    seed: int = 0,
    scale: float | None = None,
    pool: str = "flashmla",
    sentinel: int | tuple[int, ...] | None = FLASHMLA_UNUSED_BLOCK,
    fp8: bool = False,
) -> Paged:
    """A batch of requests over a poisoned paged pool.

    ``pool="flashmla"``: each request owns ``ceil(max_len / 256) * 256 / page_size`` table slots, all the pool's
    blocks shuffled over all slots (FlashMLA's generator). ``pool="contiguous"``: request ``b``'s pages are the next
    ``ceil(len / page_size)`` ids in order (FlashInfer's ``kv_indices = arange``), plus one spare page.

    Every slot a request does not read -- whole unused pages and the tail of each last page -- is NaN (bytes 0xFF
    in an FP8 pool: NaN as E4M3, as float32 scale and as bfloat16), and table slots past a request's pages hold
    ``sentinel`` (cycled when a tuple) or, with ``sentinel=None``, keep pointing at NaN pages.

    ``data="flashmla"``: values ``randn / 10`` clamped to [-1, 1] and ``scale = 1/sqrt(d_c + d_R)`` (FlashMLA's
    ``1/sqrt(576)``); ``data="flashinfer"``: ``randn`` and ``scale = 1/sqrt(d_c / 4 + d_R)`` (FlashInfer's
    ``1/sqrt(128 + 64)``, the head width before absorption; scores of standard deviation ~1.7).
    """
    if fp8:
        skip_without_e4m3()
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    b = len(lengths)
    need = [cdiv(n, page_size) for n in lengths]
    width = d_c + rope_heads * d_r
    if pool == "flashmla":
        slots = cdiv(max(cdiv(max(lengths, default=0), 256), 1) * 256, page_size)
        num_pages = b * slots
        table = torch.randperm(num_pages, generator=gen, device=DEVICE).cpu().view(b, slots).int()
    elif pool == "contiguous":
        slots = max(need + [1])
        num_pages = sum(need) + 1
        table = torch.full((b, slots), num_pages - 1, dtype=torch.int32)
        start = 0
        for i, k in enumerate(need):
            table[i, :k] = torch.arange(start, start + k, dtype=torch.int32)
            start += k
    else:
        raise AssertionError(pool)

    def draw(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, device=DEVICE)
        return (x / 10).clamp(-1.0, 1.0) if data == "flashmla" else x

    # rows each table slot holds: a request's last page is partly filled, slots past it hold none
    filled = (
        torch.tensor(lengths, dtype=torch.int64)[:, None] - torch.arange(slots)[None, :] * page_size
    ).clamp(0, page_size)
    live = torch.zeros(num_pages, page_size, dtype=torch.bool)
    live[table.flatten().long()] = torch.arange(page_size)[None, :] < filled.reshape(-1, 1)
    if pool == "contiguous":
        live[-1] = False  # the spare page (padding slots point at it)
    live = live.to(DEVICE)
    rows = draw(num_pages, page_size, width)
    lay = None
    if fp8:
        lay = F8.layout(d_c, rope_heads * d_r)
        cache = F8.quantize_rows(rows, lay)
        cache[~live] = 0xFF
        q_dtype = q_dtype or torch.float32
    else:
        cache = rows.to(dtype)
        cache[~live] = float("nan")
        q_dtype = q_dtype or dtype
    if sentinel is not None:
        fill = torch.tensor(sentinel if isinstance(sentinel, tuple) else (sentinel,), dtype=torch.int32)
        spare = torch.arange(slots)[None, :] >= torch.tensor(need, dtype=torch.int64)[:, None]
        table[spare] = fill.repeat(cdiv(int(spare.sum()), len(fill)))[: int(spare.sum())]
    q_abs = draw(b, s_q, heads, d_c).to(q_dtype)
    q_rope = draw(b, s_q, heads, d_r).to(q_dtype)
    head_to_rope = ((torch.arange(heads) * rope_heads) // heads).int()
    if scale is None:
        scale = 1 / math.sqrt(d_c + d_r) if data == "flashmla" else 1 / math.sqrt(d_c / 4 + d_r)
    lens = torch.tensor(lengths, dtype=torch.int32)
    return Paged(
        q_abs, q_rope, cache, table.to(DEVICE), lens.to(DEVICE), head_to_rope.to(DEVICE), float(scale), lay
    )


def flashmla_lengths(b: int, s_q: int, s_k: int, varlen: bool, zeros: bool, seed: int) -> list[int]:
    """FlashMLA's lengths: ``s_k``, or ``max(N(s_k, s_k / 2), s_q)`` when varlen; about half of them 0 with
    ``zeros`` (its zero-length corner cases)."""
    rng = random.Random(seed)
    lengths = [max(int(rng.normalvariate(s_k, s_k / 2)), s_q) if varlen else s_k for _ in range(b)]
    if zeros:
        lengths = [0 if rng.random() < 0.5 else n for n in lengths]
    return lengths


# ------------------------------------------------------------------------------------ checks


def cos_diff(ans: torch.Tensor, ref: torch.Tensor) -> float:
    """FlashMLA's cosine difference ``1 - 2<a,b> / (|a|^2 + |b|^2)`` (0 for a zero reference)."""
    a, r = ans.double().flatten(), ref.double().flatten()
    if float((r * r).sum()) < 1e-12:
        return 0.0
    return 1.0 - 2.0 * float((a * r).sum()) / float((a * a).sum() + (r * r).sum())


def flashmla_allclose(
    name: str,
    ans: torch.Tensor,
    ref: torch.Tensor,
    abs_tol: float,
    rel_tol: float,
    cos_diff_tol: float | None,
) -> None:
    """FlashMLA's check: every element within ``abs_tol`` or within ``rel_tol`` of ``|ref| + 1e-6``, and the
    cosine difference at most ``cos_diff_tol``."""
    a, r = ans.double(), ref.double()
    abs_err = (a - r).abs()
    rel_err = abs_err / (r.abs() + 1e-6)
    bad = ~((abs_err < abs_tol) | (rel_err < rel_tol))
    assert not bool(bad.any()), (
        f"{name}: {int(bad.sum())} of {bad.numel()} elements outside abs {abs_tol} / rel {rel_tol}; "
        f"worst abs {float(abs_err.max()):.3g}"
    )
    if cos_diff_tol is not None:
        cd = cos_diff(a, r)
        assert abs(cd) <= cos_diff_tol, f"{name}: cosine difference {cd:.3g} > {cos_diff_tol}"


def compare(
    case: Paged,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    flashmla: dict | None = None,
    flashinfer: dict | None = None,
) -> tuple[float, float]:
    """Kernel vs float64 oracle: shapes, our empty-row convention, finiteness, this suite's tolerance for the
    queries' dtype, then the peer's check. Returns (relative out error, relative lse error)."""
    ref_out, ref_lse = case.reference()
    dtype = case.q_abs.dtype
    assert out.shape == case.q_abs.shape and out.dtype == dtype
    assert lse.shape == case.q_abs.shape[:-1] and lse.dtype == torch.float32
    seen = ref_lse > float("-inf")
    # our convention for a row that sees no cached row: exact zeros and -inf (FlashMLA's suite: +inf)
    assert not bool(out[~seen].any()), "empty rows must be exact zeros"
    assert bool((lse[~seen] == float("-inf")).all()), "empty rows must have lse = -inf (not FlashMLA's +inf)"
    assert bool(out.isfinite().all()), "NaN/inf in the output: a poisoned (unused) slot was read"
    assert bool(lse[seen].isfinite().all())
    if not bool(seen.any()):
        return 0.0, 0.0
    a, r = out[seen].double(), ref_out[seen]
    rel = float((a - r).abs().max() / r.abs().max())
    la, lr = lse[seen].double(), ref_lse[seen]
    lse_rel = float(((la - lr).abs() / lr.abs().clamp_min(1.0)).max())
    assert rel < OUT_TOL[dtype], f"out relative error {rel:.3g} >= {OUT_TOL[dtype]}"
    assert lse_rel < LSE_TOL[dtype], f"lse relative error {lse_rel:.3g} >= {LSE_TOL[dtype]}"
    if flashmla is not None:
        flashmla_allclose("out", a, r, **flashmla)
        flashmla_allclose("lse", la, lr, **FLASHMLA_LSE)
    if flashinfer is not None:
        torch.testing.assert_close(a, r, **flashinfer)
        torch.testing.assert_close(la * LOG2E, lr * LOG2E, **flashinfer)  # FlashInfer's lse is base 2
    return rel, lse_rel


def _as_16bit_cache(case: Paged, dtype: torch.dtype) -> Paged:
    """The same batch over the dequantized FP8 rows stored in ``dtype`` (FlashInfer's "bf16 reference" path)."""
    rows = F8.dequantize_rows(case.kv_cache, case.fp8).to(dtype)
    q = case.q_abs.to(dtype), case.q_rope.to(dtype)
    return Paged(*q, rows, *case.args()[3:])


def check(case: Paged, out: torch.Tensor, lse: torch.Tensor, **peer) -> None:
    """:func:`compare`, except for an FP8 cache with 16-bit queries: the kernel rounds the dequantized rows to the
    queries' dtype (as FlashMLA's reference does, which dequantizes to bfloat16), so our tolerance applies against
    the float32 rows and the peer's check against the oracle on the rows in the queries' dtype."""
    if case.fp8 is None or case.q_abs.dtype == torch.float32:
        compare(case, out, lse, **peer)
        return
    compare(case, out, lse)
    compare(_as_16bit_cache(case, case.q_abs.dtype), out, lse, **peer)


# ------------------------------------------------------------------------------------ FlashMLA: dense decoding

# (b, s_q, s_k, heads, rope heads for FlashMLA's h_kv, varlen, d_c, d_R, dtype, num_splits) -- FlashMLA's grid
# b {1, 2, 6, 64} x s_q {1, 2, 4} x s_k {20, 140, 4096} x h_q {1, 3, 9, 63, 64, 126, 128} x h_kv {1, 2, 3, 8},
# cut to cases the interpreter runs in about a second in all; explicit num_splits stand in for FlashMLA's
# tile scheduler (the CPU's default is 1 split)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DENSE_CPU = [
    (1, 1, 20, 1, 1, False, 64, 16, F32, None),
    (2, 2, 140, 3, 1, True, 64, 16, F32, 3),
    (6, 1, 140, 9, 3, True, 64, 16, F32, 2),
    (2, 4, 20, 9, 1, False, 64, 16, F32, None),
    (1, 2, 140, 63, 3, True, 32, 16, F32, 4),
    (2, 1, 140, 64, 2, False, 64, 16, F32, None),
    (1, 2, 20, 126, 2, False, 32, 16, F32, 2),
    (2, 2, 140, 16, 1, True, 512, 64, F32, 2),
    (1, 1, 140, 128, 1, False, 512, 64, F32, None),
    (2, 2, 140, 9, 1, True, 64, 16, F16, 3),
    (1, 1, 140, 16, 1, False, 512, 64, F16, None),
]


def _dense_id(p) -> str:
    b, s_q, s_k, h, r, varlen, d_c, d_r, dtype, ns = p
    v = "var" if varlen else "fix"
    return f"b{b}-sq{s_q}-sk{s_k}{v}-h{h}-r{r}-d{d_c + d_r}-{str(dtype)[6:]}-ns{ns}"


def run_dense(b, s_q, s_k, heads, rope_heads, varlen, d_c, d_r, dtype, num_splits, zeros=False, seed=0):
    lengths = flashmla_lengths(b, s_q, s_k, varlen, zeros, seed)
    case = build(
        lengths,
        heads=heads,
        d_c=d_c,
        d_r=d_r,
        rope_heads=rope_heads,
        page_size=64,
        s_q=s_q,
        dtype=dtype,
        data="flashmla",
        seed=seed,
    )
    out, lse = case.run(num_splits=num_splits)
    compare(case, out, lse, flashmla=FLASHMLA_DENSE_OUT)
    return case, out, lse


@pytest.mark.parametrize("p", DENSE_CPU, ids=_dense_id)
def test_flashmla_dense_decoding(p):
    """FlashMLA's dense decoding matrix (reduced): shuffled 64-token blocks, NaN in every unused block and each
    last block's tail, 2147480000 in unused table slots; causal for s_q > 1; H = 1, 3, 9, 63, 126 do not divide
    the kernel's 16-row blocks."""
    b, _, s_k, heads = p[:4]
    run_dense(*p, seed=1000 * b + s_k + heads)


@pytest.mark.parametrize("heads,rope_heads", [(3, 1), (16, 2)])
def test_flashmla_zero_seqlen_corner_cases(heads, rope_heads):
    """FlashMLA's corner cases (b = 128, s_q = 2, varlen around 4096, about half the requests empty), cut to
    b = 8 around 100 tokens: empty requests give zeros and lse = -inf (ours), never FlashMLA's +inf."""
    lengths = flashmla_lengths(8, 2, 100, True, True, seed=heads)
    assert 0 in lengths and any(lengths)
    case = build(
        lengths, heads=heads, d_c=64, d_r=16, rope_heads=rope_heads, page_size=64, s_q=2, data="flashmla"
    )
    out, lse = case.run(num_splits=2)
    compare(case, out, lse, flashmla=FLASHMLA_DENSE_OUT)
    empty = case.seq_lens == 0
    assert bool(torch.isneginf(lse[empty]).all()) and not bool(torch.isposinf(lse).any())


@gpu_only("FlashMLA's full dense grid at d = 576 / dv = 512 in bfloat16 and float16 (hundreds of launches)")
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("s_q", [1, 2, 4])
@pytest.mark.parametrize("b", [1, 2, 6, 64])
def test_flashmla_dense_decoding_full_grid_gpu(b, s_q, dtype):
    for s_k in (20, 140, 4096):
        for heads in (1, 3, 9, 63, 64, 126, 128):
            for kv_heads in (1, 2, 3, 8):
                if heads % kv_heads:
                    continue
                for varlen in (False, True):
                    seed = b + s_q + s_k + heads
                    run_dense(b, s_q, s_k, heads, kv_heads, varlen, 512, 64, dtype, None, seed=seed)


@gpu_only("FlashMLA's zero-length corner cases at full size (b = 128, s_q = 2, ~4096 tokens, d = 576)")
@pytest.mark.parametrize("heads", [1, 3, 9, 63, 64, 126, 128])
def test_flashmla_zero_seqlen_corner_cases_full_gpu(heads):
    for kv_heads in (1, 2, 3, 8):
        if heads % kv_heads == 0:
            case, _, lse = run_dense(128, 2, 4096, heads, kv_heads, True, 512, 64, BF16, None, zeros=True)
            assert not bool(torch.isposinf(lse).any())


# ------------------------------------------------------------------------------------ block-table sentinels


def _with_table(case: Paged, table: torch.Tensor) -> Paged:
    return Paged(*case.args()[:3], table, *case.args()[4:], fp8=case.fp8)


SENTINEL_SETS = [
    (False, (FLASHMLA_UNUSED_BLOCK,)),
    (False, (-(2**31), -123456, -1)),
    (False, (114514, 1919810, 2**31 - 1)),
    (True, SENTINELS),
]


@pytest.mark.parametrize(
    "fp8,sentinels", SENTINEL_SETS, ids=["fp32-flashmla", "fp32-negative", "fp32-positive", "fp8-all"]
)
def test_sentinel_table_slots_past_the_length_are_never_read(fp8, sentinels):
    """FlashMLA fills the table slots past a request's blocks with 2147480000 and its sparse tests scatter
    -2**31, -1, 2**31 - 1 and friends: those slots must not be read. The result equals, bit for bit, the same
    batch whose spare slots point at (NaN-poisoned) pages of the pool, and is finite."""
    kw = dict(heads=9, d_c=64, d_r=16, page_size=16, s_q=2, fp8=fp8, seed=5)
    clean = build([0, 37, 64, 130], sentinel=None, **kw)
    table = clean.block_table.clone()
    spare = torch.arange(table.shape[1], device=DEVICE)[None, :] >= (clean.seq_lens[:, None] + 15) // 16
    table[spare] = torch.tensor(sentinels, dtype=torch.int32, device=DEVICE).repeat(int(spare.sum()))[
        : int(spare.sum())
    ]
    assert all(bool((table == v).any()) for v in sentinels)
    dirty = _with_table(clean, table)
    ref = clean.run(num_splits=3)
    out, lse = dirty.run(num_splits=3)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    compare(dirty, out, lse)


@gpu_only("bfloat16 (the interpreter refuses it) with FlashMLA's sentinels on a NaN-poisoned pool")
def test_sentinels_bfloat16_gpu():
    case = build(
        [0, 37, 64, 130, 1000],
        heads=128,
        d_c=512,
        d_r=64,
        page_size=64,
        s_q=2,
        dtype=BF16,
        sentinel=SENTINELS,
    )
    out, lse = case.run()
    compare(case, out, lse, flashmla=FLASHMLA_DENSE_OUT)


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """FlashMLA's ``non_contiguousify``: the same values in a view of a larger tensor (every dimension one longer,
    the last 128 longer); the margin here is NaN (0xFF bytes for uint8), so a read of it shows."""
    fill = 0xFF if t.dtype == torch.uint8 else (float("nan") if t.is_floating_point() else -1)
    base = torch.full(
        [n + (128 if i == t.dim() - 1 else 1) for i, n in enumerate(t.shape)], fill, dtype=t.dtype
    )
    view = base.to(t.device)[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_flashmla_non_contiguous_inputs(fp8):
    """FlashMLA's tests pass queries, cache and block table as non-contiguous views (``non_contiguousify``): same
    results, bit for bit, as the contiguous inputs (queries, page and row strides padded; last dims contiguous)."""
    case = build([5, 0, 77, 40], heads=9, d_c=64, d_r=16, page_size=16, s_q=2, fp8=fp8, seed=11)
    ref = case.run(num_splits=2)
    views = Paged(
        non_contiguous(case.q_abs),
        non_contiguous(case.q_rope),
        non_contiguous(case.kv_cache),
        non_contiguous(case.block_table),
        case.seq_lens,
        case.head_to_rope,
        case.scale,
        case.fp8,
    )
    assert not views.kv_cache.is_contiguous() and not views.q_abs.is_contiguous()
    assert views.kv_cache.stride(1) == case.kv_cache.shape[2] + 128
    out, lse = views.run(num_splits=2)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    compare(views, out, lse, flashmla=FLASHMLA_SPARSE_OUT)


# ------------------------------------------------------------------------------------ FlashMLA: FP8 rows


@pytest.mark.parametrize("page_size,s_q", [(2, 1), (53, 3), (61, 1), (64, 3), (69, 3)])
def test_flashmla_fp8_rows_vs_dequantized_reference(page_size, s_q):
    """FlashMLA's sparse-decoding FP8 checks (block sizes 2, 53, 61, 64, 69; s_q 1 and 3; kernel vs a reference on
    the dequantized cache) on our FP8 rows with float32 queries, a 0xFF-poisoned pool (NaN in every part of an
    unused row) and FlashMLA's invalid indices in the spare table slots."""
    lengths = flashmla_lengths(4, s_q, 100, True, False, seed=page_size + s_q)
    case = build(
        lengths,
        heads=16,
        d_c=128,
        d_r=32,
        page_size=page_size,
        s_q=s_q,
        data="flashmla",
        fp8=True,
        sentinel=SENTINELS,
        seed=page_size,
    )
    assert case.kv_cache.dtype == torch.uint8
    out, lse = case.run(num_splits=2)
    compare(case, out, lse, flashmla=FLASHMLA_SPARSE_OUT)


def test_flashmla_fp8_v32_row_width_576():
    """FlashMLA's "V32" FP8 row (d = 576: 512 E4M3 bytes + 4 float32 scales of 128 values + 64 bfloat16) is our
    layout at 512 + 64: 656 bytes. 64-token blocks; float32 queries with H = 64 (s_q = 1), float16 queries with
    H = 16 (s_q = 3)."""
    lay = F8.layout(512, 64)
    assert (lay.group, lay.row_bytes) == (128, 512 + 4 * 4 + 2 * 64)
    for q_dtype, heads, s_q in ((torch.float32, 64, 1), (torch.float16, 16, 3)):
        case = build(
            [3, 70, 0],
            heads=heads,
            d_c=512,
            d_r=64,
            page_size=64,
            s_q=s_q,
            data="flashmla",
            fp8=True,
            q_dtype=q_dtype,
            seed=576,
        )
        assert case.fp8 == lay
        out, lse = case.run(num_splits=2)
        check(case, out, lse, flashmla=FLASHMLA_SPARSE_OUT)


@gpu_only("FlashMLA's FP8 sparse-decoding sizes (h_q 64/128, b 4/74, ~512-2046 tokens) with bfloat16 queries")
@pytest.mark.parametrize("page_size", [2, 53, 61, 64, 69])
@pytest.mark.parametrize("heads", [64, 128])
def test_flashmla_fp8_v32_full_gpu(heads, page_size):
    for s_q, b, s_k in [(s_q, b, s_k) for s_q in (1, 3) for b, s_k in ((4, 512), (74, 1024), (4, 2046))]:
        lengths = flashmla_lengths(b, s_q, s_k, True, False, seed=b)
        case = build(
            lengths,
            heads=heads,
            d_c=512,
            d_r=64,
            page_size=page_size,
            s_q=s_q,
            data="flashmla",
            fp8=True,
            q_dtype=BF16,
            sentinel=SENTINELS,
        )
        out, lse = case.run()
        check(case, out, lse, flashmla=FLASHMLA_SPARSE_OUT)


# ------------------------------------------------------------------------------------ the empty-row convention


@pytest.mark.parametrize("s_q,num_splits", [(1, 1), (2, 4)])
def test_empty_requests_give_zeros_and_minus_inf(s_q, num_splits):
    """FlashMLA's suite expects lse = +inf for a query with nothing to attend, FlashInfer's -inf; ours is -inf with
    exact zeros (never NaN), through the split merge too, mixed with requests that have rows."""
    case = build([0, 5, 0, 33], heads=9, d_c=64, d_r=16, page_size=16, s_q=s_q)
    out, lse = case.run(num_splits=num_splits)
    compare(case, out, lse)
    for b in (0, 2):
        assert bool(torch.isneginf(lse[b]).all()) and not bool(out[b].any())
    assert bool(torch.isfinite(lse[[1, 3]]).all())
    ref_out, ref_lse = case.reference()
    assert bool(torch.isneginf(ref_lse[[0, 2]]).all()) and not bool(ref_out[[0, 2]].any())
    everything_empty = build([0, 0], heads=9, d_c=64, d_r=16, page_size=16, s_q=s_q)
    out, lse = everything_empty.run(num_splits=num_splits)
    assert not bool(out.any()) and bool(torch.isneginf(lse).all())


# ------------------------------------------------------------------------------------ FlashInfer: paged attention

# (page_size, qo_len, d_c, d_R, dtype, kv_lens): FlashInfer's batch {1, 3, 5, 7, 157} x kv_len {0, 17, 33, 96, 97, 114, 514,
# 1024} x qo_len {1, 3, ..., 17} x page {1, 16}, float16, H = 16: here one mixed batch holding every kv_len up to
# 114 per item (FlashInfer skips causal qo_len > kv_len; a length-0 request stays)
FI_PAGE_LENS = [0, 17, 33, 96, 97, 114]
FI_PAGE_CPU = [
    (1, 1, 64, 16, F16, FI_PAGE_LENS),
    (1, 3, 64, 16, F16, FI_PAGE_LENS),
    (16, 1, 64, 16, F16, FI_PAGE_LENS),
    (16, 17, 64, 16, F16, [0, 17, 40]),
    (16, 3, 64, 16, F32, FI_PAGE_LENS),
    (16, 3, 512, 64, F16, [0, 33, 97]),
]


def run_fi_page(batch, kv_lens, page_size, qo_len, d_c, d_r, dtype, heads=16, seed=0):
    lengths = [n for n in kv_lens if n == 0 or n >= qo_len] * batch
    case = build(
        lengths,
        heads=heads,
        d_c=d_c,
        d_r=d_r,
        page_size=page_size,
        s_q=qo_len,
        dtype=dtype,
        pool="contiguous",
        sentinel=None,
        seed=seed,
    )
    out, lse = case.run()
    compare(case, out, lse, flashinfer=FLASHINFER_PAGE)


@pytest.mark.parametrize("page_size,qo_len,d_c,d_r,dtype,kv_lens", FI_PAGE_CPU)
def test_flashinfer_batch_mla_page_attention(page_size, qo_len, d_c, d_r, dtype, kv_lens):
    run_fi_page(1, kv_lens, page_size, qo_len, d_c, d_r, dtype, seed=page_size * 100 + qo_len)


@gpu_only("FlashInfer's full page-attention grid at 512 + 64 (batch up to 157, kv_len up to 1024)")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", [1, 3, 5, 7, 157])
def test_flashinfer_batch_mla_page_attention_full_gpu(batch, page_size):
    for qo_len in (1, 3, 5, 7, 9, 11, 13, 15, 17):
        for kv_len in FI_PAGE_LENS + [514, 1024]:
            if kv_len == 0 or kv_len >= qo_len:
                run_fi_page(batch, [kv_len], page_size, qo_len, 512, 64, F16, seed=kv_len)


# (kv_len_0, kv_len_1, kv_len_2, heads, qo_len): FlashInfer's {0, 1, 3, 11} x {17, 33, 79, 114} x {514, 2743, 8736}
# x qo_len {1, 3, ..., 17} x heads {16, 64}, page size 1, batch {1, 3, 5, 7} (a batch repeats the triple)
FI_VARLEN_CPU = [(0, 17, 514, 16, 1), (3, 79, 514, 64, 1), (11, 114, 514, 16, 3)]


def run_fi_varlen(batch, kv_lens, heads, qo_len, d_c, d_r, dtype, seed=0):
    lengths = [n if n == 0 or n >= qo_len else 0 for n in kv_lens] * batch
    case = build(
        lengths,
        heads=heads,
        d_c=d_c,
        d_r=d_r,
        page_size=1,
        s_q=qo_len,
        dtype=dtype,
        pool="contiguous",
        sentinel=None,
        seed=seed,
    )
    out, lse = case.run()
    compare(case, out, lse, flashinfer=FLASHINFER_VARLEN)


@pytest.mark.parametrize("k0,k1,k2,heads,qo_len", FI_VARLEN_CPU)
def test_flashinfer_batch_mla_varlen_page_attention(k0, k1, k2, heads, qo_len):
    run_fi_varlen(1, [k0, k1, k2], heads, qo_len, 64, 16, F16, seed=k0 + k1)


@gpu_only("FlashInfer's varlen grid at 512 + 64 with kv_len_2 up to 8736")
@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("batch", [1, 3, 5, 7])
def test_flashinfer_batch_mla_varlen_page_attention_full_gpu(batch, heads):
    for k2 in (514, 2743, 8736):
        for qo_len in (1, 3, 5, 7, 9, 11, 13, 15, 17):
            for k0, k1 in zip((0, 1, 3, 11), (17, 33, 79, 114), strict=True):
                run_fi_varlen(batch, [k0, k1, k2], heads, qo_len, 512, 64, F16, seed=k0)


# (batch, kv_len, qo_len, page_size): FlashInfer's batch {1..7, 157} x kv_len {17, 33, 75, 197} x qo_len {3, 7, 17}
# x page {16, 32}
FI_OOB_CPU = [(3, 17, 3, 16), (2, 75, 7, 32), (1, 197, 17, 16), (2, 33, 3, 32)]


@pytest.mark.parametrize("batch,kv_len,qo_len,page_size", FI_OOB_CPU)
def test_flashinfer_oob_kv_nan(batch, kv_len, qo_len, page_size):
    """FlashInfer's ``test_batch_mla_oob_kv_nan``: pages in order, NaN in the tail of each request's last page;
    the output must be finite and match."""
    case = build(
        [kv_len] * batch,
        heads=16,
        d_c=64,
        d_r=16,
        page_size=page_size,
        s_q=qo_len,
        dtype=F16,
        pool="contiguous",
        sentinel=None,
        seed=kv_len,
    )
    tail = kv_len % page_size
    if tail:
        last = case.kv_cache[case.block_table[0, cdiv(kv_len, page_size) - 1]]
        assert bool(last[tail:].isnan().all()) and not bool(last[:tail].isnan().any())
    out, lse = case.run()
    compare(case, out, lse, flashinfer=FLASHINFER_PAGE)


@gpu_only("FlashInfer's out-of-bounds NaN grid at 512 + 64 (batch up to 157)")
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 6, 7, 157])
def test_flashinfer_oob_kv_nan_full_gpu(batch):
    for page_size, qo_len, kv_len in [
        (p, q, n) for p in (16, 32) for q in (3, 7, 17) for n in (17, 33, 75, 197)
    ]:
        if kv_len >= qo_len:
            run_fi_page(batch, [kv_len], page_size, qo_len, 512, 64, F16, seed=kv_len)


# ------------------------------------------------------------------------------------ page ids past 2^31 elements


def huge_offset_case(fp8: bool) -> tuple[Paged, Paged, torch.Tensor]:
    """FlashInfer's ``test_mla_page_index_uint32_overflow_regression`` for our cache: requests whose pages start
    just below and past element offset 2^31, past 2^32, and near the start (0xFF / NaN tails poisoned), in one
    pool of ``2^32 + ...`` elements behind a 2^31-element lead (so that a 32-bit wrap, signed or not, reads mapped
    memory and gives a wrong answer rather than a crash). Returns the huge case, the same rows on a compact pool,
    and the storage (keep it alive while the case is used).

    Only the written pages are committed: ``torch.empty`` reserves address space, so on the CPU this costs a few
    MB of memory for 6 GB (FP8) or 12 GB (float16) of addresses.
    """
    page_size, heads, d_c, d_r = 32, 16, 48, 16
    if fp8:
        skip_without_e4m3()
        lay = F8.layout(d_c, d_r)
        stride, dtype = 128, torch.uint8  # rows padded to 128 bytes: 4096 bytes (2^12 elements) a page
        assert lay.row_bytes <= stride
    else:
        lay, stride, dtype = None, d_c + d_r, torch.float16  # 64 elements a row: 2^11 elements a page
    per_page = page_size * stride
    lead = 2**31
    at31, at32 = 2**31 // per_page, 2**32 // per_page
    pages = [[at31 - 1, at31, at31 + 1], [at32 - 1, at32 + 2, at32, at32 + 5], [3, 0]]
    lengths = [3 * page_size - 5, 4 * page_size - 1, 2 * page_size]
    num_pages = at32 + 6
    need = (lead + num_pages * per_page) * torch.tensor([], dtype=dtype).element_size()
    if CUDA and torch.cuda.mem_get_info()[0] < need + (2 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory for page ids past 2^32 elements")
    try:
        storage = torch.empty(lead + num_pages * per_page, dtype=dtype, device=DEVICE)
    except RuntimeError as err:  # pragma: no cover - depends on the host's overcommit policy
        pytest.skip(f"cannot reserve {need / 2**30:.1f} GiB of address space: {err}")
    pool = storage[lead:].view(num_pages, page_size, stride)

    gen = torch.Generator().manual_seed(31 + fp8)
    compact_rows = torch.randn(sum(map(len, pages)), page_size, d_c + d_r, generator=gen)
    if fp8:
        compact = F8.quantize_rows(compact_rows, lay)
        compact = torch.cat(
            [compact, torch.full((*compact.shape[:2], stride - compact.shape[2]), 0xFF, dtype=dtype)], -1
        )
    else:
        compact = compact_rows.to(dtype)
    poison = 0xFF if fp8 else float("nan")
    compact_table = torch.zeros(3, 4, dtype=torch.int32)
    table = torch.zeros(3, 4, dtype=torch.int32)
    k = 0
    for b, (ids, n) in enumerate(zip(pages, lengths, strict=True)):
        for j, page in enumerate(ids):
            valid = min(page_size, n - j * page_size)
            compact[k, valid:] = poison
            pool[page] = compact[k].to(DEVICE)
            table[b, j], compact_table[b, j] = page, k
            k += 1
    q_abs = torch.randn(3, 1, heads, d_c, generator=gen)
    q_rope = torch.randn(3, 1, heads, d_r, generator=gen)
    q_dtype = torch.float32 if fp8 else dtype
    common = dict(
        q_abs=q_abs.to(q_dtype).to(DEVICE),
        q_rope=q_rope.to(q_dtype).to(DEVICE),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        head_to_rope=torch.zeros(heads, dtype=torch.int32, device=DEVICE),
        scale=1 / math.sqrt(d_c / 4 + d_r),
        fp8=lay,
    )
    width = lay.row_bytes if fp8 else d_c + d_r
    huge = Paged(kv_cache=pool[..., :width], block_table=table.to(DEVICE), **common)
    small = Paged(kv_cache=compact.to(DEVICE)[..., :width], block_table=compact_table.to(DEVICE), **common)
    offsets = [p * per_page for p in table.flatten().tolist()]
    assert max(offsets) >= 2**32 and any(2**31 <= o < 2**32 for o in offsets)
    return huge, small, storage


@pytest.mark.parametrize("fp8", [False, True], ids=["fp16", "fp8"])
def test_page_ids_past_int32_element_offsets(fp8):
    """Page id x page stride past 2^31 and 2^32 elements must be computed in 64 bits: the same rows at huge and at
    small page ids give bit-identical results (FlashInfer's regression test compares them within 1e-3), and both
    match the oracle."""
    huge, small, storage = huge_offset_case(fp8)
    out, lse = huge.run(num_splits=2)
    ref = small.run(num_splits=2)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    compare(small, *ref, flashinfer=FLASHINFER_PAGE)
    if (
        not fp8
    ):  # the oracle gathers only the pages it reads; FP8 dequantizes the whole pool, so it reads small
        compare(huge, out, lse)
    del huge, storage


@gpu_only(
    "FlashInfer's uint32-overflow regression at full size (page 32, 512 + 64, H = 128: ~10 GB of cache)"
)
def test_flashinfer_uint32_overflow_full_size_gpu():
    page_size, d_c, d_r, heads, start, n_pages = 32, 512, 64, 128, 262144, 26
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    gen = torch.Generator().manual_seed(0)
    real = torch.randn(n_pages, page_size, d_c + d_r, generator=gen).to(BF16).to(DEVICE)
    big = torch.zeros(start + n_pages, page_size, d_c + d_r, dtype=BF16, device=DEVICE)
    big[start:] = real
    common = dict(
        q_abs=torch.randn(1, 1, heads, d_c, generator=gen).to(BF16).to(DEVICE),
        q_rope=torch.randn(1, 1, heads, d_r, generator=gen).to(BF16).to(DEVICE),
        seq_lens=torch.tensor([n_pages * page_size], dtype=torch.int32, device=DEVICE),
        head_to_rope=torch.zeros(heads, dtype=torch.int32, device=DEVICE),
        scale=1 / math.sqrt(128 + 64),
    )
    huge_table = torch.arange(start, start + n_pages, dtype=torch.int32, device=DEVICE)[None]
    small_table = torch.arange(n_pages, dtype=torch.int32, device=DEVICE)[None]
    out, lse = Paged(kv_cache=big, block_table=huge_table, **common).run()
    del big
    small = Paged(kv_cache=real, block_table=small_table, **common)
    ref = small.run()
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    compare(small, out, lse, flashinfer=FLASHINFER_PAGE)


# ------------------------------------------------------------------------------------ FlashInfer: FP8 tests


@pytest.mark.parametrize("batch,kv_len,qo_len,page_size,heads", [(4, 256, 1, 16, 16), (1, 64, 16, 64, 16)])
def test_flashinfer_fp8_kv_matches_16bit_path(batch, kv_len, qo_len, page_size, heads):
    """FlashInfer's ``test_batch_mla_fp8_kv_matches_bf16_reference`` (data x 0.1; batch {1, 4, 16} x kv_len {256,
    1024, 4096} x qo_len {1, 16} x page {16, 64} x heads {16, 128}, reduced): the FP8 path with float16 queries
    against the float16-cache path on the dequantized rows, max abs difference < 1.5e-2 (theirs), and both against
    the oracle."""
    case = build(
        [kv_len] * batch,
        heads=heads,
        d_c=64,
        d_r=16,
        page_size=page_size,
        s_q=qo_len,
        fp8=True,
        q_dtype=F16,
        pool="contiguous",
        scale=1 / math.sqrt(64 + 16),
        seed=kv_len,
    )
    case.q_abs, case.q_rope = case.q_abs * 0.1, case.q_rope * 0.1
    out, lse = case.run()
    compare(case, out, lse)
    plain = _as_16bit_cache(case, F16)
    out16, lse16 = plain.run()
    compare(plain, out16, lse16)
    diff = float((out.float() - out16.float()).abs().max())
    assert diff < 1.5e-2
    assert diff <= 2 * OUT_TOL[F16] * float(
        out16.float().abs().max()
    )  # ours: the same values, fp16 rounding apart


@pytest.mark.parametrize("ckv_mag", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("kpe_mag", [0.01, 0.1, 1.0])
def test_flashinfer_fp8_scale_sensitivity(ckv_mag, kpe_mag):
    """FlashInfer's ``test_batch_mla_fp8_kv_scale_sensitivity``: latent and rope parts at magnitudes 0.01..1 (queries
    scaled by 0.1 / max magnitude), batch 2, page 64, scales derived as amax / 448 -- ours per group: the kernel
    against the oracle on the dequantized rows (ours: 1e-5 relative) and against the float32-cache path (theirs:
    5e-2 absolute)."""
    gen = torch.Generator().manual_seed(7)
    case = build([64, 64], heads=16, d_c=64, d_r=64, page_size=64, fp8=True, pool="contiguous", seed=7)
    rows = torch.cat(
        [torch.randn(2, 64, 64, generator=gen) * ckv_mag, torch.randn(2, 64, 64, generator=gen) * kpe_mag], -1
    )
    spare = torch.zeros(1, 64, rows.shape[-1])
    case.kv_cache = F8.quantize_rows(torch.cat([rows, spare]), case.fp8).to(DEVICE)
    q_scale = 0.1 / max(ckv_mag, kpe_mag)
    case.q_abs = (torch.randn(2, 1, 16, 64, generator=gen) * q_scale).to(DEVICE)
    case.q_rope = (torch.randn(2, 1, 16, 64, generator=gen) * q_scale).to(DEVICE)
    case.scale = 1 / math.sqrt(64 + 64)
    out, lse = case.run()
    compare(case, out, lse)
    plain = _as_16bit_cache(case, F32)
    out32, _ = plain.run()
    assert float((out - out32).abs().max()) < 5e-2
    assert float((out - out32).abs().max()) <= OUT_TOL[F32] * float(out32.abs().max())


def test_flashinfer_fp8_zero_kv_gives_zero_output():
    """FlashInfer's ``test_batch_mla_fp8_kv_zero_kv_gives_zero_output`` (batch 2, 256 tokens, H = 128 cut to 16,
    page 64): all-zero rows give an exactly zero output, and every score is 0, so lse = log(n)."""
    case = build([256, 256], heads=16, d_c=64, d_r=64, page_size=64, fp8=True, pool="contiguous")
    zero = torch.zeros(case.kv_cache.shape[0], 64, 128)
    case.kv_cache = F8.quantize_rows(zero, case.fp8).to(DEVICE)
    case.q_abs, case.q_rope = case.q_abs * 0.1, case.q_rope * 0.1
    out, lse = case.run(num_splits=3)
    assert not bool(out.any())
    assert torch.allclose(lse, torch.full_like(lse, math.log(256)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_flashinfer_kpe_dominant_rows_do_not_alias(fp8):
    """FlashInfer's ``test_fp8_kv_kpe_dominant_no_row_aliasing``: q_abs = 0, q_rope = 1 (d_R = 64), rope row 4 all +1
    and row 8 all -1, their latent rows +100 / -100 in the first value, scale 1: the softmax picks row 4, so the
    first output value is ~+100 (> 50, theirs); an aliasing of rope rows 4 and 8 would flip it."""
    heads, d_c, d_r, n = 16, 512, 64, 64
    case = build([n], heads=heads, d_c=d_c, d_r=d_r, page_size=64, fp8=fp8, pool="contiguous", scale=1.0)
    rows = torch.zeros(case.kv_cache.shape[0], 64, d_c + d_r)
    rows[0, 4, d_c:], rows[0, 8, d_c:] = 1.0, -1.0
    rows[0, 4, 0], rows[0, 8, 0] = 100.0, -100.0
    case.kv_cache = (F8.quantize_rows(rows, case.fp8) if fp8 else rows).to(DEVICE)
    case.q_abs = torch.zeros_like(case.q_abs)
    case.q_rope = torch.ones_like(case.q_rope)
    out, lse = case.run()
    compare(case, out, lse)
    assert float(out[..., 0].min()) > 50.0
    expected = 100 * (1 - math.exp(-128)) / (1 + math.exp(-64) * (n - 2) + math.exp(-128))
    assert torch.allclose(
        out[..., 0].double(), torch.full_like(out[..., 0].double(), expected), rtol=1e-6, atol=0
    )
    assert torch.allclose(lse.double(), torch.full_like(lse.double(), 64.0), rtol=0, atol=1e-5)


@gpu_only("FlashInfer's FP8 vs bfloat16 matrix at 512 + 64 (kv_len up to 4096, H up to 128)")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_flashinfer_fp8_kv_matches_bf16_path_full_gpu(batch, heads):
    for kv_len, qo_len, page_size in [
        (n, q, p) for n in (256, 1024, 4096) for q in (1, 16) for p in (16, 64)
    ]:
        case = build(
            [kv_len] * batch,
            heads=heads,
            d_c=512,
            d_r=64,
            page_size=page_size,
            s_q=qo_len,
            fp8=True,
            q_dtype=BF16,
            pool="contiguous",
            scale=1 / math.sqrt(512 + 64),
            seed=kv_len,
        )
        case.q_abs, case.q_rope = case.q_abs * 0.1, case.q_rope * 0.1
        out, lse = case.run()
        check(case, out, lse)
        out16, _ = _as_16bit_cache(case, BF16).run()
        assert float((out.float() - out16.float()).abs().max()) < 1.5e-2


# ------------------------------------------------------------------------------------ FlashInfer: absorption, cosine


def test_flashinfer_absorbed_decode_cosine():
    """FlashInfer's ``test_mla_decode_kernel`` (bsz 6, kv_len 640, page 16; DeepSeek-V2 projections): attention on
    the unabsorbed keys/values (k_nope = W_UK c, v = W_UV c per head) against our kernel on absorbed queries
    ``q_abs = W_UK^T q_nope`` followed by ``W_UV``; cosine similarity > 0.99 and WMAPE < 0.02 (theirs), 1e-5
    relative (ours). Reduced: bsz 2, kv_len 160, H = 16, d_c = 64, nope 32, v 32, rope 16."""
    bsz, kv_len, page, heads, d_c, d_n, d_v, d_r = 2, 160, 16, 16, 64, 32, 32, 16
    gen = torch.Generator().manual_seed(666)
    w_uk = torch.randn(heads, d_n, d_c, generator=gen, dtype=torch.float64) / math.sqrt(d_c)
    w_uv = torch.randn(heads, d_v, d_c, generator=gen, dtype=torch.float64) / math.sqrt(d_c)
    q_nope = torch.randn(bsz, heads, d_n, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(bsz, heads, d_r, generator=gen, dtype=torch.float64)
    c_kv = torch.randn(bsz, kv_len, d_c, generator=gen, dtype=torch.float64)
    k_pe = torch.randn(bsz, kv_len, d_r, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(d_n + d_r)
    # unabsorbed ("vanilla") attention, float64
    k_nope = torch.einsum("hnc,btc->bhtn", w_uk, c_kv)
    v = torch.einsum("hvc,btc->bhtv", w_uv, c_kv)
    scores = (
        torch.einsum("bhn,bhtn->bht", q_nope, k_nope) + torch.einsum("bhr,btr->bht", q_pe, k_pe)
    ) * scale
    vanilla = torch.einsum("bht,bhtv->bhv", scores.softmax(-1), v)
    # absorbed, through the paged kernel (pages in order)
    pages = kv_len // page
    cache = torch.cat([c_kv, k_pe], -1).reshape(bsz * pages, page, d_c + d_r).float()
    case = Paged(
        torch.einsum("hnc,bhn->bhc", w_uk, q_nope).float()[:, None].to(DEVICE),
        q_pe.float()[:, None].to(DEVICE),
        cache.to(DEVICE),
        torch.arange(bsz * pages, dtype=torch.int32).view(bsz, pages).to(DEVICE),
        torch.full((bsz,), kv_len, dtype=torch.int32).to(DEVICE),
        torch.zeros(heads, dtype=torch.int32).to(DEVICE),
        scale,
    )
    latent, lse = case.run(num_splits=2)
    compare(case, latent, lse)
    absorbed = torch.einsum("hvc,bhc->bhv", w_uv, latent[:, 0].double().cpu())
    a, r = absorbed.flatten(), vanilla.flatten()
    assert float(F.cosine_similarity(r, a, dim=0)) > 0.99
    assert float((r - a).abs().sum() / r.abs().sum()) < 0.02  # WMAPE
    assert float((a - r).abs().max() / r.abs().max()) < 1e-5
    assert abs(cos_diff(a, r)) <= FLASHMLA_DENSE_OUT["cos_diff_tol"]


# ------------------------------------------------------------------------------------ FlashInfer: head counts

# (heads, s_q, fp8): trtllm-gen's non-power-of-two heads {3, 6, 9, 12, 17, 24, 33, 48, 63} (bf16 and FP8) and
# cute-dsl's packed queries heads {12, 24, 48, 96} x q_len {1, 2, 4, 8}: rows s_q x H tile 16 at a time
HEADS_CPU = [
    (6, 1, False),
    (6, 8, False),
    (12, 2, False),
    (24, 2, False),
    (48, 1, False),
    (17, 2, False),
    (33, 1, True),
    (9, 4, True),
]


@pytest.mark.parametrize(
    "heads,s_q,fp8", HEADS_CPU, ids=[f"h{h}-sq{s}{'-fp8' if f else ''}" for h, s, f in HEADS_CPU]
)
def test_non_power_of_two_heads_packed_queries(heads, s_q, fp8):
    """Head counts that do not divide the kernel's 16-row blocks, with several query tokens packed into a block."""
    case = build(
        [s_q + 20, 130, 0],
        heads=heads,
        d_c=64,
        d_r=16,
        rope_heads=3,
        page_size=32,
        s_q=s_q,
        fp8=fp8,
        seed=heads,
    )
    out, lse = case.run(num_splits=2)
    compare(case, out, lse, flashinfer={"rtol": 1e-2, "atol": 1e-2})


@gpu_only(
    "FlashInfer's trtllm-gen and cute-dsl head matrices at 512 + 64 in bfloat16 and FP8 (batch up to 128)"
)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [3, 6, 9, 12, 17, 24, 33, 48, 63, 96, 192])
def test_head_matrix_full_gpu(heads, fp8):
    for q_len, batch, kv_len in [
        (q, b, n) for q in (1, 2, 4, 8) for b, n in ((1, 1024), (4, 128), (16, 1024), (128, 1024))
    ]:
        case = build(
            [kv_len] * batch,
            heads=heads,
            d_c=512,
            d_r=64,
            page_size=64,
            s_q=q_len,
            dtype=BF16,
            fp8=fp8,
            q_dtype=BF16,
            seed=heads,
        )
        out, lse = case.run()
        check(case, out, lse, flashinfer={"rtol": 1e-2, "atol": 1e-2})


# ------------------------------------------------------------------------------------ long contexts (GPU)


@gpu_only("H = 128 at d_c = 512 over long contexts (32k tokens; 16 x 4k) in bfloat16 and FP8, default splits")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "lengths", [[32768], [4096] * 16, [1, 32768, 0, 4097]], ids=["1x32k", "16x4k", "mixed"]
)
def test_long_context_h128_gpu(lengths, fp8):
    case = build(
        lengths, heads=128, d_c=512, d_r=64, page_size=64, dtype=BF16, fp8=fp8, q_dtype=BF16, data="flashmla"
    )
    out, lse = case.run()
    check(case, out, lse, flashmla=FLASHMLA_SPARSE_OUT if fp8 else FLASHMLA_DENSE_OUT)
