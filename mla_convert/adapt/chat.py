"""Does the adapted model still answer in chat the way its source does? KL to the source on chat answers.

An instruct model is adapted on plain text (or on chat data); its perplexity on held-out prose says nothing
about its replies. This probe takes chat prompts, lets the frozen source answer each greedily once, and then
measures, teacher-forced on those answers, the KL divergence from the source's next-token distribution to
the converted model's (nats per answer token) and their top-1 agreement. It runs with every evaluation, so
the report has it before and after adaptation.

Prompts: the held-out conversations (evaluation split) of the first ``loss=assistant`` chat source, cut
before their first assistant turn; otherwise the bundled news corpus's evaluation split (never trained on by
default), each article's first 600 characters behind a fixed instruction, rendered with the tokenizer's chat
template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mla_convert.text.corpora import Document

__all__ = ["ChatProbe", "build_chat_probe", "chat_divergence", "chat_prompts"]

INSTRUCTION = "Summarize this news article in two sentences.\n\n"
ARTICLE_CHARS = 600


@dataclass
class ChatProbe:
    """Chat prompts with the source's greedy answers.

    Attributes:
        sequences: per prompt, ``[1, T_i]`` int64 prompt + answer tokens.
        answer_start: per prompt, the index of the first answer token in its sequence.
        record: what was measured on: ``prompts`` (source and document ids), ``answer_tokens``, ``count``.
    """

    sequences: list[torch.Tensor]
    answer_start: list[int]
    record: dict[str, Any]


def chat_prompts(
    tokenizer: Any, chat_docs: list[Document], count: int, questions: Sequence[str] | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Rendered prompt strings (ending with the assistant header) and their provenance."""
    if questions is not None:
        texts = [
            str(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True))
            for q in questions
        ]  # fmt: skip
        return texts, {"source": "fixed questions", "questions": list(questions)}
    held = [d for d in chat_docs if d.loss_spans]
    if held:
        picked = held[:count]
        texts = [d.text[: d.loss_spans[0][0]] for d in picked if d.loss_spans]
        return texts, {"source": "held-out conversations", "documents": [d.id for d in picked]}
    from mla_convert.text.corpora import news_documents
    from mla_convert.text.windows import split_documents

    picked = split_documents(news_documents())["evaluation"][:count]
    texts = [
        str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": INSTRUCTION + d.text[:ARTICLE_CHARS]}],
                tokenize=False,
                add_generation_prompt=True,
            )
        )
        for d in picked
    ]
    what = f"news evaluation split: {INSTRUCTION.strip()!r} + the first {ARTICLE_CHARS} characters"
    return texts, {"source": what, "documents": [d.id for d in picked]}


@torch.no_grad()
def build_chat_probe(
    tokenizer: Any,
    source: torch.nn.Module,
    chat_docs: list[Document],
    count: int = 8,
    answer_tokens: int = 32,
    questions: Sequence[str] | None = None,
) -> ChatProbe | None:
    """Render ``count`` chat prompts and let ``source`` answer each greedily (``answer_tokens`` at most).

    Args:
        tokenizer: the checkpoint's tokenizer; None is returned when it has no chat template.
        source: the frozen source model (a transformers causal LM, float32).
        chat_docs: held-out chat documents with ``loss_spans`` (may be empty: news prompts are used).
        questions: user turns to ask instead (``eval --task chat``'s fixed questions); ``count`` is then ignored.

    Returns:
        The probe, or None without a chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    texts, record = chat_prompts(tokenizer, chat_docs, count, questions)
    device = next(source.parameters()).device
    sequences, starts = [], []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        out = source.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=answer_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        sequences.append(out.cpu())
        starts.append(ids.shape[1])
    record.update(
        count=len(texts), answer_tokens=sum(s.shape[1] - a for s, a in zip(sequences, starts, strict=True))
    )
    record["answers"] = f"the source's greedy replies (at most {answer_tokens} tokens each), teacher-forced"
    return ChatProbe(sequences, starts, record)


@torch.no_grad()
def chat_divergence(model: torch.nn.Module, source: torch.nn.Module, probe: ChatProbe) -> dict[str, float]:
    """``KL(p_source || p_model)`` in nats per answer token and top-1 agreement on the probe's answers.

    Both models run in float32 on full sequences (no cache); position ``t`` scores answer token ``t + 1``.

    Returns:
        ``{"chat_kl": float, "chat_top1": float}`` (means over all answer tokens of all prompts).
    """
    device = next(model.parameters()).device
    kl = 0.0
    agree = count = 0
    for seq, start in zip(probe.sequences, probe.answer_start, strict=True):
        if seq.shape[1] <= start:
            continue
        ids = seq.to(device)
        lo = model(input_ids=ids, use_cache=False).logits[0, start - 1 : -1].double()  # type: ignore[operator]
        ref = source(input_ids=ids, use_cache=False).logits[0, start - 1 : -1].double()  # type: ignore[operator]
        logp, ref_logp = F.log_softmax(lo, -1), F.log_softmax(ref, -1)
        kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        agree += int((lo.argmax(-1) == ref.argmax(-1)).sum())
        count += lo.shape[0]
    return {"chat_kl": kl / max(count, 1), "chat_top1": agree / max(count, 1)}
