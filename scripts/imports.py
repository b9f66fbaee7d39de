"""The import graph of ``mla_convert`` (and ``mla_kernels``, installed as ``mla_convert.kernels``): modules, edges,
cycles and imports that point back up a layer.

Every ``import`` counts: module-level, function-local and ``if TYPE_CHECKING:`` ones alike. A module's layer is
that of the most specific prefix in :data:`LAYERS` naming it; a module may import its own layer (without a cycle) and
the layers below. A prefix is dotted segments, each a name or ``*`` (any one segment): ``mla_convert.engines.*.spec``
names ``mla_convert.engines.vllm.spec`` (and anything under it), so one package can sit in several layers (each
engine's spec below ``convert``, the rest of ``mla_convert.engines`` above it). The most specific prefix is the one
of most segments, then of fewest ``*``; ``mla_convert.engines.*.spec`` (4 segments) beats ``mla_convert.engines``
(2). Run from the repository root: ``python scripts/imports.py`` prints the figures, each cycle and
each back-up import (``importer:line -> imported``) and exits 1 when there is any. ``tests/test_imports.py`` runs
the same check.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where each package's files live (``mla_kernels/`` is installed as ``mla_convert.kernels``, pyproject.toml).
PACKAGES = {"mla_convert": ROOT / "mla_convert", "mla_convert.kernels": ROOT / "mla_kernels"}

#: The layers, lowest first: a module may import modules of its own layer and of the layers before it.
LAYERS: list[tuple[str, list[str]]] = [
    ("base: user errors, files", ["mla_convert.errors", "mla_convert.files"]),
    ("inputs: source checkpoints, text", ["mla_convert.sources", "mla_convert.text"]),
    (
        "model: the MLA model, its kernels, cache and decode",
        ["mla_convert.mla", "mla_convert.kernels", "mla_convert.runtime"],
    ),
    ("package: version, register()", ["mla_convert"]),
    ("metrics", ["mla_convert.metrics"]),
    ("precision", ["mla_convert.precision"]),
    ("artifacts: manifests, checkpoints, reports", ["mla_convert.artifacts"]),
    (
        "engine specs: what each engine accepts (data, config checks), the engine table",
        ["mla_convert.engines.registry", "mla_convert.engines.*.spec"],
    ),
    (
        "convert, with the conversion shaped for an engine and what each target makes of it",
        ["mla_convert.convert", "mla_convert.engines.*.shape", "mla_convert.engines.precheck"],
    ),
    ("engines: exports, probes, checks, the vLLM plugin", ["mla_convert.engines"]),
    (
        "tasks: validate, adapt, recipes, task evaluation",
        ["mla_convert.validate", "mla_convert.adapt", "mla_convert.recipes", "mla_convert.tasks"],
    ),
    ("cli", ["mla_convert.cli", "mla_convert.__main__"]),
]


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` at ``line`` of the importer's file."""

    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} -> {self.imported}"


def modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    mods: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((package, *parts))] = path
    return mods


def _targets(mods: dict[str, Path], importer: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package modules ``node`` (in ``importer``) imports: the deepest module each name resolves to."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = importer.split(".")
            if mods[importer].name != "__init__.py":
                pkg = pkg[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = set()
    for name in names:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in mods and name != importer:
            out.add(name)
    return out


def edges(mods: dict[str, Path]) -> list[Edge]:
    """Every import between two package modules (one edge per importing statement and imported module)."""
    out = []
    for importer, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                out.extend(Edge(importer, t, node.lineno) for t in sorted(_targets(mods, importer, node)))
    return out


def cycles(mods: dict[str, Path], graph: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {m: set() for m in mods}
    for e in graph:
        succ[e.importer].add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(mods):
        if v not in index:
            visit(v)
    return sorted(found)


def names(prefix: str, module: str) -> bool:
    """Whether ``prefix`` (dotted segments, ``*`` any one segment) names ``module``: it is the module or a package
    above it. ``names("mla_convert.engines.*.spec", "mla_convert.engines.vllm.spec")`` is True."""
    want, have = prefix.split("."), module.split(".")
    return len(want) <= len(have) and all(w in ("*", h) for w, h in zip(want, have, strict=False))


def specificity(prefix: str) -> tuple[int, int]:
    """How specific ``prefix`` is: ``(segments, -wildcards)``; the larger wins where several prefixes name a module."""
    parts = prefix.split(".")
    return len(parts), -parts.count("*")


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the most specific prefix naming ``module`` (:func:`names`, :func:`specificity`).

    Raises:
        KeyError: no layer names the module.
    """
    best, rank = -1, (-1, 0)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if names(p, module) and specificity(p) > rank:
                best, rank = i, specificity(p)
    if best < 0:
        raise KeyError(f"no layer in scripts/imports.py LAYERS names {module}")
    return best


def back_up(graph: list[Edge]) -> list[Edge]:
    """The imports whose imported module lies in a higher layer than the importer."""
    return [e for e in graph if layer_of(e.imported) > layer_of(e.importer)]


def main() -> int:
    """Print the figures, the cycles and the back-up imports; 1 when there is a cycle or a back-up import."""
    mods = modules()
    graph = edges(mods)
    found = cycles(mods, graph)
    ups = back_up(graph)
    pairs = {(e.importer, e.imported) for e in graph}
    print(f"modules {len(mods)}  edges {len(pairs)}  cycles {len(found)}  back-up imports {len(ups)}")
    print("layers, lowest first:")
    for i, (name, prefixes) in enumerate(LAYERS):
        print(f"  {i:2d} {name}: {', '.join(prefixes)}")
    for c in found:
        print("cycle:", " <-> ".join(c))
    for e in ups:
        print(f"back up: {e}  (layer {layer_of(e.importer)} -> {layer_of(e.imported)})")
    return 1 if found or ups else 0


if __name__ == "__main__":
    sys.exit(main())
