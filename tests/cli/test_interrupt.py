"""SIGTERM ends a command as Ctrl-C does (staged outputs removed, exit 130), not by killing Python mid-write."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent(
    """
    import os, signal, sys, tempfile, time
    from pathlib import Path

    import typer

    from mla_convert.cli.commands import terminate_as_interrupt
    from mla_convert.cli.render import user_errors

    terminate_as_interrupt()
    staged = Path(sys.argv[1]) / ".model.gguf.x.tmp"
    try:
        with user_errors():
            staged.write_bytes(b"half a file")
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
            finally:
                staged.unlink()  # what every staged writer does on the way out
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    """
)


def test_sigterm_runs_the_interrupt_path(tmp_path):
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 130, (res.returncode, res.stderr)
    assert "interrupted: nothing was written" in res.stderr
    assert "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []  # the staged file was removed on the way out
    assert time.perf_counter() - t0 < 25  # it did not sleep out the 30 s


def test_an_interrupted_export_after_factor_says_the_checkpoint_is_complete(tmp_path, monkeypatch, capsys):
    """``factor --export gguf`` stopped during the export: OUT is complete, so the message gives the command that
    writes the export instead of only "nothing was written"."""
    import pytest
    import typer

    from mla_convert.cli.export_cmds import export_after
    from mla_convert.engines.llamacpp import gguf_file

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_file, "export_gguf", stopped)
    out = tmp_path / "mla"
    with pytest.raises(typer.Exit) as exc:
        export_after(out, "gguf", False)
    assert exc.value.exit_code == 130
    err = " ".join(capsys.readouterr().err.split())
    assert f"{out} is complete; the export was not written: mla-convert export {out} {out}.gguf --format gguf" in err
