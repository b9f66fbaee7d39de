"""The CLI's layout: one module per command group, each under 600 lines, and ``mla_convert.cli.commands.app``
holding every command in the order ``--help`` lists them."""

from __future__ import annotations

from pathlib import Path

import typer

import mla_convert.cli
from mla_convert.cli.commands import app

COMMANDS = ["inspect", "factor", "export", "eval", "generate", "validate", "adapt", "run", "init-recipe"]


def test_every_cli_module_is_under_600_lines() -> None:
    folder = Path(mla_convert.cli.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert {"commands.py", "convert_cmds.py", "eval_cmds.py", "export_cmds.py"} <= sizes.keys()
    assert max(sizes.values()) < 600, sizes


def test_app_holds_every_command_in_order() -> None:
    click_app = typer.main.get_command(app)
    names = list(click_app.list_commands(None))  # type: ignore[attr-defined,arg-type]
    assert names == [*COMMANDS, "manifest"]
    manifest = click_app.get_command(None, "manifest")  # type: ignore[attr-defined,arg-type]
    assert list(manifest.list_commands(None)) == ["verify"]  # type: ignore[union-attr,arg-type]
