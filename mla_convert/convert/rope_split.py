"""The RoPE split measured on the source being converted: how many RoPE pairs the cache row keeps, which, and the
``o_proj`` refit that goes with them.

A cache row of ``B`` values per token per layer is spent on the rope key (``R`` rope heads x ``2 r`` values) and
the latent (the rest). Where the user does not give ``--rope-pairs``, :func:`~mla_convert.convert.resolve.
resolve_options` starts from the split and levers measured best on another model (``measured_splits.json``, a
prior) and asks for candidates around it (:func:`rope_candidates`), for the other rope strategy (``2-norm``,
``rotation``) where ``--rope-strategy`` is not given, and for the other ``o_proj`` refit mode (``teacher``,
``sequential``) where ``--refit-o-proj`` is not given. The conversion then measures them on this source, the way
the ``o_proj`` refit is decided (docs/math.md §Partial RoPE):

1. pass 1 (:func:`candidate_spectra`): per layer, each candidate's RoPE plan and weighted K/V matrix from the same
   calibration statistics, and its singular values (and what each refit mode fits on);
2. between the passes (:func:`choose_rope_pairs`): per measured conversion the latent ranks allocated over every
   layer's spectrum (:func:`~mla_convert.convert.factorize.allocate_ranks`); the held-out windows then run through
   its converted layers (factored, assembled, rounded to the output dtype as written, with its ``o_proj`` refit,
   kept where it lowers the held-out loss, as the conversion decides), scored by the mean KL(source ||
   converted). One coordinate at a time from the prior: the pairs by a local search (the prior and its neighbours
   on the candidate ladder, then one step further while the best is at the edge of what was measured: the KL
   falls, then rises, over the pairs, as rope values are taken from the latent); then each other strategy at the
   best pairs; then each other refit mode at that split. The lowest KL is converted: its plans and targets
   replace pass 1's in the work folder, so pass 2 converts it as if it had been given.

The held-out windows are calibration-split text the statistics never saw; the evaluation windows never choose.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from mla_convert.convert.calibration import LayerStats
from mla_convert.convert.factorize import FactorError, factor_layer, spectrum
from mla_convert.convert.layers import run_mla
from mla_convert.convert.options import ConvertOptions, Geometry, SourceShape, geometry
from mla_convert.convert.refit import refit_o_proj
from mla_convert.convert.steps import is_lossless, layer_ranks, layer_state, mla_config, plan_and_target
from mla_convert.convert.workdir import load_torch, save_torch
from mla_convert.metrics import ReferenceScores, head_scores, reference_scores

if TYPE_CHECKING:
    from mla_convert.convert.resolve import Resolution
    from mla_convert.convert.stream import StreamedConversion

#: Candidate RoPE pairs as multiples of the prior's: half of it to one and a half times it.
SPREAD = (0.5, 0.75, 1.0, 1.25, 1.5)
#: The rope values per token vLLM's MLA backends cache (its 512 + 64 row; the plugin serves no wider rope part):
#: the search does not move a prior that fits it past it (a biased or scaled source has no other vLLM route).
VLLM_ROPE_WIDTH = 64


def rope_candidates(options: ConvertOptions, src: SourceShape, budget: float) -> tuple[int, ...]:
    """The RoPE pairs a conversion measures around ``options.rope_pairs`` (the prior), ascending.

    Each is ``round(m x prior)`` for ``m`` in :data:`SPREAD`, kept to what a rope head holds, to a latent of at
    least one value per layer at ``budget`` (values per token per layer), and, when the prior's rope part fits
    vLLM's :data:`VLLM_ROPE_WIDTH`, to that width too (a default conversion stays servable by vLLM's plugin; give
    ``--rope-pairs`` for more); the prior is always one of them.

    Returns:
        The candidates; one element (the prior) when nothing else fits.
    """
    geo = geometry(options, src)
    prior = geo.rope_pairs
    out = {prior}
    servable = geo.rope_width <= VLLM_ROPE_WIDTH
    for m in SPREAD:
        r = max(1, round(m * prior))
        g = geometry(options.model_copy(update={"rope_pairs": r}), src)
        if g.rope_pairs == r and _latent_fits(g, budget) and (not servable or g.rope_width <= VLLM_ROPE_WIDTH):
            out.add(r)
    return tuple(sorted(out))


def expected_measurements(res: Resolution) -> int:
    """The splits a conversion with ``res`` is expected to convert on the held-out windows: the prior and its
    neighbours on the ladder, each other strategy and each other refit mode (a local search that walks on
    measures more)."""
    ladder = res.rope_candidates
    if len(ladder) < 2:
        return 1
    at = ladder.index(res.options.rope_pairs)
    return len(ladder[max(0, at - 1): at + 2]) + len(res.rope_strategies) + len(res.refit_modes)


def _latent_fits(geo: Geometry, budget: float) -> bool:
    """Whether ``budget`` leaves every layer at least one latent value after the rope key."""
    return geo.latent_total(budget) >= geo.num_layers


def candidate_spectra(conv: StreamedConversion, weights: dict[str, torch.Tensor], stats: LayerStats) -> None:
    """Pass 1, one layer: the singular values of each candidate's weighted K/V matrix (appended per candidate to
    ``conv.state["rope_split"]["spectra"]``); the prior's are the layer's own (``state["spectra"]``)."""
    split = conv.state.setdefault("rope_split", {"spectra": {}})
    for r in conv.rope_candidates:
        if r == conv.options.rope_pairs:
            continue
        _, target = plan_and_target(conv.src, _with_pairs(conv.options, r), weights, stats)
        split["spectra"].setdefault(r, []).append(spectrum(target))


def _with_pairs(
    options: ConvertOptions, pairs: int, strategy: str | None = None, refit: str | None = None
) -> ConvertOptions:
    update: dict[str, Any] = {"rope_pairs": pairs}
    if strategy is not None:
        update["rope_strategy"] = strategy
    if refit is not None:
        update["refit_o_proj"] = refit
    return options.model_copy(update=update)


#: One measured conversion: (RoPE pairs, rope strategy, o_proj refit mode).
Key = tuple[int, str, str]
#: The plan of a split, whose spectra the ranks are allocated over: (RoPE pairs, rope strategy).
Plan = tuple[int, str]


def _stats(p1: dict[str, Any], objective: str) -> LayerStats:
    """A layer's calibration statistics again from what pass 1 saved (``p1.pt``), with the ``C^½`` its target
    was weighted by (:func:`~mla_convert.convert.factorize.xx_sqrt`; not computed again for every candidate)."""
    q_norm, k_norm = p1["pair_norms"]
    st = LayerStats(p1["target"].xx, p1["x_mean"], q_norm, k_norm, int(p1["tokens"]))
    if objective != "weight":
        st.moments["xx_sqrt"] = p1["target"].right
    return st


class _Search:
    """The measurements of one search: per split its allocated ranks, held-out KL and loss (of the variant the
    conversion keeps) and whether the ``o_proj`` refit was kept."""

    def __init__(self, conv: StreamedConversion, spectra: dict[Plan, list[torch.Tensor]]) -> None:
        self.conv, self.spectra = conv, spectra
        self.kl: dict[Key, float] = {}
        self.loss: dict[Key, float] = {}
        self.refit: dict[Key, bool] = {}
        self.reference: ReferenceScores | None = None

    def ranks(self, key: Key) -> list[int] | None:
        """The latent ranks allocated over every layer's spectrum for ``key``; None where the budget cannot hold
        that split's latent (not a candidate)."""
        opts = _with_pairs(self.conv.options, *key)
        try:
            return layer_ranks(opts, self.spectra[key[:2]], geometry(opts, self.conv.src))
        except FactorError:
            return None

    def add_spectra(self, key: Plan, stage: str) -> None:
        """``key``'s per-layer singular values from pass 1's statistics (one pass over the layers)."""
        conv, opts = self.conv, _with_pairs(self.conv.options, *key)
        out = []
        for i in range(conv.n_layers):
            weights = conv._attention(i, conv._source_tensors(i))
            stats = _stats(load_torch(conv._layer_file(i, "p1.pt")), opts.objective)
            _, target = plan_and_target(conv.src, opts, weights, stats)
            out.append(spectrum(target))
            conv.src.release()
            conv.progress(stage, 1, conv.n_layers)
        self.spectra[key] = out

    def measure(self, keys: list[Key], stage: str) -> None:
        """Convert every split in ``keys`` layer by layer on the held-out windows and score it (one pass over the
        layers for all of them)."""
        conv, src = self.conv, self.conv.src
        runs = {k: _Candidate(conv, _with_pairs(conv.options, *k), rk) for k in keys if (rk := self.ranks(k))}
        steps = conv.n_layers + len(runs)
        for i in range(conv.n_layers):
            p1 = load_torch(conv._layer_file(i, "p1.pt"))
            source = conv._source_tensors(i)
            weights = conv._attention(i, source)
            stats = _stats(p1, conv.options.objective)
            for run in runs.values():
                run.layer(i, p1, source, weights, stats)
            src.release()
            conv.progress(stage, 1, steps)
        head, src_norm, mla_norm = conv._head()
        if self.reference is None:  # the source's side of every candidate's KL, once per search
            ref = (conv.state["streams"]["src_held"], src_norm, head)
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


def _next_pairs(ladder: list[int], measured: dict[int, float]) -> list[int]:
    """The candidates beside the best measured one not measured yet (empty: the best is a local minimum)."""
    best = ladder.index(min(measured, key=lambda r: measured[r]))
    return [ladder[j] for j in (best - 1, best + 1) if 0 <= j < len(ladder) and ladder[j] not in measured]


@torch.no_grad()
def choose_rope_pairs(conv: StreamedConversion) -> dict[str, Any] | None:
    """Measure candidates on the held-out windows, convert the best (module docstring).

    Coordinate by coordinate, each from the prior: the pairs (the prior and its neighbours on the candidate
    ladder, then one step at a time towards the lower KL while the best is at the edge of what was measured: the
    KL over the pairs falls, then rises, as a budget spent on rope values is taken from the latent); then each
    other rope strategy (``conv.rope_strategies``) at the pairs chosen; then each other ``o_proj`` refit mode
    (``conv.refit_modes``) at that split. Updates ``conv.options`` (``rope_pairs``, ``rope_strategy``,
    ``refit_o_proj``), the work folder's plans and targets and ``conv.state`` (spectra, NoPE widths) to the
    choice; recorded in ``conv.state["rope_split"]["result"]`` so a resumed conversion does not measure again.

    Returns:
        ``{"candidates": [...], "prior": r, "chosen": r, "kl": {r: nats}, "loss": {r: nats}, "refit": {r: kept},
        "strategy": {"prior": s, "chosen": s, "kl": {s: nats}, "loss": ..., "refit": ...} or None,
        "refit_mode": {the same over the refit modes} or None, "tokens": n, "seconds": s}`` (KL and loss per
        held-out token of the variant kept; ``kl`` over the pairs measured at the prior levers), or None when there
        was nothing to choose (no candidates, or no held-out windows).
    """
    st = conv.state
    split = st.get("rope_split")
    if split is None or not conv.texts.held.numel():
        return None
    if "result" in split:
        result = split["result"]
        strategy = (result.get("strategy") or {}).get("chosen")
        mode = (result.get("refit_mode") or {}).get("chosen")
        conv.options = _with_pairs(conv.options, result["chosen"], strategy, mode)
        return dict(result)
    t0 = time.perf_counter()
    prior, strategy0, mode0 = conv.options.rope_pairs, conv.options.rope_strategy, conv.options.refit_o_proj
    search = _Search(conv, {(prior, strategy0): st["spectra"]}
                     | {(r, strategy0): s for r, s in split["spectra"].items()})  # fmt: skip
    ladder = [r for r in conv.rope_candidates if search.ranks((r, strategy0, mode0)) is not None]
    if prior not in ladder:  # the prior always fits (resolve checked it); kept for a safe index
        ladder = sorted({*ladder, prior})
    at = ladder.index(prior)

    def by_pairs(what: dict[Key, Any]) -> dict[int, Any]:
        return {k[0]: v for k, v in what.items() if k[1:] == (strategy0, mode0)}

    search.measure([(r, strategy0, mode0) for r in ladder[max(0, at - 1): at + 2]], "rope split")
    while step := _next_pairs(ladder, by_pairs(search.kl)):
        search.measure([(r, strategy0, mode0) for r in step], f"rope split: {step[0]} pairs")
    pairs_kl = by_pairs(search.kl)
    best = min(pairs_kl, key=lambda r: (pairs_kl[r], r != prior))
    strategies = [s for s in conv.rope_strategies
                  if geometry(_with_pairs(conv.options, best, s), conv.src).rope_pairs == best]  # fmt: skip
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
    if (best, strategy) != (prior, strategy0):
        _replace_plans(conv, (best, strategy), search.spectra[(best, strategy)])
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
        "seconds": time.perf_counter() - t0,
    }
    split["result"] = result
    conv.options = _with_pairs(conv.options, best, strategy, mode)
    return dict(result)


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
    """One candidate's converted model on the held-out windows, layer by layer, as pass 2 converts it: factored at
    its allocated ranks, assembled, rounded, with the ``o_proj`` refit of its options' mode (teacher: on the
    source's kept calibration inputs; sequential: on its own refit windows carried through its converted layers)
    and both variants' held-out streams (``plain``; ``fit`` when a refit is in play)."""

    def __init__(self, conv: StreamedConversion, options: ConvertOptions, ranks: list[int]) -> None:
        self.conv, self.ranks, self.options = conv, ranks, options
        self.refit = options.refit_o_proj != "none"
        self.sequential = options.refit_o_proj == "sequential"
        streams = conv.state["streams"]
        self.plain = streams["mla_held"].clone()
        self.fit = self.plain.clone() if self.refit else None
        self.refit_windows = streams["mla_refit"].clone() if self.sequential else None
        self.lossy_seen = False
        self.refit_layers = 0

    def layer(
        self, i: int, p1: dict[str, Any], source: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
        stats: LayerStats,
    ) -> None:
        """Convert layer ``i`` and move the streams through it."""
        conv, src = self.conv, self.conv.src
        plan, target = plan_and_target(src, self.options, weights, stats)
        factors = factor_layer(target, self.ranks[i], self.options.factorization)
        d_nope = int(plan.q_nope.shape[1])
        attn = layer_state(src, weights, plan, factors, d_nope)
        config = mla_config(src, self.options, self.ranks, [plan] * conv.n_layers, d_nope)
        layer = conv._mla(config, i, source, attn)
        heads, inter = src.num_heads, conv.intermediate
        lossy = not is_lossless([plan], [factors])
        fit_w = None
        o_proj = layer.self_attn.o_proj.weight
        if self.refit and (lossy or (self.sequential and self.lossy_seen)):
            plain_w = o_proj.detach().clone()
            x, out = p1["refit"]
            if self.refit_windows is not None:
                x = layer.input_layernorm(self.refit_windows)
            refit_o_proj(layer.self_attn, x.to(conv.device), out.to(conv.device))
            fit_w = conv._round(o_proj.detach().clone())
            o_proj.copy_(plain_w)
            self.refit_layers += 1
        self.plain = run_mla(layer, self.plain, heads, inter)
        if self.fit is not None:
            if fit_w is not None:
                o_proj.copy_(fit_w)
            self.fit = run_mla(layer, self.fit, heads, inter)
        if self.refit_windows is not None:  # through the layer as written (the refit's o_proj where there is one)
            self.refit_windows = run_mla(layer, self.refit_windows, heads, inter)
        self.lossy_seen = self.lossy_seen or lossy

    def variants(self) -> dict[str, torch.Tensor]:
        """The final hidden states of the held-out windows per ``o_proj`` variant."""
        if self.fit is None or not self.refit_layers:
            return {"plain": self.plain}
        return {"plain": self.plain, "fit": self.fit}


def _replace_plans(conv: StreamedConversion, key: Plan, spectra: list[torch.Tensor]) -> None:
    """The chosen split's plans and weighted K/V matrices in the work folder (pass 2 reads them)."""
    opts = _with_pairs(conv.options, *key)
    d_nope = []
    for i in range(conv.n_layers):
        p1 = load_torch(conv._layer_file(i, "p1.pt"))
        weights = conv._attention(i, conv._source_tensors(i))
        plan, target = plan_and_target(conv.src, opts, weights, _stats(p1, opts.objective))
        target.singular_values = spectra[i]
        p1["target"] = target
        save_torch(conv._layer_file(i, "plan.pt"), plan)
        save_torch(conv._layer_file(i, "p1.pt"), p1)
        d_nope.append(int(plan.q_nope.shape[1]))
        conv.src.release()
    conv.state["spectra"] = spectra
    conv.state["d_nope"] = d_nope


def split_record(split: dict[str, Any] | None) -> dict[str, Any] | None:
    """:func:`choose_rope_pairs`'s result as the report keeps it (JSON keys, rounded nats), None for none."""
    if split is None:
        return None
    return {
        "candidates": split["candidates"],
        "prior": split["prior"],
        "chosen": split["chosen"],
        "kl_nats_per_token": {str(r): round(v, 5) for r, v in sorted(split["kl"].items())},
        "loss_nats_per_token": {str(r): round(v, 5) for r, v in sorted(split["loss"].items())},
        "o_proj_refit_kept": {str(r): v for r, v in sorted(split["refit"].items())},
        "strategy": _lever_record(split.get("strategy")),
        "refit_mode": _lever_record(split.get("refit_mode")),
        "measured_on": f"{split['tokens']} held-out calibration-split tokens, each candidate with the o_proj "
        "refit where it lowers their loss (as the conversion keeps it)",
        "seconds": round(split["seconds"], 1),
    }


def _lever_record(lever: dict[str, Any] | None) -> dict[str, Any] | None:
    if not lever:
        return None
    return {
        "prior": lever["prior"],
        "chosen": lever["chosen"],
        "kl_nats_per_token": {k: round(v, 5) for k, v in lever["kl"].items()},
        "loss_nats_per_token": {k: round(v, 5) for k, v in lever["loss"].items()},
        "o_proj_refit_kept": dict(lever["refit"]),
    }


def outcome(record: dict[str, Any]) -> str:
    """The measured split in one sentence (``record``: :func:`split_record`'s), saying when the best is the smallest
    or largest candidate (the best may then lie beyond: ``--rope-pairs`` tries it), and the rope strategy and
    ``o_proj`` refit mode measured at the chosen pairs, where they were."""
    kl = record["kl_nats_per_token"]
    kls = ", ".join(f"{r}: {v:.4f}" for r, v in kl.items())
    chosen, cands = record["chosen"], record["candidates"]
    edge = ""
    if len(cands) > 1 and chosen in (cands[0], cands[-1]):
        side = "fewer" if chosen == cands[0] else "more"
        edge = (f"; the {'smallest' if side == 'fewer' else 'largest'} candidate tried: {side} pairs may do better "
                "still, --rope-pairs tries them")
    said = (f"--rope-pairs {chosen} measured best on this source (KL nats/token on the held-out windows: {kls}; "
            f"the prior was {record['prior']}{edge})")
    if record.get("strategy"):
        said += "; " + _lever_said("--rope-strategy", record["strategy"], f"at {chosen} pairs")
    if record.get("refit_mode"):
        said += "; " + _lever_said("--refit-o-proj", record["refit_mode"], "there")
    return said


def _lever_said(flag: str, lever: dict[str, Any], where: str) -> str:
    """One lever's outcome (``lever``: :func:`_lever_record`'s); a tie keeps the prior and says so (with why, where
    no candidate kept its ``o_proj`` refit: the refit modes then convert the same model)."""
    kl = lever["kl_nats_per_token"]
    kls = ", ".join(f"{k}: {v:.4f}" for k, v in kl.items())
    if len(kl) > 1 and len(set(kl.values())) == 1:
        why = "; no candidate kept its o_proj refit" if not any(lever["o_proj_refit_kept"].values()) else ""
        return f"{flag} {lever['chosen']} kept, the prior: every value measured the same {where} ({kls}{why})"
    return f"{flag} {lever['chosen']} measured best {where} ({kls}; the prior was {lever['prior']})"


def split_sentence(split: dict[str, Any] | None, why: str | None) -> str | None:
    """Why the conversion has its RoPE pairs: the resolution's ``why`` and, when measured, the outcome."""
    if split is None:
        return why
    record = split_record(split)
    assert record is not None
    said = outcome(record)
    return f"{why}; {said}" if why else said
