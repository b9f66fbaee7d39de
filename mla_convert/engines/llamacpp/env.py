"""The llama.cpp venv (``scripts/llamacpp_env.sh``) from this side: finding its python (:func:`find_llamacpp`) and
running llama.cpp's quantizer with it (:func:`quantize`, the script :mod:`mla_convert.engines.llamacpp.quantize`)."""

from __future__ import annotations

import os
from pathlib import Path

from mla_convert.engines.deepseek_v3.mapping import ExportError

#: Quantized types (``--dtype``) -> ``llama_ftype`` of llama.cpp's quantizer (include/llama.h).
GGUF_QUANTS = {
    "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13,
    "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18,
}
#: The attention tensor kept float32 in float16 and quantized files (the scaled latent rows of the linear norm).
KEEP_F32 = "attn_kv_a_mqa"


def find_llamacpp() -> str | None:
    """The python of a llama.cpp venv: ``MLA_LLAMACPP_PYTHON``, else the venv ``scripts/llamacpp_env.sh`` built
    (``$MLA_LLAMACPP_VENV_ROOT`` or ``~/.cache/mla-convert``, a complete one), else None.

    Raises:
        ExportError: ``MLA_LLAMACPP_PYTHON`` is set but names no file (a set variable is never ignored silently).
    """
    env = os.environ.get("MLA_LLAMACPP_PYTHON")
    if env:
        if not Path(env).is_file():
            raise ExportError(f"MLA_LLAMACPP_PYTHON={env} is not a file; point it at the python of a venv with "
                              "llama-cpp-python (bash scripts/llamacpp_env.sh builds one and prints it) or unset it")
        return env
    root = Path(os.environ.get("MLA_LLAMACPP_VENV_ROOT", Path.home() / ".cache" / "mla-convert"))
    for venv in sorted(root.glob("llamacpp-*")):
        if (venv / ".complete").is_file() and (venv / "bin" / "python").is_file():
            return str(venv / "bin" / "python")
    return None


def quantize(
    python: str, src: Path, dst: Path, dtype: str, timeout_s: int = 3600, keep: tuple[str, ...] = (KEEP_F32,),
    ftype: int | None = None, allow_requantize: bool = False,
) -> None:
    """Quantize the GGUF ``src`` into ``dst`` with llama.cpp's ``llama_model_quantize`` (run by ``python``):
    ``dtype`` one of :data:`GGUF_QUANTS` (or any ``llama_ftype`` number ``ftype``: 0 float32, 1 float16), the
    ``keep`` tensor patterns float32, ``allow_requantize`` for an already quantized ``src`` (a source GGUF).

    Raises:
        ExportError: the quantizer failed (its last log lines).
    """
    import subprocess

    script = Path(__file__).with_name("quantize.py")
    code = GGUF_QUANTS[dtype] if ftype is None else ftype
    flags = ["--allow-requantize"] if allow_requantize else []
    done = subprocess.run([python, str(script), str(src), str(dst), str(code), *flags, *keep],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not dst.is_file():
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
        raise ExportError(f"llama.cpp's quantizer failed on {src.name} ({tail}); nothing was written")
