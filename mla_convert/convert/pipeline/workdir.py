"""The resumable work folder of a ``factor`` job: ``.OUT.factor/`` next to OUT.

Layout: ``job.json`` (the options, the source's fingerprint and the output settings; ``--resume`` requires the
same), ``progress.json`` (the last finished step: ``{"pass": 1 or 2, "layer": i}``), ``state.pt`` (the hidden
states of every text stream after that layer and the per-layer records), ``layer-NNN.p1.pt`` (pass 1 of a
layer: its RoPE plan, the weighted K/V matrix and its held-out/refit activations), ``layer-NNN.safetensors``
(pass 2: the layer's MLA attention tensors in the output dtype) and ``out/`` (the checkpoint being written).
Every file is written under a temporary name and renamed, and ``progress.json`` last, so after a crash the
folder always describes a finished step. The folder is removed once OUT is in place.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from mla_convert.artifacts.output import OutputError, check_output
from mla_convert.errors import UserError
from mla_convert.files import atomic_write_text

JOB = "job.json"
PROGRESS = "progress.json"
STATE = "state.pt"
#: The layout of the work folder's pickles (they name the classes that wrote them, by module path). Raised whenever
#: those classes move or change shape; a stopped job of another layout cannot be resumed, and says so.
#: 2: ``convert/`` split into ``options/ stats/ layer/ pipeline/`` and ``engines/`` (issue 49).
WORK_FORMAT = 2


class ResumeError(UserError):
    """A ``--resume`` that cannot continue, or a fresh start that would drop a stopped job."""


def work_dir(out: Path) -> Path:
    """The work folder of OUT: ``.OUT.factor`` next to it."""
    return out.parent / f".{out.name}.factor"


def lock_path(out: Path) -> Path:
    """The job lock of OUT: ``.OUT.factor.lock`` next to it (beside the work folder, which a fresh start replaces)."""
    out = out.expanduser().resolve()
    return out.parent / f".{out.name}.factor.lock"


@contextmanager
def job_lock(out: Path) -> Iterator[None]:
    """Hold OUT's job lock (:func:`lock_path`: an exclusive ``flock``, with the holder's pid in the file) while a
    ``factor`` job runs, so that a second ``factor`` on the same OUT, with or without ``--resume``, is refused
    instead of writing the same work folder. The lock goes with the process (a killed job leaves no stale lock:
    the kernel releases it); the file is removed when the job ends.

    Raises:
        ResumeError: another process holds the lock (the message names its pid).
    """
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ResumeError(
            f"another mla-convert factor (pid {holder}) is converting into {out.expanduser().resolve()} now; wait for "
            "it to finish, or stop it (Ctrl-C keeps its work for --resume) and run again"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


P = ParamSpec("P")
R = TypeVar("R")


def holding_job_lock(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` (a job whose second argument, or ``out=``, is OUT) inside :func:`job_lock` of that OUT."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        out = kwargs["out"] if "out" in kwargs else args[1]
        with job_lock(Path(str(out))):
            return fn(*args, **kwargs)

    return run


def check_start(out: Path, job: dict[str, Any], resume: bool, overwrite: bool, source_dir: Path) -> Path:
    """Refuse a start that would lose or mix work, before anything is loaded; returns OUT resolved.

    Raises:
        ResumeError: ``resume`` without a stopped job or with other options/source/output settings; a fresh
            start while a stopped job waits (without ``overwrite``).
        OutputError: OUT is not empty (without ``overwrite``), is a file or lies inside the source folder.
    """
    out = check_output(out, overwrite, source_dir)
    work = work_dir(out)
    if resume:
        if not (work / JOB).is_file():
            raise ResumeError(f"nothing to resume: {work} holds no stopped conversion for {out}; drop --resume")
        saved = json.loads((work / JOB).read_text())
        if saved.get("work_format") != job.get("work_format"):
            raise ResumeError(
                f"the stopped conversion in {work} was written by an mla-convert whose work folder has another layout "
                f"(format {saved.get('work_format', 1)}, this one reads {job.get('work_format')}); it cannot be "
                "resumed: start over with --overwrite"
            )
        if saved != job:
            diff = []
            for k in sorted(set(saved) | set(job)):
                if k == "options":
                    old, new = saved.get(k, {}), job.get(k, {})
                    diff += [
                        f"--{o.replace('_', '-')} {old.get(o)} -> {new.get(o)}"
                        for o in sorted(set(old) | set(new))
                        if old.get(o) != new.get(o)
                    ]
                elif saved.get(k) != job.get(k):
                    name = {"max_shard_size": "--max-shard-size", "source_files": "source files"}.get(k, k)
                    diff.append(f"{name} {saved.get(k)} -> {job.get(k)}" if k != "source_files" else name)
            raise ResumeError(
                f"--resume with a different job than the stopped one ({'; '.join(diff)}); use the same source "
                "and options, or start over with --overwrite"
            )
    elif (work / PROGRESS).is_file() and not overwrite:
        raise ResumeError(
            f"a stopped conversion for {out} is in {work}; pass --resume to continue it or --overwrite to start over"
        )
    return out


def open_work(out: Path, job: dict[str, Any], resume: bool) -> tuple[Path, dict[str, Any] | None]:
    """Continue (``resume``) or start the work folder; returns it and the last finished step (None: none)."""
    work = work_dir(out)
    if resume:
        progress = json.loads((work / PROGRESS).read_text()) if (work / PROGRESS).is_file() else None
        shutil.rmtree(work / "out", ignore_errors=True)  # a checkpoint is rewritten from the layer files
        return work, progress
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    atomic_write_text(work / JOB, json.dumps(job, indent=2, sort_keys=True))
    return work, None


def mark_done(work: Path, step: dict[str, Any]) -> None:
    """Record ``step`` (``{"pass": p, "layer": i}``) as finished (atomically, after its files)."""
    atomic_write_text(work / PROGRESS, json.dumps(step))


def save_torch(path: Path, obj: Any) -> None:
    """``torch.save`` through a temporary name and ``os.replace``."""
    import torch

    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_torch(path: Path) -> Any:
    """Load a file written by :func:`save_torch` (our own pickles: plans, statistics, tensors).

    Raises:
        ResumeError: the pickle names a class this version does not have (a work folder of another layout).
    """
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (ModuleNotFoundError, AttributeError) as exc:
        raise ResumeError(
            f"{path} was written by an mla-convert of another work-folder layout ({exc}); start over with --overwrite"
        ) from None


def park(work: Path, tensors: dict[str, Any], keep: Collection[str]) -> None:
    """Move every entry of ``tensors`` not named in ``keep`` to ``work`` (``parked-NAME.pt``), popping it from the
    dict, until :func:`unpark` (a conversion's hidden-state streams that a phase does not read leave memory)."""
    for name in [k for k in tensors if k not in keep]:
        save_torch(work / f"parked-{name}.pt", tensors.pop(name))


def parked(work: Path, name: str) -> Any:
    """The entry ``name`` that :func:`park` left in ``work``, read anew (the caller's own copy)."""
    return load_torch(work / f"parked-{name}.pt")


def unpark(work: Path, tensors: dict[str, Any]) -> None:
    """Read every entry :func:`park` left in ``work`` back into ``tensors`` and remove its file."""
    for path in sorted(work.glob("parked-*.pt")):
        tensors[path.name[len("parked-") : -len(".pt")]] = load_torch(path)
        path.unlink()


def publish(staged: Path, out: Path) -> None:
    """Move the complete checkpoint ``staged`` into OUT (replacing an old OUT) and give it usual permissions.

    Raises:
        OutputError: OUT cannot be replaced.
    """
    from mla_convert.files import usual_permissions

    usual_permissions(staged)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if out.exists():
            old = out.parent / f".{out.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(staged, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staged, out)
    except OSError as exc:
        raise OutputError(f"cannot move the finished checkpoint into {out}: {exc}") from exc


def close_work(work: Path) -> None:
    """Remove the work folder (after OUT is complete)."""
    shutil.rmtree(work, ignore_errors=True)
