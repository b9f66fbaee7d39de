"""Helpers for tests that need tiny real checkpoints (random weights, real transformers layout).

Plain functions, not fixtures: a test module wraps them in the fixtures it needs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

#: A tiny Llama: head_dim 16 (8 RoPE pairs per head), 2 KV heads, SmolLM2's vocabulary size so the
#: bundled SmolLM2 tokenizer fits it.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 49152,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}

#: Tokenizer files copied from the bundled model next to a tiny checkpoint.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def write_tiny_llama(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random tiny ``LlamaForCausalLM`` (config + one safetensors file) into ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    model.save_pretrained(str(folder))
    return folder


def write_config(folder: Path, config: Any) -> None:
    """Replace ``folder/config.json`` with a transformers config object (as ``save_pretrained`` writes it)."""
    (folder / "config.json").unlink(missing_ok=True)
    config.save_pretrained(str(folder))


def edit_config(folder: Path, **changes: Any) -> dict[str, Any]:
    """Change keys of ``folder/config.json`` in place; returns the new dict."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg, indent=2))
    return cfg


@functools.cache
def bundled_model_dir() -> Path:
    """The cached safetensors folder of the bundled SmolLM2-135M (built once from its GGUF)."""
    from mla_convert.sources.checkpoint import open_source

    return open_source("smollm2-135m").path


def copy_tokenizer(folder: Path) -> list[str]:
    """Copy the bundled model's tokenizer files into ``folder``; returns the names copied."""
    src = bundled_model_dir()
    names = [n for n in TOKENIZER_FILES if (src / n).exists()]
    for n in names:
        shutil.copy2(src / n, folder / n)
    return names


def drop_tensor(file: Path, name: str) -> None:
    """Rewrite a safetensors file without tensor ``name`` (metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != name}
    assert len(tensors) >= 1
    save_file(tensors, str(file), metadata=meta)


def truncate_half(file: Path) -> int:
    """Cut a file to half its size; returns the new size."""
    data = file.read_bytes()
    half = len(data) // 2
    file.write_bytes(data[:half])
    return half


def tree_digest(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder`` (empty when it does not exist)."""
    if not folder.exists():
        return {}
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def leftovers(out: Path) -> list[str]:
    """Temporary siblings an atomic write of ``out`` may leave (``.OUT.tmp-*``, ``.OUT.old-*``)."""
    parent = out.parent
    if not parent.exists():
        return []
    return sorted(
        p.name for p in parent.iterdir() if p.name.startswith((f".{out.name}.tmp-", f".{out.name}.old-"))
    )


def write_tiny_family(folder: Path, family: str, **overrides: Any) -> Path:
    """A random tiny ``llama`` (GQA), ``mha`` (Llama, 4 KV heads), ``mistral`` or ``qwen2`` (random q/k/v biases)
    checkpoint in ``folder`` (seed 0); ``overrides`` change :data:`TINY`'s keys."""
    import torch

    torch.manual_seed(0)
    shape = {**TINY, **overrides}
    if family in ("llama", "mha"):
        return write_tiny_llama(folder, **({"num_key_value_heads": 4} if family == "mha" else {}), **overrides)
    if family == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        MistralForCausalLM(MistralConfig(**shape, sliding_window=None)).save_pretrained(str(folder))
        return folder
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**shape))
    with torch.no_grad():  # transformers initialises biases to zero: make them carry something
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    model.save_pretrained(str(folder))
    return folder


def convert(src: Any, calibration: Any, held_out: Any = None, keep_stats: bool = False, **options: Any) -> Any:
    """The product conversion (:func:`mla_convert.convert.pipeline.build.convert_windows`, the passes ``factor`` runs)
    of ``src`` on calibration windows ``[N, T]`` with ``options`` (float32 weights unless ``dtype`` is given; the closed
    form unless ``reconstruct_steps`` is given, on a GPU too, where ``factor`` fits by default); returns the
    :class:`~mla_convert.convert.pipeline.build.Conversion`."""
    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.convert.pipeline.build import convert_windows

    opts = ConvertOptions(**{"dtype": "float32", "reconstruct_steps": 0, **options})
    return convert_windows(src, opts, calibration, held_out, keep_stats=keep_stats)
