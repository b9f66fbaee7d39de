"""The RoPE pairs a conversion measures on its source around the prior (docs/math.md §Partial RoPE): the candidate
ladder :func:`~mla_convert.convert.options.resolve.resolve_options` hands the search (:mod:`mla_convert.convert.pipeline.rope_split`).
Config only: no weights."""

from __future__ import annotations

from mla_convert.convert.options.options import ConvertOptions, Geometry, SourceShape, geometry

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
    ``--rope-pairs`` for more), and with a NoPE-width reduction to splits whose query NoPE width reaches it; the
    prior is always one of them.

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
        wide = options.qk_nope_head_dim is None or g.query_nope_width >= options.qk_nope_head_dim
        if g.rope_pairs == r and _latent_fits(g, budget) and wide and (not servable or g.rope_width <= VLLM_ROPE_WIDTH):
            out.add(r)
    return tuple(sorted(out))


def _latent_fits(geo: Geometry, budget: float) -> bool:
    """Whether ``budget`` leaves every layer at least one latent value after the rope key."""
    return geo.latent_total(budget) >= geo.num_layers
