"""Source model families described as data (one JSON file per family, mergekit-style).

A family names the attention tensors per layer (``${layer}`` placeholder), the tensors copied through
unchanged, which projections carry a bias, and which config fields switch on sliding-window
attention. Adding a Llama-like family is adding a JSON file here.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict

#: Architectures refused before any work, with the reason shown to the user.
REFUSED: dict[str, str] = {
    "qwen3": "QK-norm sits between the projection and RoPE, so keys are not a linear map of the input",
    "qwen3_moe": "QK-norm sits between the projection and RoPE, so keys are not a linear map of the input",
    "gemma3": "QK-norm and alternating sliding-window attention",
    "gemma3_text": "QK-norm and alternating sliding-window attention",
    "gemma2": "alternating sliding-window attention and logit soft-capping",
    "olmo2": "QK-norm sits between the projection and RoPE",
    "cohere2": "alternating sliding-window attention",
    "deepseek_v2": "the model already uses MLA",
    "deepseek_v3": "the model already uses MLA",
    "mla": "the model is already an mla-convert MLA checkpoint (load it with `import mla_convert`, or write a "
    "stock-transformers copy with `mla-convert export CKPT OUT --format deepseek-v3`)",
}


class Family(BaseModel):
    """One source family. ``layer`` maps q_proj/k_proj/v_proj/o_proj to tensor prefixes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    model_types: list[str]
    description: str
    bias: dict[str, bool | str]
    sliding_window_fields: list[str]
    layer: dict[str, str]
    copy_layer: list[str]
    copy_global: list[str]
    lm_head: str

    def attn(self, proj: str, layer: int, kind: str = "weight") -> str:
        """Tensor name of ``proj`` (``q_proj``...) in ``layer``: ``<prefix>.weight`` or ``.bias``."""
        return f"{self.layer[proj].replace('${layer}', str(layer))}.{kind}"

    def copied(self, num_layers: int) -> list[str]:
        """Every non-attention tensor name copied unchanged (excluding ``lm_head``)."""
        names = list(self.copy_global)
        for i in range(num_layers):
            names += [n.replace("${layer}", str(i)) for n in self.copy_layer]
        return names

    def has_bias(self, proj: str, config: Any) -> bool:
        """Whether projection ``q``/``k``/``v``/``o`` has a bias under ``config``."""
        spec = self.bias[proj]
        if isinstance(spec, str) and spec.startswith("config:"):
            return bool(getattr(config, spec.split(":", 1)[1], False))
        return bool(spec)


@cache
def families() -> dict[str, Family]:
    """All bundled families keyed by ``model_type``."""
    out: dict[str, Family] = {}
    for entry in resources.files(__package__).iterdir():
        if entry.name.endswith(".json"):
            fam = Family(**json.loads(entry.read_text()))
            for mt in fam.model_types:
                out[mt] = fam
    return out
