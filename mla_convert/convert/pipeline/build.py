"""The conversion in memory: :mod:`mla_convert.convert.pipeline.stream` (the code ``factor`` runs) over given token
windows, in a temporary work folder, read back as an :class:`~mla_convert.mla.modeling.MLAForCausalLM`.

There is one conversion. Tests (the oracles, exactness, export, refit) and benchmarks call
:func:`convert_windows`; ``factor`` (:mod:`mla_convert.convert.pipeline.job`) adds text selection, measurements and an
atomic output folder around the same passes. Nothing here converts a layer.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mla_convert.convert.layer.rope import RopePlan
from mla_convert.convert.layer.steps import LayerRecord
from mla_convert.convert.options.options import ConvertOptions, check_options
from mla_convert.convert.options.resolve import Resolution, resolve_options
from mla_convert.convert.pipeline.passes import run_passes
from mla_convert.convert.pipeline.records import Streamed, Texts
from mla_convert.convert.pipeline.stream import StreamedConversion
from mla_convert.convert.pipeline.workdir import load_torch
from mla_convert.convert.stats.calibration import LayerStats
from mla_convert.metrics import EvalResult
from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.modeling import MLAForCausalLM
from mla_convert.sources.checkpoint import SourceModel

ProgressFn = Callable[[str, int, int], None]  # (stage, advance, total)

#: Tokens of the cache probe when no evaluation window is given (the probe measures the allocated cache).
PROBE_TOKENS = 128


@dataclass
class Conversion:
    """An in-memory conversion (:func:`convert_windows`).

    Attributes:
        model: the converted model, every weight as the checkpoint would hold it (``options.dtype``), in
            float32 on the CPU; ``rope_inv_freq`` float32.
        config: its config (``source["o_proj_refit"]`` records the refit decision when a refit ran).
        layers: the report rows (per-layer rank, errors on held-out tokens).
        plans: every layer's partial-RoPE plan.
        stats: every layer's calibration statistics (``keep_stats``), else empty.
        streamed: the streamed conversion's full record (caches, timings, evaluation).
        options: the options converted (resolved; the search's choice where one was made).
        split: the search's measurements, None where nothing was searched.
    """

    model: MLAForCausalLM
    config: MLAConfig
    layers: list[LayerRecord]
    plans: list[RopePlan]
    stats: list[LayerStats]
    streamed: Streamed
    options: ConvertOptions | None = None
    split: dict[str, Any] | None = None

    @property
    def eval(self) -> EvalResult | None:
        """Perplexity, KL and top-1 against the source on the evaluation windows (None without them)."""
        return self.streamed.eval


def convert_windows(
    src: SourceModel,
    options: ConvertOptions,
    calibration: torch.Tensor,
    held_out: torch.Tensor | None = None,
    evaluation: torch.Tensor | None = None,
    keep_stats: bool = False,
    progress: ProgressFn | None = None,
    resolution: Resolution | None = None,
) -> Conversion:
    """Convert ``src`` with calibration windows ``[N, T]`` exactly as ``factor`` does, without writing OUT: the
    options resolved as ``factor`` resolves them (the search included, where ``options`` leave the RoPE split
    open) and the same passes (:func:`~mla_convert.convert.pipeline.passes.run_passes`).

    Args:
        options: the options as a Python caller gives them; the fields set are taken as given
            (:func:`~mla_convert.convert.options.resolve.resolve_options`).
        calibration: ``[N, T]`` token ids of the statistics (and of the teacher-forced ``o_proj`` refit).
        held_out: ``[M, T]`` held-out calibration windows: per-layer attention errors, the search's measurements
            and the refit's keep decision (kept only if it lowers the mean loss on them). None: no attention errors,
            no search (nothing to measure on) and a refit is never kept (nothing shows it helps), as in ``factor``.
        evaluation: ``[E, T']`` windows scored against the source (:attr:`Conversion.eval`).
        keep_stats: also return every layer's :class:`LayerStats` (the oracles' metric ``E[x xᵀ]``).
        resolution: ``options`` already resolved (:func:`~mla_convert.convert.options.resolve.resolve_options`); None:
            resolved here.

    Returns:
        The :class:`Conversion` (``options`` as converted, the search's choice included: ``.options``).

    Raises:
        OptionsError: impossible options (before any tensor is built).
        RopeError, FactorError, SourceError: as ``factor``.
    """
    if resolution is None:
        resolution = resolve_options(options, src)
    options = resolution.options
    check_options(options, src)
    empty = calibration[:0]
    held = held_out if held_out is not None else empty
    ev_ids = evaluation if evaluation is not None else empty
    probe = (ev_ids if ev_ids.numel() else calibration)[:1, :PROBE_TOKENS]
    with tempfile.TemporaryDirectory(prefix="mla-convert-") as tmp:
        work = Path(tmp)
        texts = Texts(calibration, held, ev_ids, probe)
        conv = StreamedConversion(
            src,
            options,
            texts,
            work,
            progress,
            keep_stats,
            trim=False,
            resumable=False,
            rope_candidates=resolution.rope_candidates,
            rope_strategies=resolution.rope_strategies,
            refit_modes=resolution.refit_modes,
        )
        passes = run_passes(conv)
        plans = [load_torch(conv.layer_file(i, "plan.pt")) for i in range(src.num_layers)]
        model = _load(passes.config, conv)
    res = passes.result
    return Conversion(model, passes.config, res.layers, plans, conv.stats, res, conv.options, passes.split)


def _load(config: MLAConfig, conv: StreamedConversion) -> MLAForCausalLM:
    """The checkpoint the streamed conversion would write, as a float32 model on the CPU."""
    load = conv.loader()
    state = {name: load(name).to(torch.float32) for name in conv.layout(config)}
    with torch.device("meta"):  # no random initialisation: every tensor is assigned below
        model = MLAForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"internal error reading the conversion back: missing {missing[:3]} unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
