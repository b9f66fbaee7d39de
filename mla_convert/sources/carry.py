"""What travels from a source folder into a converted checkpoint, unchanged.

Everything the source ships besides its weights and model config travels byte for byte: the generation
config (eos lists, pad, sampling defaults), every tokenizer and chat-template file, and the license and
README. The source's ``README.md`` is renamed ``SOURCE_README.md`` so it does not clash with the model
card; ``LICENSE*``, ``NOTICE*``, ``USE_POLICY*`` keep their names. A folder that already carries a
``SOURCE_README.*`` (a converted checkpoint being adapted) passes that on instead of its own card.

Works from a folder path only; importing this module does not import torch or transformers.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

#: Tokenizer and chat-template files, as ``fnmatch`` patterns on the file name (case-sensitive, as
#: transformers looks them up).
TOKENIZER_PATTERNS = (
    "tokenizer*.json",  # tokenizer.json, tokenizer_config.json, versioned ``fast_tokenizer_files``
    "tokenizer.model",
    "tokenizer.model.*",  # Mistral's versioned sentencepiece files
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece*.model",
    "tekken.json",
    "*.tiktoken",
    "chat_template.json",  # processor-style template file (read by processors, not tokenizers)
    "chat_template.jinja",
)

#: Sub-folder of extra named chat templates (``additional_chat_templates/NAME.jinja``, transformers >= 4.54).
CHAT_TEMPLATE_DIR = "additional_chat_templates"

#: Files that alone make a tokenizer (``tokenizer_config.json`` or a chat template do not).
TOKENIZER_CORE_PATTERNS = (
    "tokenizer.json",
    "tokenizer.*.json",
    "tokenizer.model",
    "tokenizer.model.*",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece*.model",
    "tekken.json",
    "*.tiktoken",
)

#: Lower-case name prefixes of license-like files, carried under their own name.
LICENSE_PREFIXES = ("license", "licence", "copying", "notice", "use_policy")

GENERATION_CONFIG = "generation_config.json"
SOURCE_README_STEM = "SOURCE_README"


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


def tokenizer_files_in(folder: Path) -> dict[str, Path]:
    """Tokenizer and chat-template files of ``folder``: destination name -> file (names kept; extra
    chat templates as ``additional_chat_templates/NAME.jinja``)."""
    out = {p.name: p for p in _files(folder) if any(fnmatchcase(p.name, pat) for pat in TOKENIZER_PATTERNS)}
    extra = folder / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        out.update({f"{CHAT_TEMPLATE_DIR}/{p.name}": p for p in _files(extra) if p.suffix == ".jinja"})
    return out


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a file that defines a tokenizer (``tokenizer.json``, ``tokenizer.model``,
    ``vocab.json``, ...), not only its config or chat template."""
    return any(any(fnmatchcase(p.name, pat) for pat in TOKENIZER_CORE_PATTERNS) for p in _files(folder))


def _readme_names(folder: Path) -> dict[str, Path]:
    files = _files(folder)
    carried = [p for p in files if p.stem.upper() == SOURCE_README_STEM]
    if carried:  # a converted checkpoint: its README.md is our card, the source's travels on
        return {p.name: p for p in carried}
    readme = [p for p in files if p.stem.upper() == "README"]
    return {f"{SOURCE_README_STEM}{p.suffix}": p for p in readme[:1]}


def carried_files(src_dir: Path) -> dict[str, Path]:
    """Every file of ``src_dir`` that travels into a converted checkpoint: destination name -> source file.

    Covers ``generation_config.json``, the tokenizer and chat-template files (:func:`tokenizer_files_in`),
    license files (``LICENSE*``, ``NOTICE*``, ``USE_POLICY*``, any case; names kept) and the README (as
    ``SOURCE_README.md``). Names are relative POSIX paths inside the checkpoint, sorted.
    """
    out: dict[str, Path] = {}
    gen = src_dir / GENERATION_CONFIG
    if gen.is_file():
        out[GENERATION_CONFIG] = gen
    out.update(tokenizer_files_in(src_dir))
    out.update({p.name: p for p in _files(src_dir) if p.name.lower().startswith(LICENSE_PREFIXES)})
    out.update(_readme_names(src_dir))
    return dict(sorted(out.items()))


def copy_carried(src_dir: Path, folder: Path) -> list[str]:
    """Copy :func:`carried_files` of ``src_dir`` into ``folder`` (bytes and times kept; existing files of
    the same name replaced); returns the destination names, sorted.

    Raises:
        OSError: a file cannot be read or written.
    """
    files = carried_files(src_dir)
    for name, path in files.items():
        dest = folder / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    return list(files)


def generation_config_from(config: Any) -> dict[str, Any]:
    """The generation config a source without one gets: its model config's ``bos``/``eos``/``pad`` ids
    (``None`` ones left out)."""
    ids = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {k: v for k, v in ids.items() if v is not None}


def write_generation_config(folder: Path, src_dir: Path | None, config: Any) -> bool:
    """Write ``folder/generation_config.json``: the source's file verbatim when ``src_dir`` has one,
    else one from ``config``'s bos/eos/pad ids (transformers' ``GenerationConfig`` layout).

    Returns:
        True when the source's file was copied.

    Raises:
        OSError: the file cannot be read or written.
    """
    gen = src_dir / GENERATION_CONFIG if src_dir is not None else None
    if gen is not None and gen.is_file():
        shutil.copy2(gen, folder / GENERATION_CONFIG)
        return True
    from transformers import GenerationConfig

    GenerationConfig(**generation_config_from(config)).save_pretrained(str(folder))
    return False


def model_card_source_files(names: Iterable[str]) -> str:
    """One model-card line naming the files carried from the source (``""`` when there are none), e.g.
    ``Carried from the source, unchanged: `LICENSE`, `SOURCE_README.md`, `generation_config.json`.``"""
    names = sorted(names)
    if not names:
        return ""
    return "Carried from the source, unchanged: " + ", ".join(f"`{n}`" for n in names) + "."
