"""The paged latent cache: page bookkeeping, NaN-filled free slots, byte ledger, and greedy decoding of
a tiny random MLA model through it on the Triton kernel (interpreter on CPU) and the absorbed torch path.

End-to-end tolerance: ``E2E_TOL = 1e-4`` relative (``max|a - b| / max|b|``) on float32 logits. The three
computations (Triton kernel decode, absorbed torch decode, full recomputation without a cache) do the same
float32 math in different orders -- per-token vs batched projections, tiled online softmax vs one
softmax -- through two layers and the LM head; measured differences are ~1e-6, and any addressing,
position or scale mistake moves the logits by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton is imported)
from mla_convert.kernels import kernel_backend
from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.modeling import MLAForCausalLM
from mla_convert.runtime.decode import generate
from mla_convert.runtime.paged_cache import CacheError, PagedLatentCache

E2E_TOL = 1e-4
#: the model runs where the kernel runs natively: CUDA when present, else CPU (Triton interpreter)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROW_TOL = 1e-5

# ------------------------------------------------------------------------------------ bookkeeping


def _rows(n: int, width: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, n, width, generator=torch.Generator().manual_seed(seed))


def _used_slots(cache: PagedLatentCache) -> torch.Tensor:
    """``[num_pages, page_size]`` bool: slots holding a committed row of some request."""
    used = torch.zeros(cache.num_pages, cache.page_size, dtype=torch.bool)
    for rid, table in cache.tables.items():
        pos = torch.arange(cache.lengths[rid])
        used[torch.tensor(table, dtype=torch.long)[pos // cache.page_size], pos % cache.page_size] = True
    return used


def test_fresh_pages_are_nan():
    cache = PagedLatentCache([40, 56], page_size=4, num_pages=6)
    assert [tuple(p.shape) for p in cache.pages] == [(6, 4, 40), (6, 4, 56)]
    assert all(p.isnan().all() for p in cache.pages)
    assert all(p.dtype == torch.float32 for p in cache.pages)
    half = PagedLatentCache([8], page_size=2, num_pages=2, dtype=torch.float16)
    assert half.pages[0].dtype == torch.float16 and half.pages[0].isnan().all()


@pytest.mark.parametrize("page_size,num_pages", [(0, 4), (129, 4), (4, 0)])
def test_bad_layout_raises(page_size, num_pages):
    with pytest.raises(CacheError):
        PagedLatentCache([8], page_size=page_size, num_pages=num_pages)
    assert issubclass(CacheError, ValueError)


def test_reserve_write_commit():
    """Written rows stay invisible to ``seq_lens`` (and ``rows``) until ``commit``."""
    cache = PagedLatentCache([6, 10], page_size=4, num_pages=8, shuffle_pages=True)
    a, b = cache.add_request(), cache.add_request()
    cache.bind([a, b])
    assert cache.seq_lens().tolist() == [0, 0]
    cache.reserve(5)
    assert [len(cache.tables[r]) for r in (a, b)] == [2, 2]
    new = [_rows(5, w, seed=i, batch=2) for i, w in enumerate(cache.row_widths)]
    for layer, rows in enumerate(new):
        cache.write(layer, rows)
    assert cache.seq_lens().tolist() == [0, 0]
    assert cache.seq_lens(pending=5).tolist() == [5, 5]
    assert cache.rows(0, a).shape == (0, 6)
    assert torch.equal(cache.rows(1, b, 5), new[1][1])  # readable explicitly (the decode step's view)
    cache.commit(5)
    assert cache.seq_lens().tolist() == [5, 5]
    assert cache.seq_lens().dtype == torch.int32
    for layer, rows in enumerate(new):
        assert torch.equal(cache.rows(layer, a), rows[0])
        assert torch.equal(cache.rows(layer, b), rows[1])
        assert torch.equal(cache.gather(layer, 5), rows)
    # the next step appends after the committed rows; only bound requests advance
    cache.bind([b])
    cache.reserve(4)  # 9 rows: a third page for b only
    assert [len(cache.tables[r]) for r in (a, b)] == [2, 3]
    extra = _rows(4, 6, seed=9)
    cache.write(0, extra)
    cache.commit(4)
    assert cache.lengths == {a: 5, b: 9}
    assert torch.equal(cache.rows(0, b), torch.cat([new[0][1], extra[0]]))
    # committed slots hold finite rows, every other slot is still NaN
    used = _used_slots(cache)
    assert cache.pages[0][used].isfinite().all() and cache.pages[0][~used].isnan().all()


def test_write_errors():
    cache = PagedLatentCache([6], page_size=4, num_pages=4)
    rid = cache.add_request()
    cache.bind([rid])
    with pytest.raises(CacheError, match="reserve"):
        cache.write(0, _rows(1, 6))  # no page reserved
    cache.reserve(3)
    with pytest.raises(CacheError, match="reserve"):
        cache.write(0, _rows(5, 6))  # more rows than reserved pages hold
    with pytest.raises(CacheError, match="row width"):
        cache.write(0, _rows(3, 7))
    with pytest.raises(CacheError, match="bound requests"):
        cache.write(0, _rows(3, 6, batch=2))
    with pytest.raises(CacheError, match="unknown request"):
        cache.bind([rid, 42])
    with pytest.raises(CacheError, match="unknown request"):
        cache.release(42)
    assert cache.pages[0].isnan().all()  # no failed write left anything behind


def test_block_table_matches_rows():
    """Reading pages through ``block_table()`` (as the kernel does) gives exactly ``rows()``."""
    ps = 4
    cache = PagedLatentCache([5, 7], page_size=ps, num_pages=16, shuffle_pages=True, seed=3)
    rids = [cache.add_request() for _ in range(3)]
    for rid, n in zip(rids, [9, 1, 14], strict=True):  # different lengths, allocated interleaved
        cache.bind([rid])
        cache.reserve(n)
        for layer, w in enumerate(cache.row_widths):
            cache.write(layer, _rows(n, w, seed=rid * 10 + layer))
        cache.commit(n)
    cache.bind([rids[2], rids[0], rids[1]])
    table = cache.block_table()
    assert table.dtype == torch.int32 and table.shape == (3, 4)
    assert table[2, 1:].eq(0).all()  # unused entries are 0
    lens = cache.seq_lens()
    assert lens.tolist() == [14, 9, 1]
    all_pages = [p for rid in rids for p in cache.tables[rid]]
    assert len(set(all_pages)) == len(all_pages)  # no page is shared
    assert all_pages != sorted(all_pages)  # shuffled: addressing must go through the table
    for layer in range(2):
        for i, rid in enumerate(cache.active):
            pos = torch.arange(int(lens[i]))
            via_table = cache.pages[layer][table[i].long()[pos // ps], pos % ps]
            assert torch.equal(via_table, cache.rows(layer, rid))
            assert via_table.isfinite().all()


def test_shuffle_is_seeded():
    def first_pages(shuffle: bool, seed: int) -> list[int]:
        cache = PagedLatentCache([4], page_size=2, num_pages=32, shuffle_pages=shuffle, seed=seed)
        cache.bind([cache.add_request()])
        cache.reserve(64)
        return cache.tables[0]

    assert first_pages(False, 0) == list(range(32))
    assert first_pages(True, 0) == first_pages(True, 0)
    assert first_pages(True, 0) != first_pages(True, 1)
    assert sorted(first_pages(True, 1)) == list(range(32))


def test_out_of_pages_allocates_nothing():
    cache = PagedLatentCache([8], page_size=4, num_pages=5)
    a, b = cache.add_request(), cache.add_request()
    cache.bind([a])
    cache.reserve(8)  # 2 pages, 3 left
    cache.commit(8)
    before_tables = {r: list(t) for r, t in cache.tables.items()}
    before_ledger = cache.ledger()
    cache.bind([a, b])
    with pytest.raises(CacheError, match="out of pages"):
        cache.reserve(6)  # a needs 2 more, b needs 2: 4 > 3 free
    assert cache.tables == before_tables
    assert cache.ledger() == before_ledger
    cache.reserve(4)  # a needs 1, b needs 1: fits exactly in what is still free
    assert [len(cache.tables[r]) for r in (a, b)] == [3, 1]
    cache.bind([b])
    cache.reserve(8)  # b: 2 pages in all, 1 more -> the last free page
    with pytest.raises(CacheError, match="out of pages"):
        cache.reserve(9)


def test_release_returns_pages_and_resets_to_nan():
    cache = PagedLatentCache([6, 3], page_size=2, num_pages=4, shuffle_pages=True)
    a, b = cache.add_request(), cache.add_request()
    cache.bind([a, b])
    cache.reserve(4)  # all 4 pages
    for layer, w in enumerate(cache.row_widths):
        cache.write(layer, _rows(4, w, seed=layer, batch=2))
    cache.commit(4)
    pages_a = list(cache.tables[a])
    with pytest.raises(CacheError, match="out of pages"):
        cache.reserve(1)
    cache.release(a)
    assert a not in cache.tables and a not in cache.lengths
    for page_rows in cache.pages:
        assert page_rows[pages_a].isnan().all()
        assert page_rows[cache.tables[b]].isfinite().all()  # the other request is untouched
    assert cache.ledger()["tokens"] == 4
    c = cache.add_request()
    cache.bind([c])
    cache.reserve(4)  # the released pages are handed out again
    assert sorted(cache.tables[c]) == sorted(pages_a)
    assert all(cache.pages[0][p].isnan().all() for p in cache.tables[c])


@pytest.mark.parametrize("dtype,elem", [(torch.float32, 4), (torch.float16, 2)])
def test_ledger_bytes(dtype, elem):
    widths, ps = [40, 56, 33], 4
    cache = PagedLatentCache(widths, page_size=ps, num_pages=10, dtype=dtype)
    empty = cache.ledger()
    assert empty["tokens"] == 0 and empty["payload_bytes"] == 0 and empty["allocated_bytes"] == 0
    strides = [48, 64, 48]  # rows padded to 16 elements: aligned vector loads for the kernel
    assert empty["row_strides"] == strides and empty["row_widths"] == widths
    assert empty["capacity_bytes"] == 10 * ps * sum(strides) * elem
    a, b = cache.add_request(), cache.add_request()
    for rid, n in ((a, 5), (b, 9)):
        cache.bind([rid])
        cache.reserve(n)
        for layer, w in enumerate(widths):
            cache.write(layer, _rows(n, w))
        cache.commit(n)
    led = cache.ledger()
    tokens, pages = 5 + 9, 2 + 3
    assert led["tokens"] == tokens and led["layers"] == 3 and led["page_size"] == ps
    assert led["dtype"] == str(dtype).removeprefix("torch.")
    assert led["payload_bytes"] == tokens * sum(widths) * elem
    # memory of the pages in use: the last pages' tails and the row padding included, the padding stated
    assert led["allocated_bytes"] == pages * ps * sum(strides) * elem
    assert led["row_padding_bytes"] == pages * ps * (sum(strides) - sum(widths)) * elem
    assert led["allocated_bytes"] > led["payload_bytes"]
    assert led["capacity_bytes"] == empty["capacity_bytes"]
    assert led["payload_bytes_per_token_per_layer"] == pytest.approx(sum(widths) * elem / 3)
    assert led["allocated_bytes_per_token_per_layer"] == pytest.approx(
        pages * ps * sum(strides) * elem / (tokens * 3)
    )
    # reserved but uncommitted rows cost pages, not payload
    cache.bind([a])
    cache.reserve(4)  # 9 rows -> a third page for a
    led2 = cache.ledger()
    assert led2["payload_bytes"] == led["payload_bytes"]
    assert led2["allocated_bytes"] == (pages + 1) * ps * sum(strides) * elem


# ------------------------------------------------------------------------------------ a tiny MLA model

N_PAIRS = 4


def tiny_mla() -> MLAForCausalLM:
    """2 layers, 6 query heads, 2 KV heads, 2 rope heads of 4 pairs, per-layer latent widths 24 and 40
    (not powers of two), latent norm and biases; random weights large enough for peaked attention."""
    layers, rope_heads = 2, 2
    inv_freq = [
        [
            [(1 + 0.3 * r + 0.1 * layer) * 10000.0 ** (-p / N_PAIRS) for p in range(N_PAIRS)]
            for r in range(rope_heads)
        ]
        for layer in range(layers)
    ]
    config = MLAConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        kv_lora_rank=[24, 40],
        qk_rope_head_dim=2 * N_PAIRS,
        qk_nope_head_dim=8,
        v_head_dim=16,
        num_rope_heads=rope_heads,
        rope_inv_freq=inv_freq,
        softmax_scale=1 / math.sqrt(16),  # the source's 1/sqrt(head_dim), not 1/sqrt(d_c + d_R)
        latent_norm=True,
        q_bias=True,
        kv_a_bias=True,
        o_bias=True,
        initializer_range=0.25,
    )
    torch.manual_seed(0)
    model = MLAForCausalLM(config).eval().to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture(scope="module")
def model() -> MLAForCausalLM:
    return tiny_mla()


PROMPT_LEN, NEW = 7, 6


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 97, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1)).to(DEVICE)


@pytest.fixture(scope="module")
def runs(model, prompt):
    triton = generate(model, prompt, NEW, backend="triton", page_size=4, shuffle_pages=True)
    absorbed = generate(model, prompt, NEW, backend="absorbed", page_size=4, shuffle_pages=True)
    return triton, absorbed


def test_triton_absorbed_and_recomputation_agree(model, runs):
    triton, absorbed = runs
    assert triton.tokens.shape == (2, PROMPT_LEN + NEW)
    assert torch.equal(triton.tokens, absorbed.tokens)
    assert triton.tokens[:, PROMPT_LEN:].unique().numel() > 1  # not a degenerate constant output
    model.set_attention_path("absorbed")
    with torch.no_grad():
        full = model(input_ids=triton.tokens[:, :-1], use_cache=False).logits[:, PROMPT_LEN - 1 :].float()
    assert triton.step_logits.shape == full.shape == (2, NEW, 97)
    assert rel(triton.step_logits, full) < E2E_TOL
    assert rel(absorbed.step_logits, full) < E2E_TOL
    assert rel(triton.step_logits, absorbed.step_logits) < E2E_TOL
    # the greedy choice is the argmax of the recomputed logits
    assert torch.equal(full.argmax(-1), triton.tokens[:, PROMPT_LEN:])


def test_backend_log_proves_the_kernel_ran(model, runs):
    triton, absorbed = runs
    layers = model.config.num_hidden_layers
    kernel_key = f"{kernel_backend()}:decode"
    assert kernel_backend() == ("triton-cuda" if torch.cuda.is_available() else "triton-interpreter")
    # the prompt is prefilled on the kernel too (s_q = prompt length, causal inside the block)
    assert triton.backend_log == {kernel_key: layers * (NEW - 1), f"{kernel_backend()}:prefill": layers}
    assert "absorbed-torch:decode" not in triton.backend_log
    assert absorbed.backend_log == {
        "absorbed-torch:decode": layers * (NEW - 1),
        "absorbed-torch:prefill": layers,
    }
    assert len(triton.step_seconds) == NEW - 1
    assert model.config.attn_implementation_mla == "absorbed"  # generate restores the path


def test_cache_rows_equal_recomputed_latents(model, runs):
    """Every committed row is ``[c_kv | rotated k_rope]`` of its token at its absolute position; every
    other slot of the (shuffled) pages is still NaN."""
    triton, _ = runs
    cache = triton.cache
    seen = triton.tokens[:, :-1]  # the last generated token is never fed back
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, i=i: inputs.__setitem__(i, (args[0].detach(), args[1]))
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        model.set_attention_path("absorbed")
        with torch.no_grad():
            model(input_ids=seen, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    assert cache.lengths == {0: seen.shape[1], 1: seen.shape[1]}
    assert cache.row_widths == model.config.cache_width == [24 + 16, 40 + 16]
    for i, layer in enumerate(model.model.layers):
        x, position_ids = inputs[i]
        assert torch.equal(position_ids[0], torch.arange(seen.shape[1]))
        with torch.no_grad():
            _, _, c_kv, k_rope = layer.self_attn.project(x, position_ids)
        expected = torch.cat([c_kv, k_rope.flatten(2)], dim=-1)
        for b, rid in enumerate(cache.active):
            assert rel(cache.rows(i, rid), expected[b]) < ROW_TOL, (i, rid)
        used = _used_slots(cache)
        assert cache.pages[i][~used].isnan().all()
    pages = [p for t in cache.tables.values() for p in t]
    assert pages != sorted(pages)  # shuffle_pages really shuffled


def test_mixed_lengths_decode_like_alone(model):
    """Two requests with different committed lengths take one token each in one triton step and get the
    logits each gets when decoded alone (and by full recomputation)."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (1, n), generator=gen).to(DEVICE) for n in (5, 11)]
    nxt = [torch.tensor([[3]], device=DEVICE), torch.tensor([[60]], device=DEVICE)]
    model.set_attention_path("triton")
    try:
        with torch.no_grad():
            cache = PagedLatentCache.for_model(model.config, 64, 4, device=DEVICE, shuffle_pages=True)
            rids = []
            for p in prompts:
                rids.append(cache.add_request())
                cache.bind([rids[-1]])
                model(input_ids=p, past_key_values=cache)
            cache.bind(rids)
            assert cache.seq_lens().tolist() == [5, 11]
            before = cache.backend_log[f"{kernel_backend()}:decode"]
            joint = model(input_ids=torch.cat(nxt), past_key_values=cache).logits[:, -1]
            assert cache.backend_log[f"{kernel_backend()}:decode"] - before == model.config.num_hidden_layers
            assert cache.seq_lens().tolist() == [6, 12]
            alone = []
            for p, t in zip(prompts, nxt, strict=True):
                own = PagedLatentCache.for_model(model.config, 32, 4, device=DEVICE, shuffle_pages=True)
                own.bind([own.add_request()])
                model(input_ids=p, past_key_values=own)
                alone.append(model(input_ids=t, past_key_values=own).logits[:, -1])
            model.set_attention_path("absorbed")
            with pytest.raises(ValueError, match="different lengths"):
                model(input_ids=torch.zeros(2, 2, dtype=torch.long, device=DEVICE), past_key_values=cache)
            assert cache.seq_lens().tolist() == [6, 12]  # the refused step committed nothing
            model.set_attention_path("triton")
        model.set_attention_path("absorbed")
        with torch.no_grad():
            full = [
                model(input_ids=torch.cat([p, t], dim=1), use_cache=False).logits[:, -1]
                for p, t in zip(prompts, nxt, strict=True)
            ]
    finally:
        model.set_attention_path("absorbed")
    for b in range(2):
        assert rel(joint[b], alone[b][0]) < ROW_TOL, b
        assert rel(joint[b], full[b][0]) < E2E_TOL, b


def test_naive_path_refuses_paged_cache(model, prompt):
    cache = PagedLatentCache.for_model(model.config, 32, page_size=4, device=DEVICE)
    cache.bind([cache.add_request() for _ in range(2)])
    model.set_attention_path("naive")
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="naive"):
            model(input_ids=prompt, past_key_values=cache)
    finally:
        model.set_attention_path("absorbed")
    assert cache.seq_lens().tolist() == [0, 0]  # the failed step committed nothing


def test_triton_path_refuses_dynamic_cache(model, prompt):
    model.set_attention_path("triton")
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match="PagedLatentCache"):
                model.generate(prompt, max_new_tokens=2, do_sample=False)
            with pytest.raises(ValueError, match="PagedLatentCache"):
                model(input_ids=prompt, past_key_values=DynamicCache(config=model.config))
    finally:
        model.set_attention_path("absorbed")


def test_generate_rejects_unknown_backend(model, prompt):
    with pytest.raises(ValueError, match="backend"):
        generate(model, prompt, 2, backend="naive")
    assert model.config.attn_implementation_mla == "absorbed"


def test_generate_caches_in_the_model_dtype(prompt):
    half = tiny_mla().half()
    res = generate(half, prompt, 3, backend="triton", page_size=4)
    assert res.cache.pages[0].dtype == torch.float16
    assert res.cache.pages[0].device == half.device
    assert res.backend_log[f"{kernel_backend()}:decode"] == half.config.num_hidden_layers * 2


# ------------------------------------------------------------------------------------ issue 14: the decode step on a GPU


def test_triton_path_takes_several_tokens_of_ragged_requests(model):
    """The kernel's multi-token queries: two requests of different lengths take 3 tokens each in one step
    (speculative verification) and get the logits of full recomputation."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 97, (1, n), generator=gen).to(DEVICE) for n in (4, 9)]
    draft = torch.randint(0, 97, (2, 3), generator=gen).to(DEVICE)
    model.set_attention_path("triton")
    try:
        with torch.no_grad():
            cache = PagedLatentCache.for_model(model.config, 64, 4, device=DEVICE, shuffle_pages=True)
            rids = []
            for p in prompts:
                rids.append(cache.add_request())
                cache.bind([rids[-1]])
                model(input_ids=p, past_key_values=cache)
            cache.bind(rids)
            verify = model(input_ids=draft, past_key_values=cache).logits
            assert cache.seq_lens().tolist() == [7, 12]
            assert cache.backend_log[f"{kernel_backend()}:prefill"] == 3 * model.config.num_hidden_layers
        model.set_attention_path("absorbed")
        with torch.no_grad():
            for b, p in enumerate(prompts):
                full = model(input_ids=torch.cat([p, draft[b : b + 1]], dim=1), use_cache=False).logits
                assert rel(verify[b], full[0, -3:]) < E2E_TOL, b
    finally:
        model.set_attention_path("absorbed")


def test_triton_path_refuses_a_padding_mask(model, prompt):
    """The kernel applies no padding mask, so the triton path refuses one (before, it ignored it)."""
    cache = PagedLatentCache.for_model(model.config, 64, page_size=4, device=DEVICE)
    cache.bind([cache.add_request() for _ in range(2)])
    model.set_attention_path("triton")
    try:
        mask = torch.ones_like(prompt)
        mask[0, :2] = 0
        with torch.no_grad(), pytest.raises(ValueError, match="takes no padding mask"):
            model(input_ids=prompt, attention_mask=mask, past_key_values=cache)
    finally:
        model.set_attention_path("absorbed")
    assert cache.seq_lens().tolist() == [0, 0]


@pytest.mark.parametrize(("backend", "graph"), [("triton", False), ("absorbed", False), ("triton", True)])
def test_decode_steps_never_read_a_device_value(backend, graph, monkeypatch):
    """No host synchronisation in a step: the whole greedy loop (prefill and decode steps, metadata, cache
    writes, kernel call) runs on the meta device, whose tensors have no values, so any ``int()``, ``.item()``,
    ``bool()`` or ``.tolist()`` of a device tensor would raise. On a GPU each such read is a blocking sync
    (before: about 6 + 2B per layer per step). With ``graph`` the steps go through the decode graph's static
    buffers (filled in place each step), as a CUDA graph replays them."""
    from mla_convert.kernels import load_kernel

    kernel = load_kernel()
    real = kernel.latent_decode
    calls: list[str] = []

    def launch_nothing(*args, **kw):
        calls.append(str(args[0].device))
        monkeypatch.setattr(kernel, "_split_kernel", _NoLaunch())
        monkeypatch.setattr(kernel, "_merge_kernel", _NoLaunch())
        return real(*args, **kw)

    monkeypatch.setattr(kernel, "latent_decode", launch_nothing)
    config = tiny_mla().config
    with torch.device("meta"):
        meta_model = MLAForCausalLM(config).eval()
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    res = generate(meta_model, ids, 4, backend=backend, page_size=4, graph=graph)
    assert res.tokens.shape == (2, 9) and res.tokens.device.type == "meta"
    layers = meta_model.config.num_hidden_layers
    assert len(calls) == (4 * layers if backend == "triton" else 0) and set(calls) <= {"meta"}


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kw: None


# ------------------------------------------------------------------------------------ FP8 rows


def test_fp8_cache_bookkeeping_and_ledger():
    """FP8 rows: uint8 storage of the :mod:`mla_convert.kernels.fp8` layout (latent widths not multiples of 16
    zero-padded), free slots 0xFF (NaN in every part when read), rows read back dequantized within E4M3's
    rounding, and the ledger states latent, scales, rope and padding bytes separately."""
    from mla_convert.kernels import fp8 as F8

    widths, rope = [24 + 8, 40 + 8], 8
    layouts = [F8.layout(w - rope, rope) for w in widths]
    cache = PagedLatentCache(widths, page_size=4, num_pages=6, fp8=layouts)
    assert cache.dtype == torch.uint8 and [p.dtype for p in cache.storage] == [torch.uint8] * 2
    # d_c 24 -> 32 latent bytes, one scale, 16 rope bytes = 52 -> 64; d_c 40 -> 48 bytes, 3 scales (groups of
    # 16), 16 rope bytes = 76 -> 80
    assert cache.row_strides == [lay.stride_bytes for lay in layouts] == [64, 80]
    assert all(bool((st == 255).all()) for st in cache.storage)
    rid = cache.add_request()
    cache.bind([rid])
    cache.reserve(6)
    new = [_rows(6, w, seed=i) for i, w in enumerate(widths)]
    for layer, rows in enumerate(new):
        cache.write(layer, rows)
    cache.commit(6)
    for layer, rows in enumerate(new):
        back = cache.rows(layer, rid)
        assert back.dtype == torch.float32 and back.shape == (6, widths[layer])
        d_c = layouts[layer].d_c
        err = (back[:, :d_c] - rows[0, :, :d_c]).abs().max() / rows[0, :, :d_c].abs().max()
        assert 0 < float(err) <= 2**-4  # E4M3: 3 mantissa bits
        assert torch.equal(back[:, d_c:], rows[0, :, d_c:].to(torch.bfloat16).float())  # rope in bfloat16
    free = F8.dequantize_rows(cache.storage[0][cache.tables[rid][1], 2:], layouts[0])  # slots past the length
    assert free.isnan().all()
    led = cache.ledger()
    assert led["dtype"] == "fp8_e4m3+scales" and led["row_strides"] == [64, 80]
    parts = led["fp8_bytes_per_token_by_part"]
    assert parts == {"latent": 24 + 40, "scales": 4 + 12, "rope": 16 + 16, "padding": (64 - 44) + (80 - 68)}
    assert led["payload_bytes"] == 6 * (52 + 76)
    assert led["allocated_bytes"] == 2 * 4 * (64 + 80)
    cache.release(rid)
    assert all(bool((st == 255).all()) for st in cache.storage)


@torch.no_grad()
def teacher_forced(
    model: MLAForCausalLM, tokens: torch.Tensor, prompt_len: int, backend: str, cache_dtype: str = "model"
) -> torch.Tensor:
    """``[B, T - prompt_len, vocab]`` float32 next-token logits over a fixed token history: prefill
    ``tokens[:, :prompt_len]``, then feed ``tokens[:, i]`` one step at a time through a fresh paged cache (page
    size 4, shuffled pages; FP8 rows with ``cache_dtype="fp8"``) on ``backend``, folding on as in
    :func:`generate`. Two backends compared this way see the same tokens whatever either would choose."""
    b, t = tokens.shape
    cache = PagedLatentCache.for_model(
        model.config, b * (t + 4), 4, dtype=model.dtype, device=tokens.device, shuffle_pages=True,
        fp8=cache_dtype == "fp8",
    )  # fmt: skip
    cache.bind([cache.add_request() for _ in range(b)])
    previous, folding = model.config.attn_implementation_mla, model.folding
    model.set_attention_path(backend)
    model.set_folding(True)
    try:
        out = [model(input_ids=tokens[:, :prompt_len], past_key_values=cache).logits[:, -1].float()]
        for i in range(prompt_len, t - 1):
            out.append(model(input_ids=tokens[:, i : i + 1], past_key_values=cache).logits[:, -1].float())
    finally:
        model.set_attention_path(previous)
        model.set_folding(folding)
    return torch.stack(out, dim=1)


def test_fp8_cache_decodes_on_both_backends(model, prompt, runs):
    """The kernel and the absorbed torch path read the same FP8 rows, so over the same token history they agree
    to float32 arithmetic at every step; against the float32 cache the format's own error shows, bounded.
    Before, the two were compared only when their greedy tokens happened to match; now the torch path is fed
    the kernel's tokens (teacher forcing), so the comparison always runs."""
    fp8_triton = generate(
        model, prompt, NEW, backend="triton", page_size=4, shuffle_pages=True, cache_dtype="fp8"
    )
    assert fp8_triton.cache.fp8 is not None and fp8_triton.cache.storage[0].dtype == torch.uint8
    assert set(fp8_triton.backend_log) == {f"{kernel_backend()}:decode", f"{kernel_backend()}:prefill"}
    assert torch.equal(fp8_triton.tokens[:, :PROMPT_LEN], prompt)
    history = fp8_triton.tokens
    fp8_torch = teacher_forced(model, history, PROMPT_LEN, "absorbed", cache_dtype="fp8")
    assert fp8_torch.shape == fp8_triton.step_logits.shape == (2, NEW, 97)
    assert rel(fp8_torch, fp8_triton.step_logits) < E2E_TOL  # every step, unconditionally
    # the helper replays generate's own steps: the kernel fed its own tokens gives its logits again
    assert rel(
        teacher_forced(model, history, PROMPT_LEN, "triton", cache_dtype="fp8"), fp8_triton.step_logits
    ) < (E2E_TOL)
    # and FP8 rows are a different function from float32 rows over the same history (so agreement above is
    # a comparison that can fail): the format's error, bounded
    exact = teacher_forced(model, history, PROMPT_LEN, "absorbed")
    err = rel(fp8_triton.step_logits, exact)
    assert 1e-5 < err < 0.1, err
    assert rel(runs[0].step_logits[:, 0], exact[:, 0]) < E2E_TOL  # first step: same prompt, float32 rows
    with pytest.raises(ValueError, match="cache dtype"):
        generate(model, prompt, 1, cache_dtype="int4")


@pytest.mark.parametrize("fp8", [False, True])
def test_cache_moves_between_devices(fp8):
    """``to(device)`` moves every layer's pages, rebuilds the views and keeps the bookkeeping (validate decodes
    on the kernel's device and checks the rows on the CPU)."""
    cache = PagedLatentCache.for_model(tiny_mla().config, 12, 4, fp8=fp8)
    rid = cache.add_request()
    cache.bind([rid])
    cache.begin_step(5)
    for layer, w in enumerate(cache.row_widths):
        cache.write(layer, _rows(5, w, seed=layer))
    cache.commit(5)
    before = [cache.rows(layer, rid) for layer in range(len(cache.row_widths))]
    assert cache.to(torch.device("cpu")) is cache
    assert all(torch.equal(cache.rows(layer, rid), rows) for layer, rows in enumerate(before))
    cache.begin_step(1)
    cache.to("meta")
    assert cache.step is None and cache.lengths[rid] == 5
    pages = zip(cache.pages, cache.row_bytes, strict=True)
    assert all(p.device.type == "meta" and p.shape[-1] == w for p, w in pages)
