"""What ``mla-convert factor`` will need, before it runs: peak resident memory, disk and time, from the config,
the tensor headers and the options (no weight is read).

The estimates follow the streamed conversion (:mod:`mla_convert.convert.stream`, run by
:func:`~mla_convert.convert.job.run_factor`) on the CPU. Symbols: ``L`` layers, ``d`` hidden size, ``H``/``G``
query/KV heads of width ``h``, ``V`` vocabulary, ``T`` tokens per window, ``N`` calibration, ``M`` held-out
(:data:`~mla_convert.convert.job.HELD_OUT_WINDOWS`, at most 4) and ``E`` evaluation windows, ``P`` probe tokens
(``min(128, T)``), ``r = nope_width + G h`` rows of the weighted K/V matrix, ``p`` the parameters of one source
decoder layer, ``s`` its bytes as stored, ``b`` bytes per value of the written dtype.

**Memory** (:func:`factor_phases`). Each phase lists what the process holds at its worst moment; the peak is
the largest phase. Every phase holds the runtime (:data:`RUNTIME_BYTES`), the hidden-state streams (float32
``[windows, T, d]`` of every role the pass still runs, ``4 d`` bytes per token) and, for a GGUF source, the
mapped file. Then, per phase:

* ``embed``: the embedding table's mapped pages in its stored dtype (``V d`` values) and the finiteness check
  of :func:`~mla_convert.convert.layers.read_checked` (chunks of
  :data:`~mla_convert.convert.layers.FINITE_CHUNK` elements, a few bytes each).
* ``source forward`` (pass 1): one layer in float32 (``4 p``) plus its mapped source pages (``s``; the two are
  the same pages for a float32 source), the float64 attention weights, the statistics (``2 x 8 d²``), the kept
  captures of this layer (``8 d T (N + M)`` with the ``o_proj`` refit, ``8 d T M`` without), one chunk of
  activations (:data:`~mla_convert.convert.layers.CHUNK_BYTES`) and a second copy of the stream being run.
  Layer 0 also holds the embedding pages (the files are released after each layer).
* ``plan``: the layer's pages, float64 attention weights, statistics, the captures twice (lists and their
  concatenations), the weighted K/V target (``8 (r d + r² + d²)``) and the eigendecomposition workspace of
  ``C^½`` (:data:`EIGH_TEMPS` float64 ``d x d`` matrices).
* ``factor`` / ``assemble`` / ``refit`` / ``held-out forward`` (pass 2): the layer's pass-1 file (target with
  ``C`` and ``C^½``, captures), then the SVD workspace; or one source layer in float32 with its pages, the
  float64 weights and the float64 MLA tensors being assembled (the query map three times); or the MLA layer
  with the ridge least-squares of the refit (``z``, ``y`` float64 over ``N T`` tokens, Gram matrices); or the
  MLA layer running the held-out streams (plain and refit variants) in chunks.
* ``eval pass`` (pass 3): one MLA layer in float32 with its pages and one chunk.
* ``score``: the LM head's mapped pages in its stored dtype, then per vocabulary chunk (``C`` = 8192 rows) the
  float32 rows and the float64 ``[T, C]`` temporaries of :func:`~mla_convert.metrics.head_scores`.
* ``write``: one output shard (``--max-shard-size``, or the whole output when smaller; at least the largest
  tensor) and the tensor being read.
* ``sample`` (only when ``4 x params <= 2 GiB``, :data:`~mla_convert.convert.job.SAMPLE_MAX_BYTES`): the
  written checkpoint mapped in its dtype and its float32 copy (the job loads it in float32, since greedy
  decoding of a bf16 model on a CPU would add :data:`DECODE_GROWTH` times its size).

**Disk** (:func:`factor_disk`): the output (converted parameters x ``b``, ``rope_inv_freq`` float32), and the
work folder ``.OUT.factor/`` at its peak (the end of pass 1, or the end with the output staged, since pass 2 removes
each layer's pass-1 file once it has written the layer): per layer the pass-1 file (float64 target with ``C`` and ``C^½``,
captures), the RoPE plan and the MLA attention file in the output dtype (``o_proj`` twice with the refit), the
streams' state, the float32 copy of every layer for a quantized GGUF source (until pass 3), and the staged output.

**Time**: :mod:`mla_convert.convert.estimate_time` (:func:`~mla_convert.convert.estimate_time.factor_time`).

``tests/recipes/test_recipe_memory.py`` checks the memory estimate against the streamed run of the bundled model
and an 8B shape; ``README.md`` §Memory states the formula.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from mla_convert.convert.options import ConvertOptions, geometry

GB = 1e9

#: Transient bytes of one chunk of the finiteness check (``abs`` copy and masks of ``FINITE_CHUNK`` float32 values).
FINITE_BYTES = 4.0 * (1 << 24)

#: Resident bytes of the process besides the modelled items: Python, torch (its library pages as they get
#: used), transformers, mla_convert, the tokenizer, the loaded text and the allocator's retained heap. Measured:
#: 0.58 GB with the text loaded before the first layer (torch 2.13 CPU, transformers 5.2, Linux; RssAnon 0.36 +
#: RssFile 0.22 GB), 0.8-0.95 GB between layers of the bundled model's streamed conversion (rounded up).
RUNTIME_BYTES = 0.9e9

#: Float64 ``d x d`` matrices alive at the worst moment of ``build_target``'s ``C^½``: the identity it keeps,
#: ``C + ridge I`` and its temporaries, the eigenvectors, LAPACK's ``syevd`` workspace and the products.
EIGH_TEMPS = 6

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
    q_conv_params: int  # the MLA query map of one layer
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
    """The written checkpoint's torch dtype (:func:`~mla_convert.convert.stream.resolve_dtype`)."""
    from mla_convert.convert.stream import resolve_dtype

    return resolve_dtype(options.dtype, src)


def factor_shape(options: ConvertOptions, src: Any, refit_modes: Collection[str] = ()) -> FactorShape:
    """The sizes of a conversion of ``src`` with ``options`` (config and headers only); ``refit_modes``: the other
    ``o_proj`` refit modes its search measures (:attr:`~mla_convert.convert.resolve.Resolution.refit_modes`),
    whose inputs pass 1 keeps too.

    ``src`` is a :class:`~mla_convert.sources.checkpoint.SourceModel` or anything with its ``num_layers``,
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``hidden_size``, ``config``, ``weight_map``, ``shape(name)``,
    ``storage_dtype(name)`` and ``gguf_file``.
    """
    from mla_convert.convert.job import HELD_OUT_WINDOWS

    geo = geometry(options, src)
    n_l, h, g, hd, d = src.num_layers, src.num_heads, src.num_kv_heads, src.head_dim, src.hidden_size
    cfg = src.config
    inter = int(getattr(cfg, "intermediate_size", None) or 4 * d)
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


def _chunk_windows(s: FactorShape, windows: int) -> int:
    """Windows of one chunk when ``windows`` run (:func:`~mla_convert.convert.layers.chunk_rows`)."""
    from mla_convert.convert.layers import chunk_rows

    return max(1, min(chunk_rows(s.heads, s.window, s.hidden, s.intermediate), windows))


def _chunk_bytes(s: FactorShape, windows: int) -> float:
    """Activations of one chunk: ``4 (3 H T² + 3 T I + 8 T d)`` bytes per window, the formula
    :data:`~mla_convert.convert.layers.CHUNK_BYTES` bounds."""
    t = s.window
    per_window = 4 * (3 * s.heads * t * t + 3 * t * s.intermediate + 8 * t * s.hidden)
    return float(per_window * _chunk_windows(s, windows))


def factor_phases(
    options: ConvertOptions, src: Any, max_shard_size: str | int | None = None, refit_modes: Collection[str] = ()
) -> list[Phase]:
    """The phases of ``mla-convert factor`` (:func:`~mla_convert.convert.job.run_factor`, CPU) in bytes; the
    module docstring lists what each holds (``refit_modes``: as :func:`factor_shape` takes them).

    Raises:
        ValueError: a ``max_shard_size`` huggingface_hub cannot read.
    """
    from mla_convert.artifacts.shards import DEFAULT_MAX_SHARD_SIZE
    from mla_convert.convert.job import SAMPLE_MAX_BYTES
    from mla_convert.metrics import head_scores

    s = factor_shape(options, src, refit_modes)
    shard_max = parse_size(max_shard_size if max_shard_size is not None else DEFAULT_MAX_SHARD_SIZE)
    d, t, n, m, e = s.hidden, s.window, s.calib, s.held, s.evaluation
    tok = s.tokens
    row = 4.0 * d  # bytes of one token of a float32 stream
    chunk_v = int(inspect.signature(head_scores).parameters["vocab_chunk"].default)

    base: tuple[tuple[str, float], ...] = (("runtime", RUNTIME_BYTES),)
    if s.gguf_bytes:
        base += (("mapped GGUF file", float(s.gguf_bytes)),)
    seq = tok["calib"] if s.refit_windows else 0  # the sequential refit's windows, converted (a float32 stream)
    streams1 = row * (tok["calib"] + 2 * (tok["held"] + tok["eval"] + tok["probe"]) + seq)
    streams2 = row * (2 * tok["eval"] + tok["held"] * (2 if s.refit else 1) + tok["probe"] + seq)
    pass1 = base + (("streams (source and converted)", streams1),)
    pass2 = base + (("streams", streams2),)

    def layer_items(float32_params: float, what: str) -> tuple[tuple[str, float], ...]:
        """One layer in float32 and the source pages it was read from (the same pages for a float32 source)."""
        if s.layer_float32_stored:
            return ((f"{what} (float32, mapped source)", 4.0 * float32_params),)
        if s.gguf_bytes:
            return ((f"{what} (float32)", 4.0 * float32_params),)
        return (
            (f"{what} (float32)", 4.0 * float32_params),
            ("its mapped source pages", float(s.layer_stored)),
        )

    def pages_only() -> tuple[tuple[str, float], ...]:
        if s.gguf_bytes:
            return ()
        return (("layer's mapped source pages", float(s.layer_stored)),)

    emb_pages = () if s.gguf_bytes else (("embedding pages (released after layer 0)", float(s.embed_stored)),)
    attn64 = ("float64 attention weights", 8.0 * s.attn_params)
    stats = ("statistics (2 x float64 d x d)", 16.0 * d * d)
    captures = _captures(s)
    cap_name = "captures (refit + held-out)" if s.refit else "captures (held-out)"
    target = 8.0 * (s.rows * d + s.rows * s.rows + d * d)
    p1_file = 8.0 * (s.rows * d + s.rows * s.rows + 2 * d * d) + captures
    stats_tmp = 8.0 * t * (d + (s.heads + s.kv_heads) * s.head_dim)  # per window: float64 x, q, k
    conv_layer = s.layer_params - s.attn_params + s.conv_attn_params
    hdv = s.heads * s.head_dim  # o_proj input width
    vocab_f = float(s.vocab)

    phases: list[Phase] = []
    if s.gguf_bytes:
        embed_items = (("embedding table (float32, dequantized twice)", 8.0 * vocab_f * d),)
    else:
        embed_items = (("embedding table pages", float(s.embed_stored)),)
    phases.append(
        Phase("factor", "embed", pass1 + embed_items + (("finiteness check (one chunk)", FINITE_BYTES),))
    )
    biggest = max(n, m, e)
    phases.append(
        Phase(
            "factor",
            "source forward (layer 0)",
            pass1
            + (("copy of the stream being run", row * biggest * t),)
            + emb_pages
            + layer_items(s.layer_params, "one source layer")
            + (attn64, stats, (cap_name, captures))
            + (("activations of one chunk", _chunk_bytes(s, biggest) + stats_tmp * _chunk_windows(s, n)),),
        )
    )
    eig = EIGH_TEMPS if s.objective != "weight" else 1
    phases.append(
        Phase(
            "factor",
            "plan (layer 0)",
            pass1
            + emb_pages
            + (
                (("layer (float32, mapped source)", 4.0 * s.layer_params),)
                if s.layer_float32_stored
                else pages_only()
            )
            + (attn64, stats, (f"{cap_name} and their concatenation", 2 * captures))
            + (
                ("weighted K/V target (float64)", target),
                ("eigendecomposition workspace", 8.0 * eig * d * d),
            ),
        )
    )
    p1 = ("pass-1 file of the layer (target, C, captures)", p1_file)
    phases.append(
        Phase(
            "factor",
            "factor",
            pass2 + (p1, ("SVD workspace (float64)", 8.0 * (6 * s.rows * d + 4 * s.rows * s.rows))),
        )
    )
    assembled = 8.0 * (3 * s.q_conv_params + (s.conv_attn_params - s.q_conv_params))
    phases.append(
        Phase(
            "factor",
            "assemble",
            pass2
            + (p1,)
            + layer_items(s.layer_params, "one source layer")
            + (attn64, ("MLA attention being assembled (float64)", assembled)),
        )
    )
    if s.refit:
        nt = tok["calib"]
        refit_ws = nt * (8.0 * hdv + 8.0 * hdv + 16.0 * d) + 8.0 * (3 * hdv * hdv + 3 * hdv * d)
        phases.append(
            Phase(
                "factor",
                "refit",
                pass2
                + (p1,)
                + layer_items(conv_layer, "one MLA layer")
                + (("o_proj copy", 4.0 * d * hdv), ("ridge least squares (float64)", refit_ws)),
            )
        )
    phases.append(
        Phase(
            "factor",
            "held-out forward",
            pass2
            + (("copy of the stream being run", row * m * t), p1)
            + layer_items(conv_layer, "one MLA layer")
            + (("o_proj copies", 8.0 * d * hdv), ("activations of one chunk", _chunk_bytes(s, m))),
        )
    )
    phases.append(
        Phase(
            "factor",
            "eval pass",
            pass2
            + (("copy of the stream being run", row * e * t),)
            + layer_items(conv_layer, "one MLA layer")
            + (
                ("source attention read with it (float32)", 4.0 * s.attn_params),
                ("MLA attention file pages", float(s.out_itemsize) * s.conv_attn_params),
                ("activations of one chunk", _chunk_bytes(s, e)),
            ),
        )
    )
    head = (
        ("LM head (float32, dequantized)", 4.0 * vocab_f * d)
        if s.gguf_bytes
        else ("LM head pages", float(s.head_stored))
    )
    phases.append(
        Phase("factor", "score: LM head read", pass2 + (head, ("finiteness check (one chunk)", FINITE_BYTES)))
    )
    c = min(chunk_v, s.vocab)
    score_tmp = 8.0 * 5 * (t - 1) * c + 4.0 * 2 * (t - 1) * c + c * d * (8.0 + s.out_itemsize)
    phases.append(
        Phase("factor", "score: vocabulary chunks", pass2 + (head, (f"one chunk of {c} rows", score_tmp)))
    )
    largest_out = float(max(s.largest_params, s.q_conv_params)) * s.out_itemsize
    shard = min(max(float(shard_max), largest_out), s.output_bytes)
    same = s.out_itemsize == s.largest_itemsize and not s.gguf_bytes  # the shard holds the mapped tensor
    reading = () if same else (("tensor being read", float(s.largest_stored)),)
    phases.append(
        Phase(
            "factor",
            "write",
            pass2
            + (("one output shard", shard),)
            + reading
            + (("finiteness check (one chunk)", FINITE_BYTES),),
        )
    )
    if 4 * s.output_params <= SAMPLE_MAX_BYTES:
        # the sample loads the checkpoint in float32 (decoding a bf16 model on a CPU would add DECODE_GROWTH)
        upcast = 4.0 * s.output_params if s.out_itemsize < 4 else 0.0
        phases.append(
            Phase(
                "factor",
                "sample (the written checkpoint loaded in float32 for the report's greedy text)",
                pass2
                + (
                    (f"written checkpoint, mapped ({s.out_dtype})", s.output_bytes),
                    ("its float32 copy", upcast),
                ),
            )
        )
    return phases


@dataclass(frozen=True)
class Disk:
    """Bytes of the output and of the work folder ``.OUT.factor/`` at its peak (which includes the staged output)."""

    output: float
    work_peak: float
    items: tuple[tuple[str, float], ...]


def _captures(s: FactorShape) -> float:
    """Bytes of one layer's kept float32 captures: the held-out attention inputs and outputs, and the refit's
    source outputs (with the source inputs too for the teacher-forced refit)."""
    refit = 0 if not s.refit else 8 if s.teacher_inputs else 4
    return s.hidden * (refit * s.tokens["calib"] + 8.0 * s.tokens["held"])


def factor_disk(options: ConvertOptions, src: Any, refit_modes: Collection[str] = ()) -> Disk:
    """The disk a conversion writes (module docstring; ``refit_modes``: as :func:`factor_shape` takes them)."""
    s = factor_shape(options, src, refit_modes)
    d, hd, tok = s.hidden, s.head_dim, s.tokens
    n_l = s.layers
    captures = _captures(s)
    p1 = 8.0 * (s.rows * d + s.rows * s.rows + 2 * d * d) + captures
    nope_rows = s.rows - s.kv_heads * hd  # key rows at most
    plan = 8.0 * (
        s.heads * (s.d_nope + s.d_rope) * hd
        + nope_rows * s.kv_heads * hd
        + s.rope_heads * s.d_rope * s.kv_heads * hd
    )
    attn = s.out_itemsize * (s.conv_attn_params + (d * s.heads * hd if s.refit else 0))
    state = (
        4.0 * d * (tok["calib"] * (2 if s.refit_windows else 1) + 2 * (tok["held"] + tok["eval"] + tok["probe"]))
    )
    gguf_copies = 4.0 * n_l * s.layer_params if s.gguf_bytes else 0.0
    items = (
        (f"pass-1 files ({n_l} x {p1 / GB:.2f} GB)", n_l * p1),
        ("RoPE plans", n_l * plan),
        (f"MLA attention files ({s.out_dtype})", n_l * attn),
        ("stream state", state),
    ) + ((("float32 layer copies of the GGUF", gguf_copies),) if gguf_copies else ())
    # pass 2 removes each layer's pass-1 file once the layer is written: the peak is at the end of pass 1 or
    # with the output staged (the GGUF copies go in pass 3, before the output)
    end_pass1 = n_l * (p1 + plan) + state + gguf_copies
    work_peak = max(end_pass1, n_l * (plan + attn) + state + max(gguf_copies, s.output_bytes))
    return Disk(s.output_bytes, work_peak, items + (("staged output", s.output_bytes),))


def factor_lines(
    options: ConvertOptions, src: Any, max_shard_size: str | int | None = None, candidates: int = 1,
    measured: int | None = None, refit_modes: Collection[str] = (),
) -> list[str]:
    """Lines for ``inspect``: peak memory (its phase and largest items), disk, the time estimate (``candidates``
    and ``measured``: RoPE pairs on the search's ladder and the splits it is expected to convert, as
    :func:`~mla_convert.convert.estimate_time.factor_time` takes them), and where this machine runs the default bfloat16 calibration emulated
    (a GPU without bfloat16), that note (its calibrate stage takes several times the estimate).

    Raises:
        ValueError: a ``max_shard_size`` huggingface_hub cannot read.
    """
    from mla_convert.convert.device import calib_precision_note
    from mla_convert.convert.estimate_time import FP32_GFLOPS, factor_time
    from mla_convert.convert.estimate_time import fmt_seconds as _fmt_s
    from mla_convert.convert.stream import resolve_device

    top = peak(factor_phases(options, src, max_shard_size, refit_modes))
    items = ", ".join(f"{k} {b / GB:.2f}" for k, b in top.largest(4))
    disk = factor_disk(options, src, refit_modes)
    parts = ", ".join(f"{k} {b / GB:.2f}" for k, b in sorted(disk.items, key=lambda kv: -kv[1])[:3])
    tim = factor_time(options, src, candidates, measured)
    slow = ", ".join(f"{k} {_fmt_s(v)}" for k, v in sorted(tim.stages.items(), key=lambda kv: -kv[1])[:3])
    device = resolve_device(options.device)
    gpu = device.type != "cpu"
    emulated = calib_precision_note(options.calib_precision, device)
    where = " (a CPU run; on a GPU the streams and layers move to its memory)" if gpu else ""
    return [
        f"peak memory: ~{top.total / GB:.1f} GB resident, in {top.name}{where} (GB: {items})",
        f"disk: output ~{disk.output / GB:.2f} GB; the work folder .OUT.factor next to OUT grows to "
        f"~{disk.work_peak / GB:.1f} GB with the output staged in it, removed at the end (GB: {parts})",
        f"time: ~{_fmt_s(tim.total)}, an estimate for the reference CPU (2 cores, {FP32_GFLOPS:.0f} GFLOP/s float32 "
        f"matmul per core, where the bundled model converts in about 128 s without the RoPE split search){'; the GPU runs the forward passes faster' if gpu else ''}"
        f" ({slow})",
    ] + ([f"this machine: {emulated}"] if emulated else [])
