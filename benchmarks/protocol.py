"""The text every training-free benchmark scores on, from one place (issue 27's protocol).

- calibration and held-out windows: exactly what ``factor`` takes by default
  (:func:`mla_convert.convert.pipeline.text.calibration_windows`: the token budget spread across the Wikipedia calibration
  split's documents);
- dev windows (they choose defaults and splits): spread across the Wikipedia *adaptation* split, which no
  conversion reads;
- evaluation windows (reported, never used to choose): the Wikipedia evaluation split at 512 and 2048 tokens and
  the news corpus's evaluation split (a text never calibrated on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoTokenizer

from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.pipeline.text import calibration_windows
from mla_convert.sources.checkpoint import SourceModel, load_source_model, open_source
from mla_convert.text.corpora import load_documents
from mla_convert.text.windows import split_documents, spread_windows, token_windows

WINDOW = 512


@dataclass
class Protocol:
    """Source, tokenizer and the token windows ``[N, T]`` of each role (see the module docstring)."""

    src: SourceModel
    model: Any
    tokenizer: Any
    calibration_documents: list[Any]
    calibration: torch.Tensor
    held_out: torch.Tensor
    documents: int | None
    dev: torch.Tensor
    evals: dict[str, torch.Tensor] = field(default_factory=dict)


def load(calib_tokens: int | None = None, dev: int = 8, evals: dict[str, int] | None = None,
         source: str = "smollm2-135m") -> Protocol:
    """SmolLM2-135M (or another bundled ``source``) and the protocol's windows.

    Args:
        calib_tokens: calibration budget in tokens (None: ``factor``'s default).
        dev: dev windows of 512 tokens (adaptation split).
        evals: name -> windows, names ``wiki@512``, ``wiki@2048``, ``news@512`` (None: 40 / 2 / 8).
        source: a bundled source name (``mla-convert sources``) or a folder.
    """
    torch.manual_seed(0)
    src = open_source(source)
    model = load_source_model(src)
    tok = AutoTokenizer.from_pretrained(str(src.path))
    wiki = split_documents(load_documents("wikipedia"))
    news = split_documents(load_documents("news"))
    budget = ConvertOptions(**({} if calib_tokens is None else {"calib_tokens": calib_tokens}))
    picked = calibration_windows(tok, wiki["calibration"], WINDOW, budget.calibration_windows())
    every_dev = token_windows(tok, wiki["adaptation"], WINDOW, 64 * dev, bos=False)
    evals = {"wiki@512": 40, "wiki@2048": 2, "news@512": 8} if evals is None else evals
    texts = {"wiki": wiki["evaluation"], "news": news["evaluation"]}
    windows = {}
    for name, count in evals.items():
        text, width = name.split("@")
        windows[name] = token_windows(tok, texts[text], int(width), count, bos=False)
    return Protocol(
        src, model, tok, wiki["calibration"], picked.calibration, picked.held_out, picked.documents,
        spread_windows(every_dev, dev, 0, None).calibration, windows,
    )  # fmt: skip


def calibration(proto: Protocol, tokens: int) -> torch.Tensor:
    """``factor``'s calibration windows ``[N, 512]`` for another token budget (same spread, same split)."""
    count = ConvertOptions(calib_tokens=tokens).calibration_windows()
    return calibration_windows(proto.tokenizer, proto.calibration_documents, WINDOW, count).calibration
