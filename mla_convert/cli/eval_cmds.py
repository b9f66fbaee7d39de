"""``eval``, ``generate`` and ``validate``: measure and run a converted checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from mla_convert.cli.flags import build_options, given_on_command_line, options_from
from mla_convert.cli.render import (
    STATE,
    console,
    err_console,
    fail,
    matrix_table,
    note,
    progress_bar,
    user_errors,
    validation_failed,
    validation_table,
)
from mla_convert.cli.task_cmds import TASKS, run_chat_task, run_humaneval_task
from mla_convert.mla.checkpoint import read_checkpoint_config
from mla_convert.sources.locate import BUILTIN_MODELS, locate_source
from mla_convert.validate.options import ValidateOptions


def load_model(ckpt: Path, require_mla: bool = False) -> Any:
    """The model in CKPT (float32); call inside ``user_errors()``, which turns a CheckpointError (no
    config.json, not MLA, unloadable) into its one ``error:`` line."""
    from mla_convert.mla.checkpoint import load_checkpoint

    return load_checkpoint(ckpt, require_mla)


def eval_cmd(
    ckpt: Path = typer.Argument(
        ...,
        help="A converted checkpoint folder (or any supported source; a .gguf file for --engine llama.cpp).",
    ),
    task: str = typer.Option(
        "perplexity",
        help="perplexity (on held-out --text) | humaneval (pass@1 on the 164 HumanEval problems, greedy; each program "
        "runs in its own sandboxed subprocess) | chat (8 fixed questions: greedy answers against --against's, the "
        "source's by default).",
    ),
    against: str = typer.Option(None, help="Source model to compare with: perplexity delta, KL, top-1."),
    text: str = typer.Option(
        "wikipedia",
        help="wikipedia | news | shakespeare | python (the standard library's sources) | comma-separated .txt / .jsonl / .json / .parquet / .csv files or folders.",
    ),
    window: int = typer.Option(512, help="Tokens per window."),
    windows: int = typer.Option(8, help="Number of evaluation windows."),
    engine: str = typer.Option(
        "auto",
        help="humaneval: auto (llama.cpp for a .gguf file, else transformers) | transformers | llama.cpp.",
    ),
    out: Path = typer.Option(
        None, help="humaneval: results folder (default humaneval-<name>); resumes a partial run."
    ),
    limit: int = typer.Option(None, help="humaneval: only the first N problems."),
    threads: int = typer.Option(1, help="humaneval on llama.cpp: threads (1 on a busy two-core machine)."),
    dtype: str = typer.Option("float32", help="humaneval on transformers: float32 | bfloat16."),
    overwrite: bool = typer.Option(False, help="humaneval: replace an existing --out folder."),
) -> None:
    """Perplexity on held-out text (the evaluation split); with --against, delta, KL and top-1 agreement. With
    --task humaneval, pass@1 on HumanEval through transformers or a real llama.cpp. With --task chat, greedy answers to
    fixed questions against the source's.

    Examples: mla-convert eval out/smollm2-mla --against smollm2-135m --window 2048 --windows 4;
    mla-convert eval qwen2.5-coder-1.5b --task humaneval --engine llama.cpp
    """
    if task not in TASKS:
        fail(f"--task {task!r} is not one of {', '.join(TASKS)}")
    if task == "humaneval":
        ignored = [f"--{n}" for n in ("against", "text", "window", "windows") if given_on_command_line(n)]
        if ignored:
            verb = "belongs" if len(ignored) == 1 else "belong"
            fail(f"{', '.join(ignored)} {verb} to --task perplexity; --task humaneval scores the model alone")
        run_humaneval_task(str(ckpt), engine, out, limit, overwrite, threads, dtype)
        return
    task_only = [
        f"--{n}" for n in ("engine", "out", "limit", "threads", "dtype", "overwrite") if given_on_command_line(n)
    ]
    if task == "chat":
        ignored = [f"--{n}" for n in ("text", "window", "windows") if given_on_command_line(n)] + task_only
        if ignored:
            verb = "does" if len(ignored) == 1 else "do"
            fail(f"{', '.join(ignored)} {verb} not apply to --task chat (fixed questions, transformers, float32)")
        run_chat_task(str(ckpt), against)
        return
    if task_only:
        verb = "belongs" if len(task_only) == 1 else "belong"
        fail(f"{', '.join(task_only)} {verb} to --task humaneval; perplexity runs through transformers")
    if window < 2 or windows < 1:
        fail(f"--window {window} / --windows {windows}: need at least 2 tokens per window and 1 window")
    with user_errors():  # wrong folders and paths, before the model libraries are imported
        # a built-in source name or a .gguf file: read as a source (a folder is any checkpoint)
        bundled = str(ckpt).lower() in BUILTIN_MODELS or (ckpt.is_file() and ckpt.suffix == ".gguf")
        if not bundled:
            read_checkpoint_config(ckpt, require_mla=False)
        if against:
            locate_source(against)
    from transformers import AutoTokenizer

    from mla_convert.metrics import evaluate
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    with user_errors():
        docs = split_documents(load_documents(text))["evaluation"]  # bad text answers before the model loads
        if bundled:
            source = open_source(ckpt)
            model, tok = load_source_model(source), AutoTokenizer.from_pretrained(str(source.path))
        else:
            model, tok = load_model(ckpt), AutoTokenizer.from_pretrained(str(ckpt))
        ref = load_source_model(open_source(against)) if against else None
        ids = token_windows(tok, docs, window, windows, bos=adds_bos(tok))
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

    from mla_convert.convert.pipeline.stream import resolve_device
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
        model = load_model(ckpt, require_mla=kind != "deepseek_v3" or backend != "absorbed")
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
