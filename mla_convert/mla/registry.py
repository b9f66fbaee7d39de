"""``model_type: mla`` registered with transformers' Auto classes (:func:`register`, also ``mla_convert.register``).

Importing this module imports neither torch nor transformers; :func:`register` does.
"""

from __future__ import annotations

import os
import sys

_REGISTERED = False


def register() -> None:
    """Register ``model_type: mla`` with transformers' Auto classes (idempotent); imports torch and transformers."""
    global _REGISTERED
    if _REGISTERED:
        return
    import torch

    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    from mla_convert.mla.configuration import MLAConfig
    from mla_convert.mla.modeling import MLAForCausalLM

    AutoConfig.register("mla", MLAConfig, exist_ok=True)
    AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)
    _REGISTERED = True
