"""The ``factor`` job end to end: validate -> text -> convert -> measure -> write OUT atomically.

Everything cheap is checked before the first heavy step (source layout, options, output folder,
text length), so a bad input fails in seconds with one line and writes nothing.
"""

from __future__ import annotations

import platform
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mla_convert import __version__
from mla_convert.artifacts.manifest import write_manifest
from mla_convert.artifacts.output import atomic_folder, check_output, save_checkpoint
from mla_convert.artifacts.report import write_report
from mla_convert.convert.build import Conversion, ConvertOptions, ProgressFn, convert
from mla_convert.convert.factorize import FACTORIZATIONS, OBJECTIVES, FactorError
from mla_convert.convert.rope import BASES, MODES, STRATEGIES, RopeError
from mla_convert.sources.checkpoint import SourceModel, sha256_file, tokenizer_digest, tokenizer_files
from mla_convert.text.corpora import (
    TextError,
    documents_record,
    load_documents,
    split_documents,
    token_windows,
)
from mla_convert.validate.metrics import EvalResult, evaluate, measure_cache

#: Held-out calibration windows: per-layer attention error and the o_proj refit's keep/revert check
#: (several, so one window's noise cannot decide it; every window's loss is recorded).
HELD_OUT_WINDOWS = 4


@dataclass
class TextSplit:
    """Token windows for each role, and the documents behind them."""

    name: str
    calibration: torch.Tensor  # [N, T] statistics windows
    held_out: (
        torch.Tensor
    )  # [M, T] held-out calibration windows (attention error, o_proj refit check), M <= 4
    evaluation: torch.Tensor  # [M, T]
    records: dict[str, list[dict[str, Any]]]


def check_options(options: ConvertOptions, src: SourceModel) -> None:
    """Cheap option checks against the source (before loading weights).

    Raises:
        RopeError / FactorError: with the allowed range.
    """
    if options.rope_mode not in MODES:
        raise RopeError(f"unknown --rope-mode {options.rope_mode!r}; choose one of {', '.join(MODES)}")
    if options.rope_strategy not in STRATEGIES:
        raise RopeError(
            f"unknown --rope-strategy {options.rope_strategy!r}; choose one of {', '.join(STRATEGIES)}"
        )
    if options.rope_basis not in BASES:
        raise RopeError(f"unknown --rope-basis {options.rope_basis!r}; choose one of {', '.join(BASES)}")
    if options.objective not in OBJECTIVES:
        raise FactorError(f"unknown --objective {options.objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if options.factorization not in FACTORIZATIONS:
        raise FactorError(
            f"unknown --factorization {options.factorization!r}; choose one of {', '.join(FACTORIZATIONS)}"
        )
    from mla_convert.convert.build import REFITS

    if options.refit_o_proj not in REFITS:
        raise FactorError(
            f"unknown --refit-o-proj {options.refit_o_proj!r}; choose one of {', '.join(REFITS)}"
        )
    half, g = src.head_dim // 2, src.num_kv_heads
    limit = half * g if (options.rope_mode == "shared" and options.rope_strategy == "rotation") else half
    if not 0 <= options.rope_pairs <= limit:
        raise RopeError(
            f"--rope-pairs {options.rope_pairs} is out of range for {options.rope_mode}/{options.rope_strategy}: "
            f"0..{limit} (head_dim/2 = {half})"
        )
    rope_width = (g if options.rope_mode == "per-head" else 1) * 2 * options.rope_pairs
    n_nope = 2 * (half * g) - 2 * options.rope_pairs * (g if options.rope_mode == "per-head" else 1)
    max_rank = min(src.hidden_size, n_nope + g * src.head_dim)
    if options.kv_lora_rank is not None and not 1 <= options.kv_lora_rank <= max_rank:
        raise FactorError(
            f"--kv-lora-rank {options.kv_lora_rank} is impossible for this source: allowed 1..{max_rank}"
        )
    if options.kv_lora_rank is None:
        if options.cache_budget is None:
            raise FactorError("give --kv-lora-rank or --cache-budget")
        if options.cache_budget - rope_width < 1:
            raise FactorError(
                f"--cache-budget {options.cache_budget} leaves no latent after {rope_width} RoPE values; "
                "lower --rope-pairs or raise the budget"
            )
        if options.cache_budget - rope_width > max_rank:
            raise FactorError(
                f"--cache-budget {options.cache_budget} asks for a latent wider than possible ({max_rank})"
            )
    for name in ("calib_windows", "window", "eval_windows"):
        if getattr(options, name) < 1:
            raise FactorError(f"--{name.replace('_', '-')} must be at least 1")


def prepare_text(tokenizer: Any, options: ConvertOptions) -> TextSplit:
    """Load, split by document and tokenize calibration/evaluation text.

    Raises:
        TextError: missing/empty text, or too short for the requested windows.
    """
    spec: Any = options.text
    if spec not in ("wikipedia", "news"):
        spec = [Path(p) for p in options.text.split(",")]
    docs = load_documents(spec)
    splits = split_documents(docs)
    calib = token_windows(
        tokenizer, splits["calibration"], options.window, options.calib_windows + HELD_OUT_WINDOWS, bos=False
    )
    if calib.shape[0] < 2:
        raise TextError(
            f"calibration text gives {calib.shape[0]} window(s) of {options.window} tokens; need at least 2 "
            "(use more text or a shorter --window)"
        )
    # Up to HELD_OUT_WINDOWS windows after the calibration ones are held out (at least 1).
    held = min(HELD_OUT_WINDOWS, max(1, calib.shape[0] - options.calib_windows))
    evaluation = token_windows(
        tokenizer, splits["evaluation"], options.window, options.eval_windows, bos=False
    )
    name = options.text if isinstance(spec, str) else "local files"
    return TextSplit(
        name,
        calib[:-held],
        calib[-held:],
        evaluation,
        {role: documents_record(d) for role, d in splits.items()},
    )


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MB (``ru_maxrss``, Linux KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_card(src: SourceModel, options: ConvertOptions, conv: Conversion, ev: EvalResult) -> str:
    """A short model card naming the source and the method."""
    widths = conv.config.cache_width
    return (
        "---\nlibrary_name: transformers\ntags: [mla, mla-convert]\n---\n"
        f"# MLA conversion of {src.origin}\n\n"
        f"Converted with mla-convert {__version__} from `{src.origin}` ({src.family.name}, "
        f"{src.num_heads} query / {src.num_kv_heads} KV heads) into Multi-Head Latent Attention.\n\n"
        f"Method: partial RoPE `{options.rope_mode}` / `{options.rope_strategy}` with {options.rope_pairs} pairs "
        f"per rope head, `{options.factorization}` factorization with the `{options.objective}` objective.\n"
        f"KV cache: {sum(widths) / len(widths):.1f} values per token per layer (source: {src.kv_cache_width}).\n\n"
        f"Held-out perplexity {ev.perplexity:.3f} (source {ev.reference_perplexity:.3f}) on {ev.tokens} tokens "
        f"of the {options.text} evaluation split ({ev.windows} windows of {ev.window}).\n\n"
        f"Source weights: {src.describe()['weights']}.\n\n"
        "Load with `import mla_convert` then `AutoModelForCausalLM.from_pretrained(path)`.\n"
    )


def run_factor(
    src: SourceModel,
    out: Path,
    options: ConvertOptions,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    sample_prompt: str | None = "The capital of France is",
) -> dict[str, Any]:
    """Convert ``src`` into an MLA checkpoint in ``out`` with report and manifest.

    Returns:
        The report dict (also written to ``out/report.json``).

    Raises:
        OutputError, RopeError, FactorError, TextError, SourceError: bad input, before heavy work.
    """
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    out = check_output(out, overwrite, src.path)
    check_options(options, src)
    tokenizer = AutoTokenizer.from_pretrained(str(src.path))
    text = prepare_text(tokenizer, options)
    conv, source_model = convert(src, options, text.calibration, text.held_out, progress=progress)
    t1 = time.perf_counter()
    ev = evaluate(
        conv.model,
        text.evaluation,
        source_model,
        progress=(lambda n: progress("evaluate", n, len(text.evaluation))) if progress else None,
    )
    probe = text.evaluation[:1, :128]
    cache_src = measure_cache(source_model, probe)
    cache_mla = measure_cache(conv.model, probe)
    sample = None
    if sample_prompt:
        from mla_convert.validate.metrics import greedy

        ids = tokenizer(sample_prompt, return_tensors="pt").input_ids
        sample = tokenizer.decode(greedy(conv.model, ids, 24)[0], skip_special_tokens=True)
    t2 = time.perf_counter()
    report: dict[str, Any] = {
        "source": src.describe(),
        "options": options.model_dump(),
        "text": {
            "name": text.name,
            "calibration": text.records["calibration"],
            "evaluation": text.records["evaluation"],
            "calibration_tokens": conv.calib_tokens,
            "held_out_tokens": int(text.held_out.numel()),
            "window": options.window,
        },
        "layers": [asdict(r) for r in conv.layers],
        "model": {
            "eval": ev.as_dict(),
            "cache": {
                "source": cache_src,
                "converted": cache_mla,
                "ratio": cache_mla["values_per_token_per_layer"] / cache_src["values_per_token_per_layer"],
                "formula_values_per_token_per_layer": sum(conv.config.cache_width)
                / len(conv.config.cache_width),
                "measured_on": f"prefill of {probe.shape[1]} evaluation tokens",
            },
            "sample": {"prompt": sample_prompt, "greedy_24_tokens": sample},
        },
        "run": {
            "wall_s": t2 - t0,
            "convert_s": t1 - t0,
            "timings": conv.timings,
            "peak_rss_mb": peak_rss_mb(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
        },
    }
    manifest = {
        "tool": {"name": "mla-convert", "version": __version__},
        "source": {
            "origin": src.origin if not Path(src.origin).exists() else Path(src.origin).name,
            "family": src.family.name,
            "files": [{"name": f.name, "sha256": sha256_file(f)} for f in src.origin_files],
            "tokenizer_sha256": tokenizer_digest(src),
        },
        "options": options.model_dump(),
        "rope": {
            "mode": options.rope_mode,
            "pairs": [r.rope_pairs for r in conv.layers],
            "inv_freq": conv.config.rope_inv_freq,
        },
        "ranks": conv.config.kv_lora_rank,
        "calibration": {
            "text": text.name,
            "documents": text.records["calibration"],
            "tokens": conv.calib_tokens,
        },
        "evaluation": {"documents": text.records["evaluation"]},
        "reconstruction": {
            "perplexity_source": round(ev.reference_perplexity or 0.0, 4),
            "perplexity": round(ev.perplexity, 4),
            "kl": round(ev.kl or 0.0, 5),
            "top1": round(ev.top1 or 0.0, 4),
            "mean_attn_rel_error": round(
                sum(r.attn_rel_error or 0 for r in conv.layers) / len(conv.layers), 5
            ),
            **_refit_record(conv.config.source.get("o_proj_refit")),
        },
        "cache_schema": {
            "row_layout": ["c_kv", "k_rope"],
            "kv_lora_rank": conv.config.kv_lora_rank,
            "rope_width": conv.config.num_rope_heads * conv.config.qk_rope_head_dim,
            "num_rope_heads": conv.config.num_rope_heads,
            "qk_rope_head_dim": conv.config.qk_rope_head_dim,
            "rope_layout": "rotate_half within each rope head; k_rope cached already rotated at its absolute position",
            "dtype": "float32",
            "values_per_token_per_layer": conv.config.cache_width,
            "softmax_scale": conv.config.softmax_scale,
        },
        "run": report["run"],
    }
    with atomic_folder(out) as tmp:
        save_checkpoint(conv.model, tmp, tokenizer_files(src), model_card(src, options, conv, ev))
        write_report(tmp, report)
        write_manifest(tmp, manifest, sorted(p.name for p in tmp.iterdir() if p.is_file()))
    return report


def _refit_record(refit: dict[str, Any] | None) -> dict[str, Any]:
    """The o_proj refit's decision for the manifest: kept or not, mean held-out loss (nats) before/after and
    its spread over the held-out windows (min and max of after - before); empty without a refit."""
    if not refit or refit.get("loss_before") is None:
        return {}
    deltas = [a - b for a, b in zip(refit["window_losses_after"], refit["window_losses_before"], strict=True)]
    return {
        "o_proj_refit": {
            "kept": refit["kept"],
            "held_out_windows": len(deltas),
            "loss_before": round(refit["loss_before"], 5),
            "loss_after": round(refit["loss_after"], 5),
            "delta_min": round(min(deltas), 5),
            "delta_max": round(max(deltas), 5),
        }
    }
