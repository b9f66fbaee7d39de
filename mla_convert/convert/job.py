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
from mla_convert.artifacts.manifest import conversion_manifest, write_manifest
from mla_convert.artifacts.output import atomic_folder, check_output, save_checkpoint
from mla_convert.artifacts.report import write_report
from mla_convert.convert.build import Conversion, ProgressFn, convert
from mla_convert.convert.options import ConvertOptions, check_options
from mla_convert.sources.checkpoint import SourceModel, tokenizer_files
from mla_convert.text.corpora import TextError, load_documents, parse_text_spec
from mla_convert.text.windows import documents_record, split_documents, token_windows
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


def prepare_text(tokenizer: Any, options: ConvertOptions) -> TextSplit:
    """Load, split by document and tokenize calibration/evaluation text.

    Raises:
        TextError: missing/empty text, or too short for the requested windows.
    """
    spec = parse_text_spec(options.text)
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
    name = spec if isinstance(spec, str) else "local files"
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
        from mla_convert.runtime.decode import greedy

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
    manifest = conversion_manifest(src, options, conv, ev, text.name, text.records, report["run"])
    with atomic_folder(out) as tmp:
        save_checkpoint(conv.model, tmp, tokenizer_files(src), model_card(src, options, conv, ev))
        write_report(tmp, report)
        write_manifest(tmp, manifest, sorted(p.name for p in tmp.iterdir() if p.is_file()))
    return report

