"""The option fields as the command line and recipes spell and refuse them: retired options and values, the
wording of a value outside its choices, and ``--max-shard-size``'s units. Light (pydantic only, no torch), like
:mod:`mla_convert.convert.options.options`, whose :class:`ConvertOptions` fields these read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from mla_convert.convert.options.options import ConvertOptions, OptionsError


def _extra(model: type[BaseModel], field: str) -> dict[str, Any]:
    """The ``json_schema_extra`` of ``model``'s ``field`` (``{}`` when it has none)."""
    info = model.model_fields.get(field)
    extra = info.json_schema_extra if info is not None else None
    return extra if isinstance(extra, dict) else {}


def retired_fields(model: type[BaseModel] = ConvertOptions) -> tuple[str, ...]:
    """The fields the command line and recipes no longer take (their ``json_schema_extra`` says ``retired``); the
    library's model keeps them (the oracle and exactness tests, the benchmarks' anchor rows)."""
    return tuple(k for k in model.model_fields if "retired" in _extra(model, k))


def offered_choices(field: str, choices: tuple[str, ...], model: type[BaseModel] = ConvertOptions) -> tuple[str, ...]:
    """``choices`` of ``field`` less the values the command line and recipes no longer take."""
    gone = _extra(model, field).get("retired_values") or {}
    return tuple(c for c in choices if c not in gone)


def retired(values: Mapping[str, Any], model: type[BaseModel] = ConvertOptions) -> list[tuple[str, str]]:
    """``(field, reason)`` for every retired option or value in ``values`` (field -> value as given, None meaning
    not given): the one home of what the command line and recipes refuse and what replaces it. The reason starts
    with ``removed;`` (the option) or ``retired;`` (one of its values), in the command line's spelling."""
    window_field = model.model_fields.get("window")
    window = values.get("window") or (window_field.default if window_field is not None else None)
    out: list[tuple[str, str]] = []
    for key, value in values.items():
        extra = _extra(model, key)
        if value is None or not extra:
            continue
        if "retired" in extra:
            tokens = value * window if isinstance(value, int) and isinstance(window, int) else "N x WINDOW"
            out.append((key, str(extra["retired"]).format(value=value, window=window, tokens=tokens)))
        elif isinstance(value, str) and value in (gone := extra.get("retired_values") or {}):
            out.append((key, str(gone[value])))
    return out


def choice_message(value: object, choices: tuple[str, ...]) -> str:
    """The one wording of a value outside its choices: ``'bogus' is not one of per-head, shared``."""
    return f"{value!r} is not one of {', '.join(choices)}"


def literal_choices(error: Mapping[str, Any]) -> tuple[str, ...]:
    """The allowed values named by a pydantic ``literal_error`` (its ``ctx.expected``: ``'a', 'b' or 'c'``)."""
    expected = str(error.get("ctx", {}).get("expected", ""))
    return tuple(x.strip().strip("'") for x in expected.replace(" or ", ", ").split(", ") if x.strip())


def shard_size_of(text: str) -> str | int:
    """``--max-shard-size``: a number of bytes, or digits with a unit KB, MB, GB or TB (huggingface_hub's units,
    powers of 1000), returned as ``int`` or the string itself.

    Raises:
        OptionsError: anything else (one line with examples).
    """
    text = text.strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    if re.fullmatch(r"\d+(\.\d+)?\s*[KMGT]B", text, re.IGNORECASE) and float(text[:-2]) > 0:
        return text
    raise OptionsError(f"--max-shard-size {text!r} is not a size; use e.g. 500MB, 2GB or a number of bytes")
