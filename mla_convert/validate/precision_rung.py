"""Rung 7: the converted model's bfloat16 precision held to its source's (:mod:`mla_convert.precision`).

Runs last: it casts the checkpoint's model and the source to bfloat16 in place after their float32 passes.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_convert.precision import FACTOR, SLACK, PrecisionProbe, precision_gate, probe, probe_tokens
from mla_convert.validate.measure import timed
from mla_convert.validate.result import Rung
from mla_convert.validate.spec import PRECISION

#: Evaluation windows the rung scores as its long text (each ``--window`` tokens).
PRECISION_WINDOWS = 2


@timed
def rung_precision(model: Any, source_model: Any | None, tokenizer: Any, windows: torch.Tensor, data: str) -> Rung:
    """Rung 7 on the first :data:`PRECISION_WINDOWS` of ``windows [N, T]`` and the short prompts: the converted
    model's mean ``|d log p|`` of bfloat16 against float32 within ``FACTOR`` x the source's (+ ``SLACK``) on each
    set, and its first greedy token as float32's after every short prompt where the source's is. Without a
    source only the converted model's figures are recorded (no check can hold it to the source's precision)."""
    tokens = probe_tokens(tokenizer, windows[:PRECISION_WINDOWS])
    n_short = len(tokens["short"])
    rung = Rung.of(PRECISION, f"{data}: {min(PRECISION_WINDOWS, windows.shape[0])} x {windows.shape[1]} tokens, "
                   f"and {n_short} short prompts (chat, code, prose)")
    conv = probe(model, tokens)
    if source_model is None:
        _record(rung, "converted", conv)
        rung.record("source", "not available: the converted model's deviation is not held to the source's")
        return rung
    if hasattr(source_model, "set_attn_implementation"):
        source_model.set_attn_implementation("sdpa")  # as engines attend: float32 scores, not bfloat16 ones
    src = probe(source_model, tokens)
    gate = precision_gate(conv, src)
    for part, what in (("long", "long text"), ("short", "short prompts")):
        g = gate[part]
        rung.record(f"{what}: source mean |d log p| (nats)", round(g["source"]["mean"], 5))
        rung.record(f"{what}: converted max |d log p| (source's max {g['source']['max']:.3g})",
                    round(g["converted"]["max"], 4))
        rung.check(f"{what}: converted mean |d log p| (nats) vs {FACTOR:g} x source's + {SLACK:g}",
                   g["converted"]["mean"], g["limit"])
    ft = gate["first_token"]
    rung.record("short prompts whose bfloat16 first token is float32's: converted / source",
                f"{ft['converted_equal']} / {ft['source_equal']} of {ft['prompts']}")
    rung.record("short prompts: float32 log-prob deficit of bfloat16's first token, converted max / source max "
                "(nats)", f"{max(ft['converted_deficit']):.3g} / {max(ft['source_deficit']):.3g}")
    rung.check(f"short prompts where the source keeps float32's first token (within {ft['tie']:.3g} nats) and the "
               "converted model does not", len(ft["lost"]), 0, "==")
    return rung


def _record(rung: Rung, who: str, p: PrecisionProbe) -> None:
    s = p.summary()
    rung.record(f"long text: {who} mean / max |d log p| (nats)", f"{s['long']['mean']:.4g} / {s['long']['max']:.4g}")
    rung.record(f"short prompts: {who} mean / max |d log p| (nats)",
                f"{s['short']['mean']:.4g} / {s['short']['max']:.4g}")
    rung.record(f"short prompts whose bfloat16 first token is float32's ({who})",
                f"{sum(s['first_token_equal'])} of {len(s['first_token_equal'])}")
