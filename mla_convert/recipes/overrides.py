"""The command-line override grammar of ``mla-convert run RECIPE [key=value ...]``.

``a.b=c`` sets key ``b`` of section ``a`` to ``c``, the value read as YAML (``16`` an int, ``null`` None,
``'20'`` a string); a dotted key creates the sections on its way (``adapt.tokens=10`` turns ``adapt: null``
into a section).
"""

from __future__ import annotations

from typing import Any

import yaml


def yaml_reason(exc: yaml.YAMLError) -> str:
    """The short reason of a YAML error (its ``problem``, else the first line of the message)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return str(problem)


def parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    """``a.b=c`` -> ``(("a", "b"), value)`` with the value read as YAML (``16`` int, ``null`` None).

    Raises:
        ValueError: no ``=``, an empty key part, or a value that is not valid YAML.
    """
    key, sep, value = item.partition("=")
    key = key.strip()
    path = tuple(key.split("."))
    if not sep or not key or any(not p.strip() for p in path):
        raise ValueError(f"override {item!r} is not key=value (e.g. factor.rope_pairs=16, adapt=null)")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"override {item!r}: the value is not valid YAML ({yaml_reason(exc)})") from exc
    return tuple(p.strip() for p in path), parsed


def apply_override(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set ``raw[a][b]... = value``, creating (or replacing a null) section on the way.

    Raises:
        ValueError: when a part of the path names a value that is not a section.
    """
    node = raw
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            where = ".".join(path[: i + 1])
            raise ValueError(f"{where} is {nxt!r}, not a section, so {'.'.join(path)} cannot be set")
        node = nxt
    node[path[-1]] = value
