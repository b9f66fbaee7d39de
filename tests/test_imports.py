"""The import graph has no cycle and no import back up a layer (``scripts/imports.py``: the layers and the check)."""

from __future__ import annotations

import ast
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


def test_a_wildcard_prefix_names_one_segment_and_the_most_specific_wins() -> None:
    """``*`` in a LAYERS prefix stands for one segment; where several prefixes name a module, the one of most
    segments (then fewest ``*``) gives its layer: each engine's spec below convert, the rest of engines above."""
    names, specificity = imports_check.names, imports_check.specificity
    assert names("mla_convert.engines.*.spec", "mla_convert.engines.vllm.spec")
    assert names("mla_convert.engines.*.spec", "mla_convert.engines.vllm.spec.inner")
    assert not names("mla_convert.engines.*.spec", "mla_convert.engines.vllm.check")
    assert not names("mla_convert.engines.*.spec", "mla_convert.engines.spec")
    assert not names("mla_convert.conv", "mla_convert.convert")
    assert specificity("mla_convert.engines.*.spec") > specificity("mla_convert.engines")
    assert specificity("mla_convert.engines.vllm.spec") > specificity("mla_convert.engines.*.spec")
    layer = imports_check.layer_of
    assert layer("mla_convert.engines.vllm.spec") < layer("mla_convert.convert.options.resolve")
    assert layer("mla_convert.engines.vllm.shape") == layer("mla_convert.convert.options.resolve")
    assert layer("mla_convert.engines.vllm.check") > layer("mla_convert.convert.options.resolve")


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


#: Private members of torch and transformers our code overrides or sets (``nn.Module._apply``, a config's
#: ``_attn_implementation``): theirs, so reading them is not reaching into another of our modules.
THIRD_PARTY = {"_apply", "_attn_implementation"}


def _private_names_defined(root: Path) -> set[str]:
    """Every private name our package defines: functions, classes, module constants and ``self._x`` attributes."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_uses_a_private_member_of_another() -> None:
    """Issue 49: no module under ``mla_convert/`` imports a private name of another module or reads a private member
    (one our code defines) of an object other than ``self``/``cls``; third-party internals (``torch``'s
    ``_buffers``, transformers' ``_attn_implementation``) are not ours to rename and are not counted."""
    root = Path(__file__).resolve().parents[1] / "mla_convert"
    ours = _private_names_defined(root) - THIRD_PARTY
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mla_convert"):
                found += [f"{path}:{node.lineno}: imports {node.module}.{a.name}" for a in node.names if a.name in ours]
            elif isinstance(node, ast.Attribute) and node.attr in ours:
                base = node.value.id if isinstance(node.value, ast.Name) else None
                if base not in ("self", "cls"):
                    found.append(f"{path}:{node.lineno}: reads {base or '<expr>'}.{node.attr}")
    assert not found, "\n".join(found)
