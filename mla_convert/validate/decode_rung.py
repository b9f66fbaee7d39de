"""Rung 3 of the ladder (:mod:`.rungs` has rungs 1, 2, 4 and 5): a paged prefill and greedy decode against one full
recomputation of the same tokens, and every cache row the decode wrote against an independent recomputation.

The rows' ``k_rope`` is recomputed from the recorded pair frequencies (:func:`.rungs.source_pair_frequencies`), not
from the model's RoPE buffers, so corrupted frequencies cannot hide behind the code that wrote the rows. For a
checkpoint stored in float16/bfloat16 the decode runs again in that dtype with its tolerances
(:data:`~mla_convert.validate.spec.TOLERANCES`); rung 5 measures the cache this rung returns.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import torch

from mla_convert.mla import algebra
from mla_convert.runtime.paged_cache import PagedLatentCache
from mla_convert.validate.measure import (
    capture_attention_inputs,
    decode_on_kernel_device,
    in_dtype,
    kernel_unsupported,
    rel_err,
    timed,
)
from mla_convert.validate.result import Rung
from mla_convert.validate.spec import (
    DECODE,
    TOL_DECODE_LOGITS,
    TOL_FREQ,
    TOL_ROWS,
    tolerances_for,
)

if TYPE_CHECKING:  # importing the model class imports transformers' Llama code, which imports Triton
    from mla_convert.mla.modeling import MLAForCausalLM


def _check_frequencies(rung: Rung, model: MLAForCausalLM, pair_freq: torch.Tensor, freq_source: str) -> None:
    """The RoPE buffers the model computes with vs ``pair_freq`` and vs config.json's ``rope_inv_freq``."""
    buffers = torch.stack([layer.self_attn.rope_inv_freq for layer in model.model.layers]).float()
    recorded = torch.tensor(model.config.rope_inv_freq, dtype=torch.float32)
    for name, want in ((freq_source, pair_freq), ("config.json rope_inv_freq", recorded)):
        err = rel_err(buffers, want) if buffers.shape == want.shape else math.inf
        rung.check(f"model RoPE frequencies vs {name}, max rel. error", err, TOL_FREQ)


def _check_cache_rows(
    rung: Rung,
    model: MLAForCausalLM,
    seen: list[torch.Tensor],
    cache: PagedLatentCache,
    pair_freq: torch.Tensor,
    freq_source: str,
    tol: float = TOL_ROWS,
    prefix: str = "",
) -> None:
    """Every cache row of the decoded request vs ``[c_kv | k_rope]`` recomputed from the layer inputs that wrote
    it, ``seen`` (``[1, T, hidden]`` each: the prefill's and each decode step's, captured during the decode),
    ``k_rope`` rotated at its absolute position with ``pair_freq``; checks named with ``prefix``, within ``tol``.

    The rows are compared with the decode's own layer inputs, not with a full pass's: a full pass over the same
    tokens reaches each layer with inputs that differ by float rounding carried through the layers below (the
    step-logits check measures that), which on some checkpoints is larger than a cache row's own rounding
    (the first positions, where the attention sink's large activations sit: 3.8e-5 on a 30-pair SmolLM2
    conversion, against 1e-5)."""
    rid = cache.active[0]
    t = seen[0].shape[1]
    pos = torch.arange(t)[None]
    worst_c = worst_r = 0.0
    for li, (layer, x) in enumerate(zip(model.model.layers, seen, strict=True)):
        attn = layer.self_attn
        rows = cache.rows(li, rid)
        _, _, c_kv, _ = attn.project(x, pos)
        worst_c = max(worst_c, rel_err(rows[:, : attn.kv_lora_rank], c_kv[0]))
        if attn.qk_rope_head_dim:  # independent of the model's RoPE buffer: the unrotated projection
            k_rope = attn.kv_a_proj_with_mqa(x)[..., attn.kv_lora_rank :].reshape(
                1, t, attn.num_rope_heads, -1
            )
            cos, sin = algebra.rope_angles(pos, pair_freq[li])
            expect = algebra.apply_rope(k_rope, cos, sin).reshape(t, -1)
            worst_r = max(worst_r, rel_err(rows[:, attn.kv_lora_rank :], expect))
    rung.check(f"{prefix}cache rows c_kv vs recomputed, max rel. error over layers", worst_c, tol)
    if model.config.qk_rope_head_dim:
        rung.check(
            f"{prefix}cache rows k_rope vs recomputed at absolute positions ({freq_source}), max rel. error",
            worst_r,
            tol,
        )


def _check_backend_calls(rung: Rung, log: dict[str, int], backend: str, want: int, prefix: str = "") -> None:
    """Decode attention calls in ``log`` (a ``backend_log``): ``want`` on ``backend``, none elsewhere."""
    start = "triton-" if backend == "triton" else "absorbed-torch"
    decode = {k: v for k, v in log.items() if k.endswith(":decode")}
    on_backend = sum(v for k, v in decode.items() if k.startswith(start))
    rung.check(
        f"{prefix}decode attention calls on {backend} (want {want})", float(on_backend), float(want), "=="
    )
    rung.check(
        f"{prefix}decode attention calls on any other backend",
        float(sum(decode.values()) - on_backend),
        0.0,
        "==",
    )


def _inputs_error(decoded: list[torch.Tensor], full: list[torch.Tensor]) -> float:
    """Max over layers of the rel. error between the attention inputs the decode fed each layer (prefill rows, then
    one row per step) and a full pass's over the same tokens: a paged prefill that attends wrongly (a mask, a page)
    shows here at every earlier position, which the cache-row check, against the decode's own inputs, cannot see."""
    if len(decoded) != len(full):
        return math.inf
    return max((rel_err(a, b) if a.shape == b.shape else math.inf for a, b in zip(decoded, full, strict=True)), default=0.0)


def recompute_folded(model: MLAForCausalLM, tokens: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`capture_attention_inputs` with the weights folded as ``generate`` folds them
    (:meth:`~mla_convert.mla.modeling.MLAForCausalLM.set_folding`), so the decode is compared with a full pass
    of the same products and the rung measures the cache, not the folding's float rounding (rung 3 checks the
    folded pass against the unfolded one separately); the model's setting comes back afterwards."""
    before = model.folding
    model.set_folding(True)
    try:
        return capture_attention_inputs(model, tokens)
    finally:
        model.set_folding(before)


@timed
def rung_decode(
    model: MLAForCausalLM,
    prompt: torch.Tensor,
    new_tokens: int,
    backend: str,
    page_size: int,
    pair_freq: torch.Tensor,
    freq_source: str,
    data: str,
    dtype: str = "float32",
) -> tuple[Rung, PagedLatentCache]:
    """Rung 3: paged prefill of ``prompt [1, T]`` + greedy decode on ``backend`` vs one full recomputation;
    every cache row vs an independent recomputation with ``pair_freq [L, R, P]`` (named ``freq_source``).
    For a checkpoint stored in ``dtype`` float16/bfloat16, the same again in that dtype
    (:func:`_decode_in_dtype`).

    Returns:
        The rung and the paged cache rung 5 measures: the request's cache in the checkpoint's dtype.
    """
    rung = Rung.of(DECODE, data)
    if model.config.qk_rope_head_dim:
        _check_frequencies(rung, model, pair_freq, freq_source)
    res = decode_on_kernel_device(model, prompt, new_tokens, backend, page_size)
    tokens = res.tokens[:, :-1]  # the last generated token was never fed back
    model.set_attention_path("absorbed")
    seen, logits = recompute_folded(model, tokens)
    full = logits[:, prompt.shape[1] - 1 :].float()
    rung.check(
        "step logits vs full recomputation, max rel. error", rel_err(res.step_logits, full), TOL_DECODE_LOGITS
    )
    rung.check(
        "layer inputs of the decode (every cached position) vs full recomputation, max rel. error over layers",
        _inputs_error(res.layer_inputs, seen),
        TOL_DECODE_LOGITS,
    )
    with torch.no_grad():  # the inference folding generate uses vs the factored weights, same tokens
        plain = model(input_ids=tokens, use_cache=False).logits[:, prompt.shape[1] - 1 :].float()
    rung.check(
        "full pass with W_UK/W_UV folded (as generate runs) vs unfolded, max rel. error",
        rel_err(full, plain),
        TOL_DECODE_LOGITS,
    )
    differing = float((res.step_logits.argmax(-1) != full.argmax(-1)).sum())
    rung.check("greedy tokens differing from full recomputation", differing, 0, "==")
    _check_cache_rows(rung, model, res.layer_inputs, res.cache, pair_freq, freq_source)
    t = float(tokens.shape[1])
    rung.check("committed cache length (tokens)", float(res.cache.lengths[res.cache.active[0]]), t, "==")
    want = model.config.num_hidden_layers * (new_tokens - 1)
    _check_backend_calls(rung, res.backend_log, backend, want)
    rung.record("backends that ran", json.dumps(res.backend_log, sort_keys=True))
    if dtype == "float32":
        return rung, res.cache
    return rung, _decode_in_dtype(
        rung, model, prompt, new_tokens, backend, page_size, pair_freq, freq_source, dtype
    )


def _decode_in_dtype(
    rung: Rung,
    model: MLAForCausalLM,
    prompt: torch.Tensor,
    new_tokens: int,
    backend: str,
    page_size: int,
    pair_freq: torch.Tensor,
    freq_source: str,
    dtype: str,
) -> PagedLatentCache:
    """Rung 3's decode with the weights and the paged cache in ``dtype`` (float16/bfloat16), checked against
    one full pass in ``dtype`` over the same tokens with ``dtype``'s tolerances (checks named ``"{dtype}: "``).

    On the absorbed backend when ``backend`` is triton and the kernel cannot run ``dtype`` here (recorded).
    Greedy tokens are recorded, not checked: with every step's logits within the tolerance of the full pass
    they can differ only where its top-2 margin is below twice that error. The step logits against float32
    recomputation of the same tokens (the precision the dtype costs) are recorded too.

    Returns:
        The request's paged cache in ``dtype``.
    """
    tol = tolerances_for(dtype)
    prefix = f"{dtype}: "
    ran = backend
    why = kernel_unsupported(dtype) if backend == "triton" else None
    if why:
        ran = "absorbed"
        rung.record(
            f"{prefix}decode backend", f"absorbed (torch): {why}; the triton decode above ran in float32"
        )
    with in_dtype(model, dtype):
        res = decode_on_kernel_device(model, prompt, new_tokens, ran, page_size)
        tokens = res.tokens[:, :-1]
        model.set_attention_path("absorbed")
        seen, logits = recompute_folded(model, tokens)
        full = logits[:, prompt.shape[1] - 1 :].float()
        rung.check(
            f"{prefix}step logits vs full recomputation in {dtype}, max rel. error",
            rel_err(res.step_logits, full),
            tol.logits,
        )
        rung.check(
            f"{prefix}layer inputs of the decode vs full recomputation in {dtype}, max rel. error over layers",
            _inputs_error(res.layer_inputs, seen),
            tol.logits,
        )
        differing = int((res.step_logits.argmax(-1) != full.argmax(-1)).sum())
        rung.record(f"{prefix}greedy tokens differing from full recomputation (near ties)", float(differing))
        _check_cache_rows(rung, model, res.layer_inputs, res.cache, pair_freq, freq_source, tol.rows, prefix)
    t = float(tokens.shape[1])
    rung.check(
        f"{prefix}committed cache length (tokens)", float(res.cache.lengths[res.cache.active[0]]), t, "=="
    )
    _check_backend_calls(
        rung, res.backend_log, ran, model.config.num_hidden_layers * (new_tokens - 1), prefix
    )
    rung.record(f"{prefix}backends that ran", json.dumps(res.backend_log, sort_keys=True))
    _, logits32 = capture_attention_inputs(model, tokens)
    rung.record(
        f"{prefix}step logits vs float32 recomputation of the same tokens, max rel. difference",
        rel_err(res.step_logits, logits32[:, prompt.shape[1] - 1 :]),
    )
    return res.cache
