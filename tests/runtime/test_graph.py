"""The decode step as a replayable graph (:class:`mla_convert.runtime.graph.DecodeGraph`): on this CPU the
captured body runs eagerly on the graph's static buffers, which is the capture path's logic without the
capture (fixed addresses, metadata filled in place, a fixed ``max_seq_len`` for the kernel's grid, the folded
weights of the capture). On a CUDA host the same tests capture a real graph.

The graph's steps are compared with computations that differ from them: the absorbed torch path and full
recomputation, and the model's own paged steps with another split count (the graph's ``max_seq_len`` bound picks
the splits on an H200's 132 SMs, the plain step its true length), so a wrong merge or bound cannot pass as
agreement of a path with itself."""

from __future__ import annotations

import pytest
import torch

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton is imported)
from mla_convert.kernels import load_kernel
from mla_convert.runtime.decode import generate
from mla_convert.runtime.graph import DecodeGraph
from mla_convert.runtime.paged_cache import CacheError, PagedLatentCache
from tests.runtime.test_paged_cache import DEVICE, E2E_TOL, rel, tiny_mla

K = load_kernel()

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def model():
    return tiny_mla()


def _prefilled(
    model, lengths: list[int], seed: int = 3, tokens: int = 96
) -> tuple[PagedLatentCache, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    cache = PagedLatentCache.for_model(model.config, tokens, 4, device=DEVICE, shuffle_pages=True)
    rids = []
    model.set_attention_path("triton")
    try:
        with torch.no_grad():
            for n in lengths:
                rids.append(cache.add_request())
                cache.bind([rids[-1]])
                model(input_ids=torch.randint(0, 97, (1, n), generator=gen).to(DEVICE), past_key_values=cache)
    finally:
        model.set_attention_path("absorbed")
    cache.bind(rids)
    return cache, rids


def test_graph_generate_equals_the_plain_and_absorbed_steps(model):
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    plain = generate(model, prompt, 6, backend="triton", page_size=4)
    graphed = generate(model, prompt, 6, backend="triton", page_size=4, graph=True)
    absorbed = generate(model, prompt, 6, backend="absorbed", page_size=4)
    assert torch.equal(graphed.tokens, plain.tokens) and torch.equal(graphed.tokens, absorbed.tokens)
    assert rel(graphed.step_logits, plain.step_logits) < E2E_TOL
    assert rel(graphed.step_logits, absorbed.step_logits) < E2E_TOL  # torch math, another path
    with torch.no_grad():  # and full recomputation over the same tokens (no cache at all)
        model.set_attention_path("absorbed")
        full = model(input_ids=graphed.tokens[:, :-1], use_cache=False).logits[:, 6:].float()
    assert rel(graphed.step_logits, full) < E2E_TOL
    layers = model.config.num_hidden_layers
    decode_key = "triton-cuda:decode-graph" if CUDA else "triton-interpreter:decode"
    assert graphed.backend_log[decode_key] >= layers * 5
    assert model.config.attn_implementation_mla == "absorbed"  # generate restores the path
    with pytest.raises(ValueError, match="triton backend"):
        generate(model, prompt, 3, backend="absorbed", graph=True)


def _record_splits(monkeypatch) -> list[int]:
    """Split count of every kernel launch from now on, choosing them as an H200 would (132 SMs)."""
    splits: list[int] = []
    real = K.plan_launch

    def plan(*args, **kw):
        p = real(*args, **kw)
        splits.append(p.split_grid[1])
        return p

    monkeypatch.setattr(K, "plan_launch", plan)
    monkeypatch.setattr(K, "multiprocessor_count", lambda device: 132)
    return splits


def test_static_buffers_keep_their_addresses_and_take_each_steps_values(model):
    """Requests of different lengths (5 and 11 rows) step together; every step's metadata lands in the same
    tensors (a replay reads them by address), with the values a fresh step would build, and the logits equal
    the model's own paged step on an identical cache."""
    cache, rids = _prefilled(model, [5, 11])
    twin, _ = _prefilled(model, [5, 11])
    g = DecodeGraph(model, cache, max_seq_len=16)
    static = g.static
    addresses = [t.data_ptr() for t in (static.seq_lens, static.block_table, static.slots, static.positions)]
    assert static.block_table.shape == (2, 4)  # 16 rows / page size 4
    tokens = torch.tensor([[3], [60]], device=DEVICE)
    for step in range(3):
        logits = g.step(tokens).clone()
        assert [
            t.data_ptr() for t in (static.seq_lens, static.block_table, static.slots, static.positions)
        ] == addresses
        assert static.seq_lens.tolist() == [6 + step, 12 + step]
        assert static.positions[:, 0].tolist() == [5 + step, 11 + step]
        for b, rid in enumerate(rids):
            pos = 5 + step if b == 0 else 11 + step
            page = cache.tables[rid][pos // 4]
            assert int(static.slots[b, 0]) == page * 4 + pos % 4
            assert static.block_table[b, : len(cache.tables[rid])].tolist() == cache.tables[rid]
        with torch.no_grad():  # the graph keeps the model on the triton path while it lives
            expected = model(input_ids=tokens, past_key_values=twin).logits[:, -1].float()
        assert rel(logits, expected) < E2E_TOL
        tokens = logits.argmax(-1, keepdim=True)
    assert cache.seq_lens().tolist() == [8, 14] and g.replays == 3
    g.close()
    assert model.config.attn_implementation_mla == "absorbed"


def test_graph_steps_equal_plain_steps_split_otherwise(model, monkeypatch):
    """The graph's split count comes from its ``max_seq_len`` bound, the plain step's from the true lengths: with
    an H200's 132 SMs, requests of 131 and 71 rows and a bound of 256 rows the graph runs 4 splits per request
    (rows 0-63, 64-127, 128-: three non-empty for the longer request) and the plain step 2 (rows 0-127, 128-), so
    the merge of different partitions is compared, not a path with itself (before: both ran one split on the
    CPU)."""
    cache, _ = _prefilled(model, [130, 70], tokens=256)
    twin, _ = _prefilled(model, [130, 70], tokens=256)
    splits = _record_splits(monkeypatch)
    g = DecodeGraph(model, cache, max_seq_len=256)
    tokens = torch.tensor([[3], [60]], device=DEVICE)
    for _ in range(2):
        del splits[:]
        logits = g.step(tokens).clone()
        graph_splits = list(splits)
        del splits[:]
        with torch.no_grad():
            expected = model(input_ids=tokens, past_key_values=twin).logits[:, -1].float()
        layers = model.config.num_hidden_layers
        assert splits == [2] * layers
        if not CUDA:  # a replay plans nothing on the host (the capture planned 4 splits)
            assert graph_splits == [4] * layers
        assert rel(logits, expected) < E2E_TOL
        tokens = logits.argmax(-1, keepdim=True)
    g.close()


def test_bound_and_misuse_are_refused_and_commit_nothing(model):
    cache, _ = _prefilled(model, [5, 11])
    with DecodeGraph(model, cache, max_seq_len=13) as g:
        ids = torch.tensor([[1], [2]], device=DEVICE)
        g.step(ids)
        g.step(ids)  # request 1 reaches 13 rows: the bound
        with pytest.raises(CacheError, match="past the static step's bound of 13"):
            g.step(ids)
        assert cache.seq_lens().tolist() == [7, 13]  # the refused step committed nothing
        with pytest.raises(CacheError, match=r"input_ids must be \[2, 1\]"):
            g.step(torch.tensor([[1]], device=DEVICE))
    fresh = PagedLatentCache.for_model(model.config, 32, 4, device=DEVICE)
    fresh.bind([fresh.add_request()])
    with pytest.raises(CacheError, match="prefill every bound request"):
        DecodeGraph(model, fresh, max_seq_len=8)
    with pytest.raises(CacheError, match="pages"):
        DecodeGraph(model, cache, max_seq_len=10_000)
    if not CUDA:
        with pytest.raises(ValueError, match="needs the cache on a CUDA device"):
            DecodeGraph(model, cache, max_seq_len=16, capture=True)
    assert model.config.attn_implementation_mla == "absorbed"


def test_weight_changes_are_captured_again():
    """A replay reads the folded weights of its capture (issue 25, fault 6): after an in-place update of a
    weight that folding reads, ``set_folding(False)``, and a replaced parameter, the graph's step still equals
    the model's own paged step on an identical cache, because it captured again (before: it replayed the stale
    folded ``o_proj`` on a GPU; with the check off, the eager body here, which reads the capture's folded
    weights the same way, is off by 0.27 relative after the update)."""
    model = tiny_mla()  # its own weights: this test changes them
    model.set_folding(True)
    attn = model.model.layers[0].self_attn
    assert attn.folding_plan() == (False, True)  # layer 0 folds W_UV into o_proj (d_c = 24)
    cache, _ = _prefilled(model, [5, 11])
    twin, _ = _prefilled(model, [5, 11])
    g = DecodeGraph(model, cache, max_seq_len=16)
    tokens = torch.tensor([[3], [60]], device=DEVICE)

    def step_and_compare() -> float:
        logits = g.step(tokens).clone()
        with torch.no_grad():
            expected = model(input_ids=tokens, past_key_values=twin).logits[:, -1].float()
        return rel(logits, expected)

    assert step_and_compare() < E2E_TOL and g.captures == 1
    assert step_and_compare() < E2E_TOL and g.captures == 1  # nothing changed: no new capture
    with torch.no_grad():
        attn.o_proj.weight.mul_(1.5)  # in place: same address, new version; the folded o_proj is stale
    assert step_and_compare() < E2E_TOL and g.captures == 2
    model.set_folding(False)  # the folded weights are dropped
    assert step_and_compare() < E2E_TOL and g.captures == 3
    attn.kv_b_proj.weight = torch.nn.Parameter(attn.kv_b_proj.weight.detach() * 0.5)  # a new tensor
    assert step_and_compare() < E2E_TOL and g.captures == 4
    g.close()


def test_leaving_the_triton_path_is_refused(model):
    cache, _ = _prefilled(model, [5, 11])
    g = DecodeGraph(model, cache, max_seq_len=16)
    model.set_attention_path("absorbed")
    with pytest.raises(ValueError, match="left the triton path"):
        g.step(torch.tensor([[1], [2]], device=DEVICE))
    assert cache.seq_lens().tolist() == [5, 11]  # the refused step committed nothing
    g.close()
    assert model.config.attn_implementation_mla == "absorbed"
