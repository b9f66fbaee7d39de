"""The ``factor`` job end to end: validate -> text -> convert -> measure -> write OUT atomically.

Everything cheap is checked before the first heavy step (source layout, options, output folder,
text length), so a bad input fails in seconds with one line and writes nothing.
"""

from __future__ import annotations

import platform
import resource
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from mla_convert import __version__
from mla_convert.artifacts.manifest import conversion_manifest, write_manifest
from mla_convert.artifacts.output import write_carried
from mla_convert.artifacts.report import write_report
from mla_convert.artifacts.shards import DEFAULT_MAX_SHARD_SIZE, write_shards
from mla_convert.convert.estimate.weights import weights_ledger
from mla_convert.convert.options.options import ConvertOptions, check_options
from mla_convert.convert.options.resolve import Resolution, resolve_options
from mla_convert.convert.pipeline.device import (
    calib_precision_note,
    frozen_heap,
    map_large_blocks,
    resolve_device,
    trim_heap,
)
from mla_convert.convert.pipeline.passes import run_passes
from mla_convert.convert.pipeline.records import ProgressFn, Streamed, Texts
from mla_convert.convert.pipeline.split_report import split_record, split_sentence
from mla_convert.convert.pipeline.stream import StreamedConversion
from mla_convert.convert.pipeline.text import prepare_text
from mla_convert.convert.pipeline.workdir import (
    WORK_FORMAT,
    check_start,
    close_work,
    holding_job_lock,
    open_work,
    publish,
)
from mla_convert.engines.precheck import engine_table
from mla_convert.errors import UserError
from mla_convert.metrics import EvalResult
from mla_convert.sources.checkpoint import SourceModel
from mla_convert.sources.integrity import preflight


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB: ``VmHWM`` of ``/proc/self/status`` on Linux (this program's own
    high-water mark; ``ru_maxrss`` would carry a forking parent's resident set over ``exec``), else ``ru_maxrss``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PhasePeaks:
    """Peak resident memory (MiB) of each phase of a job: at each boundary the high-water mark ``VmHWM`` is read
    and reset (``/proc/self/clear_refs`` ``5``, Linux >= 4.0). Where the reset is refused, every phase reports the
    peak so far (still an upper bound)."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.current = "start"
        self._reset()

    @staticmethod
    def _reset() -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def enter(self, phase: str) -> None:
        """End the current phase (record its peak) and start ``phase``."""
        self.peaks[self.current] = max(self.peaks.get(self.current, 0.0), peak_rss_mb())
        self.current = phase
        self._reset()

    def finish(self) -> dict[str, float]:
        """Every phase's peak (MiB, rounded), the current one closed."""
        self.enter("end")
        self.peaks.pop("end", None)
        return {k: round(v, 1) for k, v in self.peaks.items()}


def model_card(
    src: SourceModel, options: ConvertOptions, res: Streamed, ev: EvalResult, weights: list[str] | None = None
) -> str:
    """A short model card naming the source and the method (``ev``: the held-out evaluation; ``weights``: the
    weights ledger's lines, :meth:`~mla_convert.convert.estimate.weights.WeightsLedger.lines`)."""
    ledger = "".join(f"- {line}\n" for line in weights or [])
    widths = res.config.cache_width
    return (
        "---\nlibrary_name: transformers\ntags: [mla, mla-convert]\n---\n"
        f"# MLA conversion of {src.origin}\n\n"
        f"Converted with mla-convert {__version__} from `{src.origin}` ({src.family.name}, "
        f"{src.num_heads} query / {src.num_kv_heads} KV heads) into Multi-Head Latent Attention.\n\n"
        f"Method: partial RoPE `{options.rope_mode}` / `{options.rope_strategy}` with {options.rope_pairs} pairs "
        f"per rope head, `{options.factorization}` factorization with the `{options.objective}` objective.\n"
        f"KV cache: {sum(widths) / len(widths):.1f} values per token per layer (source: {src.kv_cache_width}).\n"
        f"Weights: {res.dtype}.\n\n"
        f"Held-out perplexity {ev.perplexity:.3f} (source {ev.reference_perplexity:.3f}) on {ev.tokens} tokens "
        f"of the {options.text} evaluation split ({ev.windows} windows of {ev.window}).\n\n"
        f"Source weights: {src.describe()['weights']}.\n\n"
        "Load with `import mla_convert` then `AutoModelForCausalLM.from_pretrained(path)`.\n\n"
        + (f"## Weights and memory against the source\n\n{ledger}\n" if ledger else "")
        + f"## Where it serves (source: {src.kv_cache_width} values/token/layer)\n\n"
        f"{engine_table(src, options, res.config)}"
    )


def job_record(src: SourceModel, options: ConvertOptions, max_shard_size: str | int) -> dict[str, Any]:
    """What a stopped job must match to be resumed: the source files, the options and the output settings."""
    return {
        "source": src.origin,
        "source_files": [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in src.origin_files],
        "options": options.model_dump(),
        "max_shard_size": max_shard_size,
        "tool": __version__,
        "work_format": WORK_FORMAT,
    }


#: Largest fp32 model (bytes) whose written checkpoint is loaded whole for the report's greedy sample.
SAMPLE_MAX_BYTES = 2 * 2**30


def _sample(folder: Path, tokenizer: Any, prompt: str | None, params: int) -> str | None:
    """Greedy 24 tokens from the written checkpoint (loaded whole in float32: on a CPU, decoding a bf16 model
    grows the heap by about twice its size), or None when it is too large."""
    if not prompt or params * 4 > SAMPLE_MAX_BYTES:
        return None
    from mla_convert.mla.checkpoint import load_checkpoint
    from mla_convert.runtime.decode import greedy

    trim_heap()
    model = load_checkpoint(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    text = tokenizer.decode(greedy(model, ids, 24)[0], skip_special_tokens=True)
    del model
    return str(text)


#: Evaluation windows the report's bfloat16 check scores as its long text (:mod:`mla_convert.precision`).
PRECISION_WINDOWS = 2


def _precision(folder: Path, src: SourceModel, tokenizer: Any, windows: torch.Tensor, text: str, params: int
               ) -> dict[str, Any]:
    """The converted model's bfloat16 deviation against its source's (:func:`~mla_convert.precision.conversion_precision`),
    or why it was skipped (a model above the in-memory limit: ``mla-convert validate`` measures it, rung 7)."""
    if params * 4 > SAMPLE_MAX_BYTES:
        return {"skipped": "model larger than the in-memory limit; `mla-convert validate CKPT` measures it (rung 7)"}
    from mla_convert.precision import conversion_precision

    trim_heap()
    record = conversion_precision(folder, src, tokenizer, windows, f"{text} evaluation split")
    trim_heap()
    return record


@holding_job_lock
def run_factor(
    src: SourceModel,
    out: Path,
    options: ConvertOptions,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    sample_prompt: str | None = "The capital of France is",
    resume: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    resolution: Resolution | None = None,
    notice: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Convert ``src`` into an MLA checkpoint in ``out`` with report and manifest, layer by layer
    (:mod:`mla_convert.convert.pipeline.stream`) in the work folder ``.OUT.factor`` (:mod:`mla_convert.convert.pipeline.workdir`).

    Args:
        resume: continue the stopped job of the same source, options and shard size after its last layer.
        max_shard_size: largest output shard (``"2GB"``, bytes); one shard is held in memory while written.
        resolution: ``options`` already resolved for ``src`` (:func:`~mla_convert.convert.options.resolve.resolve_options`,
            as the CLI does with the flags typed); None: resolved here with the fields the caller set as given, so
            a library call converts as the command line does. Its ``why`` goes into the report's ``run``, its
            ``choices`` into the manifest.

    Returns:
        The report dict (also written to ``out/report.json``).

    Raises:
        OutputError, ResumeError, RopeError, FactorError, TextError, SourceError: bad input, before heavy work;
            ResumeError too while another ``factor`` converts into the same OUT (:func:`~mla_convert.convert.
            pipeline.workdir.job_lock`).
    """
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    phases = PhasePeaks()
    if resolution is None:
        resolution = resolve_options(options, src)
    options = resolution.options
    check_options(options, src)
    warnings = preflight(src)  # broken sources: before any work
    job = job_record(src, options, max_shard_size)
    out = check_start(out, job, resume, overwrite, src.path)
    tokenizer = AutoTokenizer.from_pretrained(str(src.path))
    text = prepare_text(tokenizer, options)
    if text.calibration.numel() < src.hidden_size:
        warnings.append(
            f"only {text.calibration.numel()} calibration tokens for hidden size {src.hidden_size}: the statistics "
            "cannot describe the activations (energies near 1 and errors near 0 mean nothing); use more "
            "--calib-tokens or a longer --window"
        )
    asked = options.calibration_windows()
    if text.calibration.shape[0] < asked:
        warnings.append(
            f"the calibration text gives {text.calibration.shape[0]} window(s) of {options.window} tokens where "
            f"{asked} were asked ({text.calibration.numel()} of {asked * options.window} tokens; "
            f"{text.name}): the statistics come from less text than the budget; give more text or fewer "
            "--calib-tokens"
        )
    slow = calib_precision_note(options.calib_precision, resolve_device(options.device))
    if notice is not None:
        for warning in [*warnings, *([slow] if slow else [])]:
            notice(warning)  # the speed note is not the checkpoint's: said, not kept in the report
    probe = text.evaluation[:1, :128]
    texts = Texts(text.calibration, text.held_out, text.evaluation, probe)
    work, done = open_work(out, job, resume)
    with frozen_heap():  # the per-layer gc.collect skips the objects made before the layers run
        try:
            conv = StreamedConversion(
                src, options, texts, work, progress, rope_candidates=resolution.rope_candidates,
                rope_strategies=resolution.rope_strategies, refit_modes=resolution.refit_modes,
            )
            if conv.large_layers:
                map_large_blocks()  # freed temporaries leave the resident set at once
            if done is not None:
                conv.load_state()
            tp = time.perf_counter()
            passes = run_passes(conv, done, phases.enter)
            options, split, config, res, ev = conv.options, passes.split, passes.config, passes.result, passes.eval
            assert ev is not None  # factor always has evaluation windows
            t1 = tp + passes.seconds["source"]
            t2 = t1 + passes.seconds["convert"]
            t3 = time.perf_counter()
            staged = work / "out"
            staged.mkdir()

            def shard_done(_: int, total: int) -> None:
                src.release()  # the shard's source pages leave the resident set
                if progress:
                    progress("write", 1, total)

            phases.enter("write")
            config.save_pretrained(str(staged))
            write_shards(
                staged,
                conv.layout(config),
                conv.loader(),
                max_shard_size,
                shard_done,
            )
            params = sum(t.numel() for t in conv.layout(config).values())
            ledger = weights_ledger(config, src, dtype=str(res.dtype).removeprefix("torch."))
            write_carried(staged, src.path, config, model_card(src, options, res, ev, ledger.lines()))
            phases.enter("sample")
            sample = _sample(staged, tokenizer, sample_prompt, params)
            phases.enter("bfloat16")
            precision = _precision(staged, src, tokenizer, text.evaluation[:PRECISION_WINDOWS], options.text, params)
        except UserError:
            close_work(work)  # a damaged source or impossible step: nothing to resume
            raise
    t4 = time.perf_counter()
    by_phase = phases.finish()
    cache_src, cache_mla = res.cache_source, res.cache_converted
    report: dict[str, Any] = {
        "source": src.describe(),
        "options": options.model_dump(),
        "text": {
            "name": text.name,
            "calibration": text.records["calibration"],
            "evaluation": text.records["evaluation"],
            "calibration_tokens": res.calib_tokens,
            "calibration_documents_used": text.calibration_documents,
            "held_out_tokens": int(text.held_out.numel()),
            "window": options.window,
        },
        "layers": [{k: v for k, v in asdict(r).items() if k != "reconstruct" or v is not None} for r in res.layers],
        "weights": {**ledger.as_dict(), "lines": ledger.lines()},
        "warnings": warnings,
        "model": {
            "eval": ev.as_dict(),
            "o_proj_refit": {k: v for k, v in (res.refit or {}).items() if not k.startswith("window_")}
            or None,
            "cache": {
                "source": cache_src,
                "converted": cache_mla,
                "ratio": cache_mla["values_per_token_per_layer"] / cache_src["values_per_token_per_layer"],
                "formula_values_per_token_per_layer": sum(config.cache_width) / len(config.cache_width),
                "measured_on": f"prefill of {probe.shape[1]} evaluation tokens, layer by layer",
            },
            "sample": {
                "prompt": sample_prompt,
                "greedy_24_tokens": sample,
                "skipped": None
                if sample or not sample_prompt
                else "model larger than the in-memory sample limit",
            },
            "dtype": res.dtype,
            "bfloat16": precision,
        },
        "run": {
            "wall_s": t4 - t0,
            "convert_s": t2 - t0,
            "timings": {
                "source_pass_s": t1 - t0,
                "convert_pass_s": t2 - t1,
                "score_s": t3 - t2,
                "write_s": t4 - t3,
                **res.timings,
            },
            "per_layer": res.per_layer,
            "device": res.device,
            "resumed_after": done,
            "peak_rss_mb": max(by_phase.values()),
            "peak_rss_mb_by_phase": by_phase,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "rope_pairs_chosen_by": split_sentence(split, resolution.why)
            or "given (--rope-pairs, or a fixed --kv-lora-rank)",
            "rope_split": split_record(split),
        },
    }
    manifest = conversion_manifest(
        src, options, res, ev, text.name, text.records, report["run"], resolution.choices, ledger.as_dict()
    )
    write_report(staged, report)
    write_manifest(
        staged, manifest, sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file())
    )
    publish(staged, out)
    close_work(work)
    return report
