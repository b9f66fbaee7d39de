"""Chat-templated calibration text made from bundled prose: the ``wikipedia-chat`` corpus.

An instruct model serves chat-templated dialogue, so part of its calibration should be that (issue 50; the chat
calibration table in docs/results.md: chat-templated calibration halves the chat KL of SmolLM2's conversion). No chat
data ships in a registry package, so the conversations are built from the Wikipedia *calibration* split's articles
(never its evaluation split): each article is cut into passages; for each, the user asks for a summary of the passage
and the assistant answers with its first two sentences, then the user asks which article it is from and the
assistant names it. Rendered with the model's own chat template, so the calibration windows hold its role and
turn tokens where it serves them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mla_convert.text.document import Document, TextError

__all__ = ["CHAT_CORPORA", "chat_documents", "has_chat_template", "wikipedia_conversations"]

#: Names of the bundled chat corpora (rendered with the tokenizer's chat template; a text spec or data spec names them).
CHAT_CORPORA = ("wikipedia-chat",)
#: Characters per passage, and at most this many conversations (more than 16,384 tokens of calibration after the split).
PASSAGE_CHARS = 1200
MAX_CONVERSATIONS = 400


def wikipedia_conversations(
    count: int = MAX_CONVERSATIONS, chunk: int = PASSAGE_CHARS
) -> list[tuple[str, list[dict[str, str]]]]:
    """``(id, messages)`` conversations built from the Wikipedia calibration split (see the module docstring).

    Args:
        count: at most this many conversations, drawn evenly across all the passages.
        chunk: characters per passage.

    Returns:
        ``(id, messages)`` pairs; ``id`` is ``wikipedia-chat:<article id>@<character offset>``, ``messages`` four
        ``{"role", "content"}`` turns (user, assistant, user, assistant).

    Raises:
        mla_convert.sources.assets.AssetError: The Wikipedia archive cannot be obtained.
    """
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import split_documents

    docs = split_documents(load_documents("wikipedia"))["calibration"]
    passages = [(d, i) for d in docs for i in range(0, len(d.text) - chunk // 2, chunk)]
    rows = []
    for d, i in passages[:: max(1, len(passages) // count)][:count]:
        text = d.text[i : i + chunk]
        sentences = text.replace("\n", " ").split(". ")
        messages = [
            {"role": "user", "content": "Summarize this passage:\n\n" + text},
            {"role": "assistant", "content": ". ".join(sentences[:2]).strip().rstrip(".") + "."},
            {"role": "user", "content": "Which article is it from?"},
            {"role": "assistant", "content": d.title or " ".join(sentences[0].split()[:6])},
        ]
        rows.append((f"wikipedia-chat:{d.id}@{i}", messages))
    return rows


def chat_documents(name: str, tokenizer: Any) -> list[Document]:
    """The documents of a bundled chat corpus, each conversation rendered with ``tokenizer``'s chat template.

    Raises:
        TextError: ``name`` is not a chat corpus, or the tokenizer has no chat template.
    """
    if name not in CHAT_CORPORA:
        raise TextError(f"{name!r} is not a chat corpus; use {', '.join(CHAT_CORPORA)}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise TextError(
            f"{name}: this model's tokenizer has no chat template, so chat calibration does not apply; "
            "drop it from the calibration text"
        )
    docs = []
    for doc_id, messages in wikipedia_conversations():
        text = str(tokenizer.apply_chat_template(messages, tokenize=False))
        docs.append(Document.make(doc_id, doc_id.split(":", 1)[1], text.strip()))
    return docs


def has_chat_template(folder: Path | None) -> bool:
    """Whether the tokenizer files in ``folder`` carry a chat template (``chat_template.jinja``, or
    ``tokenizer_config.json``'s ``chat_template``), read without loading the tokenizer; False for None or an
    unreadable folder."""
    if folder is None:
        return False
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(isinstance(config, dict) and config.get("chat_template"))
