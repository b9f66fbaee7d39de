"""The resumable work folder of an adaptation job: ``.OUT.adapt/`` next to OUT.

Layout: ``options.json`` (the job's options; ``--resume`` requires the same), ``metrics.jsonl`` (one JSON
object per training step or evaluation, rewritten atomically after each) and checkpoints
``step-NNNNNN/`` (model, optimizer, scheduler and RNG via ``Accelerator.save_state``, plus
``state.json`` with the step and tokens). A checkpoint is written under a temporary name and renamed when
complete, so the newest ``step-*`` holding a ``state.json`` is always whole; the two newest are kept.
The folder is removed once OUT is written.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mla_convert.adapt.options import AdaptError, AdaptOptions
from mla_convert.artifacts.output import OutputError, atomic_write_text, check_output

if TYPE_CHECKING:
    from accelerate import Accelerator

OPTIONS = "options.json"
METRICS = "metrics.jsonl"
STATE = "state.json"
KEEP = 2  # checkpoints kept


def work_dir(out: Path) -> Path:
    """The resumable work folder of OUT: ``.OUT.adapt`` next to it."""
    return out.parent / f".{out.name}.adapt"


def latest_checkpoint(work: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete ``step-NNNNNN`` checkpoint in ``work`` and its ``state.json`` (None: none)."""
    found = sorted(p for p in work.glob("step-*") if (p / STATE).is_file())
    if not found:
        return None
    return found[-1], json.loads((found[-1] / STATE).read_text())


def jsonl(rows: list[dict[str, Any]]) -> str:
    """``rows`` as JSON Lines (one compact object per line, each ending in a newline)."""
    return "".join(json.dumps(m) + "\n" for m in rows)


def check_start(ckpt: Path, out: Path, options: AdaptOptions, resume: bool, overwrite: bool) -> None:
    """Refuse a start that would lose or mix work, before anything is loaded.

    Raises:
        AdaptError: ``resume`` with no stopped run or with options other than the stopped run's; a fresh
            start while a stopped run waits (without ``overwrite``).
        OutputError: OUT is not empty (without ``overwrite``), is a file or lies inside ``ckpt``.
    """
    work = work_dir(out)
    if resume:
        if not (work / OPTIONS).is_file():
            raise AdaptError(f"nothing to resume: {work} holds no adaptation run for {out}; drop --resume")
        # options added since the stopped run started take their defaults (unknown keys still refused)
        saved = json.loads(AdaptOptions.model_validate_json((work / OPTIONS).read_text()).model_dump_json())
        if saved != json.loads(options.model_dump_json()):
            diff = sorted(k for k in saved if saved[k] != options.model_dump().get(k))
            raise AdaptError(
                f"--resume with different options than the stopped run ({', '.join(diff)}); use the same"
            )
        if out.exists() and any(out.iterdir()) and not overwrite:
            raise OutputError(f"{out} exists and is not empty; pass --overwrite to replace it")
    else:
        check_output(out, overwrite, ckpt)
        if latest_checkpoint(work) is not None and not overwrite:
            raise AdaptError(
                f"a stopped adaptation run for {out} is in {work}; pass --resume to continue it "
                "or --overwrite to start over"
            )


def open_work(
    accelerator: Accelerator, work: Path, options: AdaptOptions, resume: bool
) -> tuple[int, list[dict[str, Any]]]:
    """Continue or start the work folder, on every process (call after ``accelerator.prepare``).

    ``resume``: load the newest checkpoint's state (model, optimizer, scheduler, RNG) into the prepared
    objects and read the metrics logged up to its step. Otherwise the main process replaces ``work``
    with an empty folder holding ``options.json``.

    Returns:
        the first optimizer step to run (0 for a fresh start) and the metrics so far.
    """
    start_step = 0
    metrics: list[dict[str, Any]] = []
    if resume:
        found = latest_checkpoint(work)
        if found is not None:
            accelerator.load_state(str(found[0]))
            start_step = int(found[1]["step"])
        if (work / METRICS).exists():
            rows = [json.loads(line) for line in (work / METRICS).read_text().splitlines() if line.strip()]
            metrics = [m for m in rows if m["step"] <= start_step]
    elif accelerator.is_main_process:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        atomic_write_text(work / OPTIONS, options.model_dump_json(indent=2))
    accelerator.wait_for_everyone()
    return start_step, metrics


def write_metrics(work: Path, metrics: list[dict[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` atomically with all rows so far (main process only)."""
    atomic_write_text(work / METRICS, jsonl(metrics))


def save_step(accelerator: Accelerator, work: Path, step: int, tokens: int) -> None:
    """Checkpoint after optimizer step ``step`` (``tokens`` trained so far) as ``step-NNNNNN``, on every
    process; the main process then drops all but the two newest checkpoints."""
    tmp = work / f".tmp-step-{step:06d}"
    # accelerate warns that it dropped the tied lm_head copy of the embeddings; loading re-ties it (resume is
    # tested bitwise), so the warning only alarms
    quiet = logging.getLogger("accelerate.utils.other")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        accelerator.save_state(str(tmp))
    finally:
        quiet.setLevel(level)
    accelerator.wait_for_everyone()  # every process has written its part (RNG states, FSDP shards)
    if accelerator.is_main_process:
        (tmp / STATE).write_text(json.dumps({"step": step, "tokens": tokens}))
        tmp.replace(work / f"step-{step:06d}")
        for old in sorted(work.glob("step-*"))[:-KEEP]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def close_work(work: Path) -> None:
    """Remove the work folder (after OUT is complete)."""
    shutil.rmtree(work, ignore_errors=True)
