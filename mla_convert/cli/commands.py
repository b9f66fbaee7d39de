"""``mla-convert`` command line (typer + rich).

Every user error is one line on stderr (``error: ...``) and exit code 2; nothing is written.
Progress bars appear only on a terminal and without ``--quiet``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from mla_convert.adapt.options import AdaptOptions
from mla_convert.cli.flags import build_options, options_from
from mla_convert.cli.render import (
    STATE,
    cache_table,
    console,
    err_console,
    estimate_lines,
    fail,
    matrix_table,
    note,
    plain,
    progress_bar,
    say,
    setup,
    source_table,
    step_printer,
    usage_error,
    user_errors,
    validation_failed,
    validation_table,
)
from mla_convert.convert.options import ConvertOptions, shard_size_of
from mla_convert.mla.checkpoint import read_checkpoint_config
from mla_convert.sources.locate import locate_source
from mla_convert.validate.options import ValidateOptions

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Convert MHA/GQA transformer checkpoints into Multi-Head Latent Attention (MLA) checkpoints.",
)
manifest_app = typer.Typer(no_args_is_help=True, help="Check conversion manifests.")
app.add_typer(manifest_app, name="manifest")
EXPORT_HELP = "Also write OUT in a serving format (deepseek-v3) into the sibling folder OUT-FORMAT."
SOURCE_HELP = (
    "A HF folder (safetensors), a .gguf file, or 'smollm2-135m' (the bundled SmolLM2-135M-Instruct)."
)


@app.callback()
def _main(quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only results and errors.")) -> None:
    setup(quiet)


@app.command()
@options_from(ConvertOptions)
def inspect(
    source: str = typer.Argument(..., help=SOURCE_HELP),
    max_shard_size: str = typer.Option(
        "2GB", help="Largest output shard of the conversion the estimate is for (as for factor)."
    ),
    **values: Any,
) -> None:
    """Show the architecture, the KV cache per token now, what conversions would give, and the peak memory, disk
    and time that `factor` with the given options would take (estimates, from the config and tensor headers).

    Examples:

      mla-convert inspect smollm2-135m

      mla-convert inspect ./Llama-3.1-8B --calib-windows 2 --window 256 --eval-windows 1 --dtype bfloat16
    """
    from mla_convert.convert.options import check_options

    options = build_options(ConvertOptions, values)
    with user_errors():
        check_options(options, None)
        locate_source(source)
    from mla_convert.convert.estimate import parse_size

    try:
        parse_size(max_shard_size)
    except ValueError:
        fail(
            f"--max-shard-size {max_shard_size!r} is not a size; write it like 500MB or 5GB (KB, MB, GB, TB)"
        )
    from mla_convert.sources.checkpoint import open_source

    with user_errors():
        src = open_source(source)
        check_options(options, src)
    from mla_convert.convert.estimate import factor_lines
    from mla_convert.convert.suggest import MEASURED_SPLITS, suggestions

    console.print(source_table(source, src.describe()))
    console.print(cache_table(src, suggestions(src, MEASURED_SPLITS)))
    estimate_lines(options, max_shard_size, factor_lines(options, src, max_shard_size))


@app.command()
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
        "2GB", help="Largest output shard (e.g. 500MB, 5GB); one shard is held in memory while it is written."
    ),
    export: str = typer.Option(None, "--export", help=EXPORT_HELP),
    **values: Any,
) -> None:
    """Partial RoPE + low-rank K/V -> MLA checkpoint + report + manifest in OUT, streamed layer by layer.

    Examples:

      mla-convert factor smollm2-135m out/smollm2-mla

      mla-convert factor ./Llama-3.2-1B out/l1b --rope-mode per-head --rope-strategy 2-norm --rope-pairs 4 --kv-lora-rank 256
    """
    from mla_convert.artifacts.output import check_output
    from mla_convert.convert.options import check_options

    options = build_options(ConvertOptions, values)  # every flag, before anything heavy is imported
    with user_errors():
        check_options(options, None)  # every rule that needs no source, before any I/O
        shard_size = shard_size_of(max_shard_size)
        check_output(out, overwrite)  # refuse an occupied OUT before the source is read
        _check_export(out, export, overwrite)
        locate_source(source)  # a wrong path, before the checkpoint libraries are imported
    from mla_convert.artifacts.report import layer_table, summary_table
    from mla_convert.convert.job import run_factor
    from mla_convert.sources.checkpoint import open_source

    with user_errors():
        src = open_source(source)
        check_options(options, src)  # the source's shapes: before anything is loaded
        if export:
            from mla_convert.convert.options import geometry

            geo = geometry(options, src)
            if geo.rope_heads != 1 or geo.rope_width == 0:
                fail(
                    f"--export {export} needs one shared rope head with at least one pair; these options give "
                    f"{geo.rope_heads} rope heads and {geo.rope_width // max(geo.rope_heads, 1) // 2} pairs each: "
                    "use --rope-mode shared and --rope-pairs >= 1"
                )
        say(
            f"source: {src.origin} ({src.family.name}, {src.num_layers} layers, {src.num_heads}/{src.num_kv_heads} heads)"
        )
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
                )
        except KeyboardInterrupt:
            from mla_convert.convert.workdir import work_dir

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
    e = report["model"]["eval"]
    console.print(
        f"wrote {out}: perplexity {e['perplexity']:.3f} (source {e['reference_perplexity']:.3f}) on {e['tokens']} tokens, "
        f"cache {report['model']['cache']['converted']['values_per_token_per_layer']:.1f} values/token/layer "
        f"({report['model']['cache']['ratio']:.2%} of source), {report['run']['wall_s']:.0f} s, "
        f"peak {report['run']['peak_rss_mb']:.0f} MB",
        highlight=False,
    )
    if export:
        _export_after(out, export, overwrite)


def _check_export(out: Path, fmt: str | None, overwrite: bool) -> None:
    """``--export``: a known format and a free OUT-FORMAT folder, before any work."""
    from mla_convert.artifacts.output import check_output

    if fmt is None:
        return
    if fmt != "deepseek-v3":
        fail(f"--export {fmt!r} is not one of deepseek-v3")
    check_output(out.with_name(f"{out.name}-{fmt}"), overwrite)


def _export_after(out: Path, fmt: str, overwrite: bool) -> None:
    """Export the finished OUT (``--export``) and print one line."""
    from mla_convert.export.write import export_checkpoint, export_folder

    dest = export_folder(out, fmt)
    with user_errors():
        manifest = export_checkpoint(out, dest, fmt, overwrite, note=note)
    console.print(_export_line(dest, manifest), highlight=False, markup=False)


def _export_line(dest: Path, manifest: dict[str, Any]) -> str:
    e = manifest["export"]
    msg = (
        f"wrote {dest}: DeepseekV3ForCausalLM, kv_lora_rank {e['kv_lora_rank']}, rope {e['rope']['kind']} "
        f"({e['rope']['slots']} pairs), cache {e['cache_values_per_token_per_layer']['deepseek_v3']:.0f} values/token/layer "
        f"(MLA checkpoint {e['cache_values_per_token_per_layer']['mla']:.1f})"
    )
    p = e["parity"]
    if p:
        return msg + (
            f"; parity max |dlogit| {p['max_abs_logit_diff']:.2e} on {p['tokens']} tokens, "
            f"{p['greedy_tokens_equal']}/{p['greedy_tokens']} greedy tokens equal"
        )
    return msg + "; parity not measured (--no-check, or the model is over 2 GiB in float32)"


@app.command()
def export(
    ckpt: Path = typer.Argument(
        ..., help="A converted checkpoint folder (from 'mla-convert factor' or 'adapt')."
    ),
    out: Path = typer.Argument(
        ..., help="Output folder (built in a temporary sibling, renamed when complete)."
    ),
    format: str = typer.Option("deepseek-v3", "--format", help="Target format: deepseek-v3."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT."),
    max_shard_size: str = typer.Option("2GB", help="Largest output shard (e.g. 500MB, 5GB)."),
    check: bool = typer.Option(
        True,
        help="Measure parity against CKPT (float32 logits and greedy tokens on real text; models up to 2 GiB).",
    ),
    dtype: str = typer.Option(
        "auto", help="Written dtype: auto (the checkpoint's) | float32 | bfloat16 | float16."
    ),
) -> None:
    """Write CKPT in a format serving code loads: DeepSeek-V3 (stock transformers DeepseekV3ForCausalLM).

    The mapping is exact (docs/export.md); the parity measured is printed and recorded in OUT's manifest.

    Example: mla-convert export out/smollm2-mla out/smollm2-ds3 --format deepseek-v3
    """
    from mla_convert.artifacts.output import check_output

    with user_errors():  # wrong folders, before the model libraries are imported
        if format != "deepseek-v3":
            fail(f"--format {format!r} is not one of deepseek-v3")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            fail(f"--dtype {dtype!r} is not one of auto, float32, bfloat16, float16")
        shard_size_of(max_shard_size)
        if read_checkpoint_config(ckpt, require_mla=True).get("model_type") != "mla":
            fail(f"{ckpt} is already a DeepSeek-V3 export; export the MLA checkpoint it came from")
        check_output(out, overwrite, source_dir=ckpt)
    from mla_convert.export.write import export_checkpoint

    with user_errors():
        manifest = export_checkpoint(
            ckpt, out, format, overwrite, max_shard_size, check, note=note, dtype=dtype
        )
    msg = _export_line(out, manifest)
    console.print(msg, highlight=False, markup=False)


def _load_mla(ckpt: Path, require_mla: bool = False) -> Any:
    """The model in CKPT (float32); call inside ``user_errors()``, which turns a CheckpointError (no
    config.json, not MLA, unloadable) into its one ``error:`` line."""
    from mla_convert.mla.checkpoint import load_checkpoint

    return load_checkpoint(ckpt, require_mla)


@app.command("eval")
def eval_cmd(
    ckpt: Path = typer.Argument(..., help="A converted checkpoint folder (or any supported source)."),
    against: str = typer.Option(None, help="Source model to compare with: perplexity delta, KL, top-1."),
    text: str = typer.Option(
        "wikipedia",
        help="wikipedia | news | shakespeare | comma-separated .txt / .jsonl / .json / .parquet / .csv files or folders.",
    ),
    window: int = typer.Option(512, help="Tokens per window."),
    windows: int = typer.Option(8, help="Number of evaluation windows."),
) -> None:
    """Perplexity on held-out text (the evaluation split); with --against, delta, KL and top-1 agreement.

    Example: mla-convert eval out/smollm2-mla --against smollm2-135m --window 2048 --windows 4
    """
    with user_errors():  # wrong folders and paths, before the model libraries are imported
        read_checkpoint_config(ckpt, require_mla=False)
        if against:
            locate_source(against)
    from transformers import AutoTokenizer

    from mla_convert.metrics import evaluate
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import split_documents, token_windows

    with user_errors():
        docs = split_documents(load_documents(text))["evaluation"]  # bad text answers before the model loads
        model = _load_mla(ckpt)
        ref = load_source_model(open_source(against)) if against else None
        tok = AutoTokenizer.from_pretrained(str(ckpt))
        ids = token_windows(tok, docs, window, windows, bos=False)
        with progress_bar() as cb:
            res = evaluate(model, ids, ref, progress=lambda n: cb("evaluate", n, len(ids)))
    where = f"{text} evaluation split"
    cut = [d.title for d in docs if "@chars" in d.id]
    if cut:  # fewer documents than split roles: the evaluation part is a span of each, cut by position
        where += f", cut by position: {'; '.join(cut)}"
    msg = f"perplexity {res.perplexity:.3f} on {res.tokens} tokens ({res.windows} x {res.window}, {where})"
    if ref is not None:
        msg += (
            f"; source {res.reference_perplexity:.3f} (x{res.perplexity / (res.reference_perplexity or 1):.3f}), "
            f"KL {res.kl:.4f} nats/token, top-1 agreement {res.top1:.4f}"
        )
    console.print(msg, highlight=False, markup=False)
    if not sys.stdout.isatty():
        record = {**res.as_dict(), "text": text, "cut_by_position": cut}
        console.print(json.dumps(record), highlight=False)


@app.command()
def generate(
    ckpt: Path = typer.Argument(..., help="A converted checkpoint folder (or its DeepSeek-V3 export)."),
    prompt: str = typer.Argument(..., help="Prompt text."),
    max_new_tokens: int = typer.Option(48, help="Tokens to generate (greedy)."),
    backend: str = typer.Option(
        "absorbed",
        help="absorbed (torch, transformers generate) | triton (paged latent cache, the bundled kernel; "
        "runs in the Triton interpreter without a GPU) | paged (paged latent cache, torch).",
    ),
    device: str = typer.Option(
        "auto", help="auto (a CUDA GPU when present) | cpu | cuda[:N]: where the model and its cache live."
    ),
    dtype: str = typer.Option(
        "auto",
        help="auto (bfloat16 on a GPU, float32 on the CPU) | float32 | float16 | bfloat16: the model's and "
        "the paged cache's dtype.",
    ),
    cache_dtype: str = typer.Option(
        "model",
        help="model (cache rows in --dtype) | fp8 (E4M3 latent + float32 scales per group + bfloat16 rope; "
        "the paged and triton backends; the kernel reads FP8 rows in the Triton interpreter on a CPU and "
        "natively on a GPU of sm_89 or newer).",
    ),
) -> None:
    """Greedy text through the latent cache (never expanded K/V); the backend that ran is printed.

    Example: mla-convert generate out/smollm2-mla "The capital of France is" --backend triton
    """
    if backend not in ("absorbed", "triton", "paged"):
        fail(f"--backend {backend!r} is not one of absorbed, triton, paged")
    if dtype not in ("auto", "float32", "float16", "bfloat16"):
        fail(f"--dtype {dtype!r} is not one of auto, float32, float16, bfloat16")
    if not (
        device in ("auto", "cpu") or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())
    ):
        fail(f"--device {device!r} is not one of auto, cpu, cuda, cuda:N")
    if max_new_tokens < 1:
        fail("--max-new-tokens must be at least 1")
    if cache_dtype not in ("model", "fp8"):
        fail(f"--cache-dtype {cache_dtype!r} is not one of model, fp8")
    if cache_dtype == "fp8" and backend == "absorbed":
        fail("--cache-dtype fp8 needs a paged latent cache; use --backend triton or --backend paged")
    if not prompt.strip():
        fail('the prompt is empty; give some text to continue, e.g. "The capital of France is"')
    with user_errors():  # a wrong folder, before the model libraries are imported
        config = read_checkpoint_config(ckpt, require_mla=True)
    kind = config.get("model_type")
    import torch
    from transformers import AutoTokenizer

    from mla_convert.convert.stream import resolve_device
    from mla_convert.mla.checkpoint import cast_parameters
    from mla_convert.runtime.decode import generate as paged_generate
    from mla_convert.runtime.decode import greedy

    with user_errors():
        where = resolve_device(device)
        want = dtype if dtype != "auto" else ("bfloat16" if where.type == "cuda" else "float32")
        if backend == "triton" and where.type == "cpu" and want == "bfloat16":
            fail(
                "--backend triton --dtype bfloat16 cannot run on the CPU: the Triton interpreter reads bfloat16 as "
                "16-bit integers; use --dtype float32 or float16, or --device cuda"
            )
        from mla_convert import register

        register()  # model_type "mla" known before the tokenizer reads config.json (no transformers warning)
        tok = AutoTokenizer.from_pretrained(str(ckpt))
        ids = tok(prompt, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            fail(f"the prompt {prompt!r} gives no tokens; give some text to continue")
        positions = config.get("max_position_embeddings")
        if isinstance(positions, int) and ids.shape[1] + max_new_tokens > positions:
            fail(
                f"{ids.shape[1]} prompt tokens + --max-new-tokens {max_new_tokens} pass the model's "
                f"{positions} positions (max_position_embeddings in {ckpt / 'config.json'}); generate at most "
                f"{max(positions - ids.shape[1], 0)} tokens"
            )
        # an export runs stock for --backend absorbed; read back as MLA for the paged/triton backends
        model = _load_mla(ckpt, require_mla=kind != "deepseek_v3" or backend != "absorbed")
        model = cast_parameters(model, getattr(torch, want), where)  # buffers (RoPE frequencies) stay float32
        ids = ids.to(where)
        if kind == "deepseek_v3" and backend == "absorbed":
            out = greedy(model, ids, max_new_tokens)
            ran = "stock transformers DeepseekV3ForCausalLM (DynamicCache holding the normalised latent and k_rope)"
        elif backend == "absorbed":
            model.set_attention_path("absorbed")
            model.set_folding(True)  # W_UK / W_UV folded into q_proj / o_proj where that saves work
            out = greedy(model, ids, max_new_tokens)
            ran = "absorbed-torch (transformers DynamicCache holding [c_kv | k_rope])"
        else:
            res = paged_generate(
                model,
                ids,
                max_new_tokens,
                backend="triton" if backend == "triton" else "absorbed",
                cache_dtype=cache_dtype,
            )
            log = "attention calls (layers x steps): " + ", ".join(
                f"{k} x{v}" for k, v in sorted(res.backend_log.items())
            )
            rows = "FP8 rows" if cache_dtype == "fp8" else f"{want} rows"
            out, ran = res.tokens, f"paged latent cache ({rows}): {log}"
    console.print(tok.decode(out[0], skip_special_tokens=True), highlight=False, markup=False)
    if not STATE["quiet"]:
        err_console.print(f"backend: {ran} on {where} in {want}", highlight=False, markup=False)


@app.command()
@options_from(ValidateOptions)
def validate(
    ckpt: Path = typer.Argument(..., help="A converted checkpoint folder (written by 'mla-convert factor')."),
    **values: Any,
) -> None:
    """Run the validation ladder; write validation.json and validation.md into CKPT.

    Rungs: 1 naive vs absorbed, 2 kernel vs float64 reference, 3 decode vs full recomputation (logits and
    every cache row), 4 converted vs source (perplexity, KL, top-1, softmax scale), 5 cache ledger, 6 kernel
    matrix (prefill/decode/verify x float32/bfloat16/FP8 rows x history 1..4096, printed as a second table).
    Exits 1 when any rung fails, naming it.

    Example: mla-convert validate out/smollm2-mla
    """
    options = build_options(ValidateOptions, values)
    with user_errors():  # wrong folders and paths, before the model libraries are imported
        read_checkpoint_config(ckpt, require_mla=True)
        if options.source:
            locate_source(options.source)
    from mla_convert.validate.ladder import validate as run_validate
    from mla_convert.validate.report import write_validation

    with user_errors():
        res = run_validate(ckpt, options, progress=note)
        write_validation(ckpt, res)
    console.print(validation_table(ckpt, res))
    matrix = matrix_table(res)
    if matrix is not None:
        console.print(matrix)
    console.print(
        f"wrote {ckpt / 'validation.json'} and {ckpt / 'validation.md'}", highlight=False, markup=False
    )
    if res.passed and res.partial:
        console.print(f"validation passed, but {res.partial}", highlight=False, markup=False)
        return
    if not res.passed:
        validation_failed(res)
    console.print("validation passed: all rungs within tolerance", highlight=False, markup=False)


def _given_on_command_line(name: str) -> bool:
    """Whether the option ``name`` was typed (not its default)."""
    from typer._click.core import ParameterSource
    from typer._click.globals import get_current_context

    ctx = get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE


@app.command()
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
    **values: Any,
) -> None:
    """Fine-tune a converted checkpoint (LM loss, distillation from the source, a mix, or attention transfer).

    Runs on one CPU as is, or on several processes/machines with `accelerate launch -m mla_convert adapt ...`.
    Checkpoints go to .OUT.adapt/ next to OUT; OUT appears complete at the end with metrics.jsonl,
    training.png, adapt_report.json and a manifest whose parent is the input's canonical id.

    Example: mla-convert adapt out/smollm2-mla out/smollm2-mla-adapted --tokens 100000 --objective distill
    """
    from mla_convert.adapt.options import AdaptError

    if values.get("data") and _given_on_command_line(
        "text"
    ):  # --text wikipedia is the default: ask the parser
        fail("give --text or --data, not both: --data replaces --text (list every source with --data)")
    options = build_options(AdaptOptions, values)  # every flag, before anything heavy is imported
    if stop_after is not None and stop_after < 1:
        fail("--stop-after must be at least 1")
    with user_errors():  # wrong folders and paths, before the training libraries are imported
        ckpt_config = read_checkpoint_config(ckpt, require_mla=True)
        _check_export(out, export, overwrite)
        if export and ckpt_config.get("num_rope_heads", 1) != 1:
            fail(
                f"--export {export}: {ckpt} has {ckpt_config['num_rope_heads']} rope heads (a per-head conversion); "
                "DeepSeek-V3 has one: adapt a --rope-mode shared conversion to export it"
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
        _export_after(out, export, overwrite)


@manifest_app.command("verify")
def manifest_verify(
    out: Path = typer.Argument(..., help="An mla-convert output folder."),
    strict: bool = typer.Option(False, help="Also fail when OUT holds files the manifest does not cover."),
) -> None:
    """Check the manifest's schema, re-hash the files it and its addenda (validate's files) list, recompute
    the canonical id, and name the files neither covers.

    Exit code 2 (one error: line) when anything differs (a changed or missing file, a wrong canonical id or
    addenda chain; with --strict also files the manifest does not cover) or OUT holds no valid manifest.

    Example: mla-convert manifest verify out/smollm2-mla --strict
    """
    from mla_convert.artifacts.manifest import verify

    with user_errors():
        res = verify(out)
    console.print(f"ok: {res['files']} files match; canonical id {res['canonical_id']}", highlight=False)
    if res["addenda"]:
        added = ", ".join(f"{a['stage']} ({a['files']} files, {a['time']})" for a in res["addenda"])
        console.print(f"addenda (chained to the manifest): {added}", highlight=False)
    if res["uncovered"]:
        console.print(
            f"not covered by the manifest (not verified): {', '.join(res['uncovered'])}", highlight=False
        )
        if strict:
            fail(f"{len(res['uncovered'])} file(s) in {out} not covered by the manifest (--strict)")


# --------------------------------------------------------------------------------------------- recipes
def _recipe_fail(exc: Any) -> None:
    """Print a RecipeError (one line, or a count and one indented line per problem) and exit 2."""
    lines = exc.lines()
    err_console.print(f"[bold red]error:[/] {escape(lines[0])}", highlight=False, soft_wrap=True)
    for line in lines[1:]:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _recipe_path(recipe: str) -> Path:
    """RECIPE as a file, or the bundled recipe of that name when no such file exists."""
    from mla_convert.recipes.catalog import bundled_path

    p = Path(recipe).expanduser()
    if not p.exists():
        bundled = bundled_path(recipe)
        if bundled is not None:
            return bundled
    return p


@app.command("run")
def run_recipe_cmd(
    recipe: str = typer.Argument(..., help="A recipe YAML file (or the name of a bundled recipe)."),
    overrides: list[str] = typer.Argument(
        None, help="key=value / section.key=value, values read as YAML (factor.rope_pairs=16, adapt=null)."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check the recipe, source architecture, shapes and memory estimate without loading weights; "
        "print the plan; write nothing.",
    ),
    overwrite: bool = typer.Option(
        False,
        help="Replace stage folders (OUTPUT/factor, OUTPUT/adapt) whose outputs do not match the recipe.",
    ),
) -> None:
    """Run a recipe: factor -> adapt -> validate (-> export), skipping stages whose outputs already match.

    Prints the resolved recipe and the plan, saves OUTPUT/recipe.resolved.yaml, runs the stages into
    OUTPUT/factor and OUTPUT/adapt (a stage whose manifest matches the recipe is skipped), and ends with the
    validation ladder (exit 1 naming the failing rung). Every recipe problem is listed at once with its
    YAML path (exit 2, nothing written).

    Examples:

      mla-convert run smollm2-135m-quickstart.yaml --dry-run

      mla-convert run smollm2-135m-quickstart.yaml factor.rope_pairs=20 adapt=null
    """
    from mla_convert.adapt.options import AdaptError
    from mla_convert.recipes.load import load_recipe, resolved_yaml
    from mla_convert.recipes.memory import memory_lines
    from mla_convert.recipes.plan import blocked_problems, make_plan, plan_lines, shape_lines
    from mla_convert.recipes.run import run_recipe
    from mla_convert.recipes.schema import RecipeError

    path = _recipe_path(recipe)
    try:
        res = load_recipe(path, overrides or [])
    except RecipeError as exc:
        _recipe_fail(exc)
    r, src = res.recipe, res.src
    assert src is not None
    plan = make_plan(r)
    show = dry_run or not STATE["quiet"]
    if show:
        plain(f"# recipe {path}" + (f" with {' '.join(overrides)}" if overrides else "") + ", resolved:")
        plain(resolved_yaml(res).rstrip())
        plain(
            f"\nsource {r.source}: {src.family.name}"
            + (f" ({src.config.model_type})" if src.config.model_type != src.family.name else "")
            + f", {src.num_layers} layers, "
            f"{src.num_heads} query / {src.num_kv_heads} KV heads, head_dim {src.head_dim}, hidden {src.hidden_size}"
        )
        plain(f"\nplan (output {r.out}):")
        for line in plan_lines(plan, overwrite):
            plain(line)
    if dry_run:
        plain("\nshapes per layer (from the config; no weights loaded):")
        for line in shape_lines(r, src):
            plain(line)
        plain("\nmemory (estimate, GB; factor streams layer by layer, checkpoints in their dtype):")
        for line in memory_lines(r, src):
            plain(line)
    stop = blocked_problems(plan)
    if stop and not overwrite:
        _recipe_fail(RecipeError(res.file, stop))
    if dry_run:
        plain(
            f"\ndry run: recipe, source and options check out; nothing was loaded or written "
            f"(the run writes {r.out / 'recipe.resolved.yaml'} and the stage folders)"
        )
        return

    with user_errors():
        try:
            result = run_recipe(
                res,
                overwrite=overwrite,
                say=note,
                factor_progress=progress_bar,
                adapt_progress=step_printer(),
                validate_progress=note,
            )
        except RecipeError as exc:
            _recipe_fail(exc)
        except AdaptError as exc:
            fail(str(exc))
    summary = ", ".join(f"{k} {v}" for k, v in result.stages.items())
    for line in result.quality:  # what each stage measured (its report says on what)
        plain(line)
    vres = result.validation
    if vres is not None and not STATE["quiet"]:
        for rung in vres.rungs:
            verdict = f"skipped ({rung.skipped})" if rung.skipped else ("pass" if rung.passed else "FAIL")
            plain(f"  rung {rung.number} {rung.name}: {verdict}")
    where = f"; report {result.target / 'validation.md'}" if vres is not None else ""
    plain(f"recipe {r.name}: {summary}; checkpoint {result.target}{where}")
    if vres is not None and not vres.passed:
        validation_failed(vres)


@app.command("init-recipe")
def init_recipe_cmd(
    name: str = typer.Argument(None, help="A bundled recipe; omit it to list them."),
    dest: Path = typer.Argument(
        None,
        help="Where to write it (default ./NAME.yaml; a folder, or a new path without .yaml/.yml, gets NAME.yaml).",
    ),
    overwrite: bool = typer.Option(False, help="Replace an existing DEST."),
) -> None:
    """Copy a bundled recipe to edit and run.

    Example: mla-convert init-recipe smollm2-135m-quickstart && mla-convert run smollm2-135m-quickstart.yaml --dry-run
    """
    from mla_convert.artifacts.output import atomic_write_text
    from mla_convert.recipes.catalog import (
        accelerate_configs,
        bundled_description,
        bundled_names,
        bundled_path,
    )

    names = bundled_names()
    launch = accelerate_configs()
    if name is None:
        for n in names:
            plain(f"{n:<26} {bundled_description(n)}")
        for n in launch:
            plain(f"{n:<26} accelerate launch configuration for multi-GPU adapt (docs/adapt.md)")
        return
    src = bundled_path(name) or launch.get(name.removesuffix(".yaml"))
    if src is None:
        hint = ""
        if name.endswith((".yaml", ".yml")) or "/" in name:  # a destination given as the first argument
            example = "smollm2-135m-quickstart" if "smollm2-135m-quickstart" in names else names[0]
            hint = f"; NAME comes first, then DEST: mla-convert init-recipe {example} {name}"
        fail(f"no bundled recipe {name!r}; bundled: {', '.join([*names, *launch])}{hint}")
    assert src is not None
    stem = next((n for n, p in launch.items() if p == src), src.stem)
    target = dest if dest is not None else Path(f"{stem}.yaml")
    if target.is_dir() or (not target.exists() and target.suffix.lower() not in (".yaml", ".yml")):
        target = target / f"{stem}.yaml"
    if target.exists() and not overwrite:
        fail(f"{target} exists; pass --overwrite to replace it")
    atomic_write_text(target, src.read_text())
    if stem in launch:
        plain(
            f"wrote {target}; then: accelerate launch --config_file {target} --num_processes N "
            "-m mla_convert adapt CKPT OUT ..."
        )
    else:
        plain(f"wrote {target}; edit it, then: mla-convert run {target} --dry-run")


def main() -> None:
    """Console-script entry point: usage errors as one ``error:`` line (exit 2); help at full width in a log."""
    import os

    if not sys.stdout.isatty():
        os.environ.setdefault("TERMINAL_WIDTH", "120")  # typer's help: no option name cut at 80 columns
    # typer's (vendored click) usage error: the base of BadParameter, NoSuchOption, MissingParameter, ...
    usage: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
    try:
        code = app(standalone_mode=False)
    except usage as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare command: its help
            plain(exc.ctx.get_help() if exc.ctx is not None else str(exc))  # type: ignore[attr-defined]
            sys.exit(2)
        usage_error(exc)
    except typer.Abort:
        err_console.print("interrupted: nothing was written")
        sys.exit(130)
    except typer.Exit as exc:  # raised from a callback before a command runs
        code = exc.exit_code
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
