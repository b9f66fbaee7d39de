"""What llama.cpp accepts, decided from a config before any work: the ``--target`` that names it, the block of its
quantized KV caches and the latent width they store (:func:`cache_block_rank`).

llama.cpp's ``deepseek2`` caches K only: one row of ``kv_lora_rank + qk_rope_head_dim`` values per token per layer,
with one ``kv_lora_rank`` for every layer. The conversion steers by these (:mod:`~mla_convert.engines.llamacpp.shape`,
:mod:`~mla_convert.engines.precheck`) and the GGUF export enforces them
(:mod:`~mla_convert.engines.llamacpp.gguf_file`): this module sits below both (scripts/imports.py).
"""

from __future__ import annotations

#: The ``--target`` value (not an export target: ``--export gguf`` writes it, ``--export deepseek-v3`` gives the
#: ``transformers`` widths).
LLAMACPP = "llama.cpp"
#: llama.cpp's ``q8_0`` block: its quantized K cache needs ``kv_lora_rank`` (the V view) and the row divisible by it.
Q8_0_BLOCK = 32


def cache_block_rank(kv_lora_rank: int, rope: int, block: int) -> int | None:
    """The smallest latent width ``>= kv_lora_rank`` that is a multiple of ``block`` with the K row
    ``width + rope`` one too (llama.cpp's quantized caches store whole blocks of ``block`` values and view the
    latent as V, so both must be); None when ``rope`` is not a multiple of ``block`` (no width makes both).
    ``block`` <= 1: ``kv_lora_rank`` itself."""
    if block <= 1:
        return kv_lora_rank
    if rope % block:
        return None
    return -(-kv_lora_rank // block) * block
