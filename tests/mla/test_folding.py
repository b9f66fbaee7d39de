"""Inference folding (``MLAForCausalLM.set_folding``): ``W_UK`` folded into ``q_proj`` and ``W_UV`` into
``o_proj`` is the same function as the unfolded absorbed path (float32 rounding apart), applies only with
autograd off and only where it saves multiply-adds, and follows weight changes."""

from __future__ import annotations

import copy

import pytest
import torch

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton is imported)
from mla_convert.mla.modeling import MLAForCausalLM
from mla_convert.runtime.decode import generate
from tests.runtime.test_paged_cache import DEVICE, rel, tiny_mla

TOL = 1e-5  # float32 logits of a 2-layer random model: the folded products only reorder float32 sums


@pytest.fixture(scope="module")
def foldable() -> MLAForCausalLM:
    """The runtime tests' tiny model (biases, 2 KV heads, 2 rope heads) reshaped so that folding pays:
    ``d_N`` 32 of hidden 48 with ``d_c`` 16 / 12, ``d_V`` 24."""
    base = tiny_mla()
    config = copy.deepcopy(base.config)
    config.kv_lora_rank = [16, 12]
    config.qk_nope_head_dim = 32
    config.v_head_dim = 24
    torch.manual_seed(1)
    model = MLAForCausalLM(config).eval().to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    return model


def _ids(n: int = 12, b: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (b, n), generator=torch.Generator().manual_seed(4)).to(DEVICE)


def test_plan_folds_only_where_it_saves_work(foldable):
    assert [layer.self_attn.folding_plan() for layer in foldable.model.layers] == [(True, True), (True, True)]
    # the runtime tests' shape (d_N 8, d_V 16 of hidden 48): W_UK never pays; W_UV at d_c 24 (24 x 32 <= 48 x 16)
    # but not at 40
    assert [layer.self_attn.folding_plan() for layer in tiny_mla().model.layers] == [
        (False, True),
        (False, False),
    ]


def test_folded_equals_unfolded_and_only_without_autograd(foldable):
    ids = _ids()
    foldable.set_attention_path("absorbed")
    try:
        with torch.no_grad():
            plain = foldable(input_ids=ids).logits
            foldable.set_folding(True)
            assert foldable.folding
            folded = foldable(input_ids=ids).logits
            attn = foldable.model.layers[0].self_attn
            assert attn._folded is not None and attn._folded.q_weight is not None
        assert 0 < rel(folded, plain) < TOL  # really a different computation, the same function
        with torch.enable_grad():  # training sees the factored weights (folding is off with autograd)
            trained = foldable(input_ids=ids).logits
        assert torch.equal(trained.detach(), plain)
    finally:
        foldable.set_folding(False)
    assert not foldable.folding and foldable.model.layers[0].self_attn._folded is None


def test_folded_weights_follow_in_place_weight_changes(foldable):
    ids = _ids()
    model = copy.deepcopy(foldable)
    model.set_folding(True)
    with torch.no_grad():
        model(input_ids=ids)
        for name in ("q_proj", "kv_b_proj", "o_proj", "kv_a_proj_with_mqa"):
            getattr(model.model.layers[1].self_attn, name).weight.mul_(1.1)
        after = model(input_ids=ids).logits
        model.set_folding(False)
        expected = model(input_ids=ids).logits
    assert rel(after, expected) < TOL


@pytest.mark.parametrize("backend", ["absorbed", "triton"])
def test_generate_folds_by_default_and_restores_the_setting(foldable, backend):
    ids = _ids(7)
    folded = generate(foldable, ids, 5, backend=backend, page_size=4)
    plain = generate(foldable, ids, 5, backend=backend, page_size=4, fold=False)
    assert torch.equal(folded.tokens, plain.tokens)
    assert 0 < rel(folded.step_logits, plain.step_logits) < 1e-4
    assert not foldable.folding


def test_reference_conversion_folds_and_keeps_its_logits(reference_ckpt, eval_ids):
    """The bundled conversion: W_UK folds into every layer's q_proj (d_N 112 of hidden 576) and W_UV into o_proj
    where d_c <= 72; logits on real Wikipedia text stay within float32 rounding of the unfolded path."""
    model = MLAForCausalLM.from_pretrained(str(reference_ckpt), dtype=torch.float32).eval()
    plans = [layer.self_attn.folding_plan() for layer in model.model.layers]
    ranks = model.config.kv_lora_rank
    assert plans == [(True, d_c <= 72) for d_c in ranks]
    ids = eval_ids[:1, :128]
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        model.set_folding(True)
        folded = model(input_ids=ids).logits
    assert rel(folded, plain) < 1e-4
    assert torch.equal(folded.argmax(-1), plain.argmax(-1))
