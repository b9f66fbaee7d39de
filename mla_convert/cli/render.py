"""What the CLI prints: one console per stream, one-line errors, progress, and the rules for a log.

On a terminal: rich progress bars and tables sized to it. Off a terminal (a redirected log, CI): no bars (ours print
one line per stage; transformers' and huggingface_hub's are switched off), and tables are laid out at full width so
no cell is cut. ``--quiet`` prints only results and errors.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from mla_convert.cli.defaults import SHARD_SIZE_DEFAULT
from mla_convert.errors import UserError

#: Width of tables printed off a terminal (wide enough that no cell is wrapped or cut).
LOG_WIDTH = 1000


def _width() -> int | None:
    """None (rich's own choice) on a terminal or when COLUMNS is set; :data:`LOG_WIDTH` in a log."""
    return None if sys.stdout.isatty() or "COLUMNS" in os.environ else LOG_WIDTH


console = Console(soft_wrap=True, width=_width())
err_console = Console(stderr=True, soft_wrap=True)
STATE: dict[str, bool] = {"quiet": False}


def usage_error(exc: Any) -> None:
    """A click usage error (unknown flag, missing argument, unknown command) as one ``error:`` line, exit 2."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "mla-convert"
    message = f"{exc.format_message()} (see '{where} --help')"
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(2)


def setup(quiet: bool) -> None:
    """Apply ``--quiet`` and the off-terminal rules before any library is imported: transformers and
    huggingface_hub read ``HF_HUB_DISABLE_PROGRESS_BARS`` when they start, tqdm reads ``TQDM_DISABLE``."""
    STATE["quiet"] = quiet
    if quiet or not sys.stderr.isatty():
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        os.environ["TQDM_DISABLE"] = "1"  # bars made with tqdm directly (transformers' GGUF de-quantizing)
        if "transformers" in sys.modules:  # already imported (in-process callers, tests)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()


def plain(text: str) -> None:
    """Print ``text`` as is (no markup, no highlighting)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def note(message: str) -> None:
    """A progress note on stderr (silent with ``--quiet``)."""
    if not STATE["quiet"]:
        err_console.print(message, highlight=False, markup=False)


def fail(message: str) -> None:
    """Print ``error: message`` (one line) and exit 2."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


#: Free bytes under which a write failure that does not name its cause (torch.save's "iostream error") is a full disk.
NEARLY_FULL = 64 * 2**20


def disk_full(exc: BaseException) -> str | None:
    """The folder whose disk is full when ``exc`` is a write that ran out of space (``ENOSPC``, or a writer's
    message saying so; torch's zip writer only says "iostream error", so then a nearly full temporary folder or
    working folder decides), else None."""
    import errno
    import shutil
    import tempfile

    folders = [tempfile.gettempdir(), os.getcwd()]
    low = [f for f in folders if shutil.disk_usage(f).free < NEARLY_FULL]
    text = str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "No space left on device" in text:
        return getattr(exc, "filename", None) or (low[0] if low else "the output's disk")
    if isinstance(exc, RuntimeError) and ("iostream error" in text or "unexpected pos" in text) and low:
        return low[0]
    return None


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the package's input errors (:class:`~mla_convert.errors.UserError`) into one ``error:`` line and exit
    code 2; a full disk (:func:`disk_full`) into one line that says so and how to go on; an interrupt says nothing
    was written (130)."""
    try:
        yield
    except UserError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        err_console.print("interrupted: nothing was written")
        raise typer.Exit(130) from None
    except Exception as exc:
        where = disk_full(exc)
        if where is None:
            raise
        fail(
            f"no space left on the disk of {where} ({type(exc).__name__}); free some and run the same command again "
            "(factor: add --resume to continue from its work folder, which keeps every finished layer)"
        )


@contextmanager
def progress_bar() -> Iterator[Callable[[str, int, int], None]]:
    """A ``(stage, advance, total)`` callback drawing one rich bar per stage (silent off-terminal)."""
    if STATE["quiet"]:
        yield lambda stage, n, total: None
        return
    if not console.is_terminal:  # plain lines, so a log shows progress instead of silence
        done: dict[str, int] = {}
        started: dict[str, float] = {}
        shown: dict[str, float] = {}

        def plain(stage: str, n: int, total: int) -> None:
            now = time.perf_counter()
            if stage not in done:
                console.print(f"{stage}: started ({total} steps)", markup=False, highlight=False)
                done[stage], started[stage], shown[stage] = 0, now, now
            done[stage] += n
            if done[stage] == total:
                console.print(f"{stage}: done ({now - started[stage]:.0f} s)", markup=False, highlight=False)
            elif now - shown[stage] >= 60:  # a long stage says where it is once a minute
                shown[stage] = now
                console.print(
                    f"{stage}: {done[stage]}/{total} ({now - started[stage]:.0f} s)", markup=False, highlight=False
                )

        yield plain
        return
    tasks: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description:>10}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as prog:

        def cb(stage: str, n: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = prog.add_task(stage, total=total)
            prog.advance(tasks[stage], n)

        yield cb


def say(*args: Any) -> None:
    """Print a status line (silent with ``--quiet``)."""
    if not STATE["quiet"]:
        console.print(*args, markup=False, highlight=False)


def step_printer() -> Callable[[dict[str, Any]], None]:
    """A progress callback for adaptation steps: one line at most every 10 s, and the last step."""
    last = {"t": 0.0}

    def show(entry: dict[str, Any]) -> None:
        now = time.perf_counter()
        if STATE["quiet"] or (now - last["t"] < 10 and entry["step"] < entry["steps"]):
            return
        last["t"] = now
        plain(
            f"step {entry['step']}/{entry['steps']}  tokens {entry['tokens']}  loss {entry['loss']:.4f}  "
            f"{entry['tokens_per_s']:.0f} tok/s  ETA {entry['eta_s'] / 60:.1f} min"
        )

    return show


def validation_failed(res: Any) -> None:
    """Print the one ``error:`` line naming the failed rungs and the first failing check; exit 1."""
    from mla_convert.validate.result import format_value

    first = res.failed[0]
    bad = next((c for c in first.checks if c.passed is False), None)
    names = ", ".join(f"{r.number} ({r.name})" for r in res.failed)
    detail = f": {bad.name} = {format_value(bad.value)} (tolerance {bad.tolerance})" if bad else ""
    err_console.print(
        f"[bold red]error:[/] {escape(f'validation failed at rung {names}{detail}')}", highlight=False
    )
    raise typer.Exit(1)


def source_table(title: str, described: dict[str, Any]) -> Table:
    """``inspect``'s first table: a source's ``describe()`` fields."""
    t = Table(title=escape(title))
    t.add_column("field")
    t.add_column("value")
    for k, v in described.items():
        t.add_row(escape(k), escape(json.dumps(v) if isinstance(v, dict | list) else str(v)))
    return t


def cache_table(src: Any, suggestions: list[Any]) -> Table:
    """``inspect``'s second table: the source's KV cache per token and layer, and each suggested MLA size
    (:func:`~mla_convert.convert.options.suggest.suggestions`)."""
    w = Table(title="KV cache per token per layer (values)")
    for c in ("layout", "values", "bytes (float32)", "ratio to source", "suggested split"):
        w.add_column(c, justify="right")
    base = src.kv_cache_width
    w.add_row(
        "source K + V", str(base), str(4 * base), "1.000", f"{src.num_kv_heads} KV heads x {src.head_dim} x 2"
    )
    for sug in suggestions:
        if sug.rope_pairs is None:
            split = "not measured (benchmarks/perplexity.py --readme writes mla_convert/convert/options/measured_splits.json)"
        else:
            rope = 2 * sug.rope_pairs
            levers = "".join(f" --{k.replace('_', '-')} {v}" for k, v in sug.levers.items())
            split = (
                f"--cache-budget {sug.values} --rope-pairs {sug.rope_pairs}{levers} (latent {sug.values - rope} + "
                f"rope {rope}; measured best on {sug.measured_on} at this fraction)"
            )
        w.add_row(
            escape(f"MLA [c_kv | k_rope] at {sug.fraction:.2%}"),
            str(sug.values),
            str(4 * sug.values),
            f"{sug.fraction:.4f}",
            escape(split),
        )
    return w


def estimate_lines(options: Any, max_shard_size: str, lines: list[str], given: Collection[str] = ()) -> None:
    """``inspect``'s last lines: what ``factor`` with ``options`` would need
    (:func:`~mla_convert.convert.estimate.estimate_time.factor_lines`: peak memory, disk, time), named by the flags that differ
    from the defaults and those ``given`` (a value given equal to its default still overrides a budget's measured
    choice, so the printed command line converts what was asked)."""
    from mla_convert.convert.options.options import flag

    defaults = type(options)()
    changed = [
        " ".join(f"{flag(k)} {x}" for x in (v if isinstance(v, list) else [v]))  # a list: the flag repeated
        for k, v in options.model_dump().items()
        if v is not None and (v != getattr(defaults, k) or k in given)
        and not (k == "cache_budget" and options.cache_fraction is not None)  # the fraction's budget: not typed
        and not (k in ("calib_data", "reconstruct_steps") and k not in given)  # resolved defaults: not typed
    ]
    if max_shard_size != SHARD_SIZE_DEFAULT:
        changed.append(f"--max-shard-size {max_shard_size}")
    plain(f"\nfactor {' '.join(changed) or 'with the default options'} would need (estimates, before any work):")
    for line in lines:
        plain(f"  {line}")


def matrix_table(res: Any) -> Table | None:
    """``validate``'s second table: rung 6's kernel matrix, one row per cell (which backend ran, the kernel's
    error against the oracle, what the cache format costs), or None when no rung measured a grid."""
    from mla_convert.validate.matrix import MATRIX_HEADER, matrix_rows

    rung = next((r for r in res.rungs if r.cells), None)
    if rung is None:
        return None
    table = Table(
        title=f"rung {rung.number} {rung.name}: phase x cache x history",
        caption=escape(
            f"on: {rung.data}. kernel out/lse rel.: max relative error of the kernel's latent_out / lse against "
            "the float64 oracle on the same stored rows; format vs float32: the oracle's latent_out on these "
            "rows against float32 rows (max relative); s_q is capped by the history (one row: one query)"
        ),
    )
    for col in MATRIX_HEADER:
        table.add_column(col)
    for row in matrix_rows(rung.cells):
        table.add_row(*(escape(x) for x in row))
    return table


def validation_table(ckpt: Any, res: Any) -> Table:
    """``validate``'s table: one row per check of every rung (value, tolerance, verdict)."""
    from mla_convert.validate.result import format_value

    table = Table(title=f"validation of {ckpt}")
    for col in ("rung", "check", "value", "tolerance", "result"):
        table.add_column(col)
    for r in res.rungs:
        if r.skipped:
            table.add_row(f"{r.number} {r.name}", "skipped", escape(r.skipped), "", "")
        for i, c in enumerate(r.checks):
            verdict = "" if c.passed is None else ("pass" if c.passed else "[bold red]FAIL[/]")
            table.add_row(
                f"{r.number} {r.name}" if i == 0 else "",
                escape(c.name),
                escape(format_value(c.value)),
                c.tolerance,
                verdict,
            )
        table.add_row("", f"[dim]on: {escape(r.data)} ({r.seconds:.1f} s)[/]", "", "", "", end_section=True)
    return table
