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
