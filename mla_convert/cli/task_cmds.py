"""``eval --task humaneval`` and ``--task chat``: a model judged on a task (HumanEval through transformers or a real
llama.cpp; fixed chat questions against its source)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from mla_convert.cli.flags import given_on_command_line
from mla_convert.cli.render import console, err_console, fail, note, user_errors

TASKS = ("perplexity", "humaneval", "chat")
ENGINES = ("auto", "transformers", "llama.cpp")


def run_humaneval_task(
    ckpt: str, engine: str, out: Path | None, limit: int | None, overwrite: bool, threads: int, dtype: str
) -> None:
    """pass@1 on HumanEval for ``ckpt`` (a converted folder, a source, or a ``.gguf`` for llama.cpp); the summary is
    printed and written with a row per problem to ``out`` (default ``humaneval-<name>``, ``humaneval-<name>-llamacpp``
    for llama.cpp: a checkpoint and its GGUF, or a source in both engines, do not share a folder)."""
    if engine not in ENGINES:
        fail(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    if limit is not None and limit < 1:
        fail(f"--limit {limit}: run at least 1 problem, or leave it out for all 164")
    if threads < 1:
        fail(f"--threads {threads}: need at least 1")
    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype!r} is not one of float32, bfloat16")
    if engine == "auto":
        engine = "llama.cpp" if ckpt.endswith(".gguf") else "transformers"
    name = Path(ckpt).name.removesuffix(".gguf") or "model"
    dest = Path(os.path.abspath((out or Path(f"humaneval-{name}{'-llamacpp' if engine == 'llama.cpp' else ''}"))
                                .expanduser()))
    if engine == "transformers" and ckpt.endswith(".gguf") and Path(ckpt).is_file():
        from mla_convert.sources.checkpoint import open_source

        with user_errors():  # a GGUF transformers cannot read (our own export): said before any folder check
            open_source(ckpt)
    if dest.exists() and not dest.is_dir():
        fail(f"--out {dest} is a file; the results are a folder: choose another --out")
    if dest.exists() and not overwrite:
        fail(f"{dest} already exists; pass --overwrite to replace it or choose another --out")
    with user_errors():  # a parent that is a file, or a folder that takes no new entries
        from mla_convert.artifacts.output import check_writable

        check_writable(dest)
    from mla_convert.sources.humaneval import humaneval_problems
    from mla_convert.tasks.complete import llamacpp_completer, torch_completer
    from mla_convert.tasks.humaneval import run_humaneval

    if engine == "llama.cpp" and given_on_command_line("dtype"):
        note(f"note: --dtype {dtype} is for --engine transformers; llama.cpp runs the GGUF's own types")
    if engine == "transformers" and given_on_command_line("threads"):
        note("note: --threads is for --engine llama.cpp; transformers uses torch's threads (OMP_NUM_THREADS)")
    with user_errors():
        problems = humaneval_problems()[:limit]
        completer = (
            llamacpp_completer(ckpt, threads) if engine == "llama.cpp" else torch_completer(ckpt, dtype)
        )
        try:
            summary = run_humaneval(completer, problems, dest, overwrite=overwrite, say=note)
        except KeyboardInterrupt:
            partial = dest.with_name(dest.name + ".partial")
            err_console.print(
                f"interrupted: the problems finished so far are in {partial}; run the same command again to resume",
                highlight=False,
                markup=False,
            )
            raise typer.Exit(130) from None
    console.print(
        f"humaneval pass@1 {summary['pass@1']:.4f} ({summary['passed']} of {summary['problems']} problems, "
        f"{summary['ran']['engine']}, greedy, raw prompt); summary {dest / 'humaneval.json'}, a row per problem in "
        f"{dest / 'humaneval.jsonl'}",
        highlight=False,
        markup=False,
    )
    if not sys.stdout.isatty():
        console.print(json.dumps(summary), highlight=False)


def run_chat_task(ckpt: str, against: str | None) -> None:
    """``eval CKPT --task chat``: :func:`mla_convert.tasks.chat.run_chat` against ``against`` (default: the source
    CKPT's manifest names, when it is a built-in one); prints each question's two answers and the scores."""
    from mla_convert.sources.locate import BUILTIN_MODELS

    with user_errors():
        path = Path(ckpt)
        manifest = path / "mla_manifest.json"
        origin = json.loads(manifest.read_text()).get("source", {}).get("origin") if manifest.is_file() else None
        against = against or (origin if origin in BUILTIN_MODELS else None)
        if against is None:
            fail(f"{ckpt}: name the source to compare with: --against SOURCE (its manifest names no built-in source)")
            return
        from transformers import AutoTokenizer

        from mla_convert.mla.checkpoint import load_checkpoint
        from mla_convert.sources.checkpoint import load_source_model, open_source
        from mla_convert.tasks.chat import run_chat

        src = open_source(against)
        if ckpt.lower() in BUILTIN_MODELS or path.suffix == ".gguf":
            model = load_source_model(open_source(ckpt))
        else:
            model = load_checkpoint(path, require_mla=False)
        tok = AutoTokenizer.from_pretrained(str(src.path))
        result = run_chat(model, load_source_model(src), tok, path.name or ckpt)
    for q, a, b in zip(result["questions"], result["source_answers"], result["answers"], strict=True):
        mark = "same" if a == b else "differs"
        console.print(f"Q: {q}\n  source: {a!r}\n  model ({mark}): {b!r}", highlight=False, markup=False)
    console.print(
        f"chat: {result['same_answers']} of {len(result['questions'])} greedy answers the same as {against}'s "
        f"(first {result['answer_tokens']} tokens), {100 * result['prefix_match']:.1f} % of the source's answer "
        f"tokens matched before the first difference; teacher-forced on the source's answers KL "
        f"{result['chat_kl']:.4f} nats/token, top-1 {result['chat_top1']:.4f}",
        highlight=False,
        markup=False,
    )
    if not sys.stdout.isatty():
        console.print(json.dumps({**result, "against": against}), highlight=False)
