"""The conversion an engine serves best (issue 27, ``factor --target vllm|vllm-cpu``).

vLLM's MLA kernels allocate one fixed row per token per layer whatever the checkpoint holds: ``kv_lora_rank`` 512
plus one shared rope head of 64 dims (FlashMLA on GPU, ``AMX_MLA`` on CPU; its GPU prefill needs a rope head of
64), and one ``kv_lora_rank`` for every layer. A conversion made for such an engine therefore keeps

- one shared rope head (``--rope-mode shared``) of ``min(32, head_dim / 2)`` frequencies chosen as a plain-theta
  set from the first one (``--rope-strategy high``: the frequencies ``theta^(-2k/d)``, k < 32, are themselves a
  plain table, so the export places them exactly; docs/export.md), and
- the widest latent the engine row holds, the same in every layer (``--kv-lora-rank min(512, widest useful)``):
  a per-layer rank allocation under a smaller budget would only be padded to 512 there.

At the served cache (what the engine allocates) this uses every cached value; ``benchmarks/engine_shape.py`` measures
it against the default conversion at the same served cache. The row and the head widths are vLLM's spec
(:mod:`~mla_convert.engines.vllm.spec`); this module shapes :class:`~mla_convert.convert.options.options.ConvertOptions`
to them, so it sits in the convert layer (scripts/imports.py), called by the one option resolution
(:mod:`~mla_convert.convert.options.resolve`).
"""

from __future__ import annotations

from collections.abc import Collection

from mla_convert.convert.options.options import ConvertOptions, OptionsError, SourceShape, geometry
from mla_convert.engines.vllm.spec import ENGINE_HEAD_DIMS, ENGINE_ROWS, engine_nope_width

#: Explicit options that choose another shape: with one of them the conversion is left as asked (the export pads
#: it to the engine row), and the reason says what the row would hold instead.
OWN_SHAPE = ("rope_mode", "cache_budget", "cache_fraction")


def shape_for_engine(
    options: ConvertOptions, src: SourceShape, target: str, given: Collection[str] = ()
) -> tuple[ConvertOptions, str | None]:
    """``options`` shaped for ``target``'s served row, and why (one sentence); unchanged for ``transformers``.

    Args:
        options: the conversion options as parsed.
        src: the source's shape (head_dim, KV heads, hidden size).
        target: ``transformers`` | ``vllm`` | ``vllm-cpu``.
        given: option names the user gave explicitly: ``--rope-pairs`` (up to the rope head), ``--kv-lora-rank``
            (up to 512), ``--rope-strategy`` and ``--qk-nope-head-dim`` are kept in the shape; ``--rope-mode``,
            ``--cache-fraction`` or ``--cache-budget`` keep the
            options as given (the export pads them; ``why`` says so).

    Returns:
        ``(options, why)``; ``why`` is None for ``transformers``.

    Raises:
        OptionsError: ``--rope-mode per-head`` (the engine serves one shared rope head), more rope pairs than the
            rope head holds, or a rank over 512.
    """
    if target not in ENGINE_ROWS:
        return options, None
    rank_cap, rope_width = ENGINE_ROWS[target]
    if options.rope_mode != "shared":
        raise OptionsError(
            f"--target {target} serves one shared rope head; --rope-mode {options.rope_mode} gives one per KV head: use "
            "--rope-mode shared (or --target transformers for the MLA checkpoint alone)"
        )
    own = [f"--{k.replace('_', '-')}" for k in OWN_SHAPE if k in given]
    if own:
        return options, (
            f"--target {target} with {' and '.join(own)}: converted as asked; the engine allocates {rank_cap} + "
            f"{rope_width} values per token per layer and the export pads the latent to it (drop {' and '.join(own)} "
            "for the shape that fills the row)"
        )
    bad = []
    slots = min(rope_width // 2, src.head_dim // 2)
    pairs = options.rope_pairs if "rope_pairs" in given else slots
    if pairs > slots:
        bad.append(f"--rope-pairs {pairs} (the rope head holds {slots})")
    if "kv_lora_rank" in given and options.kv_lora_rank is not None and options.kv_lora_rank > rank_cap:
        bad.append(f"--kv-lora-rank {options.kv_lora_rank} (the engine row holds {rank_cap})")
    if bad:
        raise OptionsError(
            f"--target {target} serves one shared rope head of {rope_width} dims and one kv_lora_rank <= {rank_cap}; "
            f"drop {', '.join(bad)} (or use --target transformers for any shape)"
        )
    strategy = options.rope_strategy if "rope_strategy" in given else "high"
    shaped = options.model_copy(
        update={
            "rope_mode": "shared",
            "rope_strategy": strategy,
            "rope_pairs": pairs,
            "cache_budget": None,
            "cache_fraction": None,
            "kv_lora_rank": 1,
        }
    )
    widest = geometry(shaped, src).max_rank
    rank = options.kv_lora_rank if "kv_lora_rank" in given and options.kv_lora_rank else min(rank_cap, widest)
    shaped = shaped.model_copy(update={"kv_lora_rank": rank})
    nope, nope_why = _nope_width(shaped, src, target, given)
    shaped = shaped.model_copy(update={"qk_nope_head_dim": nope})
    why = (
        f"--target {target}: one shared rope head of {pairs} frequencies ({strategy}) and kv_lora_rank {rank} in "
        f"every layer (the widest useful is {widest}); the engine allocates {rank_cap} + {rope_width} values per "
        "token per layer whatever the conversion, so this shape uses the row a per-layer budget would pad"
    )
    why += nope_why
    source = 2 * src.num_kv_heads * src.head_dim
    if rank_cap + rope_width >= source:
        why += f" (this source caches {source} values itself: served this way it saves no cache, it proves the function)"
    return shaped, why


def _nope_width(options: ConvertOptions, src: SourceShape, target: str, given: Collection[str]) -> tuple[int | None, str]:
    """The ``qk_nope_head_dim`` a conversion for ``target`` needs and why (a clause, empty when nothing changes).

    The query's NoPE width with one shared rope head, ``d + 2r(G-2)`` (``Geometry.query_nope_width``), is kept when
    an engine shape holds it (the export pads). Else it is reduced (:mod:`mla_convert.convert.layer.nope_rank`) to the
    smallest engine width at least ``min(head_dim, kv_lora_rank)``: each head's NoPE score ``q_nope · W_UK c`` is
    a function of its source query (``head_dim`` values) and the latent, so its rank is at most that and the
    reduction is exact; when no engine width reaches it, the widest (which keeps the most of the score).
    A ``--qk-nope-head-dim`` given is kept (the export precheck says whether the engine takes it).
    """
    if "qk_nope_head_dim" in given:
        return options.qk_nope_head_dim, ""
    natural = geometry(options, src).query_nope_width
    widths = [n for n, _, v in ENGINE_HEAD_DIMS[target] if src.head_dim <= v]
    width = engine_nope_width(target, src.head_dim, options.kv_lora_rank)
    if width is None or natural <= max(widths):
        return None, ""
    bound = min(src.head_dim, options.kv_lora_rank or src.head_dim)
    how = (
        f"exact: each head's NoPE score has rank at most min(head_dim, kv_lora_rank) = {bound}"
        if width >= bound
        else f"lossy: each head's NoPE score has rank up to {bound}, the widest the engine takes keeps the most of "
        "it, activation-weighted"
    )
    return width, (
        f"; the query's NoPE width {natural} (head_dim {src.head_dim} + 2 x {options.rope_pairs} pairs x "
        f"({src.num_kv_heads} KV heads - 2)) is over the {max(widths)} the engine's prefill takes, so "
        f"--qk-nope-head-dim {width}: a per-head rank-{width} form of the NoPE score ({how})"
    )
