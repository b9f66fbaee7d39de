"""mla-convert: turn MHA/GQA transformer checkpoints into Multi-Head Latent Attention checkpoints.

Importing this package registers the ``mla`` model type with transformers' ``AutoConfig`` and
``AutoModelForCausalLM``, so converted checkpoints load with ``from_pretrained`` and no remote code.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_mla import MLAConfig
from .modeling_mla import MLAForCausalLM

__version__ = "0.1.0"

AutoConfig.register("mla", MLAConfig, exist_ok=True)
AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)

__all__ = ["MLAConfig", "MLAForCausalLM", "__version__"]
