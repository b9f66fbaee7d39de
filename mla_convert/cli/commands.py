"""``mla-convert`` command line (typer + rich): the app, its commands in the order ``--help`` lists them, and the
console-script entry point.

Each command group lives in its own module, which parses arguments, calls the library and renders:
:mod:`~mla_convert.cli.convert_cmds` (``inspect``, ``factor``), :mod:`~mla_convert.cli.export_cmds`
(``export``), :mod:`~mla_convert.cli.eval_cmds` (``eval``, ``generate``, ``validate``),
:mod:`~mla_convert.cli.adapt_cmds` (``adapt``), :mod:`~mla_convert.cli.manifest_cmds` (``manifest verify``),
:mod:`~mla_convert.cli.recipe_cmds` (``run``, ``init-recipe``). None imports torch at module level, so ``--help``
and option errors start in a fraction of a second.

Every user error is one line on stderr (``error: ...``) and exit code 2; nothing is written.
Progress bars appear only on a terminal and without ``--quiet``.
"""

from __future__ import annotations

import sys

import typer

from mla_convert.cli import adapt_cmds, convert_cmds, eval_cmds, export_cmds, manifest_cmds, recipe_cmds
from mla_convert.cli.render import err_console, plain, setup, usage_error

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Convert MHA/GQA transformer checkpoints into Multi-Head Latent Attention (MLA) checkpoints.",
)
manifest_app = typer.Typer(no_args_is_help=True, help="Check conversion manifests.")
app.add_typer(manifest_app, name="manifest")


@app.callback()
def _main(quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only results and errors.")) -> None:
    setup(quiet)


app.command()(convert_cmds.inspect)
app.command()(convert_cmds.factor)
app.command()(export_cmds.export)
app.command("eval")(eval_cmds.eval_cmd)
app.command()(eval_cmds.generate)
app.command()(eval_cmds.validate)
app.command()(adapt_cmds.adapt)
manifest_app.command("verify")(manifest_cmds.manifest_verify)
app.command("run")(recipe_cmds.run_recipe_cmd)
app.command("init-recipe")(recipe_cmds.init_recipe_cmd)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def terminate_as_interrupt() -> None:
    """Make SIGTERM (``kill``, a scheduler's stop, a container's shutdown) end a command as Ctrl-C does: the
    ``KeyboardInterrupt`` path removes staged outputs (hidden ``.OUT.tmp-*`` folders, ``.NAME.gguf.*.tmp`` files),
    keeps a conversion's finished layers for ``--resume``, says what was kept and exits 130. Without it Python dies at
    once and leaves the staged files behind. Main thread only (where ``signal.signal`` is allowed)."""
    import signal

    signal.signal(signal.SIGTERM, _interrupt)


def main() -> None:
    """Console-script entry point: usage errors as one ``error:`` line (exit 2); help at full width in a log;
    SIGTERM handled as Ctrl-C (:func:`terminate_as_interrupt`)."""
    import os

    terminate_as_interrupt()

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
