"""``eval --task chat``: does an instruct model still answer as its source does? Fixed questions, greedy answers.

Eight fixed user questions (knowledge, arithmetic, code, instructions), each rendered with the model's chat template.
The source answers each greedily; the model is scored against those answers two ways:

* teacher-forced on the source's answers: ``KL(p_source || p_model)`` in nats per answer token and top-1 agreement
  (:func:`mla_convert.adapt.chat.chat_divergence`, the probe adaptation reports);
* free-running: the model's own greedy answer (a converted model decodes through its latent cache), compared token by
  token with the source's: how many answers are the same, and the mean share of each answer's tokens that match
  before the first difference.

No question comes from calibration text; the answers are printed side by side so a reader sees what changed.
"""

from __future__ import annotations

from typing import Any

from mla_convert.errors import UserError

#: The fixed questions (user turns).
QUESTIONS = (
    "What is the capital of France?",
    "What is 12 times 7?",
    "Write a Python function that returns the factorial of n.",
    "In one sentence, what does a hash table do?",
    "Translate 'good morning' into Spanish.",
    "Name three primary colors.",
    "Explain recursion to a beginner in two sentences.",
    "Write a SQL query that counts the rows of a table named users.",
)
#: Greedy answer tokens per question.
ANSWER_TOKENS = 48


class ChatTaskError(UserError):
    """The chat probe cannot run (the tokenizer has no chat template)."""


def run_chat(model: Any, source: Any, tokenizer: Any, name: str, answer_tokens: int = ANSWER_TOKENS) -> dict[str, Any]:
    """Ask :data:`QUESTIONS` of ``source`` and ``model`` (both float32 causal LMs sharing ``tokenizer``).

    Returns:
        ``{"questions", "source_answers", "answers", "chat_kl", "chat_top1", "same_answers", "prefix_match",
        "answer_tokens", "model"}``: KL in nats per answer token and top-1 agreement teacher-forced on the source's
        answers; ``same_answers`` how many greedy answers equal the source's token for token; ``prefix_match`` the
        mean fraction of the source's answer tokens matched before the first difference.

    Raises:
        ChatTaskError: the tokenizer has no chat template.
    """
    from mla_convert.adapt.chat import build_chat_probe, chat_divergence, chat_prompts
    from mla_convert.tasks.complete import TorchCompleter

    probe = build_chat_probe(tokenizer, source, [], answer_tokens=answer_tokens, questions=QUESTIONS)
    if probe is None:
        raise ChatTaskError(f"{name}: its tokenizer has no chat template; --task chat is for instruct models")
    divergence = chat_divergence(model, source, probe)
    prompts, _ = chat_prompts(tokenizer, [], len(QUESTIONS), QUESTIONS)
    completer = TorchCompleter(model, tokenizer, name)
    theirs = [seq[0, start:].tolist() for seq, start in zip(probe.sequences, probe.answer_start, strict=True)]
    ours = [  # the rendered prompt holds its special tokens already
        completer.greedy_ids(tokenizer(p, add_special_tokens=False, return_tensors="pt").input_ids, answer_tokens)
        for p in prompts
    ]
    prefix = []
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(b), 1))
    return {
        "model": name,
        "questions": list(QUESTIONS),
        "source_answers": [tokenizer.decode(t, skip_special_tokens=True) for t in theirs],
        "answers": [tokenizer.decode(t, skip_special_tokens=True) for t in ours],
        **divergence,
        "same_answers": sum(a == b for a, b in zip(ours, theirs, strict=True)),
        "prefix_match": sum(prefix) / len(prefix),
        "answer_tokens": answer_tokens,
    }
