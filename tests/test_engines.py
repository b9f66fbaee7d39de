"""The engine table (``mla_convert/engines/registry.py``) names what exists: one entry per engine folder, every dotted
entry a module and attribute of this checkout, the vLLM plugin's entry point the one pyproject.toml installs.

Read from the files (``ast``), not imported: the probes, checks and the plugin import their engines (vLLM, MLX-LM,
llama.cpp), which our venv does not have.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

from mla_convert.engines.registry import (
    ENGINES,
    FORMATS,
    SHAPE_TARGETS,
    TARGETS,
    engine,
    export_target,
    for_target,
)

ROOT = Path(__file__).resolve().parents[1]
ENGINES_DIR = ROOT / "mla_convert" / "engines"
#: Folders of ``engines/`` that are not an engine: the DeepSeek-V3 format three engines read.
FORMAT_FOLDERS = {"deepseek_v3"}


def _module_file(module: str) -> Path:
    """The file of a dotted module name under the repository (a package: its ``__init__.py``)."""
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


ENTRIES = [
    (e.name, field, getattr(e, field))
    for e in ENGINES
    for field in ("export", "spec", "shape", "check", "probe", "serve")
    if getattr(e, field)
]


@pytest.mark.parametrize("name,field,ref", ENTRIES, ids=[f"{n}.{f}" for n, f, _ in ENTRIES])
def test_every_entry_names_a_module_and_attribute_that_exist(name: str, field: str, ref: str) -> None:
    module, _, attr = ref.partition(":")
    path = _module_file(module)
    assert path.is_file(), f"engines/registry.py: {name}'s {field} names {module}, which has no file ({path})"
    if attr:
        assert attr in _top_level_names(path), (
            f"engines/registry.py: {name}'s {field}: {module} has no {attr}"
        )


def test_every_engine_folder_has_one_entry_and_every_entry_a_folder() -> None:
    folders = {p.name for p in ENGINES_DIR.iterdir() if (p / "__init__.py").is_file()} - FORMAT_FOLDERS
    named = [e.folder for e in ENGINES if e.folder]
    assert sorted(named) == sorted(folders), (
        f"engine folders {sorted(folders)} and the registry's {sorted(named)} differ: a new engine is one folder "
        "and one entry of ENGINES"
    )
    for e in ENGINES:
        for field in ("spec", "shape", "check", "probe"):
            ref = getattr(e, field)
            if ref and e.folder:
                assert ref.startswith(f"mla_convert.engines.{e.folder}."), (
                    f"{e.name}'s {field} lives outside its folder"
                )


def test_targets_and_lookups() -> None:
    assert TARGETS == ("transformers", "vllm", "vllm-cpu")
    assert SHAPE_TARGETS == ("transformers", "vllm", "vllm-cpu", "llama.cpp")
    assert [export_target(t) for t in (*SHAPE_TARGETS, "sglang")] == [
        "transformers",
        "vllm",
        "vllm-cpu",
        "transformers",
        "sglang",
    ]
    assert for_target("vllm-cpu") is engine("vllm") and for_target("sglang") is None
    assert {e.export_format for e in ENGINES} <= set(FORMATS)
    with pytest.raises(KeyError, match="no engine 'sglang'"):
        engine("sglang")


def test_venv_scripts_exist() -> None:
    for e in ENGINES:
        if e.venv:
            assert (ROOT / e.venv[0]).is_file(), f"{e.name}'s venv script {e.venv[0]} is missing"


def test_pyproject_installs_the_plugin_and_every_engine_package() -> None:
    """vLLM's environment installs a copy of this checkout (scripts/vllm_env.sh): its entry point must name the
    registry's plugin, and the copy must hold every engine package."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = project["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"mla_convert": engine("vllm").serve}
    packages = set(project["tool"]["setuptools"]["packages"])
    wanted = {"mla_convert.engines"} | {
        f"mla_convert.engines.{p.name}" for p in ENGINES_DIR.iterdir() if (p / "__init__.py").is_file()
    }
    assert wanted <= packages, f"pyproject.toml [tool.setuptools] packages lacks {sorted(wanted - packages)}"
