"""The streamed LM-head scores (``mla_convert.metrics.head_scores``) against a dense float64 oracle.

The oracle takes whole-vocabulary ``log_softmax`` tables in float64; the code under test reads the head in chunks
with an online log-sum-exp and, for the KL, the reference's per-token terms (:func:`reference_scores`: made once,
reused for every model a conversion's search scores against the same source).
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_convert.metrics import head_scores, reference_scores

N, T, D, V = 3, 40, 32, 5000


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _oracle(h: torch.Tensor, h_ref: torch.Tensor, head: torch.Tensor, head_ref: torch.Tensor, ids: torch.Tensor
            ) -> tuple[float, float, float, float]:  # fmt: skip
    """KL(ref || model), perplexity, top-1 agreement, the reference's perplexity: dense float64 tables."""
    kl = nll = ref_nll = 0.0
    agree = count = 0
    for w in range(ids.shape[0]):
        target = ids[w, 1:, None]
        lm = torch.log_softmax(h[w, :-1].double() @ head.double().T, -1)
        lr = torch.log_softmax(h_ref[w, :-1].double() @ head_ref.double().T, -1)
        kl += float((lr.exp() * (lr - lm)).sum())
        nll -= float(lm.gather(1, target).sum())
        ref_nll -= float(lr.gather(1, target).sum())
        agree += int((lm.argmax(-1) == lr.argmax(-1)).sum())
        count += target.shape[0]
    return kl / count, math.exp(nll / count), agree / count, math.exp(ref_nll / count)


@pytest.mark.parametrize("head_dtype", [None, torch.bfloat16])
def test_head_scores_equal_the_dense_oracle(head_dtype: torch.dtype | None) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, V, (N, T))
    head = torch.randn(V, D) * 0.3
    h_ref = torch.randn(N, T, D)
    h = h_ref + 0.3 * torch.randn(N, T, D)
    mine = head.to(head_dtype).float() if head_dtype is not None else head  # the model's head as written
    kl, ppl, top1, ref_ppl = _oracle(h, h_ref, mine, head, ids)
    assert kl > 0.05 and top1 < 0.9  # a real difference to measure
    res, losses = head_scores(h, ids, _identity, head, (h_ref, _identity, head), head_dtype, vocab_chunk=1024)
    assert res.kl == pytest.approx(kl, rel=1e-6)
    assert res.perplexity == pytest.approx(ppl, rel=1e-6)
    assert res.reference_perplexity == pytest.approx(ref_ppl, rel=1e-6)
    assert res.top1 == top1 and res.tokens == N * (T - 1) and len(losses) == N
    # the reference's terms made once and reused: the same numbers bit for bit
    ref = reference_scores((h_ref, _identity, head), ids, head, head_dtype, vocab_chunk=1024)
    again, _ = head_scores(h, ids, _identity, head, ref, head_dtype, vocab_chunk=1024)
    assert (again.kl, again.perplexity, again.top1) == (res.kl, res.perplexity, res.top1)


def test_a_model_against_itself_has_no_kl() -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, V, (2, T))
    head, h = torch.randn(V, D), torch.randn(2, T, D)
    res, _ = head_scores(h, ids, _identity, head, (h, _identity, head), vocab_chunk=999)
    assert abs(res.kl or 0.0) < 1e-12 and res.top1 == 1.0


def test_reference_scores_of_other_windows_are_refused() -> None:
    ids = torch.randint(0, V, (2, T))
    head, h = torch.randn(V, D), torch.randn(2, T, D)
    ref = reference_scores((h, _identity, head), ids, head, torch.bfloat16)
    with pytest.raises(ValueError, match="reference scores of 2 windows rounded to torch.bfloat16"):
        head_scores(h[:1], ids[:1], _identity, head, ref, torch.bfloat16)
    with pytest.raises(ValueError, match="rounded to None"):
        head_scores(h, ids, _identity, head, ref, None)
