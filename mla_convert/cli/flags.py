"""CLI flags generated from the pydantic option models, so a flag's name, default and help are written once.

``@options_from(ConvertOptions)`` gives a typer command one ``--flag`` per model field (``rope_pairs`` ->
``--rope-pairs``), with the field's default and its description as help (``Literal`` choices listed). The
command receives the values as keyword arguments and builds the model with :func:`build_options`, whose
errors (every invalid flag at once) become one ``error:`` line. A field marked retired
(:func:`~mla_convert.convert.options.options.retired_fields`) is a hidden flag that only refuses, saying what replaces
it; a retired value of a kept flag is refused the same way and left out of its help.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args, get_origin

import annotated_types
import typer
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from mla_convert.convert.options.fields import (
    choice_message,
    literal_choices,
    offered_choices,
    retired,
    retired_fields,
)
from mla_convert.convert.options.options import flag

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=BaseModel)


def _cli_type(annotation: Any) -> tuple[Any, tuple[str, ...]]:
    """The type typer parses for a field annotation, and the choices of a ``Literal`` (checked by pydantic)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return str, tuple(str(a) for a in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        if len(inner) == 1:
            typ, choices = _cli_type(inner[0])
            return typing.Optional[typ], choices  # noqa: UP045 - typer reads typing.Optional
    return annotation, ()


def _sentence(text: str, choices: tuple[str, ...]) -> str:
    """A help text as a sentence: capitalised, with a full stop, unless it starts with a value the user types
    (a choice such as ``2-norm``, or a list ``a | b``), which keeps its spelling."""
    first = text.split(" ", 1)[0].rstrip(":,")
    literal = first in choices or " | " in text.split(":", 1)[0] or first in ("wikipedia", "teacher", "none")
    return (text if literal else text[:1].upper() + text[1:]) + ("" if text.endswith(".") else ".")


def option_parameters(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """One keyword-only typer option per field of ``model`` (except ``skip``)."""
    params = []
    gone = retired_fields(model)
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        typ, choices = _cli_type(field.annotation)
        if name in gone:  # hidden: typed, it is refused with what replaces it (build_options)
            optional = typing.Optional[typ]  # type: ignore[valid-type]  # noqa: UP045 - typer reads typing.Optional
            hidden = typer.Option(None, hidden=True)
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=hidden, annotation=optional))
            continue
        choices = offered_choices(name, choices, model)
        text = field.description or ""
        if choices and not all(c in text for c in choices):
            text += f" ({' | '.join(choices)})"
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        metavar = extra.get("metavar")
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(
                    field.default, help=_sentence(text, choices), metavar=str(metavar) if metavar else None
                ),
                annotation=typ,
            )
        )
    return params


def options_from(model: type[BaseModel], skip: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Decorate a command ``f(<its own parameters>, **options)``: typer then sees its own parameters followed by
    one flag per field of ``model``; the values arrive in ``**options``."""

    def decorate(func: F) -> F:
        own = [
            p
            for p in inspect.signature(func, eval_str=True).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        func.__signature__ = inspect.Signature(own + option_parameters(model, skip))  # type: ignore[attr-defined]
        return func

    return decorate


def _outside_range(model: type[BaseModel] | None, error: ErrorDetails) -> str | None:
    """``0 is outside 1..128`` for a bound error on a field with both an inclusive minimum and maximum."""
    bound = error["type"] in ("greater_than_equal", "less_than_equal")
    if model is None or not bound or len(error["loc"]) != 1:
        return None
    field = model.model_fields.get(str(error["loc"][0]))
    meta = field.metadata if field is not None else []
    low = next((m.ge for m in meta if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in meta if isinstance(m, annotated_types.Le)), None)
    return None if low is None or high is None else f"{error.get('input')} is outside {low}..{high}"


def options_error(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line listing every invalid option of a pydantic ValidationError, in CLI spelling (with ``model``,
    a value outside a field's closed range says the range)."""
    parts = []
    for e in exc.errors():
        if e["type"] == "literal_error":
            field = str(e["loc"][0]) if model is not None and len(e["loc"]) == 1 else ""
            choices = literal_choices(e)
            msg = choice_message(e.get("input"), offered_choices(field, choices, model) if model else choices)
        elif outside := _outside_range(model, e):
            msg = outside
        else:
            msg = str(e["msg"]).removeprefix("Value error, ")
        if not e["loc"]:  # a rule across several options
            parts.append(msg)
            continue
        parts.append(f"{flag('_'.join(str(x) for x in e['loc']))}: {msg}")
    return "; ".join(parts)


def retired_message(field: str, value: Any, reason: str) -> str:
    """A retired flag or value in CLI spelling: ``--objective activation: removed; ...``, ``--no-kv-balance: ...``."""
    if isinstance(value, bool):
        return f"{flag(field) if value else '--no-' + field.replace('_', '-')}: {reason}"
    return f"{flag(field)} {value}: {reason}"


def build_options(model: type[M], values: dict[str, Any]) -> M:
    """``model(**values)``, or exit 2 with one ``error:`` line naming every bad flag (a retired flag or value first,
    with what replaces it)."""
    from mla_convert.cli.render import fail

    gone = retired(values, model)
    if gone:
        fail("; ".join(retired_message(k, values[k], reason) for k, reason in gone))
    values = {k: v for k, v in values.items() if v is not None or k not in retired_fields(model)}
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        fail(options_error(exc, model))
        raise  # unreachable: fail exits


def given_on_command_line(name: str) -> bool:
    """Whether the option ``name`` was typed (not its default)."""
    from typer._click.core import ParameterSource
    from typer._click.globals import get_current_context

    ctx = get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE
