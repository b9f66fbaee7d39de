"""The per-layer converter: one layer of a conversion as a composition of steps, each a small unit with a typed input
and output (docs/math.md; docs/design.md §The per-layer converter):

    plan -> factor -> assemble -> round -> reconstruct -> refit

* **plan** (:func:`plan_step`): the layer's partial-RoPE plan and the weighted K/V matrix it factors, from the
  source weights and the calibration statistics (:class:`Planned`);
* **factor** (:func:`factor_step`): the latent factorization at the layer's rank (:class:`Factored`);
* **assemble** (:func:`assemble_step`): the MLA attention tensors, float32 (:class:`Assembled`);
* **round** (:func:`round_step`): the MLA decoder layer on the device, every weight rounded to the output dtype as the
  checkpoint holds it (:class:`Rounded`);
* **reconstruct** (:func:`reconstruct_step`): with ``reconstruct_steps``, the whole attention of a lossy layer fitted by
  gradient to the source's outputs, kept where held-out error falls (a :class:`Rounded` again);
* **refit** (:func:`refit_step`): the ``o_proj`` refit, where one is asked for (:class:`Refitted`).

:class:`LayerConverter` composes them; ``factor``'s pass 2 (:mod:`mla_convert.convert.pipeline.stream`) and the search's
candidates (:mod:`mla_convert.convert.pipeline.rope_split`) both convert through it, so a step added here (a fitted
reconstruction, say) is one unit and one line in :meth:`LayerConverter.convert`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_convert.convert.layer.factorize import Factors, LayerTarget, factor_layer
from mla_convert.convert.layer.layers import check_fits, layer_prefix, mla_layer
from mla_convert.convert.layer.reconstruct import Reconstruction, reconstruct_attention
from mla_convert.convert.layer.refit import refit_o_proj
from mla_convert.convert.layer.rope import RopePlan
from mla_convert.convert.layer.steps import is_lossless, layer_state, plan_and_target
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.stats.calibration import HeldOut, LayerStats
from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.modeling import MLADecoderLayer
from mla_convert.sources.checkpoint import SourceModel


@dataclass(frozen=True)
class LayerSource:
    """What one layer's conversion reads of the source.

    Attributes:
        index: the layer.
        tensors: the layer's float32 tensors, named inside it (``mlp...``, the norms; the attention's may be left
            out: a conversion reads them from ``weights``).
        weights: the attention's ``q, k, v, o`` weights and biases (``bq``...), float64 ``[out, in]``.
    """

    index: int
    tensors: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Planned:
    """The plan step's output: the RoPE plan and the weighted K/V matrix ``target`` it factors (float64, CPU)."""

    plan: RopePlan
    target: LayerTarget


@dataclass(frozen=True)
class Factored:
    """The factor step's output: the plan and its latent factors at the layer's rank."""

    planned: Planned
    factors: Factors

    @property
    def lossy(self) -> bool:
        """Whether the layer drops information (RoPE components or rank): the converted layer is then not the
        source's function and an ``o_proj`` refit has something to fit."""
        return not is_lossless([self.planned.plan], [self.factors])


@dataclass(frozen=True)
class Assembled:
    """The assemble step's output: the MLA attention tensors (float32, ``rope_inv_freq`` included), named inside
    ``self_attn``, as the checkpoint stores them before rounding."""

    factored: Factored
    attn: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rounded:
    """The round step's output: the MLA decoder layer on the device with every weight rounded to the output dtype (in
    float32), ``o_proj`` the assembled one."""

    assembled: Assembled
    layer: MLADecoderLayer
    index: int
    fitted: Reconstruction | None = None  # the fitted reconstruction's record, where it ran (kept or not)


@dataclass(frozen=True)
class Refitted:
    """The refit step's output: the rounded layer (``o_proj`` still the assembled one) and the refit ``o_proj``
    ``[hidden, H d_v]`` rounded to the output dtype (in float32), None where the layer was not refitted."""

    rounded: Rounded
    fit_w: torch.Tensor | None

    @property
    def plan(self) -> RopePlan:
        """The layer's RoPE plan."""
        return self.rounded.assembled.factored.planned.plan

    @property
    def factors(self) -> Factors:
        """The layer's latent factors."""
        return self.rounded.assembled.factored.factors

    @property
    def attn(self) -> dict[str, torch.Tensor]:
        """The assembled attention tensors (float32, before rounding)."""
        return self.rounded.assembled.attn

    @property
    def layer(self) -> MLADecoderLayer:
        """The rounded layer (its ``o_proj`` the assembled one)."""
        return self.rounded.layer

    @property
    def lossy(self) -> bool:
        """Whether the layer drops information (:attr:`Factored.lossy`)."""
        return self.rounded.assembled.factored.lossy


@dataclass(frozen=True)
class RefitInputs:
    """What the ``o_proj`` refit fits on.

    Attributes:
        x: ``[N, T, hidden]`` attention inputs (the source's: teacher-forced), or None: ``converted`` gives them.
        out: ``[N, T, hidden]`` the source's attention outputs on the same tokens.
        converted: ``[N, T, hidden]`` hidden states of the refit windows entering this converted layer (a
            sequential refit fits on the converted model's own inputs: their input norm is taken here), or None.
        also_lossless: refit an exact layer too (a sequential refit whose inputs earlier lossy layers moved).
    """

    x: torch.Tensor | None
    out: torch.Tensor
    converted: torch.Tensor | None = None
    also_lossless: bool = False


def plan_step(src: SourceModel, options: ConvertOptions, weights: dict[str, torch.Tensor], stats: LayerStats) -> Planned:
    """The layer's RoPE plan and weighted K/V matrix (:func:`~mla_convert.convert.layer.steps.plan_and_target`)."""
    return Planned(*plan_and_target(src, options, weights, stats))


def factor_step(planned: Planned, rank: int, factorization: str) -> Factored:
    """The latent factors of ``planned.target`` at ``rank`` (:func:`~mla_convert.convert.layer.factorize.factor_layer`).

    Raises:
        FactorError: a rank the matrix cannot have.
    """
    return Factored(planned, factor_layer(planned.target, rank, factorization))


def assemble_step(
    src: SourceModel,
    layer: LayerSource,
    factored: Factored,
    d_nope: int,
    nope_width: int | None = None,
    x_mean: torch.Tensor | None = None,
) -> Assembled:
    """The MLA attention tensors of ``factored`` (:func:`~mla_convert.convert.layer.steps.layer_state`): the plan padded to
    the checkpoint's ``d_nope``, or its NoPE width reduced to ``nope_width`` (with the attention input's mean
    ``x_mean [D]`` and the target's ``E[x xᵀ]``)."""
    planned = factored.planned
    moments = (planned.target.xx, x_mean) if x_mean is not None else None
    attn = layer_state(src, layer.weights, planned.plan, factored.factors, d_nope, nope_width, moments)
    return Assembled(factored, attn)


def rounded_layer(
    config: MLAConfig, layer: LayerSource, attn: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> MLADecoderLayer:
    """The MLA decoder layer ``layer.index`` on ``device`` from the source layer's other tensors (MLP, norms) and
    the attention tensors ``attn`` (named inside ``self_attn``), every weight rounded to ``dtype`` and back to
    float32 (the function the written checkpoint computes)."""
    tensors = {k: v for k, v in layer.tensors.items() if not k.startswith("self_attn.")}
    tensors.update({f"self_attn.{k}": v for k, v in attn.items()})
    module = mla_layer(config, layer.index, tensors, device)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(dtype).to(torch.float32))
    return module


def round_step(
    config: MLAConfig,
    layer: LayerSource,
    assembled: Assembled,
    device: torch.device,
    dtype: torch.dtype,
    check: bool = True,
) -> Rounded:
    """The converted decoder layer on ``device``, rounded as written (:func:`rounded_layer`).

    Raises:
        SourceError: (``check``) an assembled tensor ``dtype`` cannot hold (:func:`~mla_convert.convert.layer.layers.
            check_fits`).
    """
    if check:
        for name, tensor in assembled.attn.items():
            if name != "rope_inv_freq":
                check_fits(f"{layer_prefix(layer.index)}self_attn.{name}", tensor, dtype)
    return Rounded(assembled, rounded_layer(config, layer, assembled.attn, device, dtype), layer.index)


def reconstruct_step(
    rounded: Rounded, inputs: RefitInputs | None, held: HeldOut | None, steps: int, device: torch.device,
    dtype: torch.dtype,
) -> Rounded:
    """The fitted reconstruction of a lossy layer (:func:`~mla_convert.convert.layer.reconstruct.reconstruct_attention`)
    on the refit's windows and inputs (the converted model's own where ``inputs.converted`` is given), decided on the
    held-out pairs ``held``; the layer's weights and the assembled tensors it writes become the fitted ones (rounded to
    ``dtype``) where the fit is kept. Nothing is done without ``steps``, inputs, held-out pairs, or for an exact layer.
    """
    if steps <= 0 or inputs is None or held is None or not rounded.assembled.factored.lossy:
        return rounded
    layer = rounded.layer
    with torch.no_grad():
        x = layer.input_layernorm(inputs.converted.to(device)) if inputs.converted is not None else inputs.x
    assert x is not None, "a reconstruction needs the source's inputs or the converted refit windows"
    fit = reconstruct_attention(
        layer.self_attn, x.to(device), inputs.out.to(device), held.x.to(device), held.out.to(device), steps, dtype=dtype
    )
    if not fit.kept:
        return Rounded(rounded.assembled, layer, rounded.index, fit)
    state = layer.self_attn.state_dict()
    attn = {k: state[k].detach().float().cpu().clone() for k in rounded.assembled.attn}
    return Rounded(Assembled(rounded.assembled.factored, attn), layer, rounded.index, fit)


@torch.no_grad()
def refit_step(
    rounded: Rounded, inputs: RefitInputs | None, device: torch.device, dtype: torch.dtype, check: bool = True
) -> Refitted:
    """The ``o_proj`` refit of a lossy layer (or of an exact one with ``inputs.also_lossless``) on ``inputs``
    (:func:`~mla_convert.convert.layer.refit.refit_o_proj`), rounded to ``dtype``; the layer keeps its assembled
    ``o_proj``. None inputs: no refit.

    Raises:
        SourceError: (``check``) a refit ``o_proj`` ``dtype`` cannot hold.
    """
    lossy = rounded.assembled.factored.lossy
    if inputs is None or not (lossy or inputs.also_lossless):
        return Refitted(rounded, None)
    layer = rounded.layer
    o_proj = layer.self_attn.o_proj.weight
    plain = o_proj.detach().clone()
    x = layer.input_layernorm(inputs.converted) if inputs.converted is not None else inputs.x
    assert x is not None, "a refit needs the source's inputs or the converted refit windows"
    refit_o_proj(layer.self_attn, x.to(device), inputs.out.to(device))
    fit = o_proj.detach().clone()
    if check:
        check_fits(f"{layer_prefix(rounded.index)}self_attn.o_proj.weight (refit)", fit, dtype)
    o_proj.copy_(plain)
    return Refitted(rounded, fit.to(dtype).to(torch.float32))


class LayerConverter:
    """One conversion's layers, each converted by composing the steps (module docstring).

    Args:
        src: the opened source.
        options: the conversion's options (RoPE and factorization choices, ``qk_nope_head_dim``).
        config: the converted model's config (``kv_lora_rank`` per layer, ``qk_nope_head_dim``).
        device: where the layer runs; dtype: the output dtype the weights are rounded to.
        check: refuse tensors the output dtype cannot hold (``factor``; a search candidate skips it: the one
            converted is checked).
    """

    def __init__(
        self,
        src: SourceModel,
        options: ConvertOptions,
        config: MLAConfig,
        device: torch.device,
        dtype: torch.dtype,
        check: bool = True,
    ) -> None:
        self.src, self.options, self.config = src, options, config
        self.device, self.dtype, self.check = device, dtype, check

    def plan(self, layer: LayerSource, stats: LayerStats) -> Planned:
        """The plan step for ``layer`` under this conversion's options."""
        return plan_step(self.src, self.options, layer.weights, stats)

    def convert(
        self,
        layer: LayerSource,
        planned: Planned,
        refit: RefitInputs | None = None,
        x_mean: torch.Tensor | None = None,
        held: HeldOut | None = None,
    ) -> Refitted:
        """Factor, assemble, round and refit ``layer`` from its plan (the steps of the module docstring).

        Args:
            layer: the layer's source tensors.
            planned: its plan (:meth:`plan`, or the one pass 1 saved).
            refit: what an ``o_proj`` refit fits on; None: no refit.
            x_mean: the attention input's mean ``[D]`` (with ``options.qk_nope_head_dim``: the NoPE reduction).
            held: held-out attention pairs that decide a fitted reconstruction (``options.reconstruct_steps``);
                None: no reconstruction (the search's candidates).
        """
        i, opts = layer.index, self.options
        factored = factor_step(planned, self.config.kv_lora_rank[i], opts.factorization)
        assembled = assemble_step(self.src, layer, factored, self.config.qk_nope_head_dim, opts.qk_nope_head_dim, x_mean)
        rounded = round_step(self.config, layer, assembled, self.device, self.dtype, self.check)
        rounded = reconstruct_step(rounded, refit, held, opts.reconstruct_steps or 0, self.device, self.dtype)
        return refit_step(rounded, refit, self.device, self.dtype, self.check)
