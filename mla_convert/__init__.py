"""mla-convert: turn MHA/GQA transformer checkpoints into Multi-Head Latent Attention checkpoints.

Importing this package registers the ``mla`` model type with transformers' ``AutoConfig`` and
``AutoModelForCausalLM``, so converted checkpoints load with ``from_pretrained`` and no remote code.

On a machine without a CUDA GPU it also sets ``TRITON_INTERPRET=1`` (unless already set) before anything
imports Triton: the bundled decode kernel can then only run in the Triton interpreter, and Triton reads
that switch once, when it is first imported.
"""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoConfig, AutoModelForCausalLM

from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.modeling import MLAForCausalLM

__version__ = "0.1.0"

AutoConfig.register("mla", MLAConfig, exist_ok=True)
AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)

__all__ = ["MLAConfig", "MLAForCausalLM", "__version__"]
