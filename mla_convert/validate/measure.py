"""What every rung of the ladder uses: timing, the error measure, dtypes, and the kernel's device.

:func:`kernel_device` is where the Triton kernel runs (``cuda`` where Triton runs natively, else the CPU of the
interpreter): every rung that launches the kernel puts its inputs there, and moves the results back to the CPU,
where the checks run. :func:`rel_err` is the ladder's relative error, ``max|a - b| / max|b|``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch

from mla_convert.runtime.decode import generate
from mla_convert.validate.result import Rung

if TYPE_CHECKING:  # importing the model class imports transformers' Llama code, which imports Triton
    from mla_convert.mla.modeling import MLAForCausalLM

P = ParamSpec("P")
R = TypeVar("R")


def timed(fn: Callable[P, R]) -> Callable[P, R]:
    """Run a rung under ``torch.no_grad`` and set its ``seconds`` (wall time; the rung is the result or the
    first item of a tuple result)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        start = time.perf_counter()
        with torch.no_grad():
            out = fn(*args, **kwargs)
        rung = out[0] if isinstance(out, tuple) else out
        assert isinstance(rung, Rung)
        rung.seconds = round(time.perf_counter() - start, 2)
        return out

    return run


#: torch dtypes by name (the names :func:`~mla_convert.mla.checkpoint.checkpoint_dtype` returns).
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kernel_unsupported(dtype: str) -> str | None:
    """Why the Triton kernel cannot run ``dtype`` on this machine (the interpreter has no bfloat16: it runs but
    returns garbage), or None when it can."""
    from mla_convert.kernels import kernel_backend

    if dtype == "bfloat16" and kernel_backend() == "triton-interpreter":
        return "the Triton interpreter (no GPU) does not support bfloat16"
    return None


@contextmanager
def in_dtype(model: torch.nn.Module, dtype: str) -> Iterator[None]:
    """Run ``model`` (loaded in float32 from a checkpoint stored in ``dtype``) with its parameters in ``dtype``,
    as ``from_pretrained(..., dtype=dtype)`` loads them; buffers (the float32 ``rope_inv_freq``) stay as they
    are. The weights go back to float32 on exit, exactly (they were ``dtype`` values). Memory: the weights
    are replaced one by one, so no second copy of the model is held."""
    target = DTYPES[dtype]
    if target == torch.float32:
        yield
        return
    for param in model.parameters():
        param.data = param.data.to(target)
    try:
        yield
    finally:
        for param in model.parameters():
            param.data = param.data.to(torch.float32)


def kernel_device() -> torch.device:
    """The device the Triton kernel runs on: ``cuda`` where it runs natively (``triton-cuda``: it takes no CPU
    tensors), the CPU under the Triton interpreter."""
    from mla_convert.kernels import kernel_backend

    return torch.device("cuda" if kernel_backend() == "triton-cuda" else "cpu")


def decode_on_kernel_device(
    model: MLAForCausalLM, prompt: torch.Tensor, new_tokens: int, backend: str, page_size: int
) -> Any:
    """:func:`~mla_convert.runtime.decode.generate` on the device the kernel runs on (a CUDA GPU where Triton
    runs natively: the native kernel takes no CPU tensors), the model moved there for the call and back after;
    the result's tokens, step logits and cache come back on the CPU, where the rung's checks run.

    The result also carries ``layer_inputs``: every layer's attention input over the whole request
    (``[1, T, hidden]`` each, CPU; the prefill's rows then one row per decode step), the inputs the cache rows
    were written from (:func:`capture_layer_inputs`)."""
    device = kernel_device()
    if backend != "triton" or device.type == "cpu":
        with capture_layer_inputs(model) as inputs:
            res = generate(model, prompt, new_tokens, backend=backend, page_size=page_size, shuffle_pages=True)
        res.layer_inputs = inputs
        return res
    torch.nn.Module.to(model, device)
    try:
        with capture_layer_inputs(model) as inputs:
            res = generate(
                model, prompt.to(device), new_tokens, backend=backend, page_size=page_size, shuffle_pages=True
            )
    finally:
        torch.nn.Module.to(model, torch.device("cpu"))
    res.tokens, res.step_logits = res.tokens.cpu(), res.step_logits.cpu()
    res.cache.to("cpu")
    res.layer_inputs = inputs
    return res


@contextmanager
def capture_layer_inputs(model: MLAForCausalLM) -> Iterator[list[torch.Tensor]]:
    """Record every layer's attention input ``x [1, t, hidden]`` over every forward call inside the block (one
    request: a prefill, then decode steps); on exit the yielded list holds, per layer, the calls' inputs
    concatenated along the sequence (``[1, T, hidden]``, on the CPU)."""
    calls: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    handles = [
        layer.self_attn.register_forward_pre_hook(
            lambda _m, args, i=i: calls[i].append(args[0].detach().cpu())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    inputs: list[torch.Tensor] = []
    try:
        yield inputs
    finally:
        for handle in handles:
            handle.remove()
    inputs.extend(torch.cat(per_layer, dim=1) for per_layer in calls if per_layer)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64 (0 when both are empty)."""
    if b.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def capture_attention_inputs(
    model: MLAForCausalLM, ids: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run ``model`` on ``ids [B, T]`` without a cache and capture every layer's attention input
    ``x [B, T, hidden]``.

    Returns:
        The per-layer inputs (in layer order) and the logits ``[B, T, vocab]``.
    """
    seen: list[torch.Tensor] = []
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
        for layer in model.model.layers
    ]
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen, logits
