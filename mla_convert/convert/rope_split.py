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
   candidate's converted layers (factored, assembled, rounded to the output dtype as written, with the
   ``o_proj`` refit of the conversion's mode, kept where it lowers the held-out loss, as the conversion decides),
   and the candidate with the lowest mean KL(source || converted) on them is converted. Its plans and
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
from mla_convert.convert.refit import refit_o_proj
from mla_convert.convert.steps import is_lossless, layer_ranks, layer_state, mla_config, plan_and_target
from mla_convert.convert.workdir import load_torch, save_torch
from mla_convert.metrics import head_scores

if TYPE_CHECKING:
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
        ``{"candidates": [...], "prior": r, "chosen": r, "kl": {r: nats}, "loss": {r: nats}, "refit": {r: kept},
        "tokens": n, "seconds": s}`` (KL and loss per held-out token of the variant kept), or None when there was nothing to choose (no
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
    runs = {r: _Candidate(conv, r, rk) for r, rk in ranks.items()}
    steps = conv.n_layers + len(runs)  # every layer's candidates, then each candidate scored through the head
    for i in range(conv.n_layers):
        p1 = load_torch(conv._layer_file(i, "p1.pt"))
        source = conv._source_tensors(i)
        weights = conv._attention(i, source)
        stats = _stats(p1)
        for run in runs.values():
            run.layer(i, p1, source, weights, stats)
        src.release()
        conv.progress("rope split", 1, steps)
    head, src_norm, mla_norm = conv._head()
    kl: dict[int, float] = {}
    loss: dict[int, float] = {}
    refit: dict[int, bool] = {}
    ref = (st["streams"]["src_held"], src_norm, head)
    for r, run in runs.items():
        scored = {
            name: head_scores(hidden, conv.texts.held, mla_norm, head, ref, head_dtype=conv.dtype)
            for name, hidden in run.variants().items()
        }
        means = {name: sum(w) / len(w) for name, (_, w) in scored.items()}
        # the variant the conversion keeps (StreamedConversion.decide_refit): the refit where it lowers the loss
        kept = "fit" if "fit" in means and means["fit"] < means["plain"] else "plain"
        kl[r], loss[r], refit[r] = float(scored[kept][0].kl or 0.0), means[kept], kept == "fit"
        conv.progress("rope split", 1, steps)
    chosen = min(kl, key=lambda r: (kl[r], r != prior))
    if chosen != prior:
        _replace_plans(conv, chosen, spectra[chosen])
    result = {
        "candidates": sorted(ranks),
        "prior": prior,
        "chosen": chosen,
        "kl": kl,
        "loss": loss,
        "refit": refit,
        "tokens": int(conv.texts.held[:, 1:].numel()),
        "seconds": time.perf_counter() - t0,
    }
    split["result"] = result
    conv.options = _with_pairs(conv.options, chosen)
    return dict(result)


class _Candidate:
    """One candidate's converted model on the held-out windows, layer by layer, as pass 2 converts it: factored at
    its allocated ranks, assembled, rounded, with the ``o_proj`` refit of the conversion's mode (teacher: on the
    source's kept calibration inputs; sequential: on its own refit windows carried through its converted layers)
    and both variants' held-out streams (``plain``; ``fit`` when a refit is in play)."""

    def __init__(self, conv: StreamedConversion, pairs: int, ranks: list[int]) -> None:
        self.conv, self.ranks = conv, ranks
        self.options = _with_pairs(conv.options, pairs)
        streams = conv.state["streams"]
        self.plain = streams["mla_held"].clone()
        self.fit = self.plain.clone() if conv.refit else None
        self.refit_windows = streams["mla_refit"].clone() if conv.sequential else None
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
        if conv.refit and (lossy or (conv.sequential and self.lossy_seen)):
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
        "o_proj_refit_kept": {str(r): v for r, v in sorted(split["refit"].items())},
        "measured_on": f"{split['tokens']} held-out calibration-split tokens, each candidate with the o_proj "
        "refit where it lowers their loss (as the conversion keeps it)",
        "seconds": round(split["seconds"], 1),
    }


def outcome(record: dict[str, Any]) -> str:
    """The measured split in one sentence (``record``: :func:`split_record`'s), saying when the best is the smallest
    or largest candidate tried (the best may then lie beyond: ``--rope-pairs`` tries it)."""
    kl = record["kl_nats_per_token"]
    kls = ", ".join(f"{r}: {v:.4f}" for r, v in kl.items())
    chosen, cands = record["chosen"], record["candidates"]
    edge = ""
    if len(cands) > 1 and chosen in (cands[0], cands[-1]):
        side = "fewer" if chosen == cands[0] else "more"
        edge = (f"; the {'smallest' if side == 'fewer' else 'largest'} candidate tried: {side} pairs may do better "
                "still, --rope-pairs tries them")
    return (f"--rope-pairs {chosen} measured best on this source (KL nats/token on the held-out windows: {kls}; "
            f"the prior was {record['prior']}{edge})")


def split_sentence(split: dict[str, Any] | None, why: str | None) -> str | None:
    """Why the conversion has its RoPE pairs: the resolution's ``why`` and, when measured, the outcome."""
    if split is None:
        return why
    record = split_record(split)
    assert record is not None
    said = outcome(record)
    return f"{why}; {said}" if why else said
