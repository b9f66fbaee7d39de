"""Documents from data files a user brings: JSON lines, JSON, Parquet, CSV and saved ``datasets`` folders.

Tables are read with Hugging Face ``datasets`` (``load_dataset`` with its packaged ``json``/``parquet``/``csv``
builders on local files, ``load_from_disk`` for a folder written by ``Dataset.save_to_disk``; nothing is
fetched). One row is one document: the text of a column (``text`` by default), or a chat ``messages`` column
(a list of ``{"role", "content"}``) rendered with the tokenizer's chat template. Document ids are
``<kind>:<file name>#<row>``, so a manifest names every row it used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mla_convert.text.corpora import Document, TextError

#: File suffix -> the ``datasets`` packaged builder that reads it.
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

__all__ = ["TABLE_SUFFIXES", "is_table", "load_table", "table_documents"]


def is_table(path: Path) -> bool:
    """Whether ``path`` is a data file of :data:`TABLE_SUFFIXES` or a saved ``datasets`` folder."""
    if path.is_dir():
        return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
    return path.suffix.lower() in TABLE_SUFFIXES


def load_table(path: Path) -> Any:
    """Read a table (a ``datasets.Dataset``); a saved ``DatasetDict`` gives its ``train`` split.

    Raises:
        TextError: the file is empty or cannot be parsed as its format, or a saved dataset dict has no
            ``train`` split.
    """
    import datasets

    datasets.disable_progress_bars()
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (OSError, ValueError, FileNotFoundError) as exc:
            raise TextError(f"{path}: cannot be read as a saved datasets folder ({exc})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise TextError(
                    f"{path}: saved dataset has splits {list(loaded)}, no 'train'; save the split to use"
                )
            loaded = loaded["train"]
        return loaded
    if path.stat().st_size == 0:
        raise TextError(f"{path}: file is empty")
    builder = TABLE_SUFFIXES[path.suffix.lower()]
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises builder-specific errors for malformed input
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TextError(f"{path}: cannot be read as {path.suffix.lower()[1:]} ({detail})") from None


def table_documents(
    path: Path, field: str = "text", messages: str | None = None, tokenizer: Any | None = None
) -> list[Document]:
    """One document per row of the table at ``path``.

    Args:
        path: a data file of :data:`TABLE_SUFFIXES` or a saved ``datasets`` folder.
        field: the column of plain text (used when ``messages`` is None).
        messages: a column of chat conversations (lists of ``{"role": str, "content": str}``), rendered with
            ``tokenizer.apply_chat_template(..., tokenize=False)``.
        tokenizer: needed for ``messages``.

    Returns:
        Documents ``<kind>:<file name>#<row>`` in row order; rows whose text is empty are skipped.

    Raises:
        TextError: unreadable table, a missing column, a column that does not hold strings (or conversations),
            ``messages`` without a tokenizer that has a chat template, a template that fails on a row, or no
            non-empty row.
    """
    table = load_table(path)
    column = messages or field
    if column not in table.column_names:
        raise TextError(
            f"{path}: no column {column!r} (columns: {', '.join(table.column_names)}); "
            + (
                "name the conversation column with messages=NAME"
                if messages
                else "name the text column with field=NAME"
            )
        )
    if messages and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
        raise TextError(
            f"{path}: chat messages need a tokenizer with a chat template; this model's tokenizer has none"
        )
    kind = "data" if path.is_dir() else path.suffix.lower()[1:]
    docs: list[Document] = []
    for i, value in enumerate(table[column]):
        if messages:
            text = _render(path, i, value, tokenizer)
        elif value is None:
            continue
        elif not isinstance(value, str):
            raise TextError(
                f"{path}: column {column!r} holds {type(value).__name__} (row {i}), not text; "
                "name a text column with field=NAME, or a conversation column with messages=NAME"
            )
        else:
            text = value
        if text.strip():
            docs.append(Document.make(f"{kind}:{path.name}#{i}", f"{path.stem} row {i}", text.strip()))
    if not docs:
        raise TextError(f"{path}: column {column!r} has no non-empty row")
    return docs


def _render(path: Path, row: int, value: Any, tokenizer: Any) -> str:
    """One conversation rendered by the chat template (one line of error on a bad row)."""
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    ):
        raise TextError(f"{path}: row {row} is not a list of {{'role', 'content'}} messages")
    try:
        return str(tokenizer.apply_chat_template(value, tokenize=False))
    except Exception as exc:  # jinja errors of the model's template
        raise TextError(f"{path}: the chat template fails on row {row} ({exc})") from None
