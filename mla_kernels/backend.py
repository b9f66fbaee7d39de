"""How the Triton kernels run here (:func:`kernel_backend`), apart from the kernels so that they can ask too."""

from __future__ import annotations

import os

import torch


def kernel_backend() -> str:
    """``"triton-cuda"`` or ``"triton-interpreter"``: how :func:`load_kernel`'s kernel runs here."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return "triton-interpreter" if interpret or not torch.cuda.is_available() else "triton-cuda"
