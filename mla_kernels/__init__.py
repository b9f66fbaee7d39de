"""The bundled latent-cache decode kernel and its PyTorch oracle.

Importing :func:`load_kernel` chooses how Triton runs: on a CUDA GPU natively; without one, through the
Triton interpreter (``TRITON_INTERPRET=1`` is set before the kernel module is first imported, unless the
caller set it). :func:`kernel_backend` says which of the two is in use, for the records.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from mla_convert.errors import UserError

from .backend import kernel_backend
from .reference import check_decode_inputs, latent_decode_reference

__all__ = [
    "KernelUnavailable",
    "check_decode_inputs",
    "kernel_backend",
    "latent_decode_reference",
    "load_kernel",
]


class KernelUnavailable(UserError, RuntimeError):
    """Triton is missing or cannot run here; the message says why and how to fix it."""


def load_kernel() -> ModuleType:
    """Import :mod:`mla_convert.kernels.latent_decode` (the Triton kernels).

    Raises:
        KernelUnavailable: Triton is not installed.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.language as tl

        from . import latent_decode
    except ImportError as err:  # pragma: no cover - depends on the install
        raise KernelUnavailable(
            f"the Triton kernel cannot be imported ({err}); install triton (pip install -e .) or use "
            "--backend absorbed"
        ) from err
    if kernel_backend() == "triton-interpreter" and type(tl.zeros).__name__ != "InterpretedFunction":
        raise KernelUnavailable(
            "Triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on this CPU; "
            "export TRITON_INTERPRET=1 (or import mla_convert before triton)"
        )
    return latent_decode
