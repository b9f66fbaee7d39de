"""The heap handling that keeps an 8B conversion's resident set down (freed temporaries handed back after each
search candidate's layer, large blocks in their own mappings) is for large layers only: on SmolLM2 it cost 10 % of
the conversion's time (docs/results.md, the memory steps)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mla_convert.convert.pipeline import stream
from mla_convert.convert.pipeline.device import large_layers


@pytest.mark.parametrize(
    ("model", "hidden", "intermediate", "large"),
    [
        ("SmolLM2-135M", 576, 1536, False),
        ("Qwen2.5-1.5B", 1536, 8960, False),
        ("Llama-3.2-3B", 3072, 8192, True),
        ("Llama-3-8B", 4096, 14336, True),
    ],
)
def test_large_layers_by_shape(model: str, hidden: int, intermediate: int, large: bool) -> None:
    assert large_layers(hidden, intermediate) is large, model


@pytest.mark.parametrize(("hidden", "intermediate", "trims"), [(576, 1536, [1, 1]), (4096, 14336, [1, 2])])
def test_candidate_trims_only_on_large_layers(
    monkeypatch: pytest.MonkeyPatch, hidden: int, intermediate: int, trims: list[int]
) -> None:
    count = [0]
    monkeypatch.setattr(stream, "trim_heap", lambda: count.__setitem__(0, count[0] + 1))
    conv = SimpleNamespace(trim=True, large_layers=large_layers(hidden, intermediate))
    seen = []
    stream.StreamedConversion.trim_memory(conv)  # type: ignore[arg-type]  # after a layer: always
    seen.append(count[0])
    stream.StreamedConversion.trim_memory(conv, candidate=True)  # type: ignore[arg-type]
    seen.append(count[0])
    assert seen == trims
    conv.trim = False  # an in-memory conversion never trims
    stream.StreamedConversion.trim_memory(conv, candidate=True)  # type: ignore[arg-type]
    stream.StreamedConversion.trim_memory(conv)  # type: ignore[arg-type]
    assert count[0] == trims[-1]
