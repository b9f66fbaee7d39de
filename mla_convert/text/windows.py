"""Documents -> disjoint role splits, fixed-length token windows, and manifest records.

Documents are split between roles *by document* (never by window), so that calibration, adaptation
and evaluation text are disjoint; :func:`documents_record` gives the ids and hashes to put in a
manifest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mla_convert.files import sha256_text
from mla_convert.text.corpora import Document, TextError

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_FRACTIONS", "SpreadWindows", "documents_record", "split_documents", "spread_windows", "token_windows"]

#: Default split: fractions of total characters per role, assigned in this order.
DEFAULT_FRACTIONS: Mapping[str, float] = MappingProxyType(
    {"evaluation": 0.2, "calibration": 0.2, "adaptation": 0.6}
)


def _id_key(doc: Document) -> tuple[str, str]:
    """Sort key: ``sha256(id)``, then the id itself."""
    return sha256_text(doc.id), doc.id


def split_documents(
    docs: Sequence[Document], fractions: Mapping[str, float] = DEFAULT_FRACTIONS
) -> dict[str, list[Document]]:
    """Split documents between roles, disjointly and deterministically, by characters.

    Documents are ordered by ``sha256(doc.id)`` and dealt out in that order to the roles in the order
    given (``evaluation`` first by default): a role keeps taking the next document while the midpoint of
    that document stays within the role's cumulative share of the total characters, and the last role
    takes the rest. Each role with a positive fraction gets at least one document. The result depends
    only on the ids, lengths and fractions, not on the input order. With fewer documents than such roles
    (e.g. one book) each document is split by position instead (:func:`_split_by_position`).

    Args:
        docs: Documents with unique ids.
        fractions: Role name -> fraction of total characters; each >= 0, summing to 1.

    Returns:
        Role -> documents (in sha256(id) order), with the roles of ``fractions`` in the same order.
        Every document is in exactly one role.

    Raises:
        TextError: Bad fractions, duplicate ids, no documents, or a document too short to split by position.
    """
    roles = list(fractions)
    if not roles:
        raise TextError("no split roles given")
    values = [float(fractions[r]) for r in roles]
    if any(not v >= 0.0 for v in values) or abs(sum(values) - 1.0) > 1e-6:
        raise TextError(f"split fractions must be >= 0 and sum to 1, got {dict(fractions)}")
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise TextError(f"duplicate document ids {dup[:3]}; each document must have a unique id")
    positive = [r for r, v in zip(roles, values, strict=True) if v > 0]
    if not docs:
        raise TextError("no documents to split; use more text")
    if len(docs) < len(positive):
        return _split_by_position(docs, roles, values)

    ordered = sorted(docs, key=_id_key)
    total = sum(len(d.text) for d in ordered)
    out: dict[str, list[Document]] = {r: [] for r in roles}
    pos = 0
    consumed = 0  # characters assigned so far
    boundary = 0.0  # cumulative character target up to the current role
    for k, (role, frac) in enumerate(zip(roles, values, strict=True)):
        boundary += frac * total
        if k == len(roles) - 1:
            out[role] = ordered[pos:]
            break
        if frac <= 0:
            continue
        later_positive = sum(1 for v in values[k + 1 :] if v > 0)
        while pos < len(ordered) and len(ordered) - pos > later_positive:
            size = len(ordered[pos].text)
            if out[role] and consumed + size / 2 > boundary:
                break
            out[role].append(ordered[pos])
            consumed += size
            pos += 1
    return out


def _split_by_position(
    docs: Sequence[Document], roles: list[str], values: list[float]
) -> dict[str, list[Document]]:
    """Fewer documents than roles (one long book is normal user text): every document is cut by position into
    consecutive pieces, one per role with a positive fraction, of those fractions of its characters (cuts
    moved to the next whitespace), in the roles' order; a piece's id is ``<id>@chars<start>-<end>``, so the
    manifest records the split as one by position.

    Raises:
        TextError: a document too short to give every role a non-empty piece.
    """
    out: dict[str, list[Document]] = {r: [] for r in roles}
    for doc in sorted(docs, key=_id_key):
        text, start, acc = doc.text, 0, 0.0
        for k, (role, frac) in enumerate(zip(roles, values, strict=True)):
            if frac <= 0:
                continue
            acc += frac
            last = all(v <= 0 for v in values[k + 1 :])
            end = len(text) if last else round(acc * len(text))
            while not last and end < len(text) and not text[end].isspace():
                end += 1
            raw = text[start:end]
            piece = raw.strip()
            if not piece:
                parts = ", ".join(r for r, v in zip(roles, values, strict=True) if v > 0)
                raise TextError(
                    f"document {doc.id!r} ({len(text)} characters) is too short to cut into {parts} parts by "
                    "position; give more text (a few thousand characters at least) or several documents"
                )
            spans = None
            if doc.loss_spans is not None:  # the same characters, counted from the piece's first one
                first = start + len(raw) - len(raw.lstrip())
                spans = tuple(
                    (max(a, first) - first, min(b, first + len(piece)) - first)
                    for a, b in doc.loss_spans
                    if min(b, first + len(piece)) > max(a, first)
                )
            out[role].append(
                Document.make(
                    f"{doc.id}@chars{start}-{end}", f"{doc.title} (characters {start}-{end})", piece, spans
                )
            )
            start = end
    return out


def adds_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` starts an encoded prompt with its BOS token, as served prompts start (Llama-3's
    ``<|begin_of_text|>``; not SmolLM2's or Qwen2's tokenizers, which add no special token). Read from what the
    tokenizer does (its post-processor), not from a config flag: ``tokenizer("a")`` with special tokens."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(with_special) and int(with_special[0]) == int(bos_id)


def token_windows(
    tokenizer: Any,
    docs: Sequence[Document],
    window: int,
    max_windows: int | None,
    bos: bool = True,
) -> torch.Tensor:
    """Tokenize documents into non-overlapping fixed-length windows.

    Documents are tokenized without special tokens and concatenated, separated by the tokenizer's
    ``eos_token_id``; the stream is cut into consecutive chunks and the remainder is dropped. With
    ``bos`` (and a tokenizer that has ``bos_token_id``) each window is ``[bos] + window - 1`` stream
    tokens, so every row is a standalone sequence; otherwise each window is ``window`` stream tokens.
    Tokenization stops early once ``max_windows`` windows are covered.

    Args:
        tokenizer: A Hugging Face (fast) tokenizer; called as ``tokenizer(texts, add_special_tokens=False)``.
        docs: Documents, in the order to use.
        window: Tokens per window (>= 1, >= 2 with a BOS).
        max_windows: Keep at most this many windows (the first ones); None keeps all.
        bos: Start every window with the BOS token (callers pass :func:`adds_bos`: windows start as the
            tokenizer starts a served prompt).

    Returns:
        ``torch.long`` tensor of shape ``[N, window]``, ``1 <= N <= max_windows``.

    Raises:
        TextError: No documents, or too little text for one window.
        ValueError: ``window`` or ``max_windows`` out of range, or the tokenizer has no EOS token.
    """
    import torch

    bos_id = getattr(tokenizer, "bos_token_id", None) if bos else None
    prefix = [int(bos_id)] if bos_id is not None else []
    body = window - len(prefix)
    if body < 1:
        raise ValueError(f"window must be >= {len(prefix) + 1}, got {window}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token_id to separate documents")
    if not docs:
        raise TextError("no documents to tokenize; use more text")

    needed = None if max_windows is None else max_windows * body
    stream: list[int] = []
    batch = 16
    for start in range(0, len(docs), batch):
        chunk = docs[start : start + batch]
        encoded = tokenizer([d.text for d in chunk], add_special_tokens=False)["input_ids"]
        for ids in encoded:
            if stream:
                stream.append(int(eos_id))
            stream.extend(int(t) for t in ids)
        if needed is not None and len(stream) >= needed:
            break

    count = len(stream) // body
    if count < 1:
        raise TextError(
            f"text ({len(docs)} documents) has only {len(stream)} tokens; need at least {body} for one "
            f"{window}-token window (use more text or a shorter --window)"
        )
    if max_windows is not None:
        count = min(count, max_windows)
    rows = torch.tensor(stream[: count * body], dtype=torch.long).view(count, body)
    if prefix:
        rows = torch.cat([torch.full((count, 1), prefix[0], dtype=torch.long), rows], dim=1)
    return rows


@dataclass(frozen=True)
class SpreadWindows:
    """Windows drawn evenly across a document stream (:func:`spread_windows`).

    Attributes:
        calibration: ``[N, T]`` token ids, the statistics windows, in stream order.
        held_out: ``[M, T]`` token ids, held-out windows interleaved with them (disjoint rows).
        documents: how many distinct documents the calibration windows touch (None without an EOS id).
    """

    calibration: torch.Tensor
    held_out: torch.Tensor
    documents: int | None


def spread_windows(every: torch.Tensor, count: int, held: int, eos: int | None) -> SpreadWindows:
    """Pick ``count`` calibration and ``held`` held-out windows evenly across all windows of a stream.

    ``every`` are the consecutive windows of one document stream (:func:`token_windows` with ``bos=False``:
    documents joined by ``eos``). The ``count + held`` picks are the middles of equal stretches of ``every``
    (window ``floor((i + 1/2) N / (count + held))``), so a token budget spans every document of the split
    rather than the first few; every ``(count + held) / held``-th pick is held out, so the held-out windows
    span the text too. Deterministic: the same stream gives the same windows.

    Args:
        every: ``[N, T]`` token ids, consecutive windows of the stream.
        count: calibration windows wanted (>= 1); fewer are taken when ``N < count + held``.
        held: held-out windows wanted (>= 0), taken first from what ``N`` allows (at least one when ``N >= 2``).
        eos: the separator id between documents, to count the documents the calibration windows touch.

    Returns:
        :class:`SpreadWindows` with ``calibration [min(count, N - held), T]`` and ``held_out [held', T]``.

    Raises:
        ValueError: ``count < 1``, ``held < 0`` or an empty ``every``.
    """
    import torch

    n = int(every.shape[0])
    if count < 1 or held < 0 or n < 1:
        raise ValueError(f"need count >= 1, held >= 0 and windows; got count={count}, held={held}, {n} windows")
    held = min(held, max(0, n - 1), max(1, n - count)) if n >= 2 else 0
    count = min(count, n - held)
    total = count + held
    picks = [int((i + 0.5) * n / total) for i in range(total)]
    held_at = {int((k + 0.5) * total / held) for k in range(held)} if held else set()
    calib_rows = [p for j, p in enumerate(picks) if j not in held_at]
    held_rows = [p for j, p in enumerate(picks) if j in held_at]
    documents = None
    if eos is not None:
        sep = (every.reshape(-1) == eos).long()
        doc = (torch.cumsum(sep, 0) - sep).view(every.shape)  # a separator belongs to the document it ends
        documents = int(torch.unique(doc[calib_rows]).numel())
    return SpreadWindows(every[calib_rows], every[held_rows], documents)


def documents_record(docs: Sequence[Document]) -> list[dict[str, Any]]:
    """Describe documents for a manifest.

    Args:
        docs: Documents.

    Returns:
        ``[{"id": str, "sha256": str, "chars": int}, ...]`` in the given order.
    """
    return [{"id": d.id, "sha256": d.sha256, "chars": len(d.text)} for d in docs]
