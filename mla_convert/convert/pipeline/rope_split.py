"""The RoPE split measured on the source being converted: how many RoPE pairs the cache row keeps, which, and the
``o_proj`` refit that goes with them.

A cache row of ``B`` values per token per layer is spent on the rope key (``R`` rope heads x ``2 r`` values) and
the latent (the rest). Where the user does not give ``--rope-pairs``, :func:`~mla_convert.convert.options.resolve.
resolve_options` starts from the split and levers measured best on another model (``measured_splits.json``, a
prior) and asks for candidates around it (:func:`~mla_convert.convert.options.candidates.rope_candidates`), for the other rope strategy (``2-norm``,
``rotation``) where ``--rope-strategy`` is not given, and for the other ``o_proj`` refit mode (``teacher``,
``sequential``) where ``--refit-o-proj`` is not given. The conversion then measures them on this source, the way
the ``o_proj`` refit is decided (docs/math.md §Partial RoPE):

1. pass 1 (:meth:`~mla_convert.convert.pipeline.stream.StreamedConversion.pass_one`): per layer, each candidate's RoPE plan and weighted K/V matrix from the same
   calibration statistics, and its singular values (and what each refit mode fits on);
2. between the passes (:func:`choose_rope_pairs`): per measured conversion the latent ranks allocated over every
   layer's spectrum (:func:`~mla_convert.convert.layer.factorize.allocate_ranks`); the held-out windows then run through
   its converted layers (factored, assembled, rounded to the output dtype as written, with its ``o_proj`` refit,
   kept where it lowers the held-out loss, as the conversion decides), scored by the mean KL(source ||
   converted). One coordinate at a time from the prior: the pairs by a local search (the prior and its neighbours
   on the candidate ladder, then one step further while the best is at the edge of what was measured: the KL
   falls, then rises, over the pairs, as rope values are taken from the latent); then each other strategy at the
   best pairs; then each other refit mode at that split. The lowest KL is converted: :func:`choose_rope_pairs` returns it
   (a :class:`SplitChoice`) and the conversion adopts it
   (:meth:`~mla_convert.convert.pipeline.stream.StreamedConversion.adopt`), so pass 2 converts it as if it had been given.

The held-out windows are calibration-split text the statistics never saw; the evaluation windows never choose.
A resumable conversion checkpoints the search after each layer of each round (:data:`CHECKPOINT`): stopped, it goes
on after the last finished layer with the same result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mla_convert.convert.layer.converter import LayerConverter, LayerSource, Planned, RefitInputs, plan_step
from mla_convert.convert.layer.factorize import FactorError, spectrum
from mla_convert.convert.layer.layers import run_mla
from mla_convert.convert.layer.steps import layer_ranks, mla_config
from mla_convert.convert.options.options import ConvertOptions, geometry
from mla_convert.convert.pipeline.stream import StreamedConversion
from mla_convert.convert.pipeline.workdir import load_torch, park, save_torch, unpark
from mla_convert.convert.stats.calibration import LayerStats
from mla_convert.metrics import ReferenceScores, head_scores, reference_scores

#: One measured conversion: (RoPE pairs, rope strategy, o_proj refit mode).
Key = tuple[int, str, str]
#: The plan of a split, whose spectra the ranks are allocated over: (RoPE pairs, rope strategy).
Plan = tuple[int, str]


@dataclass(frozen=True)
class SplitChoice:
    """What the search chose: the options pass 2 converts with and, where the chosen plan is not pass 1's, how to
    plan each layer again and every layer's spectrum (None: pass 1's plans stand).

    Attributes:
        options: the options with the chosen ``rope_pairs``, ``rope_strategy`` and ``refit_o_proj``.
        result: the measurements (:func:`choose_rope_pairs`' dict).
        planned: ``layer -> Planned``: the chosen split's plan of a layer (computed when asked: one layer's float64
            matrices at a time), or None.
        spectra: per layer the chosen split's singular values, or None.
    """

    options: ConvertOptions
    result: dict[str, Any]
    planned: Callable[[int], Planned] | None = None
    spectra: list[torch.Tensor] | None = None


def _stats(p1: dict[str, Any]) -> LayerStats:
    """A layer's calibration statistics again from what pass 1 saved (``p1.pt``)."""
    q_norm, k_norm = p1["pair_norms"]
    return LayerStats(p1["target"].xx, p1["x_mean"], q_norm, k_norm, int(p1["tokens"]))


#: The search's checkpoint in a resumable conversion's work folder: the rounds measured, their KL, loss and refit
#: decisions, the spectra, the seconds spent, and the round under way after its last finished layer (each candidate's
#: streams). A stopped search goes on from there (an 8B's rounds take hours on a CPU).
CHECKPOINT = "search.pt"


class _Search:
    """The measurements of one search: per split its allocated ranks, held-out KL and loss (of the variant the
    conversion keeps) and whether the ``o_proj`` refit was kept; read back from the work folder's
    :data:`CHECKPOINT` where a stopped conversion left one."""

    def __init__(self, conv: StreamedConversion, spectra: dict[Plan, list[torch.Tensor]]) -> None:
        self.conv, self.spectra = conv, spectra
        self.kl: dict[Key, float] = {}
        self.loss: dict[Key, float] = {}
        self.refit: dict[Key, bool] = {}
        self.reference: ReferenceScores | None = None
        self.rounds: list[list[Key]] = []  # the rounds measured, in order
        self.seconds = 0.0  # spent before the conversion stopped
        self.t0 = time.perf_counter()
        self.partial: dict[str, Any] | None = None  # the round under way: keys, last finished layer, candidate states
        path = conv.work / CHECKPOINT
        if conv.resumable and path.is_file():
            saved = load_torch(path)
            self.kl, self.loss, self.refit = saved["kl"], saved["loss"], saved["refit"]
            self.spectra.update(saved["spectra"])
            self.rounds, self.seconds, self.partial = saved["rounds"], saved["seconds"], saved["partial"]

    def elapsed(self) -> float:
        """The search's seconds so far, those before a stop included."""
        return self.seconds + time.perf_counter() - self.t0

    def save(self, partial: dict[str, Any] | None = None) -> None:
        """Write the checkpoint (a resumable conversion only)."""
        if self.conv.resumable:
            state = {"kl": self.kl, "loss": self.loss, "refit": self.refit, "spectra": self.spectra,
                     "rounds": self.rounds, "seconds": self.elapsed(), "partial": partial}  # fmt: skip
            save_torch(self.conv.work / CHECKPOINT, state)

    def ranks(self, key: Key) -> list[int] | None:
        """The latent ranks allocated over every layer's spectrum for ``key``; None where the budget cannot hold
        that split's latent (not a candidate)."""
        opts = self.conv.options.with_split(*key)
        try:
            return layer_ranks(opts, self.spectra[key[:2]], geometry(opts, self.conv.src))
        except FactorError:
            return None

    def planned(self, key: Plan) -> Callable[[int], Planned]:
        """``layer -> Planned``: ``key``'s plan of a layer from pass 1's statistics."""
        conv, opts = self.conv, self.conv.options.with_split(*key)

        def plan(i: int) -> Planned:
            weights = conv.files.layer_source(i).weights
            planned = plan_step(conv.src, opts, weights, _stats(conv.calibration_record(i)))
            conv.src.release()
            return planned

        return plan

    def add_spectra(self, key: Plan, stage: str) -> None:
        """``key``'s per-layer singular values from pass 1's statistics (one pass over the layers; kept from a
        stopped search)."""
        if key in self.spectra:
            return
        plan, out = self.planned(key), []
        for i in range(self.conv.n_layers):
            out.append(spectrum(plan(i).target))
            self.conv.trim_memory(candidate=True)
            self.conv.progress(stage, 1, self.conv.n_layers)
        self.spectra[key] = out

    def measure(self, keys: list[Key], stage: str) -> None:
        """Convert every split in ``keys`` layer by layer on the held-out windows and score it (one pass over the
        layers for all of them), checkpointed after each layer (a round the stopped search had measured is not
        measured again; the one under way goes on after its last finished layer)."""
        if keys in self.rounds:
            return
        conv, src = self.conv, self.conv.src
        runs = {k: _Candidate(conv, conv.options.with_split(*k), rk) for k in keys if (rk := self.ranks(k))}
        steps = conv.n_layers + len(runs)
        teacher = any(not run.sequential for run in runs.values())
        start, partial = 0, self.partial
        if partial is not None and partial["keys"] == keys:
            start = partial["layer"] + 1
            for k, run in runs.items():
                run.restore(partial["runs"][k])
            conv.progress(stage, start, steps)
        self.partial = None
        for i in range(start, conv.n_layers):
            p1 = conv.calibration_record(i)
            if not teacher:  # a sequential refit fits on its own windows' inputs: the source's are not read
                p1["refit"] = (None, p1["refit"][1])
            layer = conv.files.layer_source(i)
            src.release()  # read: its mapped pages (0.4 GB at 8B) leave the resident set before the candidates run
            stats = _stats(p1)
            for run in runs.values():
                run.layer(layer, p1, stats)
                conv.trim_memory(candidate=True)  # a candidate's refit temporaries (~1 GB of float64 at 8B), before the next one's
            # before the next layer's are read: held across the read, this layer's refit inputs, float32 MLP and
            # float64 attention were ~1.5 GB more at 8B
            del p1, layer, stats
            self.save({"keys": keys, "layer": i, "runs": {k: run.carried() for k, run in runs.items()}})
            conv.progress(stage, 1, steps)
        head, src_norm, mla_norm = conv.head()
        if self.reference is None:  # the source's side of every candidate's KL, once per search
            ref = (conv.stream("src_held"), src_norm, head)
            self.reference = reference_scores(ref, conv.texts.held, head, head_dtype=conv.dtype)
        for k, run in runs.items():
            scored = {
                name: head_scores(hidden, conv.texts.held, mla_norm, head, self.reference, head_dtype=conv.dtype)
                for name, hidden in run.variants().items()
            }
            means = {name: sum(w) / len(w) for name, (_, w) in scored.items()}
            # the variant the conversion keeps (StreamedConversion.decide_refit): the refit where it lowers the loss
            kept = "fit" if "fit" in means and means["fit"] < means["plain"] else "plain"
            self.kl[k], self.loss[k] = float(scored[kept][0].kl or 0.0), means[kept]
            self.refit[k] = kept == "fit"
            conv.progress(stage, 1, steps)
        self.rounds.append(keys)
        self.save()


def _next_pairs(ladder: list[int], measured: dict[int, float]) -> list[int]:
    """The candidates beside the best measured one not measured yet (empty: the best is a local minimum)."""
    best = ladder.index(min(measured, key=lambda r: measured[r]))
    return [ladder[j] for j in (best - 1, best + 1) if 0 <= j < len(ladder) and ladder[j] not in measured]


@torch.no_grad()
def choose_rope_pairs(conv: StreamedConversion) -> SplitChoice | None:
    """Measure candidates on the held-out windows and choose the best (module docstring); the caller hands the
    choice to the conversion (:meth:`~mla_convert.convert.pipeline.stream.StreamedConversion.adopt`).

    Coordinate by coordinate, each from the prior: the pairs (the prior and its neighbours on the candidate
    ladder, then one step at a time towards the lower KL while the best is at the edge of what was measured: the
    KL over the pairs falls, then rises, as a budget spent on rope values is taken from the latent); then each
    other rope strategy (``conv.rope_strategies``) at the pairs chosen; then each other ``o_proj`` refit mode
    (``conv.refit_modes``) at that split. A resumed conversion whose search had finished gets the recorded
    choice (:meth:`~mla_convert.convert.pipeline.stream.StreamedConversion.recorded_split`) without measuring again.

    Returns:
        The :class:`SplitChoice`, whose ``result`` is ``{"candidates": [...], "prior": r, "chosen": r, "kl": {r:
        nats}, "loss": {r: nats}, "refit": {r: kept}, "strategy": {"prior": s, "chosen": s, "kl": {s: nats},
        "loss": ..., "refit": ...} or None, "refit_mode": {the same over the refit modes} or None, "tokens": n,
        "seconds": s}`` (KL and loss per held-out token of the variant kept; ``kl`` over the pairs measured at the
        prior levers), or None when there was nothing to choose (no candidates, or no held-out windows).
    """
    spectra = conv.candidate_spectra()
    if spectra is None or not conv.texts.held.numel():
        return None
    recorded = conv.recorded_split()
    if recorded is not None:  # adopted before the conversion stopped: its plans are in the work folder
        strategy = (recorded.get("strategy") or {}).get("chosen")
        mode = (recorded.get("refit_mode") or {}).get("chosen")
        return SplitChoice(conv.options.with_split(recorded["chosen"], strategy, mode), dict(recorded))
    # the evaluation and probe streams and the refit windows wait in the work folder while the candidates run (384 MB
    # off the search's peak at 8B); a sequential candidate reads the refit windows from there (conv.stream)
    streams = conv.state["streams"]
    park(conv.work, streams, ("src_held", "mla_held"))
    conv.trim_memory()
    try:
        return _search(conv, spectra)
    finally:
        unpark(conv.work, streams)


def _search(conv: StreamedConversion, spectra: dict[int, list[torch.Tensor]]) -> SplitChoice:
    """:func:`choose_rope_pairs`' measurements, from pass 1's candidate ``spectra``."""
    prior, strategy0, mode0 = conv.options.rope_pairs, conv.options.rope_strategy, conv.options.refit_o_proj
    known: dict[Plan, list[torch.Tensor]] = {(prior, strategy0): conv.prior_spectra()}
    search = _Search(conv, known | {(r, strategy0): s for r, s in spectra.items()})
    ladder = [r for r in conv.rope_candidates if search.ranks((r, strategy0, mode0)) is not None]
    if prior not in ladder:  # the prior always fits (resolve checked it); kept for a safe index
        ladder = sorted({*ladder, prior})
    at = ladder.index(prior)

    def by_pairs(what: dict[Key, Any]) -> dict[int, Any]:
        return {k[0]: v for k, v in what.items() if k[1:] == (strategy0, mode0)}

    search.measure([(r, strategy0, mode0) for r in ladder[max(0, at - 1) : at + 2]], "rope split")
    while step := _next_pairs(ladder, by_pairs(search.kl)):
        search.measure([(r, strategy0, mode0) for r in step], f"rope split: {step[0]} pairs")
    pairs_kl = by_pairs(search.kl)
    best = min(pairs_kl, key=lambda r: (pairs_kl[r], r != prior))
    strategies = [
        s for s in conv.rope_strategies if geometry(conv.options.with_split(best, s), conv.src).rope_pairs == best
    ]
    for s in strategies:
        search.add_spectra((best, s), f"rope strategy: {s} spectra")
        search.measure([(best, s, mode0)], f"rope strategy: {s}")
    strategy_rec = _lever(search, [(best, s, mode0) for s in [strategy0, *strategies]], 1) if strategies else None
    strategy = strategy_rec["chosen"] if strategy_rec else strategy0
    modes = list(conv.refit_modes)
    for m in modes:
        search.measure([(best, strategy, m)], f"o_proj refit: {m}")
    mode_rec = _lever(search, [(best, strategy, m) for m in [mode0, *modes]], 2) if modes else None
    mode = mode_rec["chosen"] if mode_rec else mode0
    result = {
        "candidates": ladder,
        "prior": prior,
        "chosen": best,
        "kl": pairs_kl,
        "loss": by_pairs(search.loss),
        "refit": by_pairs(search.refit),
        "strategy": strategy_rec,
        "refit_mode": mode_rec,
        "tokens": int(conv.texts.held[:, 1:].numel()),
        "seconds": search.elapsed(),
    }
    options = conv.options.with_split(best, strategy, mode)
    if (best, strategy) == (prior, strategy0):
        return SplitChoice(options, result)
    return SplitChoice(options, result, search.planned((best, strategy)), search.spectra[(best, strategy)])


def _lever(search: _Search, keys: list[Key], part: int) -> dict[str, Any]:
    """One lever's measurements (``part`` of the key: 1 the strategy, 2 the refit mode; ``keys[0]`` the prior's)
    and the value with the lowest KL (the prior's on a tie)."""
    kl = {k[part]: search.kl[k] for k in keys if k in search.kl}
    prior = keys[0][part]
    return {
        "prior": prior,
        "chosen": min(kl, key=lambda v: (kl[v], v != prior)),
        "kl": kl,
        "loss": {k[part]: search.loss[k] for k in keys if k in search.loss},
        "refit": {k[part]: search.refit[k] for k in keys if k in search.refit},
    }


class _Candidate:
    """One candidate's converted model on the held-out windows, layer by layer, converted as pass 2 converts it
    (the same :class:`~mla_convert.convert.layer.converter.LayerConverter`): factored at its allocated ranks, assembled,
    rounded, with the ``o_proj`` refit of its options' mode (teacher: on the source's kept calibration inputs;
    sequential: on its own refit windows carried through its converted layers) and both variants' held-out streams
    (``plain``; ``fit`` when a refit is in play)."""

    def __init__(self, conv: StreamedConversion, options: ConvertOptions, ranks: list[int]) -> None:
        self.conv, self.ranks, self.options = conv, ranks, options
        self.refit = options.refit_o_proj != "none"
        self.sequential = options.refit_o_proj == "sequential"
        self.plain = conv.stream("mla_held", copy=True)
        self.fit = self.plain.clone() if self.refit else None
        self.refit_windows = conv.stream("mla_refit", copy=True) if self.sequential else None
        self.lossy_seen = False
        self.refit_layers = 0

    def layer(self, layer: LayerSource, p1: dict[str, Any], stats: LayerStats) -> None:
        """Convert ``layer`` and move the streams through it."""
        conv, src = self.conv, self.conv.src
        planned = plan_step(src, self.options, layer.weights, stats)
        d_nope = int(planned.plan.q_nope.shape[1])
        config = mla_config(src, self.options, self.ranks, [planned.plan] * conv.n_layers, d_nope)
        refit = None
        if self.refit:
            x, out = p1["refit"]
            refit = RefitInputs(x, out, self.refit_windows, self.sequential and self.lossy_seen)
        converter = LayerConverter(src, self.options, config, conv.device, conv.dtype, check=False)
        converted = converter.convert(layer, planned, refit, p1["x_mean"])
        heads, inter = src.num_heads, src.intermediate_size
        o_proj = converted.layer.self_attn.o_proj.weight
        self.refit_layers += converted.fit_w is not None
        self.plain = run_mla(converted.layer, self.plain, heads, inter)
        if self.fit is not None:
            if converted.fit_w is not None:
                o_proj.copy_(converted.fit_w)
            self.fit = run_mla(converted.layer, self.fit, heads, inter)
        if self.refit_windows is not None:  # through the layer as written (the refit's o_proj where there is one)
            self.refit_windows = run_mla(converted.layer, self.refit_windows, heads, inter, inplace=True)
        self.lossy_seen = self.lossy_seen or converted.lossy

    #: What carries a candidate from one layer to the next: its streams and flags.
    CARRIED = ("plain", "fit", "refit_windows", "lossy_seen", "refit_layers")

    def carried(self) -> dict[str, Any]:
        """:data:`CARRIED` as it stands (for the search's checkpoint, :meth:`_Search.measure`)."""
        return {name: getattr(self, name) for name in self.CARRIED}

    def restore(self, carried: dict[str, Any]) -> None:
        """Go on from :meth:`carried` of a candidate of the same split (a stopped search's checkpoint)."""
        for name in self.CARRIED:
            setattr(self, name, carried[name])

    def variants(self) -> dict[str, torch.Tensor]:
        """The final hidden states of the held-out windows per ``o_proj`` variant."""
        if self.fit is None or not self.refit_layers:
            return {"plain": self.plain}
        return {"plain": self.plain, "fit": self.fit}
