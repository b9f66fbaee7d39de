"""``inspect`` and ``factor``: what a conversion would take, and the conversion itself (streamed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from mla_convert.cli.defaults import SHARD_SIZE_DEFAULT, TARGET_DEFAULT
from mla_convert.cli.export_cmds import EXPORT_HELP, TARGET_HELP, check_export, check_target, export_after
from mla_convert.cli.flags import (
    build_options,
    given_on_command_line,
    options_from,
)
from mla_convert.cli.render import (
    STATE,
    cache_table,
    console,
    err_console,
    estimate_lines,
    fail,
    progress_bar,
    say,
    source_table,
    user_errors,
)
from mla_convert.convert.options.fields import shard_size_of
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.options.resolve import Resolution, check_sizes_given
from mla_convert.engines.registry import export_target
from mla_convert.engines.vllm.spec import ENGINE_ROWS
from mla_convert.sources.locate import locate_source

SHAPE_HELP = (
    "The engine the conversion is for: transformers (any shape) | vllm (GPU, and SGLang) | vllm-cpu | llama.cpp. vllm "
    "and vllm-cpu allocate 512 + 64 values per token per layer, so the conversion is shaped to fill that row (one "
    "shared rope head of up to 32 frequencies, one kv_lora_rank up to 512 in every layer) unless --cache-fraction or "
    "--cache-budget is given (then converted as asked; the export lines say whether it fits). "
    "llama.cpp caches one kv_lora_rank + rope head for every layer: --cache-fraction/--cache-budget is that served "
    "row, spent as one rank and the fastest rope pairs (the split measured best there; serve it with --export gguf)."
)
SOURCE_HELP = (
    "A HF folder (safetensors), a .gguf file, or 'smollm2-135m' (the bundled SmolLM2-135M-Instruct)."
)


def check_device(spec: str) -> None:
    """A CUDA ``--device`` this machine does not have, refused before the source is read.

    Raises:
        OptionsError: no CUDA GPU (or not that many) here (:func:`~mla_convert.convert.pipeline.device.resolve_device`).
    """
    if spec.startswith("cuda"):
        from mla_convert.convert.pipeline.device import resolve_device

        resolve_device(spec)


def shape_options(options: ConvertOptions, src: Any, target: str, export: str | None = None) -> Resolution:
    """The options ``factor``/``inspect`` run (:func:`~mla_convert.convert.options.resolve.resolve_options` with the flags
    typed on the command line as the given ones, and the ``--export`` format)."""
    from mla_convert.convert.options.resolve import resolve_options

    given = [k for k in ConvertOptions.model_fields if given_on_command_line(k)]
    return resolve_options(options, src, target, given, export)


@options_from(ConvertOptions)
def inspect(
    source: str = typer.Argument(..., help=SOURCE_HELP),
    max_shard_size: str = typer.Option(
        SHARD_SIZE_DEFAULT, help="Largest output shard of the conversion the estimate is for (as for factor)."
    ),
    target: str = typer.Option(TARGET_DEFAULT, "--target", help=SHAPE_HELP),
    **values: Any,
) -> None:
    """Show the architecture, the KV cache per token now, what conversions would give, and the peak memory, disk
    and time that `factor` with the given options would take (estimates, from the config and tensor headers).

    Examples:

      mla-convert inspect smollm2-135m

      mla-convert inspect ./Llama-3.1-8B --calib-tokens 512 --window 256 --eval-windows 1 --dtype bfloat16
    """
    from mla_convert.convert.options.options import check_options

    options = build_options(ConvertOptions, values)
    with user_errors():
        check_options(options, None)
        check_sizes_given(options, [k for k in ConvertOptions.model_fields if given_on_command_line(k)])
        check_target(target)
        check_device(options.device)
        locate_source(source)
    from mla_convert.convert.estimate.estimate import parse_size

    try:
        parse_size(max_shard_size)
    except ValueError:
        fail(
            f"--max-shard-size {max_shard_size!r} is not a size; write it like 500MB or 5GB (KB, MB, GB, TB)"
        )
    from mla_convert.sources.checkpoint import open_source

    with user_errors():
        src = open_source(source)
        res = shape_options(options, src, target)
        options, why = res.options, res.why
        check_options(options, src)
    from mla_convert.convert.estimate.estimate_time import factor_lines
    from mla_convert.convert.options.suggest import MEASURED_SPLITS, suggestions

    console.print(source_table(source, src.describe()))
    console.print(cache_table(src, suggestions(src, MEASURED_SPLITS)))
    if why:
        console.print(f"\nfactor with these options takes {why}", highlight=False, markup=False)
    if res.reconstruction:
        console.print(f"\nfitted reconstruction: {res.reconstruction}", highlight=False, markup=False)
    from mla_convert.convert.estimate.weights import estimate_ledger

    console.print("\nweights against the source (what the converted model stores, and where it starts to save memory):",
                  highlight=False)
    for line in estimate_ledger(src, options).lines():
        console.print(f"  {line}", highlight=False, markup=False)
    given = [k for k in ConvertOptions.model_fields if given_on_command_line(k)]
    from mla_convert.convert.options.resolve import expected_measurements

    lines = factor_lines(
        options, src, max_shard_size, max(1, len(res.rope_candidates)), expected_measurements(res), res.refit_modes
    )
    estimate_lines(options, max_shard_size, lines, given)
    from mla_convert.engines.precheck import export_lines

    console.print("\nwhere a conversion with these options serves (each engine: exact or why not, and the cache it "
                  "allocates; checked before any work):", highlight=False)
    for line in export_lines(src, options, given):
        console.print(line, highlight=False, markup=False)


@options_from(ConvertOptions)
def factor(
    source: str = typer.Argument(..., help=SOURCE_HELP),
    out: Path = typer.Argument(
        ..., help="Output folder (built in a temporary sibling, renamed when complete)."
    ),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT."),
    resume: bool = typer.Option(
        False,
        help="Continue a stopped conversion of OUT (same source and options) after its last finished layer.",
    ),
    max_shard_size: str = typer.Option(
        SHARD_SIZE_DEFAULT, help="Largest output shard (e.g. 500MB, 5GB); one shard is held in memory while it is written."
    ),
    export: str = typer.Option(None, "--export", help=EXPORT_HELP),
    target: str = typer.Option(
        TARGET_DEFAULT, "--target", help=SHAPE_HELP + " With --export, the " + TARGET_HELP
    ),
    **values: Any,
) -> None:
    """Partial RoPE + low-rank K/V -> MLA checkpoint + report + manifest in OUT, streamed layer by layer.

    Examples:

      mla-convert factor smollm2-135m out/smollm2-mla

      mla-convert factor ./Llama-3.2-1B out/l1b --rope-strategy 2-norm --rope-pairs 16 --kv-lora-rank 256

      mla-convert factor smollm2-135m out/smollm2-vllm --target vllm-cpu --export deepseek-v3
    """
    from mla_convert.artifacts.output import check_output
    from mla_convert.convert.options.options import check_options

    options = build_options(ConvertOptions, values)  # every flag, before anything heavy is imported
    with user_errors():
        check_options(options, None)  # every rule that needs no source, before any I/O
        check_sizes_given(options, [k for k in ConvertOptions.model_fields if given_on_command_line(k)])
        shard_size = shard_size_of(max_shard_size)
        check_output(out, overwrite)  # refuse an occupied OUT before the source is read
        check_export(out, export, overwrite, target)
        check_device(options.device)
        locate_source(source)  # a wrong path, before the checkpoint libraries are imported
    from mla_convert.artifacts.report import layer_table, summary_table
    from mla_convert.convert.pipeline.job import run_factor
    from mla_convert.sources.checkpoint import open_source

    with user_errors():
        src = open_source(source)
        res = shape_options(options, src, target, export)
        options, why = res.options, res.why
        check_options(options, src)  # the source's shapes: before anything is loaded
        if why:
            say(f"{'engine shape' if target in (*ENGINE_ROWS, 'llama.cpp') else 'choices'}: {why}")
        if res.reconstruction:
            say(f"fitted reconstruction: {res.reconstruction}")
        if export:
            from mla_convert.engines.precheck import export_problems

            problems = export_problems(src, options, export_target(target), export)
            if export == "gguf" and not any(f.suffix == ".gguf" for f in src.origin_files):
                from mla_convert.engines.llamacpp.gguf_vocab import tokenizer_problem

                problem = tokenizer_problem(src.path)  # the HF tokenizer the checkpoint will carry
                if problem:
                    fail(f"--export gguf: {problem}")
            if problems:
                fail(f"--export {export} --target {target} would not be exact: " + "; ".join(problems))
        say(
            f"source: {src.origin} ({src.family.name}, {src.num_layers} layers, {src.num_heads}/{src.num_kv_heads} heads)"
        )
        noticed: list[
            str
        ] = []  # warnings run_factor gives once every input check has passed, before the work

        def notice(warning: str) -> None:
            err_console.print(f"warning: {warning}", highlight=False, markup=False)
            noticed.append(warning)

        try:
            with progress_bar() as cb:
                report = run_factor(
                    src,
                    out,
                    options,
                    overwrite=overwrite,
                    progress=cb,
                    resume=resume,
                    max_shard_size=shard_size,
                    resolution=res,
                    notice=notice,
                )
        except KeyboardInterrupt:
            from mla_convert.convert.pipeline.workdir import work_dir

            err_console.print(
                f"interrupted: OUT was not written; the finished layers are kept in {work_dir(out.resolve())}: "
                "run the same command with --resume to continue",
                highlight=False,
                markup=False,
            )
            raise typer.Exit(130) from None
    if not STATE["quiet"]:
        console.print(layer_table(report))
        console.print(summary_table(report))
        sample = report["model"]["sample"]
        if sample["greedy_24_tokens"]:
            console.print(
                f"sample (greedy, latent cache): {sample['greedy_24_tokens']!r}",
                highlight=False,
                markup=False,
            )
    if report["run"].get("rope_split"):
        from mla_convert.convert.pipeline.split_report import outcome

        console.print(f"rope split: {outcome(report['run']['rope_split'])}", highlight=False, markup=False)
    for warning in report.get("warnings", []):
        if warning not in noticed:
            err_console.print(f"warning: {warning}", highlight=False, markup=False)
    bf16 = report["model"].get("bfloat16") or {}
    if "passed" in bf16:
        from mla_convert.precision import gate_line

        (console if bf16["passed"] else err_console).print(
            ("" if bf16["passed"] else "warning: ") + gate_line(bf16), highlight=False, markup=False
        )
    e = report["model"]["eval"]
    console.print(
        f"wrote {out}: perplexity {e['perplexity']:.3f} (source {e['reference_perplexity']:.3f}) on {e['tokens']} tokens, "
        f"cache {report['model']['cache']['converted']['values_per_token_per_layer']:.1f} values/token/layer "
        f"({report['model']['cache']['ratio']:.2%} of source), {report['run']['wall_s']:.0f} s, "
        f"peak {report['run']['peak_rss_mb']:.0f} MB",
        highlight=False,
    )
    if export:
        export_after(out, export, overwrite, target)
