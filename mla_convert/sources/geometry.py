"""A source's attention geometry read from its config: its query/key head width (:func:`head_dim_of`) and its
attention scale (:func:`source_softmax_scale`), which a converted checkpoint keeps (:mod:`mla_convert.mla.algebra`)."""

from __future__ import annotations

from typing import Any


def source_softmax_scale(head_dim: int) -> float:
    """The attention scale of the supported source families (Llama, Mistral, Qwen2): ``head_dim ** -0.5``.

    ``head_dim`` is the source's query/key head width (``config.head_dim``, else ``hidden_size / heads``), not
    the latent width and not ``v_head_dim``. A converted checkpoint stores this value as ``softmax_scale``.
    """
    return float(head_dim**-0.5)


def intermediate_size_of(config: Any) -> int:
    """A source config's MLP inner width: ``config.intermediate_size`` when set, else ``4 * hidden_size`` (GPT-2's
    convention, which configs without the field follow)."""
    return int(getattr(config, "intermediate_size", None) or 4 * config.hidden_size)


def head_dim_of(config: Any) -> int:
    """A source config's query/key head width: ``config.head_dim`` when set, else ``hidden_size / heads``."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
