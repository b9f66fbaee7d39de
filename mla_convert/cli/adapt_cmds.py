"""``adapt``: fine-tune a converted checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from mla_convert.adapt.options import AdaptOptions
from mla_convert.cli.defaults import TARGET_DEFAULT
from mla_convert.cli.export_cmds import EXPORT_HELP, TARGET_HELP, check_export, export_after
from mla_convert.cli.flags import build_options, given_on_command_line, options_from
from mla_convert.cli.render import (
    console,
    fail,
    step_printer,
    user_errors,
)
from mla_convert.mla.checkpoint import read_checkpoint_config
from mla_convert.sources.locate import locate_source


@options_from(AdaptOptions)
def adapt(
    ckpt: Path = typer.Argument(..., help="A converted checkpoint folder (from 'mla-convert factor')."),
    out: Path = typer.Argument(..., help="Output folder for the adapted checkpoint."),
    resume: bool = typer.Option(
        False,
        help="Continue the stopped run for OUT from its newest checkpoint; repeat the stopped run's options "
        "(they are checked against .OUT.adapt/options.json).",
    ),
    stop_after: int = typer.Option(None, help="Stop (resumably) after this many steps of this invocation."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT."),
    export: str = typer.Option(None, "--export", help=EXPORT_HELP),
    target: str = typer.Option(TARGET_DEFAULT, "--target", help="With --export: the " + TARGET_HELP),
    **values: Any,
) -> None:
    """Fine-tune a converted checkpoint (LM loss, distillation from the source, a mix, or attention transfer).

    Runs on one CPU as is, or on several processes/machines with `accelerate launch -m mla_convert adapt ...`.
    Checkpoints go to .OUT.adapt/ next to OUT; OUT appears complete at the end with metrics.jsonl,
    training.png, adapt_report.json and a manifest whose parent is the input's canonical id.

    Example: mla-convert adapt out/smollm2-mla out/smollm2-mla-adapted --tokens 100000 --objective distill
    """
    from mla_convert.adapt.options import AdaptError

    if values.get("data") and given_on_command_line(
        "text"
    ):  # --text wikipedia is the default: ask the parser
        fail("give --text or --data, not both: --data replaces --text (list every source with --data)")
    options = build_options(AdaptOptions, values)  # every flag, before anything heavy is imported
    if stop_after is not None and stop_after < 1:
        fail("--stop-after must be at least 1")
    with user_errors():  # wrong folders and paths, before the training libraries are imported
        read_checkpoint_config(ckpt, require_mla=True)
        check_export(out, export, overwrite, target)
        if export:  # the checkpoint's geometry is what adapt keeps: the export's plan, before any training
            import torch

            from mla_convert.engines.deepseek_v3.mapping import plan_export
            from mla_convert.mla.checkpoint import checkpoint_dtype
            from mla_convert.mla.configuration import MLAConfig

            if export == "gguf":
                from mla_convert.engines.deepseek_v3.mapping import ExportError
                from mla_convert.engines.llamacpp.gguf_file import gguf_plan
                from mla_convert.engines.llamacpp.gguf_vocab import tokenizer_problem

                gguf_plan(MLAConfig.from_pretrained(str(ckpt)), checkpoint_dtype(ckpt))
                problem = tokenizer_problem(ckpt)
                if problem:
                    raise ExportError(problem)
            else:
                from mla_convert.engines.registry import export_target

                plan_export(
                    MLAConfig.from_pretrained(str(ckpt)), getattr(torch, checkpoint_dtype(ckpt)), export_target(target)
                )
        if options.source:
            locate_source(options.source)
    from mla_convert.adapt.train import run_adapt

    show = step_printer()

    with user_errors():
        try:
            report = run_adapt(ckpt, out, options, overwrite, resume, stop_after, progress=show)
        except AdaptError as exc:
            fail(str(exc))
    if report is None:
        if os.environ.get("RANK", "0") == "0":  # one line for a multi-process run
            steps = "1 step" if stop_after == 1 else f"{stop_after} steps"
            console.print(f"stopped after {steps}; continue with --resume", highlight=False, markup=False)
        return
    if "before" not in report:  # a non-main process of a multi-process run: the main one reports
        return
    b, a = report["before"], report["after"]
    console.print(
        f"wrote {out}: perplexity {b['perplexity']:.3f} -> {a['perplexity']:.3f} (source {a['source_perplexity']:.3f}) "
        f"on {a['eval_tokens']} held-out tokens; KL {b['kl']:.4f} -> {a['kl']:.4f}; "
        + (
            f"chat KL {b['chat_kl']:.4f} -> {a['chat_kl']:.4f} on {report['chat_probe']['answer_tokens']} answer tokens; "
            if report.get("chat_probe") and "chat_kl" in b
            else ""
        )
        + f"{report['tokens_trained']} tokens at {report['tokens_per_s']:.0f} tok/s",
        highlight=False,
        markup=False,
    )
    if export:
        export_after(out, export, overwrite, target)
