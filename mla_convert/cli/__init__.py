"""The ``mla-convert`` command line: parse, call the library, render."""

from mla_convert.cli.commands import app, main

__all__ = ["app", "main"]
