"""The one pass order of a conversion: calibration, the search, the per-layer conversion, the ``o_proj`` refit's
keep decision, evaluation and the record (docs/design.md §Streaming).

``factor`` (:func:`~mla_convert.convert.pipeline.job.run_factor`, which adds text selection, measurements and an atomic
output folder), recipes (through ``run_factor``), the library and the tests
(:func:`~mla_convert.convert.pipeline.build.convert_windows`, the same passes in a temporary work folder) all run
:func:`run_passes`; nothing else orders the passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mla_convert.convert.layer.linalg import decompose_on
from mla_convert.convert.pipeline.records import Streamed
from mla_convert.convert.pipeline.rope_split import choose_rope_pairs
from mla_convert.convert.pipeline.stream import StreamedConversion
from mla_convert.metrics import EvalResult
from mla_convert.mla.configuration import MLAConfig


@dataclass(frozen=True)
class Passes:
    """What :func:`run_passes` produced.

    Attributes:
        config: the converted model's config.
        split: the search's measurements (:func:`~mla_convert.convert.pipeline.rope_split.choose_rope_pairs`' result), None
            where nothing was searched.
        result: the streamed conversion's record (layers, caches, timings, evaluation).
        eval: perplexity, KL and top-1 against the source on the evaluation windows (None without them).
        seconds: wall time of ``source`` (pass 1 and the search), ``convert`` (pass 2, the refit decision, pass 3)
            and ``score``.
    """

    config: MLAConfig
    split: dict[str, Any] | None
    result: Streamed
    eval: EvalResult | None
    seconds: dict[str, float]


def run_passes(
    conv: StreamedConversion,
    done: dict[str, int] | None = None,
    enter: Any = None,
) -> Passes:
    """Run ``conv``'s passes in the one order (module docstring), resuming after the step ``done`` records.

    1. pass 1 (the source's layers: statistics, plans, the search's spectra);
    2. the search (:func:`~mla_convert.convert.pipeline.rope_split.choose_rope_pairs`), whose choice the conversion adopts;
    3. ranks and config; pass 2 (the per-layer converter) and the ``o_proj`` refit's keep decision;
    4. pass 3 and the score on the evaluation windows (when the conversion has any).

    Args:
        conv: a streamed conversion in its work folder (its state loaded when resuming).
        done: ``{"pass": p, "layer": i}``, the last step finished (a resumed ``factor``), None for a fresh run.
        enter: ``phase -> None``, called as each phase begins (``calibrate``, ``convert``, ``evaluate``, ``score``:
            ``factor``'s peak-memory record), or None.

    Raises:
        RopeError, FactorError, SourceError: as the steps raise them.
    """
    with decompose_on(conv.device):  # the statistics' decompositions on the conversion's device
        return _run(conv, done, enter)


def _run(conv: StreamedConversion, done: dict[str, int] | None, enter: Any) -> Passes:
    """:func:`run_passes`' body."""
    t0 = time.perf_counter()
    step = (done["pass"], done["layer"]) if done is not None else (1, -1)
    n = conv.n_layers

    def first(p: int) -> int:
        """First layer pass ``p`` still has to run."""
        return n if step[0] > p else (step[1] + 1 if step[0] == p else 0)

    def phase(name: str) -> None:
        if enter is not None:
            enter(name)

    phase("calibrate")
    conv.pass_one(first(1))
    choice = choose_rope_pairs(conv)  # a resumed conversion: the split adopted before it stopped
    if choice is not None:
        conv.adopt(choice.options, choice.result, choice.planned, choice.spectra)
        if step[0] <= 1:
            conv.save_state({"pass": 1, "layer": n - 1})
    t1 = time.perf_counter()
    config = conv.ranks_and_config()
    phase("convert")
    conv.pass_two(config, first(2))
    if step[0] < 3:
        conv.decide_refit()
    ev = None
    if conv.texts.eval.numel():
        phase("evaluate")
        conv.pass_three(config, first(3))
    t2 = time.perf_counter()
    if conv.texts.eval.numel():
        phase("score")
        ev = conv.score()
    res = conv.result(config, ev)
    t3 = time.perf_counter()
    split = dict(choice.result) if choice is not None else None
    return Passes(config, split, res, ev, {"source": t1 - t0, "convert": t2 - t1, "score": t3 - t2})
