"""A streamed conversion's per-layer files in its work folder (docs/design.md §Streaming): pass 1's plan and
statistics, a quantized source's float32 layer, the converted attention tensors (with the refit ``o_proj`` beside
them), and the output checkpoint read from them (its tensor layout and a loader, tensor by tensor)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from mla_convert.convert.layer.converter import LayerSource, rounded_layer
from mla_convert.convert.layer.layers import attention_weights, layer_prefix, read_checked
from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.modeling import MLADecoderLayer
from mla_convert.sources.checkpoint import SourceModel

#: The suffix of a refit ``o_proj`` written beside the assembled one (``...o_proj.weight@fit``).
FIT = "@fit"


class LayerFiles:
    """The per-layer files of one conversion in ``work``, written in ``dtype`` (``rope_inv_freq`` float32).

    Args:
        work: the work folder (:mod:`mla_convert.convert.pipeline.workdir`).
        src: the opened source (the output's other tensors are read from it).
        dtype: the output dtype.
    """

    def __init__(self, work: Path, src: SourceModel, dtype: torch.dtype) -> None:
        self.work, self.src, self.dtype = work, src, dtype

    def path(self, i: int, suffix: str) -> Path:
        """Layer ``i``'s file ``layer-III.SUFFIX`` (``plan.pt``, ``p1.pt``, ``src.safetensors``, ``safetensors``)."""
        return self.work / f"layer-{i:03d}.{suffix}"

    def source_tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s source tensors (float32, names inside the layer): from the work folder's float32 copy
        when pass 1 left one (quantized GGUF sources: dequantized once), else read from the source."""
        from safetensors.torch import load_file

        cached = self.path(i, "src.safetensors")
        if cached.is_file():
            return load_file(str(cached))
        prefix = layer_prefix(i)
        return {
            n[len(prefix) :]: read_checked(self.src, n, torch.float32, torch.device("cpu"))
            for n in self.src.weight_map
            if n.startswith(prefix)
        }

    def layer_source(self, i: int) -> LayerSource:
        """Layer ``i`` as the per-layer converter reads it: its float64 attention weights
        (:func:`~mla_convert.convert.layer.layers.attention_weights`) and its other source tensors (the float32
        attention tensors are dropped once copied: 160 MB at Llama-3-8B's shapes)."""
        tensors = self.source_tensors(i)
        weights = attention_weights(self.src, i, tensors)
        return LayerSource(i, {k: v for k, v in tensors.items() if not k.startswith("self_attn.")}, weights)

    def written_layer(self, config: MLAConfig, i: int, attn: dict[str, torch.Tensor], device: torch.device) -> MLADecoderLayer:
        """The converted layer ``i`` on ``device`` with the attention tensors ``attn`` as written (every weight
        rounded to the output dtype)."""
        return rounded_layer(config, LayerSource(i, self.source_tensors(i), {}), attn, device, self.dtype)

    def write_attention(self, i: int, attn: dict[str, torch.Tensor], fit_w: torch.Tensor | None) -> None:
        """Layer ``i``'s converted attention tensors (names inside ``self_attn``) and the refit ``o_proj`` ``fit_w``
        (None: no refit at this layer), written atomically."""
        from safetensors.torch import save_file

        prefix = f"{layer_prefix(i)}self_attn."
        tensors = {
            prefix + k: (v if k == "rope_inv_freq" else v.to(self.dtype)).contiguous() for k, v in attn.items()
        }
        if fit_w is not None:
            tensors[prefix + "o_proj.weight" + FIT] = fit_w.to(self.dtype).cpu().contiguous()
        tmp = self.path(i, "safetensors.tmp")
        save_file(tensors, str(tmp))
        tmp.replace(self.path(i, "safetensors"))

    def read_attention(self, i: int, fit: bool) -> dict[str, torch.Tensor]:
        """Layer ``i``'s attention tensors as written (float32, names inside ``self_attn``), with the refit
        ``o_proj`` where ``fit`` and the layer has one."""
        from safetensors import safe_open

        prefix = f"{layer_prefix(i)}self_attn."
        with safe_open(str(self.path(i, "safetensors")), framework="pt") as f:
            attn = {k[len(prefix) :]: f.get_tensor(k).float() for k in f.keys() if not k.endswith(FIT)}
            if fit and f"{prefix}o_proj.weight{FIT}" in f.keys():
                attn["o_proj.weight"] = f.get_tensor(f"{prefix}o_proj.weight{FIT}").float()
        return attn

    def layout(self, config: MLAConfig) -> dict[str, torch.Tensor]:
        """Every tensor of the output checkpoint as a meta tensor (name, shape, dtype), in model order."""
        from safetensors import safe_open

        src, out = self.src, {}

        def meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="meta")

        out["model.embed_tokens.weight"] = meta(src.shape("model.embed_tokens.weight"), self.dtype)
        for i in range(config.num_hidden_layers):
            with safe_open(str(self.path(i, "safetensors")), framework="pt") as f:
                for name in f.keys():
                    if not name.endswith(FIT):
                        dt = torch.float32 if name.endswith("rope_inv_freq") else self.dtype
                        out[name] = meta(tuple(f.get_slice(name).get_shape()), dt)
            prefix = layer_prefix(i)
            for name in src.weight_map:
                if name.startswith(prefix) and ".self_attn." not in name:
                    out[name] = meta(src.shape(name), self.dtype)
        out["model.norm.weight"] = meta(src.shape("model.norm.weight"), self.dtype)
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = meta(src.shape("lm_head.weight"), self.dtype)
        return out

    def loader(self, fit: bool) -> Callable[[str], torch.Tensor]:
        """``name -> tensor`` of the output checkpoint: converted attention from the layer files (the refit
        ``o_proj`` where ``fit``), everything else from the source in the output dtype."""
        from safetensors import safe_open

        def load(name: str) -> torch.Tensor:
            if ".self_attn." in name:
                i = int(name.split(".")[2])
                with safe_open(str(self.path(i, "safetensors")), framework="pt") as f:
                    if fit and name.endswith("o_proj.weight") and f"{name}{FIT}" in f.keys():
                        return f.get_tensor(f"{name}{FIT}")
                    return f.get_tensor(name)
            tensor = read_checked(self.src, name, self.src.storage_dtype(name), torch.device("cpu")).to(self.dtype)
            self.src.release()  # the shard's source pages leave the resident set tensor by tensor
            return tensor

        return load
