"""Adaptation data: documents -> ``datasets`` -> tokenized -> packed fixed-length training sequences.

The train/validation split is by document (``text.split_documents``): training uses the ``adaptation``
role, validation the ``evaluation`` role (the same held-out documents ``factor`` reports on, never
trained on). Both are recorded by document id and content sha256, and the packed token tensors by
sha256, so a run's data is identified exactly.

Order: sequence ``i`` of the run (counting over epochs) is row ``perm_e[i mod N]`` of the packed
training set with ``e = i // N`` and ``perm_e`` a permutation seeded by ``(seed, e)``. A step's rows are
a pure function of its index, which makes ``--resume`` and multi-process sharding exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_convert.artifacts.hashing import sha256_bytes
from mla_convert.text.corpora import TextError, load_documents
from mla_convert.text.windows import documents_record, split_documents, token_windows


@dataclass
class AdaptData:
    """Packed training sequences and validation windows.

    Attributes:
        train: ``[N, seq_len]`` int64 training rows (documents joined by EOS, remainder dropped).
        validation: ``[M, seq_len]`` int64 held-out windows (evaluation split).
        record: the data manifest: text, documents (id, sha256, chars) per role, token counts, hashes.
    """

    train: torch.Tensor
    validation: torch.Tensor
    record: dict[str, Any]


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (contiguous, CPU)."""
    return sha256_bytes(t.contiguous().cpu().numpy().tobytes())


def build_data(tokenizer: Any, text: str, seq_len: int, eval_windows: int) -> AdaptData:
    """Tokenize and pack the adaptation split with ``datasets``; cut validation windows.

    Args:
        tokenizer: the checkpoint's tokenizer (needs ``eos_token_id``).
        text: ``wikipedia``, ``news`` or comma-separated text files/folders.
        seq_len: tokens per training row and validation window.
        eval_windows: validation windows to keep (the first ones of the evaluation split).

    Raises:
        TextError: missing text, or too little for one training row or two validation windows.
    """
    import datasets

    datasets.disable_progress_bars()
    splits = split_documents(load_documents(text))
    train_docs = splits["adaptation"]
    if not train_docs:
        raise TextError(f"text {text!r} has no documents left for adaptation after the split; use more text")
    eos = tokenizer.eos_token_id
    ds = datasets.Dataset.from_dict({"id": [d.id for d in train_docs], "text": [d.text for d in train_docs]})

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    def pack(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        stream = [t for ids in batch["input_ids"] for t in ids]
        n = len(stream) // seq_len
        return {"input_ids": [stream[i * seq_len : (i + 1) * seq_len] for i in range(n)]}

    tokenized = ds.map(tokenize, batched=True, remove_columns=["text", "id"])
    total = sum(len(x) for x in tokenized["input_ids"])
    packed = tokenized.map(pack, batched=True, batch_size=len(tokenized))
    if len(packed) < 1:
        raise TextError(f"the adaptation split of {text!r} has {total} tokens; need {seq_len} for one row")
    train = torch.tensor(packed["input_ids"], dtype=torch.long)
    validation = token_windows(tokenizer, splits["evaluation"], seq_len, eval_windows, bos=False)
    if validation.shape[0] < 1:
        raise TextError(f"the evaluation split of {text!r} is too short for one {seq_len}-token window")
    record = {
        "text": text,
        "split": "by document: train = adaptation role, validation = evaluation role",
        "train_documents": documents_record(train_docs),
        "validation_documents": documents_record(splits["evaluation"]),
        "train_tokens_available": int(train.numel()),
        "train_rows": int(train.shape[0]),
        "validation_tokens": int(validation.numel()),
        "seq_len": seq_len,
        "train_sha256": tensor_sha256(train),
        "validation_sha256": tensor_sha256(validation),
    }
    return AdaptData(train, validation, record)


def epoch_permutation(rows: int, seed: int, epoch: int) -> torch.Tensor:
    """The row order of one epoch (seeded by ``seed`` and ``epoch``)."""
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def step_rows(
    train: torch.Tensor, step: int, batch: int, accum: int, world: int, rank: int, seed: int
) -> list[torch.Tensor]:
    """The micro-batches ``[batch, seq_len]`` that process ``rank`` of ``world`` trains on at ``step``.

    A step consumes ``batch * accum * world`` consecutive sequences of the run order; micro-batch ``m``
    of rank ``r`` takes ``batch`` of them at offset ``(m * world + r) * batch``, so one process with
    ``batch * world`` rows sees exactly the rows that ``world`` processes see together.
    """
    n = train.shape[0]
    per_step = batch * accum * world
    out = []
    cache: dict[int, torch.Tensor] = {}
    for m in range(accum):
        idx = []
        for j in range(batch):
            i = step * per_step + (m * world + rank) * batch + j
            e = i // n
            if e not in cache:
                cache[e] = epoch_permutation(n, seed, e)
            idx.append(int(cache[e][i % n]))
        out.append(train[torch.tensor(idx)])
    return out
