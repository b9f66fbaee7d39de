"""Greedy decoding: through the paged latent cache (the product path: prefill, then one token per step), through
``generate()`` (transformers' cache), and by full recomputation (the oracle of both).

The persistent state is a :class:`~mla_convert.runtime.paged_cache.PagedLatentCache` holding ``[c_kv | rotated
k_rope]`` rows only. ``backend="triton"`` runs prefill and every decode step on the bundled Triton kernel
(on the model's device) and ``"absorbed"`` on the torch absorbed math, both over the rows they wrote. The backends that actually ran are returned (``backend_log``), never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mla_convert.runtime.paged_cache import PagedLatentCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from mla_convert.mla.modeling import MLAForCausalLM

DECODE_BACKENDS = ("triton", "absorbed")


@dataclass
class DecodeResult:
    """Output of :func:`generate`.

    Attributes:
        tokens: ``[B, T + new]`` prompt and generated ids.
        step_logits: ``[B, new, vocab]`` float32 logits that chose each generated token (the last
            prefill position first).
        cache: the paged cache after the last step (committed length ``T + new - 1`` per request: the
            last generated token is never fed back).
        backend_log: attention calls per backend and phase, e.g. ``{"triton-interpreter:decode": 270}``.
        step_seconds: wall time of each decode step (seconds), prefill excluded.
        layer_inputs: every layer's attention input over the request (``[B, T + new - 1, hidden]`` each) when
            the caller captured them (validate's rung 3); empty otherwise.
    """

    tokens: torch.Tensor
    step_logits: torch.Tensor
    cache: PagedLatentCache
    backend_log: dict[str, int] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)
    layer_inputs: list[torch.Tensor] = field(default_factory=list)


@torch.no_grad()
def generate(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    backend: str = "triton",
    page_size: int = 16,
    shuffle_pages: bool = False,
    cache: PagedLatentCache | None = None,
    cache_dtype: str = "model",
    graph: bool = False,
    fold: bool = True,
) -> DecodeResult:
    """Greedy decode ``max_new_tokens`` tokens for each prompt row (no EOS stop, equal prompt lengths).

    Args:
        model: an :class:`~mla_convert.mla.modeling.MLAForCausalLM`.
        input_ids: ``[B, T]`` prompt ids, ``T >= 1``.
        backend: ``"triton"`` (decode steps on the kernel) or ``"absorbed"`` (torch).
        page_size: cache page size in tokens (1..128).
        shuffle_pages: allocate pages in a random order (tests, ``validate``).
        cache: reuse a cache (new requests are added to it); default: a fresh one sized for the job.
        cache_dtype: rows of a fresh cache in the model's dtype (``"model"``) or as FP8 rows (``"fp8"``: E4M3
            latent with float32 scales per group and bfloat16 rope, :mod:`mla_convert.kernels.fp8`).
        graph: run the decode steps through a :class:`~mla_convert.runtime.graph.DecodeGraph` (``triton``
            backend only): captured as a CUDA graph on a GPU, the same static-buffer step run eagerly elsewhere.
        fold: fold ``W_UK``/``W_UV`` into ``q_proj``/``o_proj`` where it saves work
            (:meth:`~mla_convert.mla.modeling.MLAForCausalLM.set_folding`; the same function to float rounding);
            the model's previous setting comes back afterwards.

    Returns:
        A :class:`DecodeResult`.

    Raises:
        ValueError: unknown backend or cache dtype, or empty prompt; ``KernelUnavailable`` when Triton cannot run.
    """
    import time

    if backend not in DECODE_BACKENDS:
        raise ValueError(f"unknown decode backend {backend!r}; choose one of {DECODE_BACKENDS}")
    if cache_dtype not in ("model", "fp8"):
        raise ValueError(f"unknown cache dtype {cache_dtype!r}; choose 'model' or 'fp8'")
    if graph and backend != "triton":
        raise ValueError("a decode graph runs the triton backend; use backend='triton' or graph=False")
    b, t = input_ids.shape
    if t < 1 or max_new_tokens < 1:
        raise ValueError("need a prompt of at least one token and max_new_tokens >= 1")
    if cache is None:
        cache = PagedLatentCache.for_model(
            model.config,
            b * (t + max_new_tokens + page_size),
            page_size,
            dtype=model.dtype,
            device=input_ids.device,
            shuffle_pages=shuffle_pages,
            fp8=cache_dtype == "fp8",
        )
    cache.bind([cache.add_request() for _ in range(b)])
    before = dict(cache.backend_log)
    previous = model.config.attn_implementation_mla
    folding = model.folding
    model.set_attention_path(backend)
    model.set_folding(fold)
    try:
        logits = model(input_ids=input_ids, past_key_values=cache).logits[:, -1].float()
        chosen = [logits]
        tokens = [input_ids, logits.argmax(-1, keepdim=True)]
        steps: list[float] = []
        decode_graph = None
        if graph and max_new_tokens > 1:
            from mla_convert.runtime.graph import DecodeGraph

            decode_graph = DecodeGraph(model, cache, t + max_new_tokens - 1)
        for _ in range(max_new_tokens - 1):
            start = time.perf_counter()
            if decode_graph is not None:
                logits = decode_graph.step(tokens[-1]).clone()
            else:
                logits = model(input_ids=tokens[-1], past_key_values=cache).logits[:, -1].float()
            steps.append(time.perf_counter() - start)
            chosen.append(logits)
            tokens.append(logits.argmax(-1, keepdim=True))
    finally:
        model.set_attention_path(previous)
        model.set_folding(folding)
    log = {k: v - before.get(k, 0) for k, v in cache.backend_log.items() if v - before.get(k, 0)}
    return DecodeResult(torch.cat(tokens, dim=1), torch.stack(chosen, dim=1), cache, log, steps)


@torch.no_grad()
def greedy(
    model: MLAForCausalLM, input_ids: torch.Tensor, new_tokens: int, ignore_eos: bool = False
) -> torch.Tensor:
    """Greedy continuation through ``generate()`` (the model's cache path). Returns ``[1, T + new]`` or
    shorter when EOS is produced; ``ignore_eos`` forbids EOS until ``new_tokens`` (``min_new_tokens``)."""
    out = model.generate(  # type: ignore[misc]  # transformers' decorated generate has a malformed self type
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        min_new_tokens=new_tokens if ignore_eos else 0,
    )
    assert isinstance(out, torch.Tensor)  # no return_dict_in_generate: a plain id tensor
    return out


@torch.no_grad()
def greedy_recompute(
    model: PreTrainedModel, input_ids: torch.Tensor, new_tokens: int, ignore_eos: bool = False
) -> torch.Tensor:
    """Greedy continuation by full recomputation at every step (no cache): the oracle for :func:`greedy`."""
    ids = input_ids
    eos = model.generation_config.eos_token_id if ignore_eos else None
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    for _ in range(new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]
        if eos_ids:
            logits[:, eos_ids] = float("-inf")
        nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        if (
            not ignore_eos
            and model.generation_config.eos_token_id is not None
            and int(nxt)
            in (
                [model.generation_config.eos_token_id]
                if isinstance(model.generation_config.eos_token_id, int)
                else model.generation_config.eos_token_id
            )
        ):
            break
    return ids
