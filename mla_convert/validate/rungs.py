"""Rungs 1, 2, 4 and 5 of the ladder (rung 3 is :mod:`.decode_rung`, rung 6 :mod:`.matrix`), each a function of a
loaded model and real token ids that returns a :class:`~mla_convert.validate.result.Rung` (what each compares and
its tolerances: :mod:`.spec`).

The rungs use only the model's public methods and :mod:`mla_convert.mla.algebra`; rung 3 recomputes cache
rows independently of the model's RoPE buffers on purpose (from the recorded pair indices and the source's
RoPE table, :func:`source_pair_frequencies` here), so corrupted frequencies cannot hide behind the code that
wrote the rows.

The model comes loaded in float32 (a float16/bfloat16 checkpoint upcast exactly). Rungs 2 and 3 take the
checkpoint's dtype and, when it is not float32, add the same checks run in that dtype
(:func:`~.measure.in_dtype`, :data:`~mla_convert.validate.spec.TOLERANCES`); rung 5 measures the cache rung 3
returns. What every rung uses (timing, the error measure, dtypes, the kernel's device) is :mod:`.measure`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from mla_convert.mla import algebra
from mla_convert.runtime.paged_cache import PagedLatentCache
from mla_convert.validate.measure import (
    DTYPES,
    capture_attention_inputs,
    kernel_device,
    kernel_unsupported,
    rel_err,
    timed,
)
from mla_convert.validate.result import Rung, ValidationError
from mla_convert.validate.spec import (
    KERNEL,
    LEDGER,
    PATHS,
    SOURCE,
    TOL_KERNEL,
    TOL_KERNEL_LSE,
    TOL_KL,
    TOL_LSE,
    TOL_PATHS,
    TOL_PPL,
    TOL_SCALE,
    tolerances_for,
)

if TYPE_CHECKING:  # importing the model class imports transformers' Llama code, which imports Triton
    from mla_convert.mla.modeling import MLAForCausalLM


def source_pair_frequencies(config: Any, source_inv_freq: torch.Tensor | None) -> torch.Tensor:
    """``[L, R, P]`` RoPE inverse frequencies implied by the checkpoint's recorded pair indices.

    Labels are ``"kv{g}.p{k}"`` (per-head: KV head ``g``, source pair ``k``) or ``"f{k}.c{m}"`` (shared:
    frequency ``k``, component ``m``); pair ``k`` rotates at ``source_inv_freq[k]``. Without the source
    table the config's recorded frequencies are used.

    Raises:
        ValidationError: a label that names no source pair.
    """
    origin = config.rope_pair_origin
    if source_inv_freq is None or not origin:
        return torch.tensor(config.rope_inv_freq, dtype=torch.float32)
    out = []
    for li, layer in enumerate(origin):
        rows = []
        for head in layer:
            idx = []
            for label in head:
                m = re.fullmatch(r"kv\d+\.p(\d+)|f(\d+)\.c\d+", label)
                k = int(next(g for g in m.groups() if g is not None)) if m else -1
                if not 0 <= k < source_inv_freq.numel():
                    raise ValidationError(
                        f"layer {li}: RoPE pair label {label!r} names no pair of the source's "
                        f"{source_inv_freq.numel()} pairs; the checkpoint's rope_pair_origin is corrupt"
                    )
                idx.append(k)
            rows.append(source_inv_freq[torch.tensor(idx, dtype=torch.long)])
        out.append(torch.stack(rows))
    return torch.stack(out).float()


# ------------------------------------------------------------------------------------------ rung 1
@timed
def rung_paths(model: MLAForCausalLM, ids: torch.Tensor, data: str) -> Rung:
    """Rung 1: naive (expanded K/V) vs absorbed, per layer, on the real attention inputs of ``ids [B, T]``."""
    rung = Rung.of(PATHS, data)
    seen, _ = capture_attention_inputs(model, ids)
    b, t = ids.shape
    pos = torch.arange(t)[None].expand(b, t)
    mask = algebra.causal_mask(b, t, 0, None, torch.float32, ids.device)
    visible = mask[:, 0] == 0  # [B, T, T]
    worst = {"scores": 0.0, "lse": 0.0, "output": 0.0}
    for layer, x in zip(model.model.layers, seen, strict=True):
        attn = layer.self_attn
        q_nope, q_rope, c_kv, k_rope = attn.project(x, pos)
        keys, values = algebra.expand_kv(c_kv, k_rope, *attn.up_weights())  # naive: per-KV-head K and V
        s_naive = algebra.naive_scores(q_nope, q_rope, keys) * attn.softmax_scale
        s_abs = attn.latent_scores(attn.absorb_query(q_nope), q_rope, c_kv, k_rope.reshape(b, t, -1))
        s_abs = s_abs * attn.softmax_scale
        sel = visible[:, None].expand_as(s_naive)
        worst["scores"] = max(worst["scores"], rel_err(s_abs[sel], s_naive[sel]))
        lse_n = (s_naive + mask).logsumexp(-1)
        lse_a = (s_abs + mask).logsumexp(-1)
        worst["lse"] = max(worst["lse"], float((lse_a - lse_n).abs().max()))
        out_n = attn.o_proj(algebra.naive_output(algebra.attention_probs(s_naive, 1.0, mask), values))
        latent = algebra.attend_latent(algebra.attention_probs(s_abs, 1.0, mask), c_kv)
        worst["output"] = max(worst["output"], rel_err(attn.output_from_latent(latent), out_n))
    rung.check("scaled scores before softmax, max rel. error over layers", worst["scores"], TOL_PATHS)
    rung.check("log-sum-exp, max abs. error (nats)", worst["lse"], TOL_LSE)
    rung.check("attention layer output, max rel. error over layers", worst["output"], TOL_PATHS)
    return rung


# ------------------------------------------------------------------------------------------ rung 2
def _kernel_errors(
    kernel: Any, layers: list[tuple[Any, ...]], scales: list[float], dtype: torch.dtype
) -> tuple[float, float, float]:
    """The kernel against the float64 oracle over every layer's ``(q_abs, q_rope, pages, block_table,
    seq_lens, head_to_rope)``, the floating inputs rounded to ``dtype`` for both: the worst ``latent_out``
    rel. error, ``lse`` abs. error, and 1 split vs 4 splits rel. difference (the split-KV merge is exact; the
    default split count depends on the device, 1 on the CPU)."""
    from mla_convert.kernels import latent_decode_reference

    device = kernel_device()
    worst_out = worst_lse = worst_splits = 0.0
    for layer_args, scale in zip(layers, scales, strict=True):
        q_abs, q_rope, pages, *rest = layer_args
        args = tuple(a.to(device) for a in (q_abs.to(dtype), q_rope.to(dtype), pages.to(dtype), *rest))
        ref_out, ref_lse = latent_decode_reference(*args, softmax_scale=scale)
        out, lse = kernel.latent_decode(*args, softmax_scale=scale)
        one, _ = kernel.latent_decode(*args, softmax_scale=scale, num_splits=1)
        four, _ = kernel.latent_decode(*args, softmax_scale=scale, num_splits=4)
        worst_out = max(worst_out, rel_err(out.cpu(), ref_out.cpu()))
        worst_lse = max(worst_lse, float((lse.double() - ref_lse).abs().max()))
        worst_splits = max(worst_splits, rel_err(one.cpu(), four.cpu()))
    return worst_out, worst_lse, worst_splits


@timed
def rung_kernel(
    model: MLAForCausalLM, prompts: list[torch.Tensor], page_size: int, data: str, dtype: str = "float32"
) -> Rung:
    """Rung 2: Triton kernel vs float64 oracle, per layer, on real queries and real paged cache rows.

    Each prompt ``[1, T_i]`` is one request: its first ``T_i - 1`` tokens are prefilled (absorbed path) into
    one paged cache with shuffled pages; the query is its last token, attending over those cached rows. For a
    checkpoint stored in ``dtype`` float16/bfloat16 the checks run again with the queries and rows rounded to
    ``dtype`` (its tolerances), unless the kernel cannot run ``dtype`` here (recorded).
    """
    from mla_convert.kernels import kernel_backend, load_kernel

    rung = Rung.of(KERNEL, data)
    kernel = load_kernel()
    rows = sum(p.shape[1] for p in prompts) + 2 * page_size
    cache = PagedLatentCache.for_model(model.config, rows, page_size, shuffle_pages=True)
    rids, inputs = [], []
    model.set_attention_path("absorbed")
    for ids in prompts:
        rid = cache.add_request()
        cache.bind([rid])
        model(input_ids=ids[:, :-1], past_key_values=cache)
        seen, _ = capture_attention_inputs(model, ids)
        inputs.append([x[:, -1:] for x in seen])  # the last token's attention input, per layer
        rids.append(rid)
    cache.bind(rids)
    lens = cache.seq_lens()
    layers: list[tuple[Any, ...]] = []
    scales: list[float] = []
    for li, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q_abs, q_rope = [], []
        for ids, x in zip(prompts, inputs, strict=True):
            q_nope, qr, _, _ = attn.project(x[li], torch.tensor([[ids.shape[1] - 1]]))
            q_abs.append(attn.absorb_query(q_nope)[:, 0])
            q_rope.append(qr[:, 0])
        layers.append(
            (
                torch.cat(q_abs).contiguous(),
                torch.cat(q_rope).contiguous(),
                cache.pages[li],
                cache.block_table(),
                lens,
                attn.head_to_rope(),
            )
        )
        scales.append(attn.softmax_scale)
    worst_out, worst_lse, worst_splits = _kernel_errors(kernel, layers, scales, torch.float32)
    rung.check("latent_out vs float64 oracle, max rel. error over layers", worst_out, TOL_KERNEL)
    rung.check("lse vs float64 oracle, max abs. error (nats)", worst_lse, TOL_KERNEL_LSE)
    rung.check("1 split vs 4 splits, max rel. difference", worst_splits, TOL_KERNEL)
    if dtype != "float32":
        why = kernel_unsupported(dtype)
        if why:
            rung.record(f"{dtype}: kernel", f"ran in float32 only: {why}; the float32 checks above stand")
        else:
            tol = tolerances_for(dtype)
            worst_out, worst_lse, worst_splits = _kernel_errors(kernel, layers, scales, DTYPES[dtype])
            rung.check(
                f"{dtype}: latent_out vs float64 oracle, max rel. error over layers", worst_out, tol.kernel
            )
            rung.check(f"{dtype}: lse vs float64 oracle, max abs. error (nats)", worst_lse, tol.kernel_lse)
            rung.check(f"{dtype}: 1 split vs 4 splits, max rel. difference", worst_splits, tol.kernel)
    rung.record("kernel backend", kernel_backend())
    rung.record("cached rows per request (tokens)", ", ".join(str(int(n)) for n in lens))
    return rung


# ------------------------------------------------------------------------------------------ rung 4
def _check_scale(rung: Rung, scale: float, want: float, what: str) -> None:
    rung.check(
        f"softmax_scale {scale:.6g} vs {what} {want:.6g}, rel. error", abs(scale - want) / want, TOL_SCALE
    )


@timed
def rung_source(
    model: MLAForCausalLM,
    source_model: Any,
    source_scale: float,
    windows: torch.Tensor,
    recorded: dict[str, float] | None,
    data: str,
) -> Rung:
    """Rung 4: converted vs source on held-out ``windows [N, T]``; the scale contract; the figures
    ``recorded`` at conversion (``perplexity``, ``kl``) reproduced when given."""
    from mla_convert.metrics import evaluate

    rung = Rung.of(SOURCE, data)
    _check_scale(rung, model.config.softmax_scale, source_scale, "source's")
    ev = evaluate(model, windows, source_model)
    ratio = ev.perplexity / (ev.reference_perplexity or 1.0)
    rung.record("perplexity (converted)", round(ev.perplexity, 4))
    rung.record("perplexity (source)", round(ev.reference_perplexity or 0.0, 4))
    rung.record("perplexity ratio", round(ratio, 4))
    rung.record("KL(source || converted), nats/token", round(ev.kl or 0.0, 5))
    rung.record("top-1 agreement", round(ev.top1 or 0.0, 4))
    if recorded:
        rung.check(
            f"perplexity vs recorded at conversion ({recorded['perplexity']:.4f}), rel. difference",
            abs(ev.perplexity - recorded["perplexity"]) / recorded["perplexity"],
            TOL_PPL,
        )
        rung.check(
            f"KL vs recorded at conversion ({recorded['kl']:.5f}), abs. difference",
            abs((ev.kl or 0.0) - recorded["kl"]),
            TOL_KL,
        )
    else:
        rung.record("recorded figures", "not comparable (different text or windows, or none recorded)")
    return rung


@timed
def rung_scale_only(model: MLAForCausalLM, data: str) -> Rung:
    """Rung 4 without the source: the scale against ``1/sqrt(head_dim)`` of the source's head width, which a
    conversion keeps as ``v_head_dim`` (values are never narrowed per head); the rest is ``not measured``."""
    rung = Rung.of(SOURCE, data)
    rule = algebra.source_softmax_scale(model.config.v_head_dim)
    _check_scale(rung, model.config.softmax_scale, rule, "1/sqrt(head_dim) =")
    rung.record("perplexity, KL, top-1 vs source", "not measured: source not available; pass --source")
    return rung


# ------------------------------------------------------------------------------------------ rung 5
@timed
def rung_ledger(
    model: MLAForCausalLM, cache: PagedLatentCache, source_model: Any, probe: torch.Tensor
) -> Rung:
    """Rung 5: measured paged-cache bytes vs the formula vs the source's KV cache measured on ``probe [1, T]``."""
    from mla_convert.metrics import measure_cache

    led = cache.ledger()
    rung = Rung.of(
        LEDGER,
        f"the paged cache of rung 3 ({led['tokens']} tokens, page size {led['page_size']}, {led['dtype']})",
    )
    elem = torch.empty(0, dtype=cache.dtype).element_size()
    widths = model.config.cache_width
    formula = sum(widths) / len(widths) * elem
    payload = led["payload_bytes_per_token_per_layer"]
    rung.check(
        f"payload bytes/token/layer {payload:.1f} vs formula (d_c + R*d_R) x {elem} B = {formula:.1f}, difference",
        abs(payload - formula),
        0.0,
        "==",
    )
    # read the stored tensors back: the cache holds exactly the committed rows plus NaN padding
    stored = sum(int((~p.isnan().all(-1)).sum()) for p in cache.pages)
    committed = float(led["tokens"] * led["layers"])
    rung.check("rows holding data (all layers) vs committed tokens x layers", float(stored), committed, "==")
    rung.record(
        "bytes/token/layer allocated (page tails and row-stride padding)",
        round(led["allocated_bytes_per_token_per_layer"], 1),
    )
    per = max(1, led["tokens"] * led["layers"])
    rung.record(
        f"of which row-stride padding (rows {led['row_widths'][0]} -> {led['row_strides'][0]} values in layer 0)",
        round(led["row_padding_bytes"] / per, 1),
    )
    cfg = model.config
    # the source as loaded (float32) when it is measured, else in the converted cache's element size
    src_elem = elem if source_model is None else torch.empty(0, dtype=source_model.dtype).element_size()
    # the source's KV heads (a NoPE-width reduction gives the MLA config one key group per query head)
    src_formula = 2 * int(cfg.source.get("num_key_value_heads", cfg.num_key_value_heads)) * cfg.v_head_dim * src_elem
    rung.record("source KV cache formula 2 x n_kv x head_dim x elem (bytes/token/layer)", src_formula)
    if source_model is not None:
        measured = measure_cache(source_model, probe)["bytes_per_token_per_layer"]
        rung.record(f"source KV cache measured ({probe.shape[1]}-token prefill), bytes/token/layer", measured)
        rung.check("measured source bytes vs its formula, difference", abs(measured - src_formula), 0.0, "==")
        # values per token, not bytes: the source is measured in float32 whatever the checkpoint's dtype
        ratio = (payload / elem) / (measured / src_elem)
        rung.record("cache ratio (converted payload / source measured)", round(ratio, 4))
    return rung
