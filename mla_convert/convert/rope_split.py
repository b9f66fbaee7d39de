"""The RoPE split measured on the source being converted: how many RoPE pairs the cache row keeps.

A cache row of ``B`` values per token per layer is spent on the rope key (``R`` rope heads x ``2 r`` values) and
the latent (the rest). Where the user does not give ``--rope-pairs``, :func:`~mla_convert.convert.resolve.
resolve_options` starts from the split measured best on another model (``measured_splits.json``, a prior) and asks
for candidates around it (:func:`rope_candidates`). The conversion then measures them on this source, the way the
``o_proj`` refit is decided (docs/math.md §Partial RoPE):

1. pass 1 (:func:`candidate_spectra`): per layer, each candidate's RoPE plan and weighted K/V matrix from the same
   calibration statistics, and its singular values;
2. between the passes (:func:`choose_rope_pairs`): per candidate the latent ranks allocated over every layer's
   spectrum (:func:`~mla_convert.convert.factorize.allocate_ranks`); the held-out windows then run through each
   candidate's converted layers (factored, assembled, rounded to the output dtype as written; no ``o_proj``
   refit), and the candidate with the lowest mean KL(source || converted) on them is converted. Its plans and
   targets replace pass 1's in the work folder, so pass 2 converts it as if it had been given.

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
from mla_convert.convert.steps import layer_ranks, layer_state, mla_config, plan_and_target
from mla_convert.convert.workdir import load_torch, save_torch
from mla_convert.metrics import head_scores

if TYPE_CHECKING:
    from mla_convert.convert.stream import StreamedConversion

#: Candidate RoPE pairs as multiples of the prior's: half of it to one and a half times it.
SPREAD = (0.5, 0.75, 1.0, 1.25, 1.5)


def rope_candidates(options: ConvertOptions, src: SourceShape, budget: float) -> tuple[int, ...]:
    """The RoPE pairs a conversion measures around ``options.rope_pairs`` (the prior), ascending.

    Each is ``round(m x prior)`` for ``m`` in :data:`SPREAD`, kept to what a rope head holds and to a latent of at
    least one value per layer at ``budget`` (values per token per layer); the prior is always one of them.

    Returns:
        The candidates; one element (the prior) when nothing else fits.
    """
    geo = geometry(options, src)
    prior = geo.rope_pairs
    out = {prior}
    for m in SPREAD:
        r = max(1, round(m * prior))
        g = geometry(options.model_copy(update={"rope_pairs": r}), src)
        if g.rope_pairs == r and _latent_fits(g, budget):
            out.add(r)
    return tuple(sorted(out))


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


def _with_pairs(options: ConvertOptions, pairs: int) -> ConvertOptions:
    return options.model_copy(update={"rope_pairs": pairs})


def _stats(p1: dict[str, Any]) -> LayerStats:
    """A layer's calibration statistics again from what pass 1 saved (``p1.pt``)."""
    q_norm, k_norm = p1["pair_norms"]
    return LayerStats(p1["target"].xx, p1["x_mean"], q_norm, k_norm, int(p1["tokens"]))


@torch.no_grad()
def choose_rope_pairs(conv: StreamedConversion) -> dict[str, Any] | None:
    """Measure every candidate on the held-out windows, convert the best (module docstring).

    Updates ``conv.options.rope_pairs``, the work folder's plans and targets and ``conv.state`` (spectra, NoPE
    widths) to the chosen candidate; recorded in ``conv.state["rope_split"]["result"]`` so a resumed conversion
    does not measure again.

    Returns:
        ``{"candidates": [...], "prior": r, "chosen": r, "kl": {r: nats}, "loss": {r: nats}, "tokens": n,
        "seconds": s}`` (KL and loss per held-out token), or None when there was nothing to choose (no
        candidates, or no held-out windows).
    """
    st = conv.state
    split = st.get("rope_split")
    if split is None or not conv.texts.held.numel():
        return None
    if "result" in split:
        conv.options = _with_pairs(conv.options, split["result"]["chosen"])
        return dict(split["result"])
    t0 = time.perf_counter()
    src, prior = conv.src, conv.options.rope_pairs
    spectra = {prior: st["spectra"], **split["spectra"]}
    ranks: dict[int, list[int]] = {}
    for r in conv.rope_candidates:
        opts = _with_pairs(conv.options, r)
        try:
            ranks[r] = layer_ranks(opts, spectra[r], geometry(opts, src))
        except FactorError:  # the budget cannot hold this split's latent: not a candidate
            continue
    streams = {r: st["streams"]["mla_held"].clone() for r in ranks}
    for i in range(conv.n_layers):
        p1 = load_torch(conv._layer_file(i, "p1.pt"))
        source = conv._source_tensors(i)
        weights = conv._attention(i, source)
        stats = _stats(p1)
        for r, rk in ranks.items():
            plan, target = plan_and_target(src, _with_pairs(conv.options, r), weights, stats)
            factors = factor_layer(target, rk[i], conv.options.factorization)
            d_nope = int(plan.q_nope.shape[1])
            attn = layer_state(src, weights, plan, factors, d_nope)
            config = mla_config(src, _with_pairs(conv.options, r), rk, [plan] * conv.n_layers, d_nope)
            layer = conv._mla(config, i, source, attn)
            streams[r] = run_mla(layer, streams[r], src.num_heads, conv.intermediate)
        src.release()
        conv.progress("rope split", 1, conv.n_layers)
    head, src_norm, mla_norm = conv._head()
    kl: dict[int, float] = {}
    loss: dict[int, float] = {}
    ref = (st["streams"]["src_held"], src_norm, head)
    for r, hidden in streams.items():
        ev, _ = head_scores(hidden, conv.texts.held, mla_norm, head, ref, head_dtype=conv.dtype)
        kl[r], loss[r] = float(ev.kl or 0.0), float(torch.log(torch.tensor(ev.perplexity)))
    chosen = min(kl, key=lambda r: (kl[r], r != prior))
    if chosen != prior:
        _replace_plans(conv, chosen, spectra[chosen])
    result = {
        "candidates": sorted(ranks),
        "prior": prior,
        "chosen": chosen,
        "kl": kl,
        "loss": loss,
        "tokens": int(conv.texts.held[:, 1:].numel()),
        "seconds": time.perf_counter() - t0,
    }
    split["result"] = result
    conv.options = _with_pairs(conv.options, chosen)
    return dict(result)


def _replace_plans(conv: StreamedConversion, pairs: int, spectra: list[torch.Tensor]) -> None:
    """The chosen candidate's plans and weighted K/V matrices in the work folder (pass 2 reads them)."""
    opts = _with_pairs(conv.options, pairs)
    d_nope = []
    for i in range(conv.n_layers):
        p1 = load_torch(conv._layer_file(i, "p1.pt"))
        weights = conv._attention(i, conv._source_tensors(i))
        plan, target = plan_and_target(conv.src, opts, weights, _stats(p1))
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
        "measured_on": f"{split['tokens']} held-out calibration-split tokens, no o_proj refit",
        "seconds": round(split["seconds"], 1),
    }


def split_sentence(split: dict[str, Any] | None, why: str | None) -> str | None:
    """Why the conversion has its RoPE pairs: the resolution's ``why`` and, when measured, the outcome."""
    if split is None:
        return why
    kls = ", ".join(f"{r}: {v:.4f}" for r, v in sorted(split["kl"].items()))
    said = (f"--rope-pairs {split['chosen']} measured best on this source (KL nats/token on {split['tokens']} "
            f"held-out tokens: {kls}; the prior was {split['prior']})")
    return f"{why}; {said}" if why else said
