"""Where and in what dtype a conversion runs, and handing freed memory back between layers."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mla_convert.sources.checkpoint import SourceModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def trim_heap() -> None:
    """Hand freed heap pages back to the system (glibc ``malloc_trim``; a no-op elsewhere), so the resident
    set after a layer is what the next layer holds, not the high-water mark of the last one."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside, :func:`trim_heap`'s ``gc.collect`` skips every Python object that existed on entry (``gc.freeze``):
    a process holding a tokenizer and the transformers modules has ~375k of them, and a full collection over them
    cost 0.25 s per layer on a 2-core CPU (25 s of a SmolLM2 conversion). On exit they are collectable again
    (``gc.unfreeze``). Objects made inside are collected as before; frozen ones freed by reference count still are.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def resolve_device(spec: str) -> torch.device:
    """``auto`` (a CUDA GPU when present, else the CPU), ``cpu`` or ``cuda[:N]``.

    Raises:
        OptionsError: a CUDA device this torch build or machine does not have.
    """
    from mla_convert.convert.options import OptionsError

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionsError(f"--device {spec}: this torch build or machine has no CUDA GPU; use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise OptionsError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def resolve_dtype(spec: str, src: SourceModel) -> torch.dtype:
    """The written checkpoint's dtype: ``auto`` is the source config's ``dtype``/``torch_dtype`` (float32 when
    it names none or another type), else the named one."""
    if spec != "auto":
        return DTYPES[spec]
    named = getattr(src.config, "dtype", None) or getattr(src.config, "torch_dtype", None)
    name = str(named).replace("torch.", "") if named is not None else "float32"
    return DTYPES.get(name, torch.float32)
