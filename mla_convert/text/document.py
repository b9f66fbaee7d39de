"""A document of plain text, the unit every reader of text yields (:mod:`~mla_convert.text.corpora`,
:mod:`~mla_convert.text.datafiles`), and the error text input raises."""

from __future__ import annotations

from dataclasses import dataclass

from mla_convert.errors import UserError
from mla_convert.files import sha256_text

__all__ = ["Document", "TextError"]


class TextError(UserError):
    """Text input is unusable (missing, empty, unreadable or too short); the message is one line."""


@dataclass(frozen=True)
class Document:
    """One document of plain text.

    Attributes:
        id: Stable unique id: ``wiki:<page id>``, ``news:<line number>`` or ``file:<file name>``.
        title: Human-readable title.
        text: The plain text.
        sha256: Hex sha256 of ``text`` encoded as UTF-8.
        loss_spans: For a loss on part of the text (assistant turns of a conversation): the character spans
            ``[start, end)`` whose tokens count; None: every token counts.
    """

    id: str
    title: str
    text: str
    sha256: str
    loss_spans: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def make(
        cls, id: str, title: str, text: str, loss_spans: tuple[tuple[int, int], ...] | None = None
    ) -> Document:
        """Build a document, computing ``sha256`` from ``text``."""
        return cls(id=id, title=title, text=text, sha256=sha256_text(text), loss_spans=loss_spans)
