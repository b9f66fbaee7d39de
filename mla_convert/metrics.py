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


@torch.no_grad()
def head_scores(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    norm: Callable[[torch.Tensor], torch.Tensor],
    head: torch.Tensor,
    reference: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | None = None,
    head_dtype: torch.dtype | None = None,
    vocab_chunk: int = 8192,
) -> tuple[EvalResult, list[float]]:
    """Perplexity (and KL / top-1 against a reference) from final hidden states, the vocabulary in chunks.

    The streamed twin of :func:`evaluate`: the LM head ``head [V, hidden]`` is read ``vocab_chunk`` rows at a
    time (cast to float32; first to ``head_dtype`` when given, i.e. the written checkpoint's dtype), and the
    log-sum-exp, the target logit, the argmax and the reference-weighted log-ratio are accumulated online, so
    no ``[T, V]`` log-probability table of the whole vocabulary is kept.

    Args:
        hidden: ``[N, T, hidden]`` outputs of the last decoder layer (before the final norm).
        ids: ``[N, T]`` the windows' tokens; position ``t`` predicts token ``t + 1``.
        norm: the final RMSNorm.
        head: ``[V, hidden]`` LM head (any float dtype).
        reference: ``(hidden, norm, head)`` of the reference model for KL(reference || model) and top-1.
        head_dtype: round the model's head to this dtype before use (the reference's is used as stored).

    Returns:
        The :class:`EvalResult` and each window's mean next-token loss in nats.

    Raises:
        ValueError: for empty windows.
    """
    if ids.numel() == 0:
        raise ValueError("no evaluation windows")
    nll = ref_nll = kl = 0.0
    agree = count = 0
    losses: list[float] = []
    vocab = head.shape[0]
    for w in range(ids.shape[0]):
        target = ids[w, 1:].to(hidden.device)
        h = norm(hidden[w, :-1]).float()
        hr = reference[1](reference[0][w, :-1]).float() if reference is not None else None
        n = target.shape[0]
        dev = h.device

        def vec(fill: float, n: int = n, dev: torch.device = dev) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.float64, device=dev)

        m, s, tgt, best = vec(-math.inf), vec(0.0), vec(0.0), vec(-math.inf)
        mr, sr, s1, tgt_r, best_r = vec(-math.inf), vec(0.0), vec(0.0), vec(0.0), vec(-math.inf)
        arg = torch.zeros(n, dtype=torch.long, device=dev)
        arg_r = torch.zeros(n, dtype=torch.long, device=dev)
        for v0 in range(0, vocab, vocab_chunk):
            v1 = min(v0 + vocab_chunk, vocab)
            rows = head[v0:v1].to(h.device)
            mine = rows.to(head_dtype) if head_dtype is not None else rows
            logits = (h @ mine.float().T).double()
            top, where = logits.max(-1)
            new = torch.maximum(m, top)
            s = s * torch.exp(m - new) + torch.exp(logits - new[:, None]).sum(-1)
            m = new
            inside = (target >= v0) & (target < v1)
            tgt[inside] = logits[inside, target[inside] - v0]
            up = top > best
            best, arg = torch.where(up, top, best), torch.where(up, where + v0, arg)
            if hr is not None:
                lr = (hr @ rows.float().T).double()
                top_r, where_r = lr.max(-1)
                new_r = torch.maximum(mr, top_r)
                scale = torch.exp(mr - new_r)
                e = torch.exp(lr - new_r[:, None])
                sr = sr * scale + e.sum(-1)
                s1 = s1 * scale + (e * (lr - logits)).sum(-1)
                mr = new_r
                tgt_r[inside] = lr[inside, target[inside] - v0]
                up_r = top_r > best_r
                best_r, arg_r = torch.where(up_r, top_r, best_r), torch.where(up_r, where_r + v0, arg_r)
        lse = m + torch.log(s)
        window_nll = float((lse - tgt).sum())
        nll += window_nll
        losses.append(window_nll / n)
        if hr is not None:
            lse_r = mr + torch.log(sr)
            ref_nll += float((lse_r - tgt_r).sum())
            kl += float((s1 / sr - lse_r + lse).sum())
            agree += int((arg == arg_r).sum())
        count += n
    res = EvalResult(math.exp(nll / count), count, ids.shape[1], ids.shape[0])
    if reference is not None:
        res.kl, res.top1, res.reference_perplexity = kl / count, agree / count, math.exp(ref_nll / count)
    return res, losses
