"""The options of an adaptation job and the pure rules derived from them (steps, learning-rate schedule).

Light on purpose (pydantic and math only): the CLI generates ``mla-convert adapt``'s flags from
:class:`AdaptOptions` at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mla_convert.errors import UserError


class AdaptError(UserError):
    """Bad adaptation input (checkpoint, options, resume state); one line: what, where, how to fix."""


class AdaptOptions(BaseModel):
    """Options of one adaptation job (unknown keys refused). Token counts are global (all processes)."""

    model_config = ConfigDict(extra="forbid")

    source: str | None = Field(
        None, description="teacher / reference model; default: the checkpoint's source"
    )
    text: str = Field(
        "wikipedia",
        description="wikipedia | news | shakespeare | python (the standard library's sources) | comma-separated .txt / .jsonl / .json / .parquet / .csv files or folders",
    )
    data: list[str] | None = Field(
        None,
        description="a training source: SOURCE [,field=NAME] [,messages=NAME] [,weight=W] [,loss=all|assistant] "
        "(no spaces), SOURCE a corpus name, local .txt/.jsonl/.json/.parquet/.csv files or folders, saved datasets, or a hub dataset id; "
        "repeat for a mixture (weight= on each: its share of the rows); replaces --text; validation uses the first "
        "source's held-out documents",
        json_schema_extra={"metavar": "SPEC"},
    )
    tokens: int = Field(100_000, gt=0, description="training token budget (all processes)")
    seq_len: int = Field(512, ge=8, description="tokens per training sequence and validation window")
    batch_size: int = Field(4, ge=1, description="sequences per micro-batch per process")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    objective: Literal["lm", "distill", "mix", "attention-transfer"] = Field(
        "distill",
        description="lm | distill (KL to the source) | mix | attention-transfer (each MLA attention block fit to "
        "the source attention's output on the source's layer inputs; trainable attention, one process)",
    )
    temperature: float = Field(1.0, gt=0, description="distillation temperature")
    mix_weight: float = Field(0.5, ge=0, le=1, description="weight of distillation in 'mix'")
    hidden_weight: float = Field(
        0.0,
        ge=0,
        description="weight of per-layer hidden-state matching to the source (RMS-normalised MSE of every "
        "decoder layer's output), added to the objective; 0: off",
    )
    trainable: Literal["attention", "attention+norms", "all"] = Field(
        "attention", description="parameters trained"
    )
    lr: float = Field(1e-4, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate / peak")
    warmup: float = Field(0.05, ge=0, lt=1, description="fraction of steps of linear warmup")
    schedule: Literal["cosine", "constant-decay"] = Field(
        "cosine", description="learning-rate schedule after warmup"
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="'constant-decay': final fraction that decays")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    clip: float = Field(1.0, gt=0, description="gradient-norm clip")
    eval_every: int = Field(0, ge=0, description="optimizer steps between evaluations (0: start and end)")
    eval_windows: int = Field(8, ge=1, description="validation windows of seq_len tokens")
    also_eval: str | None = Field(
        None,
        description="a second text (its evaluation split) evaluated alongside: wikipedia | news | shakespeare | python | paths",
    )
    chat_prompts: int = Field(
        8,
        ge=0,
        description="chat prompts of the KL-to-source probe run with every evaluation (the source's greedy "
        "answers, 32 tokens each; held-out conversations of a loss=assistant source, else news articles); 0: off",
    )
    checkpoint_every: int = Field(25, ge=0, description="optimizer steps between checkpoints (0: none)")
    seed: int = Field(0, description="seed of the data order")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="autocast precision where the hardware has it"
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward")

    @model_validator(mode="after")
    def _data_specs(self) -> AdaptOptions:
        from mla_convert.text.corpora import TextError, parse_text_spec
        from mla_convert.text.specs import parse_data_spec

        if self.also_eval:
            try:
                parse_text_spec(self.also_eval)
            except TextError as exc:
                raise ValueError(f"--also-eval: {exc}") from None
        if not self.data:
            self.data = None
            return self
        if self.text != "wikipedia":
            raise ValueError(
                f"give --text or --data, not both (--text {self.text!r} with {len(self.data)} --data)"
            )
        try:
            specs = [parse_data_spec(d) for d in self.data]
        except TextError as exc:
            raise ValueError(str(exc)) from None
        weighted = [s.weight is not None for s in specs]
        if any(weighted) and not all(weighted):
            raise ValueError(
                "give weight= to every --data source or to none (then each row is seen once per epoch)"
            )
        return self

    @model_validator(mode="after")
    def _transfer_alone(self) -> AdaptOptions:
        if self.objective != "attention-transfer":
            return self
        problems = []
        if self.trainable != "attention":
            problems.append(f"it needs trainable 'attention' (got {self.trainable!r})")
        if self.hidden_weight:
            problems.append(
                f"it has no end-to-end forward for the hidden-state term: hidden_weight must be 0 "
                f"(got {self.hidden_weight:g})"
            )
        if problems:
            raise ValueError(
                "objective attention-transfer fits each attention block alone: " + "; ".join(problems)
            )
        return self

    def describe(self) -> str:
        """Short label of the objective, e.g. ``lm + 2 x hidden, attention``."""
        obj = self.objective + (f" + {self.hidden_weight:g} x hidden" if self.hidden_weight else "")
        return f"{obj}, {self.trainable}"


def tokens_per_step(o: AdaptOptions, world: int) -> int:
    """Training tokens one optimizer step consumes over all processes."""
    return o.seq_len * o.batch_size * o.grad_accum * world


def total_steps(o: AdaptOptions, world: int) -> int:
    """Optimizer steps of the job: ``ceil(tokens / tokens_per_step)``."""
    return max(1, math.ceil(o.tokens / tokens_per_step(o, world)))


def lr_lambda(o: AdaptOptions, steps: int) -> Callable[[int], float]:
    """Learning-rate multiplier per step: linear warmup, then cosine to ``min_lr_ratio`` or constant
    followed by a linear decay over the last ``decay_fraction`` of steps (WSD)."""
    warm = int(o.warmup * steps)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if o.schedule == "cosine":
            prog = (step - warm) / max(1, steps - warm)
            return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))
        decay_start = steps - max(1, int(o.decay_fraction * steps))
        if step < decay_start:
            return 1.0
        prog = (step - decay_start) / max(1, steps - decay_start)
        return 1.0 - (1 - o.min_lr_ratio) * min(1.0, prog)

    return f
