"""Documents from data files a user brings: JSON lines, JSON, Parquet, CSV and saved ``datasets`` folders.

Tables are read with Hugging Face ``datasets`` (``load_dataset`` with its packaged ``json``/``parquet``/``csv``
builders on local files, ``load_from_disk`` for a folder written by ``Dataset.save_to_disk``; nothing is
fetched). One row is one document: the text of a column (``text`` by default), or a chat ``messages`` column
(a list of ``{"role", "content"}``) rendered with the tokenizer's chat template. A table without the text
column whose ``messages`` column holds such conversations is chat data (the convention of TRL and of the
chat-template docs) and is read as ``messages=messages``. Document ids are ``<kind>:<file name>#<row>``, so a
manifest names every row it used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mla_convert.text.document import Document, TextError

#: File suffix -> the ``datasets`` packaged builder that reads it.
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
#: The conversation column read as chat data when the text column is missing (TRL's ``messages``).
CHAT_COLUMN = "messages"
#: Rows sampled to tell whether a column holds conversations.
_SAMPLE_ROWS = 8

__all__ = [
    "CHAT_COLUMN",
    "TABLE_SUFFIXES",
    "assistant_spans",
    "conversation_columns",
    "hub_documents",
    "is_conversation",
    "is_table",
    "load_table",
    "rows_documents",
    "table_documents",
]


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
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own error line would precede ours
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises builder-specific errors for malformed input
        # datasets wraps the parser's error in "An error occurred while generating the dataset": show the parser's
        root: BaseException = exc.__cause__ or exc.__context__ or exc
        detail = str(root).splitlines()[0] if str(root) else type(root).__name__
        raise TextError(
            f"{path}: cannot be read as {path.suffix.lower()[1:]} ({detail}); fix the file or give it the suffix of "
            "its format"
        ) from None
    finally:
        datasets.logging.set_verbosity(level)


def table_documents(
    path: Path,
    field: str = "text",
    messages: str | None = None,
    tokenizer: Any | None = None,
    assistant: bool = False,
) -> list[Document]:
    """One document per row of the table at ``path``.

    Args:
        path: a data file of :data:`TABLE_SUFFIXES` or a saved ``datasets`` folder.
        field: the column of plain text (used when ``messages`` is None).
        messages: a column of chat conversations (lists of ``{"role": str, "content": str}``), rendered with
            ``tokenizer.apply_chat_template(..., tokenize=False)``. None with no ``field`` column: the
            :data:`CHAT_COLUMN` column when it holds conversations (chat data, as TRL reads it).
        tokenizer: needed for conversations.
        assistant: record the character spans of the assistant turns (``Document.loss_spans``) for a loss on
            assistant tokens only (:func:`assistant_spans`).

    Returns:
        Documents ``<kind>:<file name>#<row>`` in row order; rows whose text is empty are skipped.

    Raises:
        TextError: unreadable table, a missing column (the line names a column of conversations where there is
            one, as ``messages=NAME``), a column that does not hold strings (or conversations),
            ``messages`` without a tokenizer that has a chat template, a template that fails on a row (or, with
            ``assistant``, does not render a conversation by appending turns), or no non-empty row.
    """
    kind = "data" if path.is_dir() else path.suffix.lower()[1:]
    return rows_documents(
        load_table(path), str(path), f"{kind}:{path.name}", path.stem, field, messages, tokenizer, assistant
    )


def hub_documents(
    dataset_id: str,
    field: str = "text",
    messages: str | None = None,
    tokenizer: Any | None = None,
    assistant: bool = False,
) -> list[Document]:
    """One document per row of the ``train`` split of a Hugging Face dataset (needs a network or the
    ``datasets`` cache); ids ``hub:<dataset id>#<row>``. Arguments and errors as :func:`table_documents`.

    Raises:
        TextError: the dataset cannot be loaded (no network, unknown id, no ``train`` split), or as
            :func:`table_documents`.
    """
    import os
    import socket

    import datasets

    datasets.disable_progress_bars()
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if not offline:  # fail in seconds, not after the hub client's retries, when there is no network
        try:
            socket.create_connection(("huggingface.co", 443), timeout=5).close()
        except OSError as exc:
            raise TextError(
                f"dataset {dataset_id!r} needs the Hugging Face hub, which cannot be reached ({exc.strerror or exc}); "
                "save it as .jsonl/.parquet or with Dataset.save_to_disk and pass the path"
            ) from None
    try:
        table = datasets.load_dataset(dataset_id, split="train")
    except Exception as exc:  # offline, unknown id, gated, no train split: one line whatever the cause
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TextError(
            f"dataset {dataset_id!r} cannot be loaded from the Hugging Face hub ({detail}); without a network "
            "save it as .jsonl/.parquet or with Dataset.save_to_disk and pass the path"
        ) from None
    stem = dataset_id.replace("/", "_")
    return rows_documents(table, dataset_id, f"hub:{dataset_id}", stem, field, messages, tokenizer, assistant)


def rows_documents(
    table: Any,
    where: str,
    prefix: str,
    stem: str,
    field: str,
    messages: str | None,
    tokenizer: Any | None,
    assistant: bool,
) -> list[Document]:
    """Documents ``<prefix>#<row>`` from a loaded ``datasets.Dataset`` (see :func:`table_documents`);
    ``where`` names the table in errors. Without ``messages`` and without the ``field`` column, a
    :data:`CHAT_COLUMN` column of conversations is read as chat data."""
    columns = ", ".join(table.column_names)
    if messages is None and field not in table.column_names:
        chats = conversation_columns(table)
        if CHAT_COLUMN not in chats:
            hint = (
                f"column {chats[0]!r} holds conversations: name it with messages={chats[0]}"
                if chats
                else "name the text column with field=NAME"
            )
            raise TextError(f"{where}: no column {field!r} (columns: {columns}); {hint}")
        if tokenizer is None:
            raise TextError(
                f"{where}: no column {field!r}; its {CHAT_COLUMN!r} column holds chat conversations, which need the "
                "model's chat template (adapt --data renders them): give a file with a text column here"
            )
        messages = CHAT_COLUMN  # chat data (TRL's convention): as if messages=messages were given
    column = messages or field
    if column not in table.column_names:
        chats = conversation_columns(table)
        hint = (
            f"column {chats[0]!r} holds conversations: name it with messages={chats[0]}"
            if chats
            else "name the conversation column with messages=NAME, or drop messages= for a text column"
        )
        raise TextError(f"{where}: no column {column!r} (columns: {columns}); {hint}")
    if messages and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
        raise TextError(
            f"{where}: chat messages need a tokenizer with a chat template; this model's tokenizer has none"
        )
    docs: list[Document] = []
    for i, value in enumerate(table[column]):
        spans: tuple[tuple[int, int], ...] | None = None
        if messages:
            text = _render(where, i, value, tokenizer)
            if assistant:
                spans = assistant_spans(where, i, value, tokenizer, text)
        elif value is None:
            continue
        elif is_conversation(value):
            raise TextError(
                f"{where}: column {column!r} holds chat conversations (row {i}), not text; "
                f"name it with messages={column}"
            )
        elif not isinstance(value, str):
            raise TextError(
                f"{where}: column {column!r} holds {type(value).__name__} (row {i}), not text; "
                "name a text column with field=NAME, or a conversation column with messages=NAME"
            )
        else:
            text = value
        if not text.strip():
            continue
        lead = len(text) - len(text.lstrip())
        body = text.strip()
        if spans is not None:  # the same characters in the stripped text
            spans = tuple(
                (max(0, a - lead), min(len(body), b - lead))
                for a, b in spans
                if min(len(body), b - lead) > a - lead
            )
        docs.append(Document.make(f"{prefix}#{i}", f"{stem} row {i}", body, loss_spans=spans))
    if not docs:
        raise TextError(f"{where}: column {column!r} has no non-empty row")
    return docs


def is_conversation(value: Any) -> bool:
    """Whether ``value`` is one conversation: a non-empty list of ``{"role", "content", ...}`` dicts."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def conversation_columns(table: Any) -> list[str]:
    """The columns of a ``datasets.Dataset`` whose values in the first rows (up to 8 non-empty ones) are all
    conversations (:func:`is_conversation`), in column order."""
    sample = table[: min(len(table), _SAMPLE_ROWS)]
    found = []
    for name in table.column_names:
        values = [v for v in sample[name] if v is not None]
        if values and all(is_conversation(v) for v in values):
            found.append(name)
    return found


def assistant_spans(
    where: str, row: int, conversation: list[dict[str, Any]], tokenizer: Any, rendered: str
) -> tuple[tuple[int, int], ...]:
    """Character spans ``[start, end)`` of ``rendered`` produced by the assistant turns.

    Turn ``i`` spans from the end of ``template(messages[:i], add_generation_prompt=True)`` to the end of
    ``template(messages[:i + 1])``: its content and end-of-turn marker, not the role header. Works with any
    template that renders a conversation by appending turns (checked: each prefix must be a prefix of the
    whole rendering).

    Raises:
        TextError: the template fails on a prefix, or a prefix is not a prefix of the whole conversation.
    """
    spans = []
    for i, message in enumerate(conversation):
        if message.get("role") != "assistant":
            continue
        try:
            head = str(
                tokenizer.apply_chat_template(conversation[:i], tokenize=False, add_generation_prompt=True)
            )
            upto = str(tokenizer.apply_chat_template(conversation[: i + 1], tokenize=False))
        except Exception as exc:  # jinja errors of the model's template
            raise TextError(
                f"{where}: the chat template fails on the turns before row {row}'s answer {i} ({exc})"
            ) from None
        if not (upto.startswith(head) and rendered.startswith(upto)):
            raise TextError(
                f"{where}: row {row}: the chat template does not render a conversation by appending turns, so "
                "its assistant tokens cannot be located; use loss=all"
            )
        spans.append((len(head), len(upto)))
    return tuple(spans)


def _render(where: str, row: int, value: Any, tokenizer: Any) -> str:
    """One conversation rendered by the chat template (one line of error on a bad row)."""
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    ):
        raise TextError(f"{where}: row {row} is not a list of {{'role', 'content'}} messages")
    try:
        return str(tokenizer.apply_chat_template(value, tokenize=False))
    except Exception as exc:  # jinja errors of the model's template
        raise TextError(f"{where}: the chat template fails on row {row} ({exc})") from None
