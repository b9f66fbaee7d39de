"""The export's parity measured one decoder layer at a time, for models too large to hold whole in float32 twice.

Stock transformers' own ``DeepseekV3DecoderLayer`` (the class ``DeepseekV3ForCausalLM`` builds, found on a
``meta``-device skeleton of the export's config, so nothing is allocated) holds layer ``i``'s tensors read from the
staged export with safetensors' ``safe_open`` (that layer's only); our
:class:`~mla_convert.mla.modeling.MLADecoderLayer` holds the checkpoint's layer-``i`` tensors (rounded to the
export's dtype, as :func:`mla_convert.engines.deepseek_v3.write.parity` rounds our whole model). Both run in float32 on the
real-text windows, each window alone (``[1, T]``, as the whole-model check runs them), with the inputs
``DeepseekV3Model.forward`` gives its layers: positions ``arange(T)``, the rotary embedding class of the
export's config, and ``create_causal_mask`` of that config.

Two residual streams run side by side:

* **ours**: our layers, from our embedding rows. Layer ``i`` of the export gets our hidden state as input (times
  the export's ``residual_scale`` ``s``, docs/export.md) and its output divided by ``s`` is compared with our
  layer's: max ``|Δ|`` and that relative to the largest ``|output|`` of our layer, per layer. A wrong mapping of
  one layer shows there, named, whatever the other layers do.
* **stock**: the export's layers on the export's own stream, from its embedding rows, exactly what
  ``DeepseekV3ForCausalLM`` computes; its final norm and ``lm_head`` against ours give the max ``|Δlogit|``
  of the whole-model check (equal to it to float rounding: ``tests/export/test_parity_layers.py``).

Memory: two decoder layers in float32 (about 1.8 GB for an 8B Llama-shaped model), the windows' hidden states, the
embedding rows of the windows' tokens, and :data:`HEAD_ROWS` vocabulary rows of each ``lm_head`` at a time; the
checkpoint's and the export's files are read through memory maps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mla_convert.engines.deepseek_v3.mapping import ExportError

#: The module stock transformers' DeepSeek-V3 classes come from (anything else is not the stock model).
STOCK_MODULE = "transformers.models.deepseek_v3.modeling_deepseek_v3"
#: Vocabulary rows of ``lm_head`` read and scored at a time (8192 x 4096 float32 = 128 MiB).
HEAD_ROWS = 8192


class _Folder:
    """A safetensors folder (sharded or not) read one tensor, or a slice of rows, at a time through ``safe_open``."""

    def __init__(self, path: Path, what: str) -> None:
        from mla_convert.sources.weights import weight_map

        try:
            self.map = weight_map(path)
        except ValueError as exc:
            raise ExportError(f"the layer-by-layer parity cannot read {what} {path}: {exc}") from None
        self.path = path
        self.what = what
        self._handles: dict[str, Any] = {}

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.map:
            raise ExportError(f"{self.what} {self.path} has no tensor {name!r}; it is incomplete")
        file = self.map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]

    def _slice(self, name: str) -> Any:
        return self._handle(name).get_slice(name)

    def names(self, prefix: str) -> list[str]:
        """The tensors whose names start with ``prefix``."""
        return [n for n in self.map if n.startswith(prefix)]

    def read(self, name: str) -> torch.Tensor:
        """One whole tensor, as stored."""
        out: torch.Tensor = self._handle(name).get_tensor(name)
        return out

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a 2-D tensor, read without the rest."""
        out: torch.Tensor = self._slice(name)[start:stop]
        return out

    def vocab(self, name: str) -> int:
        """The first dimension of ``name``."""
        return int(self._slice(name).get_shape()[0])

    def take(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (token ids of any shape) of a 2-D tensor, ``[*ids.shape, cols]``, read row by row."""
        uniq, inverse = torch.unique(ids, return_inverse=True)
        rows = torch.cat([self.rows(name, int(t), int(t) + 1) for t in uniq])
        return rows[inverse]

    def release(self) -> None:
        """Close the files (their mapped pages stop counting as this process's memory)."""
        self._handles.clear()


class _Stock:
    """Stock transformers' DeepSeek-V3 parts for the export's config, as ``DeepseekV3ForCausalLM`` builds them:
    the decoder layer class, the rotary embedding, the final norm class and the resolved config."""

    def __init__(self, staged: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(str(staged))
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise ExportError(f"stock transformers cannot build the export: {str(exc).splitlines()[0]}") from None
        if type(skeleton).__module__ != STOCK_MODULE:
            raise ExportError(f"the export builds as {type(skeleton).__module__}, not transformers' DeepseekV3ForCausalLM")
        self.config = skeleton.config  # attention implementation resolved as from_pretrained resolves it
        self.layer_cls: type[nn.Module] = type(skeleton.model.layers[0])
        self.norm_cls: type[nn.Module] = type(skeleton.model.norm)
        self.rotary = type(skeleton.model.rotary_emb)(config=self.config)
        self.stock_class = f"{self.layer_cls.__module__}.{self.layer_cls.__name__}"
        del skeleton

    def layer(self, i: int, state: dict[str, torch.Tensor]) -> nn.Module:
        """``DeepseekV3DecoderLayer`` ``i`` holding ``state`` (names inside the layer, float32).

        Raises:
            ExportError: the tensors do not fit the config's layer (names the layer).
        """
        with torch.device("meta"):
            layer = self.layer_cls(self.config, i)
        try:
            layer.load_state_dict(state, assign=True, strict=True)
        except RuntimeError as exc:
            raise ExportError(
                f"layer {i} of the export does not fit stock DeepseekV3DecoderLayer: {str(exc).splitlines()[0]}"
            ) from None
        return layer.eval()

    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``layer`` on windows ``hidden [N, T, D]``, one window at a time, with the position ids, rotary embedding
        and causal mask ``DeepseekV3Model.forward`` makes for a ``[1, T]`` input without padding."""
        from transformers.masking_utils import create_causal_mask

        out = torch.empty_like(hidden)
        for n in range(hidden.shape[0]):
            h = hidden[n : n + 1]
            pos = torch.arange(h.shape[1]).unsqueeze(0)
            mask = create_causal_mask(
                config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos
            )
            res = layer(
                h,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=None,
                use_cache=False,
                position_embeddings=self.rotary(h, pos),
            )
            out[n : n + 1] = res[0] if isinstance(res, tuple) else res
        return out


def _ours_run(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Our decoder ``layer`` on windows ``hidden [N, T, D]``, one window at a time, as ``MLAModel.forward`` runs it."""
    from mla_convert.mla.algebra import causal_mask

    out = torch.empty_like(hidden)
    for n in range(hidden.shape[0]):
        h = hidden[n : n + 1]
        t = h.shape[1]
        pos = torch.arange(t)[None]
        out[n : n + 1] = layer(h, pos, causal_mask(1, t, 0, None, h.dtype, h.device), None)
    return out


@torch.no_grad()
def layerwise(
    ckpt: Path, staged: Path, ids: torch.Tensor, dtype: torch.dtype, residual_scale: float, keep_logits: bool = False
) -> tuple[dict[str, Any], tuple[torch.Tensor, torch.Tensor] | None]:
    """The layer-by-layer parity (module docstring) of the staged export ``staged`` against the MLA checkpoint
    ``ckpt`` on token windows ``ids [N, T]``.

    Args:
        dtype: the export's dtype; our tensors are rounded to it first (RoPE frequencies stay float32).
        residual_scale: ``s``, the export's residual-stream scale (``ExportPlan.residual_scale``).
        keep_logits: also return both models' logits ``[N, T, vocab]`` (ours, stock) (tests; costs their memory).

    Returns:
        ``(record, logits)``: ``record`` holds ``max_abs_logit_diff`` (float32 logits, the two streams),
        ``argmax_equal`` (positions whose top token agrees), ``layers`` (per layer ``max_abs_diff`` and
        ``relative``, the latter over our layer output's max ``|.|``) and ``stock_class``.

    Raises:
        ExportError: a file or tensor missing, a layer whose tensors do not fit stock transformers' layer (named).
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from mla_convert.convert.layer.layers import mla_layer
    from mla_convert.mla.configuration import MLAConfig

    config = MLAConfig.from_pretrained(str(ckpt))
    stock = _Stock(staged)
    ours_f, export_f = _Folder(ckpt, "the MLA checkpoint"), _Folder(staged, "the staged export")

    def ours_tensor(t: torch.Tensor, name: str) -> torch.Tensor:
        return t.float() if name.endswith("rope_inv_freq") else t.to(dtype).float()

    s = residual_scale
    h_ours = ours_tensor(ours_f.take("model.embed_tokens.weight", ids), "")
    h_stock = export_f.take("model.embed_tokens.weight", ids).float()
    layers: list[dict[str, Any]] = []
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        mine = {n[len(prefix) :]: ours_tensor(ours_f.read(n), n) for n in ours_f.names(prefix)}
        try:
            ours_layer = mla_layer(config, i, mine, torch.device("cpu"))
        except RuntimeError as exc:
            raise ExportError(f"layer {i} of {ckpt} does not fit its config: {str(exc).splitlines()[0]}") from None
        theirs = {n[len(prefix) :]: export_f.read(n).float() for n in export_f.names(prefix)}
        stock_layer = stock.layer(i, theirs)
        out_ours = _ours_run(ours_layer, h_ours)
        out_local = stock.run(stock_layer, h_ours * s) / s
        h_stock = stock.run(stock_layer, h_stock)
        diff = float((out_local - out_ours).abs().max())
        layers.append(
            {"layer": i, "max_abs_diff": diff, "relative": diff / max(float(out_ours.abs().max()), 1e-30)}
        )
        h_ours = out_ours
        del mine, theirs, ours_layer, stock_layer, out_local
    norm_ours = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    norm_ours.weight.data = ours_tensor(ours_f.read("model.norm.weight"), "")
    norm_stock = stock.norm_cls(stock.config.hidden_size, eps=stock.config.rms_norm_eps)
    norm_stock.weight.data = export_f.read("model.norm.weight").float()
    x_ours, x_stock = norm_ours(h_ours), norm_stock(h_stock)
    head_ours = "lm_head.weight" if "lm_head.weight" in ours_f.map else "model.embed_tokens.weight"
    vocab = export_f.vocab("lm_head.weight")
    diff, best_ours, best_stock = 0.0, None, None
    kept: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for start in range(0, vocab, HEAD_ROWS):
        stop = min(start + HEAD_ROWS, vocab)
        lo = nn.functional.linear(x_ours, ours_tensor(ours_f.rows(head_ours, start, stop), ""))
        ls = nn.functional.linear(x_stock, export_f.rows("lm_head.weight", start, stop).float())
        diff = max(diff, float((lo - ls).abs().max()))
        best_ours = _running_argmax(best_ours, lo, start)
        best_stock = _running_argmax(best_stock, ls, start)
        if keep_logits:
            kept[0].append(lo)
            kept[1].append(ls)
    ours_f.release()
    export_f.release()
    assert best_ours is not None and best_stock is not None
    record = {
        "max_abs_logit_diff": diff,
        "argmax_equal": int((best_ours[1] == best_stock[1]).sum()),
        "layers": layers,
        "stock_class": stock.stock_class,
    }
    logits = (torch.cat(kept[0], -1), torch.cat(kept[1], -1)) if keep_logits else None
    return record, logits


def _running_argmax(
    best: tuple[torch.Tensor, torch.Tensor] | None, chunk: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max value, argmax)`` over the vocabulary so far, updated with the logits ``chunk`` of rows ``start:``."""
    value, index = chunk.max(-1)
    index = index + start
    if best is None:
        return value, index
    better = value > best[0]
    return torch.where(better, value, best[0]), torch.where(better, index, best[1])
