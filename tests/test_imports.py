"""The import graph has no cycle and no import back up a layer (``scripts/imports.py``: the layers and the check)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "imports_check", Path(__file__).parent.parent / "scripts" / "imports.py"
)
assert _SPEC is not None and _SPEC.loader is not None
imports_check = importlib.util.module_from_spec(_SPEC)
sys.modules["imports_check"] = imports_check
_SPEC.loader.exec_module(imports_check)

#: Imports the check lets pass: none (issue 49: no import cycle, no import back up a layer).
ALLOWED: set[tuple[str, str]] = set()


def _graph() -> tuple[dict[str, Path], list]:
    mods = imports_check.modules()
    return mods, [e for e in imports_check.edges(mods) if (e.importer, e.imported) not in ALLOWED]


def test_every_module_has_a_layer() -> None:
    missing = []
    for m in imports_check.modules():
        try:
            imports_check.layer_of(m)
        except KeyError:
            missing.append(m)
    assert not missing, "modules no layer names (scripts/imports.py LAYERS): " + ", ".join(missing)


def test_no_import_cycle() -> None:
    mods, graph = _graph()
    found = imports_check.cycles(mods, graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_back_up_a_layer() -> None:
    _, graph = _graph()
    ups = imports_check.back_up(graph)
    assert not ups, "imports back up a layer (scripts/imports.py LAYERS):\n" + "\n".join(map(str, ups))


def test_allow_list_is_still_needed() -> None:
    """An allowed import that no longer exists leaves the list (so it cannot hide a new one later)."""
    present = {(e.importer, e.imported) for e in imports_check.edges(imports_check.modules())}
    assert not ALLOWED - present, f"allowed imports that are gone: {sorted(ALLOWED - present)}"
