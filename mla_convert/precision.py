"""The same function in bfloat16: a model's bfloat16-vs-float32 deviation, held to its source's.

Every engine we export to serves in bfloat16, but a conversion is built and checked in float32. A converted
model is *bfloat16-safe* when rounding it to bfloat16 moves its predictions no more than rounding the source
moves the source's, on the same tokens. Measured here (issue 48):

* **long text**: ``|log p32(y_t) - log p16(y_t)|`` (nats) of every next token ``y_t`` of real-text windows;
* **short prompts** (:data:`SHORT_PROMPTS`: chat through the tokenizer's chat template, code, prose; a few tokens
  each, where one bad position is not diluted): the same deviation at every prompt position, the last one scored on
  float32's greedy next token; and whether bfloat16's first greedy token equals float32's.

:func:`precision_gate` compares a converted model's figures with its source's: mean deviation within
:data:`FACTOR` x the source's on each set (plus :data:`SLACK` nats for sets where both are at the rounding noise),
and the first greedy token equal to float32's after every short prompt where the source's is. The bfloat16 copy
is ``model.to(torch.bfloat16)`` (every parameter and activation in bfloat16; RoPE frequencies stay float32, as every
engine keeps them), run with ``use_cache=False`` as one forward per sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

#: Short prompts ``(kind, text)``; ``chat`` texts go through the tokenizer's chat template as one user turn.
SHORT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("chat", "What is the capital of France?"),
    ("chat", "Write a Python function that reverses a string."),
    ("code", "def fibonacci(n):"),
    ("code", "import numpy as"),
    ("code", "for i in range("),
    ("code", "#include <stdio.h>\nint main"),
    ("prose", "The capital of France is"),
    ("prose", "Once upon a time"),
)
#: A converted model's mean deviation may be at most this many times its source's (issue 48's "within 2x").
FACTOR = 2.0
#: ...plus this many nats: two deviations at the level of summation noise are not told apart by a ratio.
SLACK = 0.005
#: A bfloat16 first token that float32 scores within this many nats of its own greedy token (or within FACTOR x the
#: source's largest bfloat16 change on the short prompts, if larger) is a near tie, not a lost answer: the engine
#: checks' greedy margin.
TIE = 0.1


@dataclass
class PrecisionProbe:
    """One model's bfloat16-vs-float32 deviation on the tokens of :func:`probe_tokens`.

    ``long``: per-token ``|d log p|`` (nats, float64) over the text windows; ``short``: the same over the short
    prompts' positions (each prompt's last position scored on float32's greedy token); ``first_f32`` /
    ``first_bf16``: the greedy next token after each short prompt in each precision; ``first_deficit``: float32's
    log-prob of its own greedy token minus its log-prob of bfloat16's (0 where they agree; nats).
    """

    long: list[float]
    short: list[float]
    first_f32: list[int]
    first_bf16: list[int]
    first_deficit: list[float]
    kinds: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Mean / max of each set (nats), token counts and first-token agreement."""

        def stats(d: list[float]) -> dict[str, float]:
            t = torch.tensor(d, dtype=torch.float64)
            return {"mean": float(t.mean()), "max": float(t.max()), "tokens": len(d)}

        same = [a == b for a, b in zip(self.first_f32, self.first_bf16, strict=True)]
        return {"long": stats(self.long), "short": stats(self.short), "first_token_equal": same,
                "first_token_deficit": self.first_deficit}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_tokens(tokenizer: Any, windows: torch.Tensor) -> dict[str, Any]:
    """The token ids a precision probe scores: ``windows [N, T]`` of real text and :data:`SHORT_PROMPTS`
    tokenized with ``tokenizer`` (chat prompts through its chat template when it has one)."""
    short, kinds = [], []
    for kind, text in SHORT_PROMPTS:
        if kind == "chat" and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text).input_ids
        short.append([int(i) for i in ids])
        kinds.append(kind)
    return {"long": windows.tolist(), "short": short, "kinds": kinds}


@torch.no_grad()
def _logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """``[T, V]`` float64 log-probabilities of the next token at every position of ``ids``."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    return F.log_softmax(model(input_ids=x, use_cache=False).logits[0].double().cpu(), -1)


def to_bfloat16(model: Any) -> Any:
    """``model`` cast to bfloat16 in place, its RoPE ``inv_freq`` buffers kept float32 (as engines keep their
    rotary tables; an MLA model keeps its own, see ``MLAAttention._apply``); returns it."""
    keep = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    model.to(torch.bfloat16)
    for name, buf in keep.items():
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        owner._buffers[name.rsplit(".", 1)[-1]] = buf
    return model


@torch.no_grad()
def probe(model: Any, tokens: dict[str, Any]) -> PrecisionProbe:
    """``model`` (float32, eval mode) against itself in bfloat16 on ``tokens`` (:func:`probe_tokens`).

    The model is cast to bfloat16 **in place** after its float32 pass (:func:`to_bfloat16`: one copy of the
    weights in memory); callers that need it afterwards in float32 load it again.
    """
    seqs = [*tokens["long"], *tokens["short"]]
    n_long = len(tokens["long"])
    targets, ref, last = [], [], []
    for i, ids in enumerate(seqs):
        a = _logprobs(model, ids)
        y = torch.tensor(ids[1:]) if i < n_long else torch.tensor([*ids[1:], int(a[-1].argmax())])
        targets.append(y)
        ref.append(a[torch.arange(len(y)), y])
        if i >= n_long:
            last.append(a[-1])
    to_bfloat16(model)
    dev: list[list[float]] = []
    first_bf16, deficit = [], []
    for i, (ids, y) in enumerate(zip(seqs, targets, strict=True)):
        b = _logprobs(model, ids)
        dev.append((ref[i] - b[torch.arange(len(y)), y]).abs().tolist())
        if i >= n_long:
            pick, a_last = int(b[-1].argmax()), last[i - n_long]
            first_bf16.append(pick)
            deficit.append(float(a_last.max() - a_last[pick]))
    first_f32 = [int(y[-1]) for y in targets[n_long:]]
    long = [d for row in dev[:n_long] for d in row]
    short = [d for row in dev[n_long:] for d in row]
    return PrecisionProbe(long, short, first_f32, first_bf16, deficit, list(tokens.get("kinds", [])))


def precision_gate(converted: PrecisionProbe, source: PrecisionProbe) -> dict[str, Any]:
    """The converted model held to its source's bfloat16 precision on the same tokens.

    Returns a record: each set's mean / max for both, the ratio of means, the limit
    (``FACTOR x source mean + SLACK``), the short prompts where the converted model's bfloat16 first token is not
    float32's beyond a near tie while the source's is within one, and ``passed``. A near tie: float32 scores the
    bfloat16 pick at most ``max(TIE, FACTOR x the source's largest |d log p| on the short prompts)`` nats below its
    own greedy token (bfloat16 moves this source's log-probs that much, so it flips tokens that close in any copy).
    """
    c, s = converted.summary(), source.summary()
    out: dict[str, Any] = {"factor": FACTOR, "slack": SLACK}
    passed = True
    for part in ("long", "short"):
        limit = FACTOR * s[part]["mean"] + SLACK
        ok = c[part]["mean"] <= limit
        passed &= ok
        out[part] = {
            "converted": c[part],
            "source": s[part],
            "ratio": c[part]["mean"] / max(s[part]["mean"], 1e-12),
            "limit": limit,
            "passed": ok,
        }
    flip = max(TIE, FACTOR * s["short"]["max"])
    lost = [
        i for i, (cd, sd) in enumerate(zip(c["first_token_deficit"], s["first_token_deficit"], strict=True))
        if cd > flip and sd <= flip
    ]
    out["first_token"] = {
        "converted_equal": sum(c["first_token_equal"]),
        "source_equal": sum(s["first_token_equal"]),
        "converted_deficit": c["first_token_deficit"],
        "source_deficit": s["first_token_deficit"],
        "tie": flip,
        "prompts": len(c["first_token_equal"]),
        "lost": lost,
        "passed": not lost,
    }
    out["passed"] = passed and not lost
    return out


def gate_line(record: dict[str, Any]) -> str:
    """One line of :func:`precision_gate`'s record for logs and tables."""
    lo, sh, ft = record["long"], record["short"], record["first_token"]
    return (
        f"bfloat16 vs float32, mean |d log p| converted / source: long text {lo['converted']['mean']:.4f} / "
        f"{lo['source']['mean']:.4f} (x{lo['ratio']:.2f}), short prompts {sh['converted']['mean']:.4f} / "
        f"{sh['source']['mean']:.4f} (x{sh['ratio']:.2f}); first token as float32 {ft['converted_equal']}/"
        f"{ft['prompts']} (source {ft['source_equal']}/{ft['prompts']}): "
        + ("passed" if record["passed"] else "FAILED")
    )


def conversion_precision(ckpt: Any, source: Any, tokenizer: Any, windows: torch.Tensor, text: str) -> dict[str, Any]:
    """The report's ``model.bfloat16`` record: :func:`precision_gate` of the converted checkpoint in folder ``ckpt``
    against ``source`` (a :class:`~mla_convert.sources.checkpoint.SourceModel`) on ``windows [N, T]`` (evaluation
    text, named by ``text``) and :data:`SHORT_PROMPTS`. Loads each model in float32 in turn (one at a time)."""
    from mla_convert.mla.checkpoint import load_checkpoint
    from mla_convert.sources.checkpoint import load_source_model

    tokens = probe_tokens(tokenizer, windows)
    src_model = load_source_model(source, torch.float32)
    src_model.set_attn_implementation("sdpa")  # as engines attend: float32 scores, not bfloat16 ones
    src = probe(src_model, tokens)
    del src_model
    conv = probe(load_checkpoint(ckpt), tokens)
    return {
        **precision_gate(conv, src),
        "measured_on": f"{text}, {windows.shape[0]} x {windows.shape[1]} tokens, and {len(SHORT_PROMPTS)} short "
        "prompts (chat, code, prose); float32 against bfloat16 (RoPE frequencies float32), source in SDPA attention",
    }


def bfloat16_refusal(ckpt: Any) -> str | None:
    """Why ``ckpt`` (a converted folder) must not be exported in bfloat16, or None: its ``report.json`` records the
    bfloat16 check (``model.bfloat16``) as failed. Checkpoints whose report has no such record (older versions, or
    a model above factor's in-memory limit) are not refused here: ``mla-convert validate`` measures them (rung 7)."""
    import json
    from pathlib import Path

    try:
        report = json.loads((Path(ckpt) / "report.json").read_text())
    except (OSError, ValueError):
        return None
    rec = (report.get("model") or {}).get("bfloat16") or {}
    if rec.get("passed") is not False:
        return None
    return (f"{ckpt} is not bfloat16-safe ({gate_line(rec)}; report.json model.bfloat16): an engine serving it in "
            "bfloat16 would not compute the checkpoint's function; export --dtype float32, or convert again with "
            "this version of mla-convert (its o_proj refit is bounded for bfloat16)")
