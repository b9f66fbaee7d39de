"""``mla-convert validate``: the numerical ladder every converted checkpoint must pass.

Rungs (after the parity harness of ../shared/seeds/000 §0x0E; FIELD.md §1, §4):

1. ``naive-vs-absorbed``: per layer, on the model's real attention inputs, the expanded-K/V path and the
   absorbed latent path give the same scaled scores before softmax, log-sum-exp and layer outputs (fp32).
2. ``kernel-vs-reference``: the bundled Triton kernel against the float64 PyTorch oracle on the model's
   real queries and real paged cache rows (two requests of different lengths, shuffled pages).
3. ``decode-vs-recompute``: prefill + step-by-step decode through the paged cache on the chosen backend
   against a full recomputation: logits, and every cache row against an independent recomputation of
   ``[c_kv | k_rope rotated at its absolute position]`` whose frequencies come from the recorded RoPE pair
   indices and the source's RoPE table (so corrupted pair indices or frequencies fail here).
4. ``converted-vs-source``: perplexity, KL and top-1 agreement on held-out text; the softmax scale must
   be the source's; and the figures recorded at conversion time must be reproduced when the text and
   windows are the same.
5. ``cache-ledger``: measured bytes per token per layer of the paged cache (payload, and with page
   padding) against the formula and against the source model's measured KV cache.

Every number is measured on named real data; tolerances and their reasons are part of the record.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mla_convert.mla.modeling import MLAForCausalLM, apply_rope, causal_mask
from mla_convert.runtime.decode import generate
from mla_convert.runtime.paged_cache import PagedLatentCache

#: fp32 tolerances (relative error = max|a - b| / max|b|) and why.
TOL_PATHS = 1e-4  # naive vs absorbed: same fp32 math re-associated through the d_c-wide latent
TOL_KERNEL = 1e-5  # kernel vs float64 oracle: fp32 accumulation over <= a few thousand rows
TOL_LSE = 1e-4  # absolute, nats: lse values are O(10); fp32 leaves ~1e-6 relative
TOL_DECODE_LOGITS = 1e-4  # one-token steps vs one full pass: different matmul shapes, fp32
TOL_ROWS = 1e-5  # cache rows vs recomputation: same projections, one row at a time vs batched
TOL_FREQ = 1e-6  # relative, RoPE inverse frequencies must be the source's exact values
TOL_PPL = 0.01  # relative, perplexity vs the figure recorded at conversion (same windows, same math)
TOL_KL = 0.01  # absolute nats/token, KL vs the recorded figure


@dataclass
class Check:
    """One measured quantity against its tolerance (``passed`` is None for information only)."""

    name: str
    value: float | str
    tolerance: str = ""
    passed: bool | None = None


@dataclass
class Rung:
    """One rung of the ladder: its checks, the data it ran on, and wall time (seconds)."""

    number: int
    name: str
    data: str
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        return self.skipped is None and all(c.passed is not False for c in self.checks)

    def check(self, name: str, value: float, tol: float, kind: str = "<=") -> None:
        """Add a check ``value <= tol`` (``kind="=="`` for exact equality)."""
        ok = value == tol if kind == "==" else (math.isfinite(value) and value <= tol)
        shown = f"{kind} {tol:g}"
        self.checks.append(Check(name, float(value), shown, ok))


class ValidationError(ValueError):
    """The checkpoint or its source cannot be validated (missing files, wrong kind); one line."""


def format_value(value: float | str) -> str:
    """Integers as integers, other floats to 4 significant digits, text as is."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    return str(value)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64 (0 when both are empty)."""
    if b.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def capture_attention_inputs(model: MLAForCausalLM) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Hook every layer's attention: returns the list its inputs ``x [B, T, hidden]`` go into and a
    function that removes the hooks."""
    seen: list[torch.Tensor] = []
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
        for layer in model.model.layers
    ]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return seen, remove


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


# --------------------------------------------------------------------------------------------- rungs
@torch.no_grad()
def rung_paths(model: MLAForCausalLM, ids: torch.Tensor, data: str) -> Rung:
    """Rung 1: naive (expanded K/V) vs absorbed, per layer, on real attention inputs."""
    rung = Rung(1, "naive-vs-absorbed", data)
    seen, remove = capture_attention_inputs(model)
    model(input_ids=ids, use_cache=False)
    remove()
    b, t = ids.shape
    pos = torch.arange(t)[None].expand(b, t)
    mask = causal_mask(b, t, 0, None, torch.float32, ids.device)
    visible = mask[:, 0] == 0  # [B, T, T]
    worst = {"scores": 0.0, "lse": 0.0, "output": 0.0}
    for layer, x in zip(model.model.layers, seen, strict=True):
        attn = layer.self_attn
        q_nope, q_rope, c_kv, k_rope = attn.project(x, pos)
        h, g, r = attn.num_heads, attn.num_kv_heads, attn.num_rope_heads
        # naive: expand per KV head, replicate to query heads
        kv = attn.kv_b_proj(c_kv).view(b, t, g, attn.qk_nope_head_dim + attn.v_head_dim)
        k_nope = kv[..., : attn.qk_nope_head_dim]
        keys = torch.cat([k_nope, k_rope.repeat_interleave(g // r, dim=2)], dim=-1)
        keys = keys.repeat_interleave(h // g, dim=2)  # [B, T, H, d_N + d_R]
        q = torch.cat([q_nope, q_rope], dim=-1)
        s_naive = torch.einsum("bthd,bshd->bhts", q, keys) * attn.softmax_scale
        s_abs = attn.latent_scores(attn.absorb_query(q_nope), q_rope, c_kv, k_rope.reshape(b, t, -1))
        s_abs = s_abs * attn.softmax_scale
        sel = visible[:, None].expand_as(s_naive)
        worst["scores"] = max(worst["scores"], rel_err(s_abs[sel], s_naive[sel]))
        lse_n = (s_naive + mask).logsumexp(-1)
        lse_a = (s_abs + mask).logsumexp(-1)
        worst["lse"] = max(worst["lse"], float((lse_a - lse_n).abs().max()))
        out_n = attn._naive(q_nope, q_rope, c_kv, k_rope, mask, None)
        out_a = attn._absorbed(q_nope, q_rope, c_kv, k_rope, mask, None)
        worst["output"] = max(worst["output"], rel_err(out_a, out_n))
    rung.check("scaled scores before softmax, max rel. error over layers", worst["scores"], TOL_PATHS)
    rung.check("log-sum-exp, max abs. error (nats)", worst["lse"], TOL_LSE)
    rung.check("attention layer output, max rel. error over layers", worst["output"], TOL_PATHS)
    return rung


@torch.no_grad()
def rung_kernel(model: MLAForCausalLM, prompts: list[torch.Tensor], page_size: int, data: str) -> Rung:
    """Rung 2: Triton kernel vs float64 oracle on real queries and paged cache rows, per layer."""
    from mla_convert.kernels import kernel_backend, latent_decode_reference, load_kernel

    rung = Rung(2, "kernel-vs-reference", data)
    kernel = load_kernel()
    cache = PagedLatentCache.for_model(
        model.config, sum(p.shape[1] for p in prompts) + 2 * page_size, page_size, shuffle_pages=True
    )
    rids, queries = [], []
    model.set_attention_path("absorbed")
    for ids in prompts:  # prefill all but the last token; the last token's queries read that cache
        rid = cache.add_request()
        cache.bind([rid])
        model(input_ids=ids[:, :-1], past_key_values=cache)
        seen, remove = capture_attention_inputs(model)
        model(input_ids=ids, use_cache=False)
        remove()
        queries.append([x[:, -1:] for x in seen])
        rids.append(rid)
    cache.bind(rids)
    lens = cache.seq_lens()
    worst_out = worst_lse = 0.0
    worst_splits = 0.0
    for li, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        qa, qr = [], []
        for ids, q in zip(prompts, queries, strict=True):
            pos = torch.tensor([[ids.shape[1] - 1]])
            q_nope, q_rope, _, _ = attn.project(q[li], pos)
            qa.append(attn.absorb_query(q_nope)[:, 0])
            qr.append(q_rope[:, 0])
        q_abs, q_rope = torch.cat(qa).contiguous(), torch.cat(qr).contiguous()
        args = (q_abs, q_rope, cache.pages[li], cache.block_table(), lens, attn.head_to_rope())
        ref_out, ref_lse = latent_decode_reference(*args, softmax_scale=attn.softmax_scale)
        out, lse = kernel.latent_decode(*args, softmax_scale=attn.softmax_scale)
        one, _ = kernel.latent_decode(*args, softmax_scale=attn.softmax_scale, num_splits=1)
        worst_out = max(worst_out, rel_err(out, ref_out))
        worst_lse = max(worst_lse, float((lse.double() - ref_lse).abs().max()))
        worst_splits = max(worst_splits, rel_err(one, out))
    rung.check("latent_out vs float64 oracle, max rel. error over layers", worst_out, TOL_KERNEL)
    rung.check("lse vs float64 oracle, max abs. error (nats)", worst_lse, TOL_KERNEL * 10)
    rung.check("1 split vs default splits, max rel. difference", worst_splits, TOL_KERNEL)
    rung.checks.append(Check("kernel backend", kernel_backend()))
    rung.checks.append(Check("request lengths (tokens)", ", ".join(str(int(n)) for n in lens)))
    return rung


@torch.no_grad()
def rung_decode(
    model: MLAForCausalLM,
    prompt: torch.Tensor,
    new_tokens: int,
    backend: str,
    page_size: int,
    pair_freq: torch.Tensor,
    freq_source: str,
    data: str,
) -> tuple[Rung, PagedLatentCache]:
    """Rung 3: paged prefill + decode on ``backend`` vs full recomputation; cache rows vs recomputed."""
    rung = Rung(3, "decode-vs-recompute", data)
    cfg = model.config
    buffers = torch.stack([layer.self_attn.rope_inv_freq for layer in model.model.layers]).float()
    if cfg.qk_rope_head_dim:
        rung.check(
            f"model RoPE frequencies vs {freq_source}, max rel. error",
            rel_err(buffers, pair_freq) if buffers.shape == pair_freq.shape else math.inf,
            TOL_FREQ,
        )
        recorded = torch.tensor(cfg.rope_inv_freq, dtype=torch.float32)
        rung.check(
            "model RoPE frequencies vs config.json rope_inv_freq, max rel. error",
            rel_err(buffers, recorded) if buffers.shape == recorded.shape else math.inf,
            TOL_FREQ,
        )
    res = generate(model, prompt, new_tokens, backend=backend, page_size=page_size, shuffle_pages=True)
    tokens = res.tokens[:, :-1]  # the last generated token was never fed back
    model.set_attention_path("absorbed")
    seen, remove = capture_attention_inputs(model)
    full = model(input_ids=tokens, use_cache=False).logits[:, prompt.shape[1] - 1 :].float()
    remove()
    rung.check(
        "step logits vs full recomputation, max rel. error", rel_err(res.step_logits, full), TOL_DECODE_LOGITS
    )
    rung.check(
        "greedy tokens differing from full recomputation",
        float((res.step_logits.argmax(-1) != full.argmax(-1)).sum()),
        0,
        "==",
    )
    t = tokens.shape[1]
    pos = torch.arange(t)[None]
    worst_c = worst_r = 0.0
    for li, (layer, x) in enumerate(zip(model.model.layers, seen, strict=True)):
        attn = layer.self_attn
        kv = attn.kv_a_proj_with_mqa(x)
        c_kv = kv[..., : attn.kv_lora_rank]
        if attn.kv_a_layernorm is not None:
            c_kv = attn.kv_a_layernorm(c_kv)
        rows = res.cache.rows(li, res.cache.active[0])
        worst_c = max(worst_c, rel_err(rows[:, : attn.kv_lora_rank], c_kv[0]))
        if attn.qk_rope_head_dim:
            k_rope = kv[..., attn.kv_lora_rank :].reshape(1, t, attn.num_rope_heads, -1)
            angles = pos[:, :, None, None].float() * pair_freq[li][None, None]
            expect = apply_rope(k_rope, angles.cos(), angles.sin()).reshape(t, -1)
            worst_r = max(worst_r, rel_err(rows[:, attn.kv_lora_rank :], expect))
    rung.check("cache rows c_kv vs recomputed, max rel. error over layers", worst_c, TOL_ROWS)
    if cfg.qk_rope_head_dim:
        rung.check(
            f"cache rows k_rope vs recomputed at absolute positions ({freq_source}), max rel. error",
            worst_r,
            TOL_ROWS,
        )
    rung.check(
        "committed cache length (tokens)", float(res.cache.lengths[res.cache.active[0]]), float(t), "=="
    )
    layers = cfg.num_hidden_layers
    want = f"{'triton-' if backend == 'triton' else 'absorbed-torch'}"
    decode_calls = sum(v for k, v in res.backend_log.items() if k.endswith(":decode") and k.startswith(want))
    other = sum(v for k, v in res.backend_log.items() if k.endswith(":decode") and not k.startswith(want))
    rung.check(
        f"decode attention calls on {backend} (want {layers * (new_tokens - 1)})",
        float(decode_calls),
        float(layers * (new_tokens - 1)),
        "==",
    )
    rung.check("decode attention calls on any other backend", float(other), 0.0, "==")
    rung.checks.append(Check("backends that ran", json.dumps(res.backend_log, sort_keys=True)))
    return rung, res.cache


@torch.no_grad()
def rung_source(
    model: MLAForCausalLM,
    source_model: Any,
    source_scale: float,
    windows: torch.Tensor,
    recorded: dict[str, Any] | None,
    data: str,
) -> tuple[Rung, dict[str, Any]]:
    """Rung 4: converted vs source on held-out windows; scale contract; recorded figures reproduced."""
    from mla_convert.validate.metrics import evaluate

    rung = Rung(4, "converted-vs-source", data)
    rung.check(
        f"softmax_scale {model.config.softmax_scale:.6g} vs source's {source_scale:.6g}, rel. error",
        abs(model.config.softmax_scale - source_scale) / source_scale,
        1e-6,
    )
    ev = evaluate(model, windows, source_model)
    ratio = ev.perplexity / (ev.reference_perplexity or 1.0)
    rung.checks.append(Check("perplexity (converted)", round(ev.perplexity, 4)))
    rung.checks.append(Check("perplexity (source)", round(ev.reference_perplexity or 0.0, 4)))
    rung.checks.append(Check("perplexity ratio", round(ratio, 4)))
    rung.checks.append(Check("KL(source || converted), nats/token", round(ev.kl or 0.0, 5)))
    rung.checks.append(Check("top-1 agreement", round(ev.top1 or 0.0, 4)))
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
        rung.checks.append(
            Check("recorded figures", "not comparable (different text or windows, or none recorded)")
        )
    return rung, ev.as_dict()


@torch.no_grad()
def rung_ledger(
    model: MLAForCausalLM, cache: PagedLatentCache, source_model: Any, probe: torch.Tensor
) -> Rung:
    """Rung 5: measured paged-cache bytes vs the formula vs the source's measured KV cache."""
    from mla_convert.validate.metrics import measure_cache

    led = cache.ledger()
    rung = Rung(
        5, "cache-ledger", f"the paged cache of rung 3 ({led['tokens']} tokens, page size {led['page_size']})"
    )
    elem = torch.empty(0, dtype=cache.dtype).element_size()
    formula = sum(model.config.cache_width) / len(model.config.cache_width) * elem
    rung.check(
        f"payload bytes/token/layer {led['payload_bytes_per_token_per_layer']:.1f} vs formula "
        f"(d_c + R*d_R) x {elem} B = {formula:.1f}, difference",
        abs(led["payload_bytes_per_token_per_layer"] - formula),
        0.0,
        "==",
    )
    # read the stored tensors back: the cache holds exactly the committed rows plus NaN padding
    stored = sum(int((~p.isnan().all(-1)).sum()) for p in cache.pages)
    rung.check(
        "rows holding data (all layers) vs committed tokens x layers",
        float(stored),
        float(led["tokens"] * led["layers"]),
        "==",
    )
    rung.checks.append(
        Check("bytes/token/layer with page padding", round(led["allocated_bytes_per_token_per_layer"], 1))
    )
    cfg = model.config
    src_formula = 2 * cfg.num_key_value_heads * cfg.v_head_dim * elem
    rung.checks.append(
        Check("source KV cache formula 2 x n_kv x head_dim x elem (bytes/token/layer)", src_formula)
    )
    if source_model is not None:
        measured = measure_cache(source_model, probe)["bytes_per_token_per_layer"]
        rung.checks.append(
            Check(f"source KV cache measured ({probe.shape[1]}-token prefill), bytes/token/layer", measured)
        )
        rung.check("measured source bytes vs its formula, difference", abs(measured - src_formula), 0.0, "==")
        rung.checks.append(
            Check(
                "cache ratio (converted payload / source measured)",
                round(led["payload_bytes_per_token_per_layer"] / measured, 4),
            )
        )
    return rung


# --------------------------------------------------------------------------------------------- driver
@dataclass
class ValidationResult:
    """All rungs plus provenance; ``passed`` is True when no rung failed (skipped rungs do not fail)."""

    checkpoint: str
    rungs: list[Rung]
    settings: dict[str, Any]
    environment: dict[str, Any]

    @property
    def passed(self) -> bool:
        return all(r.passed or r.skipped for r in self.rungs)

    @property
    def partial(self) -> str | None:
        """What the ladder could not measure (e.g. no source), or None."""
        missing = [
            f"rung {r.number}: {c.value}"
            for r in self.rungs
            for c in r.checks
            if isinstance(c.value, str) and c.value.startswith("not measured")
        ]
        return "; ".join(missing) or None

    @property
    def failed(self) -> list[Rung]:
        return [r for r in self.rungs if not r.passed and not r.skipped]

    def as_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "passed": self.passed,
            "not_measured": self.partial,
            "failed_rungs": [f"{r.number}:{r.name}" for r in self.failed],
            "settings": self.settings,
            "environment": self.environment,
            "rungs": [dict(asdict(r), passed=r.passed) for r in self.rungs],
        }


def recorded_figures(ckpt: Path, text: str, window: int, windows: int) -> dict[str, Any] | None:
    """The conversion-time evaluation figures when ``text``/``window``/``windows`` match, else None."""
    try:
        report = json.loads((ckpt / "report.json").read_text())
    except (OSError, ValueError):
        return None
    opts = report.get("options", {})
    ev = report.get("model", {}).get("eval", {})
    if (opts.get("text"), opts.get("window"), opts.get("eval_windows")) != (text, window, windows) or not ev:
        return None
    if ev.get("kl") is None:
        return None
    return {"perplexity": float(ev["perplexity"]), "kl": float(ev["kl"])}


def validate(
    ckpt: Path,
    source: str | None = None,
    text: str | None = None,
    window: int | None = None,
    windows: int | None = None,
    prompt_tokens: int = 61,
    new_tokens: int = 16,
    page_size: int = 16,
    backend: str = "triton",
    progress: Callable[[str], None] | None = None,
) -> ValidationResult:
    """Run the five rungs on a converted checkpoint.

    Args:
        ckpt: a folder written by ``mla-convert factor``.
        source: the source model (default: the one recorded in the checkpoint's config when it can be
            opened); without one, rung 4 is skipped and rung 3 uses the recorded frequencies.
        text, window, windows: held-out text (evaluation split) for rungs 1-4; default: the conversion's.
        prompt_tokens: prefill length of rungs 2-3 (61 crosses page boundaries at page size 16).
        new_tokens: decode steps of rung 3.
        page_size: paged-cache page size (1..128).
        backend: decode backend of rung 3, ``triton`` or ``absorbed``.

    Returns:
        The :class:`ValidationResult`; nothing is written here (see :func:`write_validation`).

    Raises:
        ValidationError: not a converted checkpoint, or text too short; SourceError for a bad source.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mla_convert.kernels import kernel_backend
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.text.corpora import load_documents, split_documents, token_windows

    say = progress or (lambda _m: None)
    if not (ckpt / "config.json").is_file():
        raise ValidationError(f"{ckpt} has no config.json; pass a folder written by 'mla-convert factor'")
    config = json.loads((ckpt / "config.json").read_text())
    if config.get("model_type") != "mla":
        raise ValidationError(
            f"{ckpt} holds a {config.get('model_type')!r} model, not a converted MLA checkpoint; "
            "run 'mla-convert factor' first"
        )
    if not 1 <= page_size <= 128:
        raise ValidationError(f"--page-size {page_size} is outside 1..128")
    if prompt_tokens < 2 or new_tokens < 2:
        raise ValidationError("--prompt-tokens and --new-tokens must be at least 2")
    opts = {}
    try:
        opts = json.loads((ckpt / "report.json").read_text()).get("options", {})
    except (OSError, ValueError):
        pass
    text = opts.get("text", "wikipedia") if text is None else text
    window = int(opts.get("window", 512)) if window is None else window
    windows = int(opts.get("eval_windows", 8)) if windows is None else windows
    if window < 2 or windows < 2:
        raise ValidationError(f"--window {window} / --windows {windows}: need at least 2 of each")
    src = None
    if source is not None:  # asked for explicitly: it must open
        src = open_source(source)
    else:
        source = config.get("source", {}).get("origin")
        if source and (source == "smollm2-135m" or Path(source).exists()):
            src = open_source(source)
    say("loading checkpoint")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    spec: Any = text if text in ("wikipedia", "news") else [Path(p) for p in text.split(",")]
    docs = split_documents(load_documents(spec))["evaluation"]
    eval_ids = token_windows(tok, docs, window, windows, bos=False)
    if eval_ids.shape[0] < 2 or eval_ids.shape[1] < prompt_tokens + new_tokens:
        raise ValidationError(
            f"the {text} evaluation split gives {eval_ids.shape[0]} window(s) of {eval_ids.shape[1]} tokens; "
            f"need 2 windows of >= {prompt_tokens + new_tokens} (use more text or fewer --prompt-tokens)"
        )
    data = f"{text} evaluation split"
    rungs: list[Rung] = []

    def timed(fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        rung = out[0] if isinstance(out, tuple) else out
        rung.seconds = round(time.perf_counter() - start, 2)
        rungs.append(rung)
        return out

    say("rung 1: naive vs absorbed")
    timed(lambda: rung_paths(model, eval_ids[:1, :128], f"{data}, window 0, first 128 tokens"))
    say("rung 2: kernel vs reference")
    short = max(2, prompt_tokens // 2 + 3)
    prompts = [eval_ids[:1, :prompt_tokens], eval_ids[1:2, :short]]
    timed(
        lambda: rung_kernel(
            model,
            prompts,
            page_size,
            f"{data}: queries of tokens {prompt_tokens} and {short} over their prefixes",
        )
    )
    say("rung 3: decode vs recompute")
    source_model = load_source_model(src) if src is not None else None
    pair_freq = source_pair_frequencies(model.config, src.inv_freq if src is not None else None)
    freq_source = "source RoPE table at the recorded pair indices" if src else "recorded config frequencies"
    _, cache = timed(
        lambda: rung_decode(
            model,
            eval_ids[:1, :prompt_tokens],
            new_tokens,
            backend,
            page_size,
            pair_freq,
            freq_source,
            f"{data}: {prompt_tokens}-token prompt + {new_tokens} greedy steps, page size {page_size}",
        )
    )
    say("rung 4: converted vs source")
    if src is None or source_model is None:
        # without the source, check what the checkpoint alone can show: the family's scale rule
        rung4 = Rung(4, "converted-vs-source", f"{data} (source {source!r} not available)")
        rule = model.config.v_head_dim**-0.5
        rung4.check(
            f"softmax_scale {model.config.softmax_scale:.6g} vs 1/sqrt(head_dim) = {rule:.6g} (source absent), rel. error",
            abs(model.config.softmax_scale - rule) / rule,
            1e-6,
        )
        rung4.checks.append(
            Check("perplexity, KL, top-1 vs source", "not measured: source not available; pass --source")
        )
        rungs.append(rung4)
    else:
        rec = recorded_figures(ckpt, text, window, windows)
        timed(
            lambda: rung_source(
                model, source_model, src.softmax_scale, eval_ids, rec, f"{data}: {windows} x {window} tokens"
            )[0]
        )
    say("rung 5: cache ledger")
    timed(lambda: rung_ledger(model, cache, source_model, eval_ids[:1, :128]))
    import triton

    env = {
        "kernel_backend": kernel_backend(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    }
    settings = {
        "source": source,
        "text": text,
        "window": window,
        "windows": windows,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "page_size": page_size,
        "backend": backend,
        "dtype": "float32",
    }
    return ValidationResult(str(ckpt), rungs, settings, env)


def validation_markdown(res: ValidationResult) -> str:
    """``validation.md``: one table per rung with value, tolerance and verdict."""
    lines = [
        f"# Validation of `{Path(res.checkpoint).name}`: {'PASSED' if res.passed else 'FAILED'}",
        "",
        f"Backend: {res.environment['kernel_backend']} (triton {res.environment['triton']}, torch "
        f"{res.environment['torch']}); settings: " + ", ".join(f"{k}={v}" for k, v in res.settings.items()),
        "Relative error = max|a - b| / max|b| over all compared entries; tolerances are float32 figures.",
        "",
    ]
    for r in res.rungs:
        verdict = f"skipped ({r.skipped})" if r.skipped else ("pass" if r.passed else "FAIL")
        lines += [f"## {r.number}. {r.name}: {verdict}", "", f"Data: {r.data}; {r.seconds:.1f} s.", ""]
        if r.checks:
            lines += ["| check | value | tolerance | result |", "|---|---|---|---|"]
            for c in r.checks:
                val = format_value(c.value)
                res_s = "" if c.passed is None else ("pass" if c.passed else "FAIL")
                lines.append(f"| {c.name} | {val} | {c.tolerance} | {res_s} |")
            lines.append("")
    return "\n".join(lines)


def write_validation(ckpt: Path, res: ValidationResult) -> None:
    """Write ``validation.json`` and ``validation.md`` into ``ckpt`` (each via a temporary file + rename)."""
    for name, body in (
        ("validation.json", json.dumps(res.as_dict(), indent=2) + "\n"),
        ("validation.md", validation_markdown(res) + "\n"),
    ):
        tmp = ckpt / f".{name}.tmp"
        tmp.write_text(body)
        tmp.replace(ckpt / name)
