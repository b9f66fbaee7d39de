"""Adaptation data: sources (``--data`` specs) -> documents -> ``datasets`` -> tokenized -> packed rows.

Each source is split by document (``text.split_documents``): training uses its ``adaptation`` role;
validation is the first source's ``evaluation`` role (the same held-out documents ``factor`` reports on,
never trained on). Documents are recorded by id and content sha256 per source, and the packed token
tensors (and the loss mask and mixture schedule where there is one) by sha256, so a run's data is
identified exactly.

Order: sequence ``i`` of the run (counting over epochs) is row ``perm_e[i mod N]`` of the packed
training set with ``e = i // N`` and ``perm_e`` a permutation seeded by ``(seed, e)``; a weighted mixture
follows its precomputed schedule (:func:`mixture_schedule`) instead. A step's rows are a pure function of
its index, which makes ``--resume`` and multi-process sharding exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mla_convert.files import sha256_bytes
from mla_convert.text.corpora import Document, TextError, load_documents
from mla_convert.text.specs import DataSpec, parse_data_spec, spec_documents
from mla_convert.text.windows import adds_bos, documents_record, split_documents, token_windows


@dataclass
class AdaptData:
    """Packed training sequences, their loss masks and row schedule, and validation windows.

    Attributes:
        train: ``[N, seq_len]`` int64 training rows of every source (each source's documents joined by EOS,
            its remainder dropped), sources in ``--data`` order.
        validation: ``[M, seq_len]`` int64 held-out windows (the first source's evaluation split).
        record: the data manifest: sources, documents (id, sha256, chars) per role, token counts, hashes.
        mask: ``[N, seq_len]`` bool, True where a token is a loss target (``loss=assistant`` sources); None
            when every token is.
        schedule: ``[R]`` int64 rows of ``train`` in run order (weighted mixtures, see :func:`mixture_schedule`);
            None: epochs of seeded permutations of all rows (:func:`epoch_permutation`).
        chat_held_out: the evaluation-split documents of the first ``loss=assistant`` source (chat prompts of
            :mod:`~mla_convert.adapt.chat`); empty without such a source.
    """

    train: torch.Tensor
    validation: torch.Tensor
    record: dict[str, Any]
    mask: torch.Tensor | None = None
    schedule: torch.Tensor | None = None
    chat_held_out: list[Document] = field(default_factory=list)


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (contiguous, CPU)."""
    return sha256_bytes(t.contiguous().cpu().numpy().tobytes())


def data_specs(text: str, data: list[str] | None) -> list[DataSpec]:
    """The sources of a job: the ``--data`` specs, else ``--text`` as one source.

    Raises:
        TextError: a bad spec (:func:`~mla_convert.text.specs.parse_data_spec`), or weights on some sources
            but not all.
    """
    specs = [parse_data_spec(d) for d in data] if data else [DataSpec(source=text)]
    weighted = [s.weight is not None for s in specs]
    if any(weighted) and not all(weighted):
        raise TextError(
            "give weight= to every --data source or to none (then each row is seen once per epoch)"
        )
    return specs


def _pack(tokenizer: Any, docs: list[Document], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tokenize ``docs`` (each followed by EOS) with ``datasets``, concatenate and cut into rows.

    Returns:
        ``[n, seq_len]`` ids, ``[n, seq_len]`` bool loss-target mask (False outside a document's
        ``loss_spans`` and on the EOS after such a document), and the total tokens before the cut.
    """
    import datasets

    eos = tokenizer.eos_token_id
    spans = [d.loss_spans for d in docs]
    offsets = any(s is not None for s in spans)
    ds = datasets.Dataset.from_dict({"text": [d.text for d in docs]})

    def tokenize(batch: dict[str, list[Any]], idx: list[int]) -> dict[str, list[Any]]:
        enc = tokenizer(batch["text"], add_special_tokens=False, return_offsets_mapping=offsets)
        masks = []
        for k, ids in enumerate(enc["input_ids"]):
            doc_spans = spans[idx[k]]
            if doc_spans is None:
                masks.append([True] * (len(ids) + 1))
            else:
                starts = [a for a, _ in enc["offset_mapping"][k]]
                masks.append([any(a <= s0 < b for a, b in doc_spans) for s0 in starts] + [False])
        return {"input_ids": [x + [eos] for x in enc["input_ids"]], "mask": masks}

    def pack(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for key in ("input_ids", "mask"):
            stream = [t for row in batch[key] for t in row]
            n = len(stream) // seq_len
            out[key] = [stream[i * seq_len : (i + 1) * seq_len] for i in range(n)]
        return out

    tokenized = ds.map(tokenize, batched=True, with_indices=True, remove_columns=["text"])
    total = sum(len(x) for x in tokenized["input_ids"])
    packed = tokenized.map(pack, batched=True, batch_size=len(tokenized))
    if len(packed) == 0:
        empty = torch.zeros(0, seq_len, dtype=torch.long)
        return empty, empty.bool(), total
    return (
        torch.tensor(packed["input_ids"], dtype=torch.long),
        torch.tensor(packed["mask"], dtype=torch.bool),
        total,
    )


def mixture_schedule(
    rows: list[int], weights: list[float], total: int, seed: int
) -> tuple[torch.Tensor, list[int]]:
    """The run order of a weighted mixture: ``total`` rows, source ``s`` contributing its share
    ``w_s / sum(w)`` of them (largest-remainder rounding).

    Source ``s`` (rows ``offset_s .. offset_s + rows_s - 1`` of the packed training set) hands out its rows in
    passes, each a permutation seeded by ``(seed, s, pass)``, so no row repeats before the source is used up;
    the chosen rows of all sources are then shuffled together (seeded). Sampling with fixed proportions,
    as in data mixtures of LM pre-training (e.g. the Pile's epochs per component, Gao et al. 2020).

    Args:
        rows: packed rows per source (each >= 1); weights: positive weights, same length.
        total: rows the run consumes (optimizer steps x rows per step).

    Returns:
        the ``[total]`` int64 schedule of row indices, and the rows drawn per source.
    """
    shares = [w / sum(weights) * total for w in weights]
    counts = [int(x) for x in shares]
    for s in sorted(range(len(rows)), key=lambda s: counts[s] - shares[s])[: total - sum(counts)]:
        counts[s] += 1
    picked = []
    offset = 0
    for s, (n, k) in enumerate(zip(rows, counts, strict=True)):
        passes = [
            torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + s * 1_009 + p))
            for p in range(-(-k // n))
        ]
        picked.append(torch.cat(passes)[:k] + offset if passes else torch.zeros(0, dtype=torch.long))
        offset += n
    order = torch.cat(picked)
    order = order[torch.randperm(order.numel(), generator=torch.Generator().manual_seed(seed * 100_003 - 1))]
    return order, counts


def build_data(
    tokenizer: Any,
    specs: list[DataSpec],
    seq_len: int,
    eval_windows: int,
    rows_per_step: int = 1,
    rows_needed: int = 1,
    seed: int = 0,
) -> AdaptData:
    """Read every source, split each by document, tokenize and pack the adaptation splits; cut validation
    windows from the first source's evaluation split.

    Args:
        tokenizer: the checkpoint's tokenizer (needs ``eos_token_id``; a chat template for chat sources).
        specs: the sources (:func:`data_specs`); each is split by document (``text.split_documents``):
            its ``adaptation`` role is trained on, its ``evaluation`` and ``calibration`` roles never are.
        seq_len: tokens per training row and validation window.
        eval_windows: validation windows to keep (the first ones of the first source's evaluation split).
        rows_per_step: rows one optimizer step takes over all processes (the minimum the data must hold).
        rows_needed: rows the whole run consumes (the length of a weighted mixture's schedule).
        seed: the data-order seed.

    Raises:
        TextError: a source cannot be read, has no documents for adaptation, or the sources together hold
            fewer than ``rows_per_step`` rows; the first source is too short for one validation window.
    """
    import datasets

    datasets.disable_progress_bars()
    trains: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    sources: list[dict[str, Any]] = []
    val_docs: list[Document] = []
    chat_held_out: list[Document] = []
    for spec in specs:
        name = spec.label()
        splits = split_documents(spec_documents(spec, tokenizer))
        train_docs = splits["adaptation"]
        if not train_docs:
            raise TextError(
                f"text {name!r} has no documents left for adaptation after the split; use more text"
            )
        ids, mask, total = _pack(tokenizer, train_docs, seq_len)
        trains.append(ids)
        masks.append(mask)
        if not val_docs:
            val_docs = splits["evaluation"]
        if spec.loss == "assistant" and not chat_held_out:
            chat_held_out = [d for d in splits["evaluation"] if d.loss_spans]
        sources.append(
            {
                "spec": name,
                "train_documents": documents_record(train_docs),
                "held_out_documents": documents_record(splits["evaluation"] + splits["calibration"]),
                "train_tokens": total,
                "train_rows": int(ids.shape[0]),
                "loss": spec.loss,
                "loss_tokens": int(mask.sum()),
                "weight": spec.weight,
            }
        )
    train = torch.cat(trains)
    what = " + ".join(repr(s["spec"]) for s in sources)
    if train.shape[0] < rows_per_step:
        raise TextError(
            f"the adaptation split of {what} has {sum(s['train_tokens'] for s in sources)} tokens "
            f"({train.shape[0]} rows of {seq_len}); one optimizer step needs {rows_per_step} rows "
            f"({rows_per_step * seq_len} tokens): give more text, or lower --batch-size / --seq-len"
        )
    if any(s["loss"] == "assistant" and s["loss_tokens"] == 0 for s in sources):
        bad = next(s["spec"] for s in sources if s["loss"] == "assistant" and s["loss_tokens"] == 0)
        raise TextError(
            f"{bad!r}: no assistant token in its adaptation split; check the conversations' roles"
        )
    mask = torch.cat(masks)
    full_mask = bool(mask.all())
    schedule = None
    if all(s.weight is not None for s in specs) and len(specs) > 1:
        empty = [s["spec"] for s in sources if s["train_rows"] == 0]
        if empty:
            raise TextError(f"{empty[0]!r} has less than one {seq_len}-token row to mix; give it more text")
        schedule, counts = mixture_schedule(
            [s["train_rows"] for s in sources], [float(sp.weight or 0) for sp in specs], rows_needed, seed
        )
        for s, k in zip(sources, counts, strict=True):
            s["rows_scheduled"] = k
            s["passes"] = round(k / s["train_rows"], 4)
    validation = _windows(tokenizer, sources[0]["spec"], val_docs, seq_len, eval_windows)
    if validation.shape[0] < 1:
        raise TextError(
            f"the evaluation split of {sources[0]['spec']!r} is too short for one {seq_len}-token window"
        )
    record = {
        "text": sources[0]["spec"] if len(sources) == 1 else [s["spec"] for s in sources],
        "split": "by document per source: train = adaptation role, validation = the first source's evaluation role",
        "sources": sources,
        "train_documents": [d for s in sources for d in s["train_documents"]],
        "validation_documents": documents_record(val_docs),
        "held_out_documents": [d for s in sources for d in s["held_out_documents"]],
        "train_tokens_available": int(train.numel()),
        "train_rows": int(train.shape[0]),
        "validation_tokens": int(validation.numel()),
        "seq_len": seq_len,
        "train_sha256": tensor_sha256(train),
        "validation_sha256": tensor_sha256(validation),
    }
    if not full_mask:
        record["loss_mask_sha256"] = tensor_sha256(mask)
    if schedule is not None:
        record["schedule"] = "weighted mixture: rows per source by weight, seeded passes, shuffled together"
        record["schedule_sha256"] = tensor_sha256(schedule)
    return AdaptData(train, validation, record, None if full_mask else mask, schedule, chat_held_out)


def _windows(tokenizer: Any, name: str, docs: list[Document], seq_len: int, count: int) -> torch.Tensor:
    """``token_windows`` of an evaluation split, its too-short error naming the source and ``--seq-len``."""
    try:
        return token_windows(tokenizer, docs, seq_len, count, bos=adds_bos(tokenizer))
    except TextError:
        chars = sum(len(d.text) for d in docs)
        raise TextError(
            f"the evaluation split of {name!r} ({len(docs)} of its documents, {chars} characters) is too short for "
            f"one {seq_len}-token validation window: give more text or a shorter --seq-len"
        ) from None


def validation_windows(tokenizer: Any, text: str, seq_len: int, eval_windows: int) -> torch.Tensor:
    """``[M, seq_len]`` windows of the evaluation split of ``text`` (a ``--text`` spec), as for validation.

    Raises:
        TextError: the text cannot be read or its evaluation split is too short for one window.
    """
    docs = split_documents(load_documents(text))["evaluation"]
    windows = _windows(tokenizer, text, docs, seq_len, eval_windows)
    if windows.shape[0] < 1:
        raise TextError(f"the evaluation split of {text!r} is too short for one {seq_len}-token window")
    return windows


def epoch_permutation(rows: int, seed: int, epoch: int) -> torch.Tensor:
    """The row order of one epoch (seeded by ``seed`` and ``epoch``)."""
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def step_rows(
    data: AdaptData, step: int, batch: int, accum: int, world: int, rank: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The micro-batches ``([batch, seq_len] ids, [batch, seq_len] loss mask or None)`` that process ``rank``
    of ``world`` trains on at ``step``.

    A step consumes ``batch * accum * world`` consecutive sequences of the run order; micro-batch ``m``
    of rank ``r`` takes ``batch`` of them at offset ``(m * world + r) * batch``, so one process with
    ``batch * world`` rows sees exactly the rows that ``world`` processes see together. Sequence ``i`` of the
    run order is ``schedule[i]`` for a weighted mixture, else row ``perm_e[i mod N]`` with ``e = i // N``.
    """
    n = data.train.shape[0]
    per_step = batch * accum * world
    out = []
    cache: dict[int, torch.Tensor] = {}
    for m in range(accum):
        idx = []
        for j in range(batch):
            i = step * per_step + (m * world + rank) * batch + j
            if data.schedule is not None:
                idx.append(int(data.schedule[i % data.schedule.numel()]))
                continue
            e = i // n
            if e not in cache:
                cache[e] = epoch_permutation(n, seed, e)
            idx.append(int(cache[e][i % n]))
        rows = torch.tensor(idx)
        out.append((data.train[rows], None if data.mask is None else data.mask[rows]))
    return out
