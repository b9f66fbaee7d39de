"""mla-convert: turn MHA/GQA transformer checkpoints into Multi-Head Latent Attention checkpoints.

``import mla_convert`` registers the ``mla`` model type with transformers' ``AutoConfig`` and
``AutoModelForCausalLM`` (:func:`register`), so converted checkpoints load with ``from_pretrained`` and no
remote code. On a machine without a CUDA GPU, registering also sets ``TRITON_INTERPRET=1`` (unless already set)
before anything imports Triton: the bundled decode kernel can then only run in the Triton interpreter, and
Triton reads that switch once, when it is first imported.

Two exceptions. Inside vLLM (``vllm`` imported first), as when vLLM loads our plugin
(:mod:`mla_convert.engines.vllm.plugin`), nothing is registered: vLLM's environment has an older transformers, and the
plugin imports only what it needs. The other is the ``mla-convert`` command itself (the console script or ``python -m mla_convert``): it
starts without torch or transformers, so ``--help`` and bad options answer at once, and each command registers
(:func:`register`) only when it loads a model. docs/design.md, "A thin CLI".
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from typing import Any

from mla_convert.mla.registry import register

try:  # the installed distribution's version (pyproject.toml)
    __version__ = _dist_version("mla-convert")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

def _started_as_cli() -> bool:
    """True while the ``mla-convert`` console script or ``python -m mla_convert`` is starting."""
    argv0 = os.path.basename(sys.argv[0]) if sys.argv else ""
    return argv0 in ("mla-convert", "mla-convert.exe") or (argv0 == "-m" and "mla_convert" in sys.orig_argv)


def __getattr__(name: str) -> Any:
    """``mla_convert.MLAConfig`` / ``mla_convert.MLAForCausalLM``, imported on first use."""
    if name in ("MLAConfig", "MLAForCausalLM"):
        register()
        from mla_convert.mla import configuration, modeling

        return configuration.MLAConfig if name == "MLAConfig" else modeling.MLAForCausalLM
    raise AttributeError(f"module 'mla_convert' has no attribute {name!r}")


def _no_gpu_device() -> bool:
    """True when no GPU device node exists (NVIDIA ``/dev/nvidiactl``, ROCm ``/dev/kfd``): cheap, torch-free."""
    return not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd"))


if not _started_as_cli() and "vllm" not in sys.modules:
    register()
elif "triton" not in sys.modules and _no_gpu_device():
    # The CLI imports torch later, inside a command, and some import may pull Triton in before register()
    # runs: decide the Triton mode now, from the device nodes (register() confirms with torch).
    os.environ.setdefault("TRITON_INTERPRET", "1")

__all__ = ["MLAConfig", "MLAForCausalLM", "__version__", "register"]
