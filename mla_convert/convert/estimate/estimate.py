"""What ``mla-convert factor`` will need, before it runs: peak resident memory, disk and time, from the config,
the tensor headers and the options (no weight is read). This module sizes a conversion (:func:`factor_shape`);
:mod:`~mla_convert.convert.estimate.estimate_memory` turns the sizes into memory phases (:func:`factor_phases`) and disk
(:func:`factor_disk`), :mod:`~mla_convert.convert.estimate.estimate_time` into time and the lines ``inspect`` prints.

The estimates follow the streamed conversion (:mod:`mla_convert.convert.pipeline.stream`, run by
:func:`~mla_convert.convert.pipeline.job.run_factor`) on the CPU. Symbols: ``L`` layers, ``d`` hidden size, ``H``/``G``
query/KV heads of width ``h``, ``V`` vocabulary, ``T`` tokens per window, ``N`` calibration, ``M`` held-out
(:data:`~mla_convert.convert.pipeline.text.HELD_OUT_WINDOWS`, at most 4) and ``E`` evaluation windows, ``P`` probe tokens
(``min(128, T)``), ``r = nope_width + G h`` rows of the weighted K/V matrix, ``p`` the parameters of one source
decoder layer, ``s`` its bytes as stored, ``b`` bytes per value of the written dtype.

**Memory** (:func:`factor_phases`). Each phase lists what the process holds at its worst moment; the peak is
the largest phase. Every phase holds the runtime (:data:`RUNTIME_BYTES`), the hidden-state streams (float32
``[windows, T, d]`` of every role the pass still runs, ``4 d`` bytes per token) and, for a GGUF source, the
mapped file. Then, per phase:

* ``embed``: the embedding table's mapped pages in its stored dtype (``V d`` values) and the finiteness check
  of :func:`~mla_convert.convert.layer.layers.read_checked` (chunks of
  :data:`~mla_convert.convert.layer.layers.FINITE_CHUNK` elements, a few bytes each).
* ``source forward`` (pass 1): one layer in float32 (``4 p``) plus its mapped source pages (``s``; the two are
  the same pages for a float32 source), the float64 attention weights, the statistics (``2 x 8 d²``), the kept
  captures of this layer (``8 d T (N + M)`` with the ``o_proj`` refit, ``8 d T M`` without), one chunk of
  activations (:data:`~mla_convert.convert.layer.layers.CHUNK_BYTES`) and a second copy of the stream being run.
  Layer 0 also holds the embedding pages (the files are released after each layer).
* ``plan``: the layer's pages, float64 attention weights, statistics, the captures twice (lists and their
  concatenations), the weighted K/V target with its Gram matrix's eigenvectors (``8 (r d + 2 r²)``) and the
  Gram route's workspace (``C`` with its ridge, ``L W C``, the eigendecomposition: ``8 (d² + 2 r d + 3 r²)``).
* ``factor`` / ``assemble`` / ``refit`` / ``held-out forward`` (pass 2): the layer's pass-1 file (target with
  ``C`` and the eigenvectors, captures), then the factorization's products; or one source layer in float32 with its pages, the
  float64 weights and the float64 MLA tensors being assembled (the query map at its full NoPE width, written in
  place, and its reduced copy); or the MLA layer
  with the ridge least-squares of the refit (``z``, ``y`` of one chunk of windows, Gram matrices); or the
  MLA layer running the held-out streams (plain and refit variants) in chunks.
* ``eval pass`` (pass 3): one MLA layer in float32 with its pages and one chunk.
* ``score``: the LM head's mapped pages in its stored dtype, then per vocabulary chunk (``C`` = 8192 rows) the
  float32 rows and the float64 ``[T, C]`` temporaries of :func:`~mla_convert.metrics.head_scores`.
* ``write``: one output shard (``--max-shard-size``, or the whole output when smaller; at least the largest
  tensor) and the tensor being read.
* ``sample`` (only when ``4 x params <= 2 GiB``, :data:`~mla_convert.convert.pipeline.job.SAMPLE_MAX_BYTES`): the
  written checkpoint mapped in its dtype and its float32 copy (the job loads it in float32, since greedy
  decoding of a bf16 model on a CPU would add :data:`DECODE_GROWTH` times its size).

**Disk** (:func:`factor_disk`): the output (converted parameters x ``b``, ``rope_inv_freq`` float32), and the
work folder ``.OUT.factor/`` at its peak (the end of pass 1, or the end with the output staged, since pass 2 removes
each layer's pass-1 file once it has written the layer): per layer the pass-1 file (float64 target with ``C`` and the
eigenvectors, captures), the RoPE plan and the MLA attention file in the output dtype (``o_proj`` twice with the refit), the
streams' state, the float32 copy of every layer for a quantized GGUF source (until pass 3), and the staged output.

**Time**: :mod:`mla_convert.convert.estimate.estimate_time` (:func:`~mla_convert.convert.estimate.estimate_time.factor_time`).

``tests/recipes/test_recipe_memory.py`` checks the memory estimate against the streamed run of the bundled model
and an 8B shape; ``README.md`` §Memory states the formula.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from mla_convert.convert.options.options import ConvertOptions, geometry
from mla_convert.sources.geometry import intermediate_size_of

GB = 1e9

#: Transient bytes of one chunk of the finiteness check (``abs`` copy and masks of ``FINITE_CHUNK`` float32 values).
FINITE_BYTES = 4.0 * (1 << 24)

#: Resident bytes of the process besides the modelled items: Python, torch (its library pages as they get
#: used), transformers, mla_convert, the tokenizer, the loaded text and the allocator's retained heap. Measured:
#: 0.58 GB with the text loaded before the first layer (torch 2.13 CPU, transformers 5.2, Linux; RssAnon 0.36 +
#: RssFile 0.22 GB), 0.8-0.95 GB between layers of the bundled model's streamed conversion (rounded up).
RUNTIME_BYTES = 0.9e9

#: Anonymous bytes that greedy decoding (24 tokens, the report's sample) adds per byte of a bfloat16/float16
#: checkpoint on the CPU (oneDNN keeps packed weights per new sequence length): measured 0.67 GB for the bundled
#: model's 0.29 GB bfloat16 checkpoint (2.3x); float32 adds nothing.
DECODE_GROWTH = 2.3

#: Probe tokens of the cache measurement (``text.evaluation[:1, :128]`` in ``run_factor``).
PROBE_TOKENS = 128


@dataclass(frozen=True)
class Phase:
    """What one moment of a stage holds: ``items`` as ``(what, bytes)``."""

    stage: str
    name: str
    items: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        """Bytes of all items."""
        return sum(b for _, b in self.items)

    def largest(self, n: int = 3) -> list[tuple[str, float]]:
        """The ``n`` largest items, largest first."""
        return sorted(self.items, key=lambda kv: -kv[1])[:n]


def peak(phases: list[Phase]) -> Phase:
    """The phase that holds the most."""
    return max(phases, key=lambda p: p.total)


@dataclass(frozen=True)
class FactorShape:
    """Every size the estimates use, from the options, the config and the tensor headers (counts of values)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    window: int
    calib: int  # N windows
    held: int  # M windows
    evaluation: int  # E windows
    probe: int  # P tokens
    refit: bool
    sequential: bool  # the refit fits on the converted model's own inputs (its windows travel through pass 2)
    teacher_inputs: bool  # pass 1 keeps the source's refit inputs (a teacher refit, or one the search measures)
    refit_windows: bool  # pass 1 starts the refit windows' converted stream (a sequential refit, or measured)
    objective: str
    budget: bool  # ranks allocated from every layer's spectrum
    rows: int  # r, rows of the weighted K/V matrix
    d_nope: int  # qk_nope_head_dim (an upper bound: every layer's widest)
    d_rope: int  # per rope head
    rope_heads: int
    latent: float  # mean d_c
    layer_params: int  # p: one source decoder layer
    layer_stored: int  # s: its bytes as stored
    layer_float32_stored: bool  # its tensors are stored as float32 (read without a copy)
    attn_params: int  # q, k, v, o (+ biases) of one source layer
    conv_attn_params: float  # q, kv_a, kv_b, o (+ biases) of one MLA layer
    q_conv_params: int  # the MLA query map of one layer as assembled (d_nope wide)
    q_reduced_params: int  # the query map after a NoPE-width reduction (0 without one: it is never whole then)
    embed_stored: int  # bytes of the embedding table as stored
    head_stored: int  # bytes of the LM head as stored (the embedding when tied)
    largest_params: int  # the largest source tensor
    largest_stored: int  # its bytes as stored
    largest_itemsize: int  # bytes per value of it as stored
    source_params: int  # parameters of the source checkpoint
    output_params: float  # parameters of the written checkpoint
    output_bytes: float  # their bytes in the output dtype (rope_inv_freq float32)
    out_dtype: str
    out_itemsize: int
    gguf_bytes: int  # size of the GGUF file (0 for safetensors)

    @property
    def tokens(self) -> dict[str, int]:
        """Tokens per role: ``calib``, ``held``, ``eval`` (windows x T) and ``probe``."""
        t = self.window
        return {
            "calib": self.calib * t,
            "held": self.held * t,
            "eval": self.evaluation * t,
            "probe": self.probe,
        }


def _itemsize(dtype: Any) -> int:
    """Bytes per value of a torch (or numpy) dtype."""
    return int(dtype.itemsize)


def d_nope_bound(options: ConvertOptions, src: Any) -> int:
    """The widest NoPE part of a query head any layer can get (the checkpoint's ``qk_nope_head_dim`` is the widest
    over layers).

    Per-head mode: ``h - 2 pairs``. Shared mode: a frequency none of whose components keeps RoPE leaves the head
    its own pair (2 dims); a frequency with ``c`` kept components leaves the ``G - c`` others, which every head
    reads (``2 (G - c)`` dims). Spreading the kept components one per frequency gives the most,
    ``h + 2 pairs (G - 2)``, bounded by the whole NoPE width ``G h - 2 pairs``.
    """
    geo = geometry(options, src)
    h, g, pairs = src.head_dim, src.num_kv_heads, geo.rope_pairs
    if options.rope_mode == "per-head":
        return h - 2 * pairs
    return max(0, min(h + 2 * pairs * (g - 2), geo.nope_width))


def output_dtype(options: ConvertOptions, src: Any) -> Any:
    """The written checkpoint's torch dtype (:func:`~mla_convert.convert.pipeline.stream.resolve_dtype`)."""
    from mla_convert.convert.pipeline.stream import resolve_dtype

    return resolve_dtype(options.dtype, src)


def factor_shape(options: ConvertOptions, src: Any, refit_modes: Collection[str] = ()) -> FactorShape:
    """The sizes of a conversion of ``src`` with ``options`` (config and headers only); ``refit_modes``: the other
    ``o_proj`` refit modes its search measures (:attr:`~mla_convert.convert.options.resolve.Resolution.refit_modes`),
    whose inputs pass 1 keeps too.

    ``src`` is a :class:`~mla_convert.sources.checkpoint.SourceModel` or anything with its ``num_layers``,
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``hidden_size``, ``config``, ``weight_map``, ``shape(name)``,
    ``storage_dtype(name)`` and ``gguf_file``.
    """
    from mla_convert.convert.pipeline.text import HELD_OUT_WINDOWS

    geo = geometry(options, src)
    n_l, h, g, hd, d = src.num_layers, src.num_heads, src.num_kv_heads, src.head_dim, src.hidden_size
    cfg = src.config
    inter = intermediate_size_of(cfg)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))

    def numel(name: str) -> int:
        return math.prod(src.shape(name))

    def stored(name: str) -> int:
        return numel(name) * _itemsize(src.storage_dtype(name))

    prefix = "model.layers.0."
    layer = [n for n in src.weight_map if n.startswith(prefix)]
    attn = [n for n in layer if ".self_attn." in n]
    layer_params = sum(numel(n) for n in layer)
    attn_params = sum(numel(n) for n in attn)
    d_nope = d_nope_bound(options, src)
    d_r = 2 * geo.rope_pairs
    d_c = geo.mean_width(options) - geo.rope_width
    has_bias = {p: any(n.endswith(f"{p}_proj.bias") for n in attn) for p in "qkvo"}
    q_conv = h * (d_nope + d_r) * d
    reduced = options.qk_nope_head_dim is not None and options.qk_nope_head_dim < d_nope
    q_reduced = h * (options.qk_nope_head_dim + d_r) * d if reduced and options.qk_nope_head_dim else 0
    conv_attn = (
        q_conv
        + (h * (d_nope + d_r) if has_bias["q"] else 0)
        + (d_c + geo.rope_width) * d
        + (d_c + geo.rope_width if has_bias["k"] else 0)
        + g * (d_nope + hd) * d_c
        + d * h * hd
        + (d if has_bias["v"] or has_bias["o"] else 0)
    )
    rope_values = geo.rope_heads * geo.rope_pairs  # rope_inv_freq, float32
    embed = "model.embed_tokens.weight"
    head = embed if tied else "lm_head.weight"
    vocab = src.shape(embed)[0]
    total_src = sum(numel(n) for n in src.weight_map)
    out_params = total_src + n_l * (conv_attn + rope_values - attn_params)
    dtype = output_dtype(options, src)
    b = _itemsize(dtype)
    largest = max(src.weight_map, key=numel)
    gguf = src.gguf_file
    return FactorShape(
        layers=n_l,
        hidden=d,
        heads=h,
        kv_heads=g,
        head_dim=hd,
        intermediate=inter,
        vocab=vocab,
        window=options.window,
        calib=options.calibration_windows(),
        held=HELD_OUT_WINDOWS,
        evaluation=options.eval_windows,
        probe=min(PROBE_TOKENS, options.window),
        refit=options.refit_o_proj != "none",
        sequential=options.refit_o_proj == "sequential",
        teacher_inputs="teacher" in {options.refit_o_proj, *refit_modes},
        refit_windows="sequential" in {options.refit_o_proj, *refit_modes},
        objective=options.objective,
        budget=options.kv_lora_rank is None,
        rows=geo.nope_width + g * hd,
        d_nope=d_nope,
        d_rope=d_r,
        rope_heads=geo.rope_heads,
        latent=d_c,
        layer_params=layer_params,
        layer_stored=sum(stored(n) for n in layer),
        layer_float32_stored=gguf is None and all(_itemsize(src.storage_dtype(n)) == 4 for n in layer),
        attn_params=attn_params,
        conv_attn_params=conv_attn,
        q_conv_params=q_conv,
        q_reduced_params=q_reduced,
        embed_stored=stored(embed),
        head_stored=stored(head),
        largest_params=numel(largest),
        largest_stored=stored(largest),
        largest_itemsize=_itemsize(src.storage_dtype(largest)),
        source_params=total_src,
        output_params=out_params,
        output_bytes=(out_params - n_l * rope_values) * b + 4.0 * n_l * rope_values,
        out_dtype=str(dtype).replace("torch.", ""),
        out_itemsize=b,
        gguf_bytes=gguf.stat().st_size if gguf is not None else 0,
    )


def parse_size(size: str | int) -> int:
    """Bytes of a ``--max-shard-size`` (``"2GB"``, ``"500MB"``, an int), as ``huggingface_hub`` reads it.

    Raises:
        ValueError: a size it cannot read.
    """
    if isinstance(size, int):
        return size
    from huggingface_hub.serialization._base import parse_size_to_int

    return int(parse_size_to_int(size))
