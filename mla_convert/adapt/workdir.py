"""The resumable work folder of an adaptation job: ``.OUT.adapt/`` next to OUT.

Layout: ``options.json`` (the job's options; ``--resume`` requires the same), ``data.json`` (the data
record: every document's id and sha256 per source and role, the packed rows' sha256; ``--resume`` requires
the same data, :func:`check_data`), ``metrics.jsonl`` (one JSON
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
from mla_convert.artifacts.output import OutputError, check_output
from mla_convert.files import atomic_write_text

if TYPE_CHECKING:
    from accelerate import Accelerator

OPTIONS = "options.json"
DATA = "data.json"
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


def check_data(work: Path, record: dict[str, Any]) -> None:
    """Refuse to resume the run in ``work`` on other data than it started with (call before training).

    Args:
        work: the work folder of the stopped run.
        record: the data record of this invocation (:attr:`~mla_convert.adapt.data.AdaptData.record`),
            compared with the stopped run's ``data.json``: every source's documents (id and sha256) by role,
            then the sha256 of the packed rows, the loss mask and the mixture schedule.

    Raises:
        AdaptError: the data differs; the line names the first changed, added or removed document (and how
            many more differ) or the packed rows that differ, and how to start afresh.
    """
    path = work / DATA
    if not path.is_file():  # a run started before data.json was written: nothing to compare with
        logging.getLogger(__name__).warning(
            "note: %s records no data of the stopped run (started by an older mla-convert); resuming without "
            "checking that the training and validation documents are unchanged",
            work,
        )
        return
    saved = json.loads(path.read_text())
    change = data_change(saved, json.loads(json.dumps(record)))
    if change:
        raise AdaptError(
            f"--resume: {change} since the stopped run in {work}; a resumed run must train and validate on the "
            "same data: restore it, or start afresh (drop --resume and pass --overwrite, or write to a new OUT)"
        )


def _documents(source: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """id -> (sha256, role) of one source's documents in a data record (role ``training`` or ``held-out``)."""
    return {
        d["id"]: (d["sha256"], role)
        for key, role in (("train_documents", "training"), ("held_out_documents", "held-out"))
        for d in source[key]
    }


def data_change(saved: dict[str, Any], new: dict[str, Any]) -> str | None:
    """What differs between two data records (:func:`check_data`), in words; None when they agree."""
    if [s["spec"] for s in saved["sources"]] != [s["spec"] for s in new["sources"]]:
        return "the data sources changed"
    validation = {d["id"] for d in saved["validation_documents"]}
    for old_src, new_src in zip(saved["sources"], new["sources"], strict=True):
        spec = old_src["spec"]
        before, after = _documents(old_src), _documents(new_src)
        changed = [i for i in before if i in after and before[i][0] != after[i][0]]
        gone = [i for i in before if i not in after]
        added = [i for i in after if i not in before]
        more = len(changed) + len(gone) + len(added) - 1
        tail = f" ({more} more documents differ)" if more > 0 else ""
        if changed or gone:
            i = (changed or gone)[0]
            role = "validation" if i in validation else before[i][1]
            if changed:
                return (
                    f"{role} document {i!r} of {spec!r} changed (sha256 {before[i][0][:12]}... -> "
                    f"{after[i][0][:12]}...){tail}"
                )
            return f"{role} document {i!r} of {spec!r} is gone{tail}"
        if added:
            return f"{spec!r} has a new document {added[0]!r}{tail}"
    for key, what in (
        ("train_sha256", "the packed training rows"),
        ("validation_sha256", "the validation windows"),
        ("loss_mask_sha256", "the loss mask"),
        ("schedule_sha256", "the mixture schedule"),
    ):
        if saved.get(key) != new.get(key):
            return f"{what} changed (the same documents: did the checkpoint's tokenizer or chat template change?)"
    if saved != new:
        keys = sorted(k for k in set(saved) | set(new) if saved.get(k) != new.get(k))
        return f"the data record changed ({', '.join(keys)})"
    return None


def open_work(
    accelerator: Accelerator,
    work: Path,
    options: AdaptOptions,
    resume: bool,
    data_record: dict[str, Any] | None = None,
) -> tuple[int, list[dict[str, Any]]]:
    """Continue or start the work folder, on every process (call after ``accelerator.prepare``).

    ``resume``: load the newest checkpoint's state (model, optimizer, scheduler, RNG) into the prepared
    objects and read the metrics logged up to its step (check the data first: :func:`check_data`).
    Otherwise the main process replaces ``work`` with an empty folder holding ``options.json`` and
    ``data.json`` (``data_record``, when given).

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
        if data_record is not None:
            atomic_write_text(work / DATA, json.dumps(data_record))
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
