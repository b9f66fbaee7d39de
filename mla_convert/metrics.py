"""Measurements on real text: perplexity, KL to the source, top-1 agreement, KV cache bytes.

Every number says what it was measured on: :class:`EvalResult` carries the token count, window
length and the text's document ids.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from mla_convert.mla.modeling import latent_cache_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class EvalResult:
    """Perplexity of a model on ``tokens`` predicted tokens in windows of ``window`` tokens; and, against
    a reference model, the mean token KL(reference || model) in nats and top-1 agreement (0..1)."""

    perplexity: float
    tokens: int
    window: int
    windows: int
    kl: float | None = None
    top1: float | None = None
    reference_perplexity: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def evaluate(
    model: PreTrainedModel,
    windows: torch.Tensor,
    reference: PreTrainedModel | None = None,
    progress: Callable[[int], None] | None = None,
) -> EvalResult:
    """Perplexity of ``model`` on token windows ``[N, T]`` (each window scored on its own, next-token
    loss over ``T - 1`` positions), with KL and top-1 agreement against ``reference`` when given.

    Raises:
        ValueError: for an empty window tensor.
    """
    if windows.numel() == 0:
        raise ValueError("no evaluation windows")
    nll = ref_nll = kl = 0.0
    agree = count = 0
    for row in windows:
        ids = row[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].double()
        target = ids[0, 1:]
        logp = F.log_softmax(logits, -1)
        nll += float(-logp.gather(1, target[:, None]).sum())
        if reference is not None:
            ref_logits = reference(input_ids=ids, use_cache=False).logits[0, :-1].double()
            ref_logp = F.log_softmax(ref_logits, -1)
            ref_nll += float(-ref_logp.gather(1, target[:, None]).sum())
            kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
            agree += int((ref_logits.argmax(-1) == logits.argmax(-1)).sum())
        count += target.numel()
        if progress:
            progress(1)
    res = EvalResult(math.exp(nll / count), count, windows.shape[1], windows.shape[0])
    if reference is not None:
        res.kl, res.top1, res.reference_perplexity = kl / count, agree / count, math.exp(ref_nll / count)
    return res


@torch.no_grad()
def measure_cache(model: PreTrainedModel, input_ids: torch.Tensor) -> dict[str, Any]:
    """Run a prefill and read back the bytes the model's cache tensors actually hold.

    Args:
        input_ids: ``[1, T]`` real tokens.

    Returns:
        ``values_per_token_per_layer`` and ``bytes_per_token_per_layer`` (averaged over layers),
        ``dtype`` and ``tokens``: measured from the allocated cache tensors, not from a formula.
    """
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    nbytes, values = latent_cache_bytes(cache)
    layers = len(cache.layers)
    tokens = input_ids.shape[1] * input_ids.shape[0]
    keys = getattr(cache.layers[0], "keys", None)
    assert isinstance(keys, torch.Tensor)
    dtype = str(keys.dtype).replace("torch.", "")
    return {
        "values_per_token_per_layer": values / tokens / layers,
        "bytes_per_token_per_layer": nbytes / tokens / layers,
        "dtype": dtype,
        "tokens": tokens,
        "layers": layers,
    }


@dataclass
class ReferenceScores:
    """What KL(reference || model), top-1 agreement and the reference's perplexity need of the reference model, per
    predicted token of each window: computed once by :func:`reference_scores`, then any number of models are scored
    against it by :func:`head_scores` at the cost of their own logits alone (a conversion's search scores several
    candidates against one source on the same held-out windows).

    Per window ``w`` (lists over the windows), float64 on the hidden states' device:
        lse: ``[T-1]`` log-sum-exp of the reference's logits.
        target: ``[T-1]`` the reference's logit of the next token.
        argmax: ``[T-1]`` (int64) the reference's most likely token.
        expected_logit: ``[T-1]`` E_p[l_ref] = sum_v p_ref(v) l_ref(v).
        mean_row: ``[T-1, hidden]`` E_p[w] = sum_v p_ref(v) w_v over the *model's* LM-head rows (as rounded to
            ``head_dtype``), so that the model's expected logit under the reference is ``h . mean_row``.
        head_dtype: the rounding of the model's head ``mean_row`` was made with.

    KL per token: ``(expected_logit - lse) - (h . mean_row - lse_model)`` (both expectations under the
    reference's distribution), exact algebra on the chunked log-sum-exp of :func:`head_scores`.
    """

    lse: list[torch.Tensor]
    target: list[torch.Tensor]
    argmax: list[torch.Tensor]
    expected_logit: list[torch.Tensor]
    mean_row: list[torch.Tensor]
    head_dtype: torch.dtype | None


class _OnlineLogits:
    """One window's next-token logits read a vocabulary chunk at a time: per token the running maximum ``m``, the
    sum ``s`` of ``exp(logit - m)`` (so ``lse = m + log s``), the target's logit and the argmax (float64)."""

    def __init__(self, target: torch.Tensor) -> None:
        n, dev = target.shape[0], target.device
        self.target = target
        self.m = torch.full((n,), -math.inf, dtype=torch.float64, device=dev)
        self.s = torch.zeros(n, dtype=torch.float64, device=dev)
        self.tgt = torch.zeros(n, dtype=torch.float64, device=dev)
        self.arg = torch.zeros(n, dtype=torch.long, device=dev)

    def add(self, logits: torch.Tensor, v0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the chunk ``logits [n, C]`` of vocabulary rows ``v0..v0+C``; returns the rescale of earlier sums
        ``[n]`` and the chunk's ``exp(logit - m)`` ``[n, C]`` (for sums the caller keeps beside ``s``)."""
        top, where = logits.max(-1)
        self.arg = torch.where(top > self.m, where + v0, self.arg)  # the running maximum is the best logit so far
        new = torch.maximum(self.m, top)
        scale = torch.exp(self.m - new)
        e = torch.exp(logits - new[:, None])
        self.s = self.s * scale + e.sum(-1)
        self.m = new
        t = self.target
        inside = (t >= v0) & (t < v0 + logits.shape[1])
        self.tgt[inside] = logits[inside, t[inside] - v0]
        return scale, e

    @property
    def lse(self) -> torch.Tensor:
        return self.m + torch.log(self.s)


@torch.no_grad()
def reference_scores(
    reference: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    head: torch.Tensor,
    head_dtype: torch.dtype | None = None,
    vocab_chunk: int = 8192,
) -> ReferenceScores:
    """The reference's per-token terms of :class:`ReferenceScores`, the vocabulary in chunks (online
    log-sum-exp, as :func:`head_scores`).

    Args:
        reference: ``(hidden [N, T, hidden], norm, head_ref [V, hidden])`` of the reference model (its head used as
            stored).
        ids: ``[N, T]`` the windows' tokens; position ``t`` predicts token ``t + 1``.
        head: ``[V, hidden]`` the LM head of the models that will be scored against it, rounded to ``head_dtype``
            when given (their ``mean_row``).
        vocab_chunk: rows of the heads read at a time (float64 ``[T, C]`` temporaries).

    Raises:
        ValueError: for empty windows, or heads of different vocabularies.
    """
    hidden, norm, head_ref = reference
    if ids.numel() == 0:
        raise ValueError("no evaluation windows")
    if head.shape != head_ref.shape:
        raise ValueError(f"LM heads of shapes {tuple(head.shape)} and {tuple(head_ref.shape)}: not one vocabulary")
    out = ReferenceScores([], [], [], [], [], head_dtype)
    vocab = head.shape[0]
    # the scored models' head differs from the reference's where it is rounded, or is another tensor
    rounded = head is not head_ref or (head_dtype is not None and head_dtype != head.dtype)
    for w in range(ids.shape[0]):
        target = ids[w, 1:].to(hidden.device)
        h = norm(hidden[w, :-1]).float()
        dev = h.device
        acc = _OnlineLogits(target)
        mean_mine = torch.zeros(target.shape[0], head.shape[1], dtype=torch.float64, device=dev)
        mean_ref = torch.zeros_like(mean_mine) if rounded else mean_mine
        for v0 in range(0, vocab, vocab_chunk):
            rows = head_ref[v0 : v0 + vocab_chunk].to(dev)
            scale, e = acc.add((h @ rows.float().T).double(), v0)
            mean_ref.mul_(scale[:, None]).add_(e @ rows.double())
            if rounded:
                mine = head[v0 : v0 + vocab_chunk].to(dev)
                mine = mine.to(head_dtype) if head_dtype is not None else mine
                mean_mine.mul_(scale[:, None]).add_(e @ mine.double())
        out.lse.append(acc.lse)
        out.target.append(acc.tgt)
        out.argmax.append(acc.arg)
        # both expectations as h . E_p[w] in float64, so a model scored against itself has a KL of exactly 0
        out.expected_logit.append((h.double() * mean_ref).sum(-1) / acc.s)
        out.mean_row.append(mean_mine / acc.s[:, None])
    return out


@torch.no_grad()
def head_scores(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    norm: Callable[[torch.Tensor], torch.Tensor],
    head: torch.Tensor,
    reference: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | ReferenceScores | None = None,
    head_dtype: torch.dtype | None = None,
    vocab_chunk: int = 8192,
) -> tuple[EvalResult, list[float]]:
    """Perplexity (and KL / top-1 against a reference) from final hidden states, the vocabulary in chunks.

    The streamed twin of :func:`evaluate`: the LM head ``head [V, hidden]`` is read ``vocab_chunk`` rows at a
    time (cast to float32; first to ``head_dtype`` when given, i.e. the written checkpoint's dtype), and the
    log-sum-exp, the target logit and the argmax are accumulated online, so no ``[T, V]`` log-probability table of
    the whole vocabulary is kept. The reference's side of the KL is :class:`ReferenceScores` (computed here from a
    ``(hidden, norm, head)`` tuple, or given, made once for several models).

    Args:
        hidden: ``[N, T, hidden]`` outputs of the last decoder layer (before the final norm).
        ids: ``[N, T]`` the windows' tokens; position ``t`` predicts token ``t + 1``.
        norm: the final RMSNorm.
        head: ``[V, hidden]`` LM head (any float dtype).
        reference: ``(hidden, norm, head)`` of the reference model, or its :func:`reference_scores` on these windows
            with this head and ``head_dtype``, for KL(reference || model) and top-1.
        head_dtype: round the model's head to this dtype before use (the reference's is used as stored).

    Returns:
        The :class:`EvalResult` and each window's mean next-token loss in nats.

    Raises:
        ValueError: for empty windows, or a :class:`ReferenceScores` of other windows or another head rounding.
    """
    if ids.numel() == 0:
        raise ValueError("no evaluation windows")
    ref = (
        reference_scores(reference, ids, head, head_dtype, vocab_chunk)
        if isinstance(reference, tuple)
        else reference
    )
    if ref is not None and (len(ref.lse) != ids.shape[0] or ref.head_dtype != head_dtype):
        raise ValueError(
            f"reference scores of {len(ref.lse)} windows rounded to {ref.head_dtype} for {ids.shape[0]} windows "
            f"rounded to {head_dtype}: make them with reference_scores on the same windows and head_dtype"
        )
    nll = ref_nll = kl = 0.0
    agree = count = 0
    losses: list[float] = []
    vocab = head.shape[0]
    for w in range(ids.shape[0]):
        target = ids[w, 1:].to(hidden.device)
        h = norm(hidden[w, :-1]).float()
        n = target.shape[0]
        acc = _OnlineLogits(target)
        for v0 in range(0, vocab, vocab_chunk):
            rows = head[v0 : v0 + vocab_chunk].to(h.device)
            mine = rows.to(head_dtype) if head_dtype is not None else rows
            acc.add((h @ mine.float().T).double(), v0)
        lse, arg = acc.lse, acc.arg
        window_nll = float((lse - acc.tgt).sum())
        nll += window_nll
        losses.append(window_nll / n)
        if ref is not None:
            ref_nll += float((ref.lse[w] - ref.target[w]).sum())
            expected = (h.double() * ref.mean_row[w]).sum(-1)  # E_ref[model logit]
            kl += float(((ref.expected_logit[w] - ref.lse[w]) - (expected - lse)).sum())
            agree += int((arg == ref.argmax[w]).sum())
        count += n
    res = EvalResult(math.exp(nll / count), count, ids.shape[1], ids.shape[0])
    if ref is not None:
        res.kl, res.top1, res.reference_perplexity = kl / count, agree / count, math.exp(ref_nll / count)
    return res, losses
