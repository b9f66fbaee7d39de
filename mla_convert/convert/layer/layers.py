"""One decoder layer at a time: build a source or MLA layer from tensors read lazily, run token windows through it.

The streamed conversion (:mod:`mla_convert.convert.pipeline.stream`) never builds a whole model. A source layer is the
family's own transformers decoder layer class (found on a ``meta``-device skeleton of the model, so no weight
is allocated) with its tensors assigned from the checkpoint; an MLA layer is
:class:`~mla_convert.mla.modeling.MLADecoderLayer` with the converted attention tensors and the source's MLP and
norms. Windows run in chunks sized so one chunk's attention scores and MLP activations stay near
:data:`CHUNK_BYTES`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mla_convert.errors import UserError
from mla_convert.mla.algebra import causal_mask
from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.modeling import MLADecoderLayer
from mla_convert.sources.checkpoint import SourceModel
from mla_convert.sources.locate import SourceError

#: Target bytes of one chunk's attention scores and MLP activations (float32).
CHUNK_BYTES = 256 * 2**20


def layer_prefix(layer: int) -> str:
    """Tensor-name prefix of decoder layer ``layer`` (all supported families use the Llama layout)."""
    return f"model.layers.{layer}."


#: Elements checked at a time by :func:`all_finite` (its temporaries are a few bytes per element).
FINITE_CHUNK = 1 << 24


def all_finite(t: torch.Tensor, chunk: int = FINITE_CHUNK) -> bool:
    """Whether ``t`` holds no NaN or Inf, checked ``chunk`` elements at a time: ``torch.isfinite`` on a whole
    tensor allocates an ``abs`` copy and two boolean masks (measured: +2 GB transient for an 8B model's
    bfloat16 embedding), a chunk costs ~64 MB."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(chunk))


def read_checked(src: SourceModel, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One source tensor as ``dtype`` on ``device``.

    Raises:
        SourceError: the tensor holds NaN or Inf values (names the tensor).
    """
    t = src.tensor(name, dtype)
    if t.is_floating_point() and not all_finite(t):
        raise SourceError(
            f"tensor {name!r} of {src.origin} holds NaN or Inf values; the checkpoint is damaged, re-download or "
            "re-save it"
        )
    return t.to(device)


class DtypeRangeError(UserError):
    """A tensor holds values the chosen output dtype cannot represent (they would be written as ``inf``)."""


def check_fits(name: str, t: torch.Tensor, dtype: torch.dtype, chunk: int = FINITE_CHUNK) -> None:
    """Refuse ``t`` when its largest magnitude exceeds ``dtype``'s largest finite value (float16: 65504), so no
    weight is written as ``inf``; checked ``chunk`` elements at a time.

    Raises:
        DtypeRangeError: naming the tensor, its largest magnitude and a dtype that holds it.
    """
    if not dtype.is_floating_point or not t.is_floating_point() or t.numel() == 0:
        return
    limit = torch.finfo(dtype).max
    if torch.finfo(t.dtype).max <= limit:
        return
    big = max(float(part.abs().max()) for part in t.reshape(-1).split(chunk))
    if big > limit:
        fits = "bfloat16" if big <= torch.finfo(torch.bfloat16).max else "float32"
        name_dt = str(dtype).replace("torch.", "")
        raise DtypeRangeError(
            f"tensor {name!r} holds values up to {big:.4g}, beyond {name_dt}'s largest {limit:.4g} (they would be "
            f"written as inf); use --dtype {fits}"
        )


def chunk_rows(num_heads: int, tokens: int, hidden: int, intermediate: int) -> int:
    """Windows per chunk so that ``3 H T² + 3 T I + 8 T hidden`` float32 values fit :data:`CHUNK_BYTES`."""
    per_window = 4 * (3 * num_heads * tokens * tokens + 3 * tokens * intermediate + 8 * tokens * hidden)
    return max(1, CHUNK_BYTES // per_window)


def chunks(x: torch.Tensor, rows: int) -> Iterator[slice]:
    """Slices of ``rows`` windows over the first dimension of ``x``."""
    for start in range(0, x.shape[0], rows):
        yield slice(start, min(start + rows, x.shape[0]))


class SourceLayers:
    """Builds the source's decoder layers one at a time (float32, SDPA attention) on ``device``.

    Args:
        src: the opened source.
        device: where layers and activations live.
    """

    def __init__(self, src: SourceModel, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.src = src
        self.device = device
        config = copy.deepcopy(src.config)
        config._attn_implementation = "sdpa"
        self.config = config
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        self.layer_cls: type[nn.Module] = type(skeleton.model.layers[0])
        self.rotary = type(skeleton.model.rotary_emb)(config=config).to(device)
        del skeleton

    def layer(self, i: int, state: dict[str, torch.Tensor]) -> nn.Module:
        """Decoder layer ``i`` holding ``state`` (its float32 tensors, names inside the layer) on the device.

        Raises:
            SourceError: the tensors do not fit the family's layer class.
        """
        with torch.device("meta"):
            layer = self.layer_cls(self.config, i)
        try:
            layer.load_state_dict({k: v.to(self.device) for k, v in state.items()}, assign=True, strict=True)
        except RuntimeError as exc:
            raise SourceError(
                f"layer {i} of {self.src.origin} does not match its config: {str(exc).splitlines()[0]}"
            ) from exc
        return layer.eval()

    @torch.no_grad()
    def run(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        capture: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """Hidden states after ``layer`` for windows ``hidden [N, T, hidden]`` (float32).

        ``capture(x, out)`` receives each chunk's attention input (after ``input_layernorm``) and the source
        attention output. ``cache``: a transformers ``Cache`` the layer writes its K/V to (one chunk only).
        """
        rows = chunk_rows(self.src.num_heads, hidden.shape[1], self.src.hidden_size, self.src.intermediate_size)
        out = torch.empty_like(hidden)
        seen: dict[str, torch.Tensor] = {}

        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen["x"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        def post(_m: nn.Module, _a: Any, _k: Any, output: Any) -> None:
            seen["out"] = output[0] if isinstance(output, tuple) else output

        attn: Any = layer.self_attn
        handles = []
        if capture is not None:
            handles = [
                attn.register_forward_pre_hook(pre, with_kwargs=True),
                attn.register_forward_hook(post, with_kwargs=True),
            ]
        try:
            for sl in chunks(hidden, rows):
                h = hidden[sl]
                b, t, _ = h.shape
                pos = torch.arange(t, device=h.device)[None].expand(b, t)
                mask = causal_mask(b, t, 0, None, h.dtype, h.device)
                res = layer(
                    h,
                    attention_mask=mask,
                    position_ids=pos,
                    position_embeddings=self.rotary(h, pos),
                    past_key_values=cache,
                    use_cache=cache is not None,
                )
                out[sl] = res[0] if isinstance(res, tuple) else res
                if capture is not None:
                    capture(seen["x"], seen["out"])
        finally:
            for hd in handles:
                hd.remove()
        return out


def mla_layer(
    config: MLAConfig, i: int, tensors: dict[str, torch.Tensor], device: torch.device
) -> MLADecoderLayer:
    """:class:`MLADecoderLayer` ``i`` with ``tensors`` (names inside the layer, float32) assigned on ``device``
    (on the same device the parameters are the given tensors, not copies).

    Raises:
        RuntimeError: the tensors do not match the config (an internal error).
    """
    with torch.device("meta"):
        layer = MLADecoderLayer(config, i)
    layer.load_state_dict({k: v.to(device) for k, v in tensors.items()}, assign=True, strict=True)
    return layer.eval()


@torch.no_grad()
def run_mla(
    layer: MLADecoderLayer,
    hidden: torch.Tensor,
    num_heads: int,
    intermediate: int,
    cache: Any = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Hidden states after an MLA ``layer`` for windows ``hidden [N, T, hidden]`` (absorbed path).

    ``inplace``: write them over ``hidden`` chunk by chunk (each window reads only itself), for a caller whose
    stream is spent and held by no one else: one ``[N, T, hidden]`` float32 stream less at the peak (256 MB for
    16,384 refit tokens at Llama-3-8B's width)."""
    rows = chunk_rows(num_heads, hidden.shape[1], hidden.shape[2], intermediate)
    out = hidden if inplace else torch.empty_like(hidden)
    for sl in chunks(hidden, rows):
        h = hidden[sl]
        b, t, _ = h.shape
        pos = torch.arange(t, device=h.device)[None].expand(b, t)
        out[sl] = layer(h, pos, causal_mask(b, t, 0, None, h.dtype, h.device), cache)
    return out


@torch.no_grad()
def run_attention(attn: nn.Module, x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """An MLA attention module's output for its inputs ``x [N, T, hidden]`` (normalised hidden states)."""
    rows = chunk_rows(num_heads, x.shape[1], x.shape[2], 0)
    out = torch.empty_like(x)
    for sl in chunks(x, rows):
        h = x[sl]
        b, t, _ = h.shape
        pos = torch.arange(t, device=h.device)[None].expand(b, t)
        out[sl] = attn(h, pos, causal_mask(b, t, 0, None, h.dtype, h.device), None)
    return out


def embed_windows(src: SourceModel, texts: Any, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Embedding rows ``[N, T, hidden]`` (float32 on ``device``) of every window of ``texts``
    (:class:`~mla_convert.convert.pipeline.records.Texts`: ``calib``, ``held``, ``eval``, ``probe``), the table read once in
    its stored dtype.

    Raises:
        SourceError: an embedding table the output ``dtype`` cannot hold.
    """
    name = "model.embed_tokens.weight"
    table = read_checked(src, name, src.storage_dtype(name), torch.device("cpu"))
    check_fits(name, table, dtype)
    roles = (("calib", texts.calib), ("held", texts.held), ("eval", texts.eval), ("probe", texts.probe))
    out = {role: table[ids].to(torch.float32).to(device) for role, ids in roles}
    del table
    src.release()
    return out


def check_head_range(src: SourceModel, dtype: torch.dtype) -> None:
    """Refuse, before any layer runs, a final norm or untied LM head the output ``dtype`` cannot hold.

    Raises:
        SourceError: one line naming the tensor.
    """
    names = ["model.norm.weight"]
    if not getattr(src.config, "tie_word_embeddings", False):
        names.append("lm_head.weight")
    for name in names:
        check_fits(name, read_checked(src, name, src.storage_dtype(name), torch.device("cpu")), dtype)
    src.release()


def lm_head(
    src: SourceModel, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """The LM head ``[vocab, hidden]`` (stored dtype, on ``device``) and the final RMS norms of the source
    (float32) and of the converted model (its weight rounded to the output ``dtype``, as written)."""
    head_name = "model.embed_tokens.weight" if getattr(src.config, "tie_word_embeddings", False) else "lm_head.weight"
    head = read_checked(src, head_name, src.storage_dtype(head_name), device)
    norm_w = read_checked(src, "model.norm.weight", torch.float32, device)
    eps = float(src.config.rms_norm_eps)

    def rms(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(x: torch.Tensor) -> torch.Tensor:
            var = x.pow(2).mean(-1, keepdim=True)
            return weight * (x * torch.rsqrt(var + eps))

        return fn

    return head, rms(norm_w), rms(norm_w.to(dtype).to(torch.float32))


def attention_weights(src: SourceModel, i: int, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float64 ``q, k, v, o`` weights ``[out, in]`` and biases (``bq``, ``bk``, ``bv``, ``bo`` where the family has
    them) of layer ``i`` from its source tensors ``source`` (float32, names inside the layer)."""
    prefix = layer_prefix(i)
    out: dict[str, torch.Tensor] = {}
    for p in "qkvo":
        out[p] = source[src.family.attn(f"{p}_proj", i)[len(prefix) :]].double()
        if src.family.has_bias(p, src.config):
            out[f"b{p}"] = source[src.family.attn(f"{p}_proj", i, "bias")[len(prefix) :]].double()
    return out

