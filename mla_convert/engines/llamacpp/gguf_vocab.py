"""The tokenizer and chat template of a GGUF export (``export --format gguf``): llama.cpp's ``tokenizer.*`` keys.

Two sources, in this order:

1. the GGUF file the checkpoint was converted from (the bundled SmolLM2 file, the built-in Qwen2.5-Coder file, or a
   ``.gguf`` SOURCE still at its recorded path with the sha256 the manifest records): its ``tokenizer.*`` keys as
   they are;
2. the Hugging Face tokenizer the checkpoint folder carries (``tokenizer.json`` or ``tokenizer.model``, copied from
   the source at conversion): written by llama.cpp's own ``convert_hf_to_gguf.py --vocab-only`` (kept by
   ``scripts/llamacpp_env.sh`` in the llama.cpp venv, run by this python, which has the torch, transformers and
   sentencepiece it imports) on a staging folder of those files and a ``config.json`` naming the source's
   architecture, so that the vocabulary, merges, special ids, BOS behaviour and the pre-tokenizer type
   (``tokenizer.ggml.pre``, chosen by llama.cpp from the tokenizer's own output) are what llama.cpp's converter writes
   for the source model. Its other keys are dropped.

The export's llama.cpp check then asserts that llama.cpp tokenizes the check's prompts as the checkpoint's tokenizer
does (:mod:`~mla_convert.engines.llamacpp.check`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mla_convert.engines.deepseek_v3.mapping import ExportError

#: The files of a Hugging Face tokenizer a checkpoint may carry (copied to the converter's staging folder).
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
#: Source ``model_type`` -> the architecture llama.cpp's converter reads the tokenizer as.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
#: Seconds the converter may take (a vocabulary of ~150k tokens takes ~10 s).
CONVERTER_TIMEOUT_S = 600


def source_gguf(ckpt: Path) -> Path | None:
    """The GGUF file ``ckpt`` was converted from, found again (the bundled SmolLM2 file, the built-in Qwen2.5-Coder
    file, or the recorded path with the recorded sha256); None for a Hugging Face folder source or a file that is
    gone or changed."""
    m = ckpt / "mla_manifest.json"
    if not m.is_file():
        return None
    source = json.loads(m.read_text()).get("source") or {}
    files = [f for f in source.get("files") or [] if str(f.get("name", "")).endswith(".gguf")]
    origin = str(source.get("origin", ""))
    if not files:
        return None
    if origin.lower() == "smollm2-135m":
        from mla_convert.sources.assets import bundled_gguf_path

        return bundled_gguf_path()
    if origin.lower() == "qwen2.5-coder-1.5b":
        from mla_convert.sources import qwen_coder

        return qwen_coder.qwen_coder_gguf_path()
    path = Path(origin).expanduser()
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            digest.update(block)
    return path if digest.hexdigest() == files[0].get("sha256") else None


def has_hf_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a Hugging Face tokenizer (``tokenizer.json`` or a sentencepiece ``tokenizer.model``)."""
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()


def vocab_converter() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` as ``scripts/llamacpp_env.sh`` keeps it (``<venv>/llama.cpp``, beside
    its ``gguf-py`` and ``conversion`` package), for the venv :func:`~mla_convert.engines.llamacpp.env.find_llamacpp`
    finds; None without one.

    Raises:
        ExportError: ``MLA_LLAMACPP_PYTHON`` names no file.
    """
    from mla_convert.engines.llamacpp.env import find_llamacpp

    python = find_llamacpp()
    if python is None:
        return None
    path = Path(python).absolute().parent.parent / "llama.cpp" / "convert_hf_to_gguf.py"  # not resolve(): a venv python links out
    return path if path.is_file() else None


def tokenizer_problem(ckpt: Path) -> str | None:
    """Why the GGUF export of ``ckpt`` cannot carry its tokenizer (None: it can, from the source GGUF or from the
    Hugging Face tokenizer in ``ckpt``).

    Raises:
        ExportError: ``MLA_LLAMACPP_PYTHON`` names no file.
    """
    return None if source_gguf(ckpt) is not None else _hf_problem(ckpt)


def _hf_problem(ckpt: Path) -> str | None:
    """Why the Hugging Face tokenizer in ``ckpt`` cannot be written as GGUF keys (None: it can)."""
    if not has_hf_tokenizer(ckpt):
        return (
            f"{ckpt} holds no tokenizer (tokenizer.json or tokenizer.model) and was not converted from a GGUF file "
            "still at its recorded path with its recorded sha256: copy the source's tokenizer files into it, or "
            "convert from the .gguf file"
        )
    if vocab_converter() is None:
        env, root = os.environ.get("MLA_LLAMACPP_PYTHON"), os.environ.get("MLA_LLAMACPP_VENV_ROOT")
        where = (
            f"MLA_LLAMACPP_PYTHON={env} has no llama.cpp/convert_hf_to_gguf.py beside its venv"
            if env
            else f"no llama.cpp venv was found in {root or '~/.cache/mla-convert'}"
        )
        return (f"{ckpt}'s tokenizer is a Hugging Face one, which the GGUF export writes with llama.cpp's own "
                f"convert_hf_to_gguf.py --vocab-only, and {where}: run `bash scripts/llamacpp_env.sh` (it builds the "
                "venv and keeps the converter) and point MLA_LLAMACPP_PYTHON at the python it prints, or unset it")
    eos = _hf_eos(ckpt)
    if eos:
        return eos
    return None


def _hf_eos(ckpt: Path) -> str | None:
    """Why ``ckpt``'s Hugging Face tokenizer cannot end a generation in llama.cpp (no EOS token: its
    ``tokenizer_config.json`` / ``special_tokens_map.json`` missing), or unreadable; None when it is fine."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(ckpt))
    except Exception as exc:  # noqa: BLE001 - any failure to read the files is the user's to fix
        return (f"{ckpt}'s tokenizer files cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): "
                "copy the source model's tokenizer files (tokenizer.json, tokenizer_config.json, ...) into it")
    if tok.eos_token_id is None:
        return (f"{ckpt}'s tokenizer has no EOS token (is tokenizer_config.json or special_tokens_map.json missing?), "
                "so llama.cpp could not stop a generation: copy the source model's tokenizer files into it")
    return None


def gguf_tokenizer_fields(path: Path) -> list[tuple[str, Any, Any, Any]]:
    """``(key, value, type, sub_type)`` of every ``tokenizer.*`` key of the GGUF ``path`` (vocabulary, merges,
    special token ids, chat template), as :meth:`gguf.GGUFWriter.add_key_value` takes them."""
    from gguf import GGUFReader, GGUFValueType

    out = []
    for key, field in GGUFReader(str(path)).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    return out


def tokenizer_fields(ckpt: Path, config: Any) -> tuple[list[tuple[str, Any, Any, Any]], str]:
    """The ``tokenizer.*`` keys of ``ckpt``'s GGUF export and where they came from (a sentence for the record).

    Args:
        ckpt: the MLA checkpoint folder.
        config: its :class:`~mla_convert.mla.configuration.MLAConfig` (the vocabulary size and the source's
            ``model_type`` the converter reads).

    Raises:
        ExportError: no tokenizer can be carried (:func:`tokenizer_problem`), or llama.cpp's converter failed on it
            (its last error line, e.g. a BPE pre-tokenizer it does not know).
    """
    source = source_gguf(ckpt)  # once: a user's GGUF source is hashed whole to be found again
    if source is not None:
        return gguf_tokenizer_fields(source), f"the source GGUF's tokenizer keys ({source.name})"
    problem = _hf_problem(ckpt)
    if problem:
        raise ExportError(problem)
    converter = vocab_converter()
    assert converter is not None
    model_type = str((getattr(config, "source", None) or {}).get("model_type") or "llama")
    with tempfile.TemporaryDirectory(prefix="mla-vocab-") as tmp:
        stage = Path(tmp) / "tokenizer"
        stage.mkdir()
        for name in HF_TOKENIZER_FILES:
            if (ckpt / name).is_file():
                shutil.copyfile(ckpt / name, stage / name)
        heads = int(config.num_attention_heads)
        (stage / "config.json").write_text(
            json.dumps(
                {
                    "architectures": [_ARCHITECTURES.get(model_type, "LlamaForCausalLM")],
                    "model_type": model_type,
                    "vocab_size": int(config.vocab_size),
                    "hidden_size": int(config.hidden_size),
                    "num_hidden_layers": int(config.num_hidden_layers),
                    "num_attention_heads": heads,
                    "num_key_value_heads": heads,
                    "intermediate_size": int(config.intermediate_size),
                    "rms_norm_eps": float(config.rms_norm_eps),
                    "max_position_embeddings": int(config.max_position_embeddings),
                    "rope_theta": 10000.0,
                    "tie_word_embeddings": bool(config.tie_word_embeddings),
                }
            )
        )
        out = Path(tmp) / "vocab.gguf"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        biased = any(getattr(config, f, False) for f in ("q_bias", "kv_a_bias", "o_bias"))
        instead = ("serve it through transformers (mla-convert generate / eval) or vLLM with our plugin" if biased
                   else "export --format deepseek-v3")  # a biased conversion has no DeepSeek-V3 export either
        cmd = [sys.executable, str(converter), str(stage), "--vocab-only", "--outfile", str(out)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=CONVERTER_TIMEOUT_S, env=env, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ExportError(f"llama.cpp's convert_hf_to_gguf.py --vocab-only on {ckpt}'s tokenizer took over "
                              f"{CONVERTER_TIMEOUT_S} s; {instead}") from exc
        if res.returncode != 0 or not out.is_file():
            lines = [x for x in (res.stderr + res.stdout).splitlines() if x.strip()]
            last = next((x for x in reversed(lines) if "Error" in x or "error" in x), lines[-1] if lines else "")
            raise ExportError(f"llama.cpp's convert_hf_to_gguf.py --vocab-only could not write the tokenizer in "
                              f"{ckpt} ({', '.join(n for n in HF_TOKENIZER_FILES if (ckpt / n).is_file())}; exit "
                              f"{res.returncode}: {last.strip()[:300]}): check those files against the source model's "
                              f"(a tokenizer llama.cpp does not know is named in that line), or {instead}")
        return (gguf_tokenizer_fields(out),
                f"the checkpoint's Hugging Face tokenizer, written by llama.cpp's {converter.name} --vocab-only")
