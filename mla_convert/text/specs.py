"""Data specs: the ``--data`` option of ``mla-convert adapt``, one source of a training mixture each.

A spec is ``SOURCE[,key=value...]``:

* ``SOURCE``: a bundled corpus (``wikipedia``, ``news``, ``shakespeare``, ``python``, ``code``; ``wikipedia-chat``,
  rendered with the tokenizer's chat template: :mod:`mla_convert.text.chats`), local files or folders (``.txt``,
  ``.jsonl``, ``.json``, ``.parquet``, ``.csv``, saved ``datasets`` folders; several joined by commas), or a
  Hugging Face dataset id (``owner/name``, loaded with ``datasets.load_dataset`` where a network exists).
* ``field=NAME``: the text column of data files (default ``text``).
* ``messages=NAME``: a column of chat conversations, rendered with the tokenizer's chat template.
* ``weight=W``: relative sampling weight in a mixture (default: the source's own size, i.e. each training
  row once per epoch).
* ``loss=all|assistant``: which tokens the loss counts; ``assistant`` (chat data only) counts the assistant
  turns (their content and end-of-turn tokens), the way instruction tuning masks prompts.

Parsing is pure (no file is read) so every spec is checked with the other flags before anything loads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mla_convert.text.chats import CHAT_CORPORA
from mla_convert.text.corpora import BUNDLED_CORPORA, Document, TextError

__all__ = ["DataSpec", "parse_data_spec", "spec_documents"]

_KEYS = ("field", "messages", "weight", "loss")
#: Suffixes that make a missing ``a/b.x`` a local path rather than a hub dataset id.
_FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".csv", ".arrow", ".gz", ".zst")
#: ``owner/name`` of a Hugging Face dataset (tried only when no such local path exists).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class DataSpec(BaseModel):
    """One parsed ``--data`` source (see the module docstring for the syntax)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="bundled corpus name, comma-separated local paths, or a hub dataset id")
    field: str = "text"
    messages: str | None = None
    weight: float | None = Field(default=None, gt=0)
    loss: Literal["all", "assistant"] = "all"

    @property
    def kind(self) -> Literal["bundled", "local", "hub"]:
        """``bundled`` corpus name, ``local`` paths, or a ``hub`` dataset id: ``owner/name`` where neither the
        path nor its first folder exists and the name has no text or data-file suffix (``data/x.jsonl`` is a
        missing local file, not a dataset)."""
        if self.source.strip().lower() in BUNDLED_CORPORA + CHAT_CORPORA:
            return "bundled"
        path = Path(self.source.strip()).expanduser()
        if (
            _HUB_ID.match(self.source.strip())
            and not path.exists()
            and not path.parent.exists()
            and path.suffix.lower() not in _FILE_SUFFIXES
        ):
            return "hub"
        return "local"

    def label(self) -> str:
        """The spec written back as the user would type it (for reports and manifests)."""
        parts = [self.source]
        if self.field != "text":
            parts.append(f"field={self.field}")
        if self.messages:
            parts.append(f"messages={self.messages}")
        if self.loss != "all":
            parts.append(f"loss={self.loss}")
        if self.weight is not None:
            parts.append(f"weight={self.weight:g}")
        return ",".join(parts)


def parse_data_spec(spec: str) -> DataSpec:
    """Parse ``SOURCE[,field=NAME][,messages=NAME][,weight=W][,loss=all|assistant]``.

    Parts without ``=`` make up the source (so ``a.txt,b.txt,weight=2`` is one source of two files).

    Returns:
        The :class:`DataSpec`.

    Raises:
        TextError: no source, an unknown or repeated key, a weight that is not a positive number, a bad
            ``loss``, ``loss=assistant`` without ``messages=``, or local paths of which one does not exist.
    """
    parts = [p.strip() for p in spec.split(",")]
    source_parts: list[str] = []
    values: dict[str, str] = {}
    for part in parts:
        if "=" not in part:
            if part:
                source_parts.append(part)
            continue
        key, value = (x.strip() for x in part.split("=", 1))
        if key not in _KEYS:
            raise TextError(
                f"--data {spec!r}: unknown key {key!r}; use SOURCE[,field=NAME][,messages=NAME][,weight=W]"
                "[,loss=all|assistant]"
            )
        if key in values:
            raise TextError(f"--data {spec!r}: {key}= given twice")
        if not value:
            raise TextError(f"--data {spec!r}: {key}= has no value")
        values[key] = value
    if not source_parts:
        raise TextError(f"--data {spec!r} names no source; start it with a corpus name, path or dataset id")
    weight: float | None = None
    if "weight" in values:
        try:
            weight = float(values["weight"])
        except ValueError:
            weight = None
        if weight is None or not weight > 0 or weight == float("inf"):
            raise TextError(f"--data {spec!r}: weight={values['weight']} is not a positive number")
    loss = values.get("loss", "all")
    if loss not in ("all", "assistant"):
        raise TextError(f"--data {spec!r}: loss={loss} is not 'all' or 'assistant'")
    if loss == "assistant" and "messages" not in values:
        raise TextError(
            f"--data {spec!r}: loss=assistant needs chat data; name its conversation column with messages=NAME"
        )
    if "field" in values and "messages" in values:
        raise TextError(f"--data {spec!r}: give field= (plain text) or messages= (chat), not both")
    if ("field" in values or "messages" in values) and ",".join(
        source_parts
    ).strip().lower() in BUNDLED_CORPORA + CHAT_CORPORA:
        raise TextError(
            f"--data {spec!r}: {source_parts[0]} is plain text; field=/messages= apply to data files"
        )
    parsed = DataSpec(
        source=",".join(source_parts),
        field=values.get("field", "text"),
        messages=values.get("messages"),
        weight=weight,
        loss=loss,  # type: ignore[arg-type]
    )
    if parsed.kind == "local":
        for p in source_parts:
            if not Path(p).expanduser().exists():
                raise TextError(
                    f"--data {spec!r}: {p}: no such file or folder (bundled corpora: "
                    f"{', '.join(BUNDLED_CORPORA + CHAT_CORPORA)}; a hub dataset id is owner/name)"
                )
    return parsed


def spec_documents(spec: DataSpec, tokenizer: Any | None = None) -> list[Document]:
    """The documents of one source: a bundled corpus, local files/folders, or a hub dataset's rows.

    Args:
        spec: the parsed source.
        tokenizer: renders chat ``messages`` (needed for them).

    Raises:
        TextError: ``field=``/``messages=`` on a bundled corpus, a chat corpus without a chat template, or what
            :func:`~mla_convert.text.corpora.local_documents` / :func:`~mla_convert.text.datafiles.hub_documents`
            raise.
        mla_convert.sources.assets.AssetError: a bundled corpus cannot be obtained.
    """
    from mla_convert.text.chats import chat_documents
    from mla_convert.text.corpora import load_documents, local_documents
    from mla_convert.text.datafiles import hub_documents

    assistant = spec.loss == "assistant"
    if spec.kind == "bundled":
        if spec.messages or spec.field != "text":
            raise TextError(
                f"--data {spec.label()!r}: {spec.source} is plain text; field=/messages= apply to data files"
            )
        name = spec.source.strip().lower()
        return chat_documents(name, tokenizer) if name in CHAT_CORPORA else load_documents(name)
    if spec.kind == "hub":
        return hub_documents(spec.source, spec.field, spec.messages, tokenizer, assistant)
    paths = [Path(p.strip()).expanduser() for p in spec.source.split(",")]
    return local_documents(paths, spec.field, spec.messages, tokenizer, assistant)
