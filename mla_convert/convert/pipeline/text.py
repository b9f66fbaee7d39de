"""The text of a ``factor`` job: its token windows, from one ``--text`` or a ``--calib-data`` mixture.

Calibration, held-out and evaluation windows; a mixture takes one source per ``--calib-data`` spec, each by its weight.

Every source is split by document (:func:`~mla_convert.text.windows.split_documents`): calibration reads only each
source's calibration split, and the report's evaluation windows come from ``--text``'s evaluation split, so no
conversion reads the documents it is scored on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_convert.convert.options.options import ConvertOptions
from mla_convert.text.chats import CHAT_CORPORA, chat_documents
from mla_convert.text.corpora import Document, TextError, load_documents, parse_text_spec
from mla_convert.text.specs import parse_data_spec, spec_documents
from mla_convert.text.windows import (
    SpreadWindows,
    adds_bos,
    documents_record,
    split_documents,
    spread_windows,
    token_windows,
)

#: Held-out calibration windows: per-layer attention error and the o_proj refit's keep/revert check
#: (several, so one window's noise cannot decide it; every window's loss is recorded).
HELD_OUT_WINDOWS = 4


#: How far calibration windows are spread: the calibration split is tokenized up to this many times the windows
#: taken (all of the bundled texts' splits), and the windows are drawn evenly across what was tokenized.
CALIBRATION_SPAN = 64


@dataclass
class TextSplit:
    """Token windows for each role, and the documents behind them.

    Attributes:
        name: the text's name (``wikipedia``, ``news``, ``local files``...).
        calibration: ``[N, T]`` statistics windows, spread across the calibration documents.
        held_out: ``[M, T]`` held-out calibration windows (attention error, ``o_proj`` refit check), ``M <= 4``.
        evaluation: ``[E, T]`` evaluation windows (the first of the evaluation split).
        records: role -> the documents' ids, hashes and lengths.
        calibration_documents: distinct documents the calibration windows touch (None without an EOS id).
    """

    name: str
    calibration: torch.Tensor
    held_out: torch.Tensor
    evaluation: torch.Tensor
    records: dict[str, list[dict[str, Any]]]
    calibration_documents: int | None = None


def calibration_windows(
    tokenizer: Any, docs: list[Document], window: int, count: int, count_documents: bool = True
) -> SpreadWindows:
    """The calibration and held-out windows ``factor`` uses: ``count`` (and up to :data:`HELD_OUT_WINDOWS`
    held-out) windows of ``window`` tokens spread evenly across the calibration documents ``docs``.
    ``count_documents=False`` for text whose documents hold EOS themselves (chat-templated turns end with it): the
    windows' documents are then not counted (``documents`` None) rather than miscounted.

    Raises:
        TextError: the documents give fewer than 2 windows.
    """
    every = token_windows(
        tokenizer, docs, window, CALIBRATION_SPAN * (count + HELD_OUT_WINDOWS), bos=adds_bos(tokenizer)
    )
    if every.shape[0] < 2:
        raise TextError(
            f"calibration text gives {every.shape[0]} window(s) of {window} tokens; need at least 2 "
            "(use more text or a shorter --window)"
        )
    eos = getattr(tokenizer, "eos_token_id", None) if count_documents else None
    return spread_windows(every, count, HELD_OUT_WINDOWS, eos)


def text_documents(text: str, tokenizer: Any) -> tuple[list[Document], str]:
    """The documents of a ``--text`` spec and its recorded name: a bundled corpus, comma-separated files, or a data
    file with ``field=NAME`` / ``messages=NAME`` (:func:`~mla_convert.text.specs.parse_data_spec`; chat rows
    rendered with ``tokenizer``'s chat template).

    Raises:
        TextError: what the spec's reader raises; ``weight=`` or ``loss=``, which only adaptation reads.
    """
    if text.strip().lower() in CHAT_CORPORA:
        return chat_documents(text.strip().lower(), tokenizer), text.strip().lower()
    if "=" not in text:
        spec = parse_text_spec(text)
        return load_documents(spec), spec if isinstance(spec, str) else "local files"
    data = parse_data_spec(text)
    if data.weight is not None or data.loss != "all":
        raise TextError(
            f"--text {text!r}: weight= and loss= are adaptation keys (adapt --data); drop them here"
        )
    keys = data.label()[len(data.source) :]  # ",messages=NAME": the files are recorded by hash, not by path
    return spec_documents(data, tokenizer), ("local files" if data.kind == "local" else data.source) + keys


def prepare_text(tokenizer: Any, options: ConvertOptions) -> TextSplit:
    """Load, split by document and tokenize calibration/evaluation text.

    The calibration windows (``options.calibration_windows()`` of ``options.window`` tokens: the token budget)
    and up to :data:`HELD_OUT_WINDOWS` held-out windows are drawn evenly across the calibration split
    (:func:`~mla_convert.text.windows.spread_windows`), so they span its documents, not the first few. A text with
    ``field=``/``messages=`` (``chats.jsonl,messages=messages``, read as ``adapt --data`` reads it) gives one
    document per row; chat rows are rendered with the tokenizer's chat template, so an instruct model calibrates on
    what it serves.

    Raises:
        TextError: missing/empty text, too short for the requested windows, or ``weight=``/``loss=`` (adaptation
            keys) in the text.
    """
    docs, name = text_documents(options.text, tokenizer)
    splits = split_documents(docs)
    evaluation = token_windows(
        tokenizer, splits["evaluation"], options.window, options.eval_windows, bos=adds_bos(tokenizer)
    )
    records = {role: documents_record(d) for role, d in splits.items()}
    if options.calib_data:
        mix = mixture_windows(tokenizer, options)
        records["calibration"] = mix.records
        return TextSplit(mix.name, mix.calibration, mix.held_out, evaluation, records, mix.documents)
    picked = calibration_windows(
        tokenizer,
        splits["calibration"],
        options.window,
        options.calibration_windows(),
        count_documents=not is_chat(options.text),
    )
    return TextSplit(name, picked.calibration, picked.held_out, evaluation, records, picked.documents)


def is_chat(text: str) -> bool:
    """Whether a text spec's documents are chat-templated conversations, whose rendered turns end with EOS (so the
    EOS count is not a document count)."""
    return "messages=" in text or text.strip().lower() in CHAT_CORPORA


@dataclass
class MixtureWindows:
    """A calibration mixture's windows (see :func:`mixture_windows`).

    Attributes:
        name: the sources as typed, joined by `` + `` (the report's and manifest's text name).
        calibration: ``[N, T]`` windows, the sources' windows in one fixed shuffled order (seed 0).
        held_out: ``[M, T]`` held-out windows, ``M <= HELD_OUT_WINDOWS`` shared out by weight.
        records: the documents of every source's calibration split (ids, hashes, lengths).
        documents: distinct documents the calibration windows touch (None where a chat source cannot count them).
        counts: calibration windows taken from each source.
    """

    name: str
    calibration: torch.Tensor
    held_out: torch.Tensor
    records: list[dict[str, Any]]
    documents: int | None
    counts: list[int]


def apportion(weights: list[float], total: int, minimum: int = 1) -> list[int]:
    """``total`` shared out in proportion to ``weights`` by largest remainders, each at least ``minimum``
    (so the counts may sum past ``total`` when it is smaller than ``minimum x len(weights)``)."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)[: total - sum(counts)]:
        counts[i] += 1
    return [max(minimum, c) for c in counts]


def mixture_windows(tokenizer: Any, options: ConvertOptions) -> MixtureWindows:
    """The calibration and held-out windows of a mixture (``options.calib_data``): each source's share of the
    ``options.calibration_windows()`` windows is its weight (default 1) over the weights' sum (at least one window
    each), drawn evenly across that source's calibration split as a single ``--text`` is
    (:func:`calibration_windows`); the :data:`HELD_OUT_WINDOWS` held-out windows are shared out the same way.

    Raises:
        TextError: a source that cannot be read or gives fewer than 2 windows; a chat source on a tokenizer without a
            chat template.
    """
    specs = [parse_data_spec(s) for s in options.calib_data or []]  # checked with the other options (problems())
    weights = [spec.weight if spec.weight is not None else 1.0 for spec in specs]
    counts = apportion(weights, options.calibration_windows())
    held = apportion(weights, HELD_OUT_WINDOWS, minimum=0)
    parts, held_parts, records = [], [], []
    documents: int | None = 0
    for spec, count, keep in zip(specs, counts, held, strict=True):
        docs = split_documents(spec_documents(spec, tokenizer))["calibration"]
        chat = spec.messages is not None or spec.source.strip().lower() in CHAT_CORPORA
        picked = calibration_windows(tokenizer, docs, options.window, count, count_documents=not chat)
        parts.append(picked.calibration)
        held_parts.append(picked.held_out[:keep])
        records += documents_record(docs)
        documents = None if documents is None or picked.documents is None else documents + picked.documents
    # a fixed shuffle: the refit's every k-th window (options.refit_stride) then samples each source by its share,
    # where an even interleave can line one source up with the stride
    joined = torch.cat(parts)
    calibration = joined[torch.randperm(joined.shape[0], generator=torch.Generator().manual_seed(0))]
    return MixtureWindows(
        " + ".join(spec.label() for spec in specs),
        calibration,
        torch.cat(held_parts),
        records,
        documents,
        [p.shape[0] for p in parts],
    )
