"""Quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``), keeping some tensors float32.

Run with the python of a llama.cpp venv (``scripts/llamacpp_env.sh``); it imports only ``llama_cpp``::

    python quantize.py IN.gguf OUT.gguf FTYPE [--allow-requantize] [KEEP_F32_PATTERN ...]

``FTYPE`` is a ``llama_ftype`` number (include/llama.h: 0 ALL_F32, 1 MOSTLY_F16, 7 Q8_0, 15 Q4_K_M, ...).
``--allow-requantize`` lets quantized input tensors through (dequantized, then written as ``FTYPE``: how the
benchmarks turn the bundled Q4_1 source into float32). Each pattern (a regex on the
tensor name) is kept as GGML_TYPE_F32 through ``tt_overrides``: the GGUF export's ``attn_kv_a_mqa`` holds the latent
rows of the linear latent norm scaled by a tiny power of two, which a block's float16 scale cannot hold.
Exit status 0 on success.
"""

from __future__ import annotations

import ctypes
import sys


def main(src: str, dst: str, ftype: int, keep: list[str], allow_requantize: bool = False) -> int:
    """Quantize ``src`` into ``dst`` as ``ftype`` with the ``keep`` patterns float32; returns llama.cpp's status."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    params.allow_requantize = allow_requantize
    overrides = (llama_cpp.llama_model_tensor_override * (len(keep) + 1))()
    for i, pattern in enumerate(keep):
        overrides[i].pattern = pattern.encode()
        overrides[i].type = 0  # GGML_TYPE_F32
    overrides[len(keep)].pattern = None
    params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    return int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: python quantize.py IN.gguf OUT.gguf FTYPE [--allow-requantize] [KEEP_F32_PATTERN ...]")
    rest = sys.argv[4:]
    requantize = "--allow-requantize" in rest
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), [x for x in rest if x != "--allow-requantize"], requantize))
