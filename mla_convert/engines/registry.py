"""The engines mla-convert's conversions run in: one :class:`Engine` per engine, :data:`ENGINES` the one table.

Each engine has one home, ``mla_convert/engines/<folder>/``: what it accepts (``spec.py``, data and config checks,
below the conversion), how a conversion is shaped for its row (``shape.py``, part of the conversion), the export it
reads, how it is probed (``probe.py``, run by the engine's own python) and checked (``check.py``). A new engine is one
folder and one entry of :data:`ENGINES` (one that fixes a served shape also gets its call in
:mod:`mla_convert.convert.options.resolve` and its row in :func:`mla_convert.engines.precheck.engine_rows`). The
DeepSeek-V3 folder format that transformers, vLLM and MLX-LM read is ``engines/deepseek_v3/``: a format, not an
engine.

The entries are dotted strings (``module`` or ``module:attribute``), resolved only when used (:func:`load`): the
registry sits below the conversion (scripts/imports.py) and the writers, probes and checks above it, so it names
them without importing them. ``tests/test_engines.py`` checks that every entry names a module and attribute that
exist.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from mla_convert.engines.llamacpp.spec import LLAMACPP
from mla_convert.engines.vllm.spec import ENGINE_ROWS

#: The export formats: the DeepSeek-V3 folder (``engines/deepseek_v3/``) and llama.cpp's GGUF file.
FORMATS = ("deepseek-v3", "gguf")


@dataclass(frozen=True)
class Engine:
    """One engine, and where each part of its support lives (dotted strings, ``module`` or ``module:attribute``).

    Attributes:
        name: its key (``transformers``, ``vllm``, ``mlx``, ``llama.cpp``).
        label: its name in prose and tables.
        folder: its home under ``mla_convert/engines/``; None for transformers, which runs our own model.
        targets: the ``--target`` values (factor, inspect, recipes, export) that are this engine; none: it reads
            any export of its format (MLX-LM).
        export_format: the format it reads (:data:`FORMATS`).
        export: ``module:function`` writing that export.
        spec: the module of what it accepts (row, widths, cache blocks), below the conversion; None: any width.
        shape: ``module:function`` shaping a conversion's options for its served row (in the conversion's
            layer); None: the conversion is not shaped for it.
        check: ``module:function`` holding the engine's result to our model's (the function the tests run).
        probe: the module the engine's own python runs as a script on an export (request in, result out).
        venv: ``(script, variable)``: the script that builds the engine's venv and prints its python, and the
            environment variable the tests read it from; None: it runs in our own environment.
        serve: ``module:function`` the engine calls to serve our MLA folders with no export (vLLM's plugin
            entry point, transformers' ``register``); None: only exports.
    """

    name: str
    label: str
    folder: str | None
    targets: tuple[str, ...]
    export_format: str
    export: str
    spec: str | None = None
    shape: str | None = None
    check: str | None = None
    probe: str | None = None
    venv: tuple[str, str] | None = None
    serve: str | None = None


_DEEPSEEK_V3 = "mla_convert.engines.deepseek_v3.write:export_checkpoint"

#: Every engine, in the order the CLI and the model card list them: one entry per engine.
ENGINES: tuple[Engine, ...] = (
    Engine(
        name="transformers",
        label="transformers",
        folder=None,
        targets=("transformers",),
        export_format="deepseek-v3",
        export=_DEEPSEEK_V3,
        check="mla_convert.engines.deepseek_v3.write:parity",
        serve="mla_convert:register",
    ),
    Engine(
        name="vllm",
        label="vLLM",
        folder="vllm",
        targets=tuple(ENGINE_ROWS),
        export_format="deepseek-v3",
        export=_DEEPSEEK_V3,
        spec="mla_convert.engines.vllm.spec",
        shape="mla_convert.engines.vllm.shape:shape_for_engine",
        check="mla_convert.engines.vllm.check:check_vllm",
        probe="mla_convert.engines.vllm.probe",
        venv=("scripts/vllm_env.sh", "MLA_VLLM_PYTHON"),
        serve="mla_convert.engines.vllm.plugin:register",
    ),
    Engine(
        name="mlx",
        label="MLX-LM",
        folder="mlx",
        targets=(),
        export_format="deepseek-v3",
        export=_DEEPSEEK_V3,
        check="mla_convert.engines.mlx.check:check_mlx",
        probe="mla_convert.engines.mlx.probe",
        venv=("scripts/mlx_env.sh", "MLA_MLX_PYTHON"),
    ),
    Engine(
        name="llama.cpp",
        label="llama.cpp",
        folder="llamacpp",
        targets=(LLAMACPP,),
        export_format="gguf",
        export="mla_convert.engines.llamacpp.gguf_file:export_gguf",
        spec="mla_convert.engines.llamacpp.spec",
        shape="mla_convert.engines.llamacpp.shape:shape_for_llamacpp",
        check="mla_convert.engines.llamacpp.check:check_llamacpp",
        probe="mla_convert.engines.llamacpp.probe",
        venv=("scripts/llamacpp_env.sh", "MLA_LLAMACPP_PYTHON"),
    ),
)

#: Every DeepSeek-V3 export ``--target``: ``transformers`` (any shape) and the engine rows (``vllm``, ``vllm-cpu``).
TARGETS = tuple(t for e in ENGINES if e.export_format == "deepseek-v3" for t in e.targets)
#: Every ``factor``/``inspect``/recipe ``--target``: the export targets and ``llama.cpp``
#: (:mod:`mla_convert.engines.llamacpp.shape`; served from ``--export gguf``).
SHAPE_TARGETS = tuple(t for e in ENGINES for t in e.targets)


def engine(name: str) -> Engine:
    """The engine called ``name`` (:attr:`Engine.name`).

    Raises:
        KeyError: no engine has that name (the message lists them).
    """
    for e in ENGINES:
        if e.name == name:
            return e
    raise KeyError(
        f"no engine {name!r} in mla_convert/engines/registry.py (engines: {', '.join(e.name for e in ENGINES)})"
    )


def for_target(target: str) -> Engine | None:
    """The engine a ``--target`` names (``vllm-cpu`` -> vLLM), None for a value no engine has."""
    return next((e for e in ENGINES if target in e.targets), None)


def export_target(target: str) -> str:
    """The DeepSeek-V3 export's engine shape for a conversion ``--target``: an engine that reads another format
    (``llama.cpp``, whose GGUF is ``--export gguf``) gets the checkpoint's own widths (``transformers``); the others
    are their own (an unknown value is returned as given, for the export to refuse)."""
    e = for_target(target)
    return "transformers" if e is not None and e.export_format != "deepseek-v3" else target


def load(ref: str) -> Any:
    """What a dotted entry names: ``module`` (the module) or ``module:attribute`` (the attribute), imported now.

    Raises:
        ImportError: the module does not import (an engine's own dependency missing, as vLLM in our venv).
        AttributeError: the module has no such attribute.
    """
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj
