"""``mla-convert adapt``: a short fine-tune that recovers what factorization lost (FIELD.md §2).

Objectives: the language-model loss, distillation from the frozen source model (``T^2 * KL(p_src^T ||
p_mla^T)`` per token, Hinton et al. 2015), or a mix ``w * distill + (1 - w) * lm``. Trainable sets:
``attention`` (the MLA projections ``q_proj``, ``kv_a_proj_with_mqa``, latent norm, ``kv_b_proj``,
``o_proj``), ``attention+norms`` (plus the RMSNorms) or ``all``. Training runs on the absorbed path, so
gradients reach every factor (``kv_b_proj`` through ``W_UK``/``W_UV`` views, never a detached product).

Runs under ``accelerate`` (one CPU process, or ``accelerate launch`` with several processes/machines and
DDP/FSDP from an accelerate config). Work happens in ``.OUT.adapt/`` next to OUT: checkpoints
``step-NNNNNN/`` (model, optimizer, scheduler, RNG via ``Accelerator.save_state``, plus the step), each
written to a temporary name and renamed when complete, and ``metrics.jsonl``. OUT itself appears only at
the end, complete (model, tokenizer, metrics, plot, report, manifest with the parent's id).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mla_convert import __version__
from mla_convert.adapt.data import AdaptData, build_data, step_rows
from mla_convert.artifacts.output import OutputError, atomic_folder, check_output

ProgressFn = Callable[[dict[str, Any]], None]


class AdaptError(ValueError):
    """Bad adaptation input (checkpoint, options, resume state); one line: what, where, how to fix."""


class AdaptOptions(BaseModel):
    """Options of one adaptation job (unknown keys refused). Token counts are global (all processes)."""

    model_config = ConfigDict(extra="forbid")

    source: str | None = Field(
        None, description="teacher / reference model; default: the checkpoint's source"
    )
    text: str = Field("wikipedia", description="wikipedia | news | comma-separated text files or folders")
    tokens: int = Field(100_000, gt=0, description="training token budget (all processes)")
    seq_len: int = Field(512, ge=8, description="tokens per training sequence and validation window")
    batch_size: int = Field(4, ge=1, description="sequences per micro-batch per process")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    objective: Literal["lm", "distill", "mix", "attention-transfer"] = "distill"
    temperature: float = Field(1.0, gt=0, description="distillation temperature")
    mix_weight: float = Field(0.5, ge=0, le=1, description="weight of distillation in 'mix'")
    hidden_weight: float = Field(
        0.0,
        ge=0,
        description="weight of per-layer hidden-state matching to the source (RMS-normalised MSE of every "
        "decoder layer's output), added to the objective; 0: off",
    )
    trainable: Literal["attention", "attention+norms", "all"] = "attention"
    lr: float = Field(1e-4, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate / peak")
    warmup: float = Field(0.05, ge=0, lt=1, description="fraction of steps of linear warmup")
    schedule: Literal["cosine", "constant-decay"] = "cosine"
    decay_fraction: float = Field(0.2, gt=0, le=1, description="'constant-decay': final fraction that decays")
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    clip: float = Field(1.0, gt=0, description="gradient-norm clip")
    eval_every: int = Field(0, ge=0, description="optimizer steps between evaluations (0: start and end)")
    eval_windows: int = Field(8, ge=1, description="validation windows of seq_len tokens")
    also_eval: str | None = Field(
        None, description="a second text (its evaluation split) evaluated alongside: wikipedia | news | paths"
    )
    checkpoint_every: int = Field(25, ge=0, description="optimizer steps between checkpoints (0: none)")
    seed: int = 0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    gradient_checkpointing: bool = False

    @model_validator(mode="after")
    def _transfer_alone(self) -> AdaptOptions:
        if self.objective != "attention-transfer":
            return self
        problems = []
        if self.trainable != "attention":
            problems.append(f"it needs trainable 'attention' (got {self.trainable!r})")
        if self.hidden_weight:
            problems.append(f"it has no end-to-end forward for the hidden-state term: hidden_weight must be 0 "
                            f"(got {self.hidden_weight:g})")  # fmt: skip
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


def select_trainable(model: torch.nn.Module, which: str) -> dict[str, Any]:
    """Freeze everything except ``which``; returns the inventory (names and parameter counts).

    ``attention``: parameters under ``.self_attn.``; ``attention+norms``: also every RMSNorm weight
    (``*layernorm*``, ``model.norm``); ``all``: everything.
    """
    trainable: list[tuple[str, int]] = []
    frozen: list[tuple[str, int]] = []
    for name, p in model.named_parameters():
        keep = which == "all" or ".self_attn." in name
        if which == "attention+norms" and ("layernorm" in name or name == "model.norm.weight"):
            keep = True
        p.requires_grad_(keep)
        (trainable if keep else frozen).append((name, p.numel()))
    return {
        "set": which,
        "trainable_parameters": sum(n for _, n in trainable),
        "frozen_parameters": sum(n for _, n in frozen),
        "trainable": [n for n, _ in trainable],
        "frozen": [n for n, _ in frozen],
    }


def hidden_loss(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layers and tokens of ``mean_d (n(h_mla) - n(h_src))^2`` with ``n(x) = x / rms(x)``.

    Args:
        student, teacher: one ``[B, T, hidden]`` output per decoder layer, same length.

    Normalising each token's vector (what the next layer's RMSNorm sees) keeps the few massive-activation
    tokens from dominating; 0 for identical directions, 2 for orthogonal ones. Intermediate-layer
    distillation in the manner of TinyBERT (Jiao et al. 2020).
    """

    def n(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    return torch.stack([(n(s) - n(t)).pow(2).mean() for s, t in zip(student, teacher, strict=True)]).mean()


def objective_loss(
    o: AdaptOptions,
    logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    hidden: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch ``ids [B, T]``, logits ``[B, T, V]``; next-token positions ``0..T-2``.

    Args:
        teacher_logits: the source's ``[B, T, V]`` (needed by ``distill`` and ``mix``).
        hidden: per-layer outputs (MLA, source) for the ``hidden_weight`` term (:func:`hidden_loss`).

    Returns:
        the scalar loss and its parts (``lm``, ``kl`` in nats/token, ``hidden``) as floats.
    """
    s = logits[:, :-1].float()
    parts: dict[str, float] = {}
    lm = F.cross_entropy(s.reshape(-1, s.shape[-1]), ids[:, 1:].reshape(-1))
    parts["lm"] = float(lm.detach())
    loss = lm
    if o.objective != "lm":
        if teacher_logits is None:
            raise ValueError(f"objective {o.objective!r} needs the source's logits")
        t = teacher_logits[:, :-1].float() / o.temperature
        log_p_t = F.log_softmax(t, -1)
        log_p_s = F.log_softmax(s / o.temperature, -1)
        kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1).mean() * o.temperature**2
        parts["kl"] = float(kl.detach())
        loss = kl if o.objective == "distill" else o.mix_weight * kl + (1 - o.mix_weight) * lm
    if o.hidden_weight > 0:
        if hidden is None:
            raise ValueError("hidden_weight > 0 needs the per-layer outputs of both models")
        h = hidden_loss(*hidden)
        parts["hidden"] = float(h.detach())
        loss = loss + o.hidden_weight * h
    return loss, parts


class AttentionIO:
    """Forward hooks recording each source attention block's input and output in one forward pass.

    ``take()`` returns one ``(x [B, T, hidden], y [B, T, hidden])`` per layer: ``x`` the normalised hidden
    states the attention read, ``y`` its output (after ``o_proj``). Hugging Face Llama/Mistral/Qwen2 layout
    (``model.model.layers[i].self_attn``). Raises AdaptError when the model has no such modules.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise AdaptError(
                f"{type(model).__name__} has no model.layers[*].self_attn for attention transfer"
            )
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.enabled = False
        self.handles = [
            layer.self_attn.register_forward_hook(self._hook, with_kwargs=True) for layer in layers
        ]

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self.handles:
            h.remove()

    def _hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if self.enabled:
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self.pairs.append((x, output[0] if isinstance(output, tuple) else output))

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The recorded (input, output) pairs (and forget them)."""
        out, self.pairs = self.pairs, []
        return out


def attention_transfer_loss(
    model: torch.nn.Module, pairs: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Attention transfer (LoLCATs, Zhang et al. 2024, applied to MLA): every MLA attention block is fed
    the source's normalised hidden states of its layer and trained to reproduce the source attention's
    output, ``mean_l ||attn_l(x_l) - y_l||^2 / ||y_l||^2`` (relative squared error, each layer alone).

    Args:
        model: the MLA model (``model.model.layers[l].self_attn``).
        pairs: ``(x_l, y_l)`` per layer from :class:`AttentionIO`, ``[B, T, hidden]`` each, positions
            ``0..T-1`` (packed windows, causal, no padding).

    Returns:
        the scalar loss and its parts (``transfer``: the mean relative error; ``transfer_first`` and
        ``transfer_last`` for the first and last layer).
    """
    from mla_convert.mla.modeling import causal_mask

    layers: list[torch.nn.Module] = list(model.model.layers)  # type: ignore[union-attr,arg-type]
    if len(pairs) != len(layers):
        raise ValueError(f"{len(pairs)} recorded source layers for {len(layers)} MLA layers")
    b, t, _ = pairs[0][0].shape
    device = pairs[0][0].device
    positions = torch.arange(t, device=device)[None].expand(b, t)
    mask = causal_mask(b, t, 0, None, torch.float32, device)
    errs = []
    for layer, (x, y) in zip(layers, pairs, strict=True):
        pred = layer.self_attn(x.detach(), positions, mask)  # type: ignore[operator]
        y = y.detach().float()
        errs.append((pred.float() - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-12))
    loss = torch.stack(errs).mean()
    parts = {
        "transfer": float(loss.detach()),
        "transfer_first": float(errs[0].detach()),
        "transfer_last": float(errs[-1].detach()),
    }
    return loss, parts


class LayerOutputs:
    """Forward hooks recording each decoder layer's output ``[B, T, hidden]`` of one forward pass.

    Works on the MLA model and on Hugging Face Llama/Mistral/Qwen2 models (``model.model.layers``).
    Raises AdaptError when the model has no ``model.layers``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise AdaptError(
                f"{type(model).__name__} has no model.layers; hidden_weight needs decoder layers"
            )
        self.outputs: list[torch.Tensor] = []
        self.enabled = False
        self.handles = [layer.register_forward_hook(self._hook) for layer in layers]

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self.handles:
            h.remove()

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.enabled:
            self.outputs.append(output[0] if isinstance(output, tuple) else output)

    def take(self) -> list[torch.Tensor]:
        """The recorded outputs (and forget them)."""
        out, self.outputs = self.outputs, []
        return out


def work_dir(out: Path) -> Path:
    """The resumable work folder of OUT: ``.OUT.adapt`` next to it."""
    return out.parent / f".{out.name}.adapt"


def latest_checkpoint(work: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete ``step-NNNNNN`` checkpoint in ``work`` and its ``state.json``."""
    found = sorted(p for p in work.glob("step-*") if (p / "state.json").is_file())
    if not found:
        return None
    return found[-1], json.loads((found[-1] / "state.json").read_text())


def _plot(metrics: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [m for m in metrics if m["kind"] == "train"]
    evals = [m for m in metrics if m["kind"] == "eval"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([m["tokens"] for m in train], [m["loss"] for m in train], lw=1)
    a.set_xlabel("training tokens")
    a.set_ylabel("training loss")
    a.set_title("loss")
    b.plot([m["tokens"] for m in evals], [m["perplexity"] for m in evals], "o-", label="converted")
    if evals and evals[0].get("source_perplexity"):
        b.axhline(evals[0]["source_perplexity"], color="gray", ls="--", label="source")
    b.set_xlabel("training tokens")
    b.set_ylabel("validation perplexity")
    b.set_yscale("log")
    b.legend()
    b.set_title("held-out perplexity")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_adapt(
    ckpt: Path,
    out: Path,
    options: AdaptOptions,
    overwrite: bool = False,
    resume: bool = False,
    stop_after: int | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, Any] | None:
    """Fine-tune the converted checkpoint ``ckpt`` and write the adapted checkpoint to ``out``.

    Args:
        ckpt: a folder written by ``mla-convert factor`` (or an earlier ``adapt``).
        out: the output folder; appears only when the job completes.
        options: :class:`AdaptOptions`.
        overwrite: replace an existing non-empty ``out``.
        resume: continue from the newest checkpoint in ``.OUT.adapt`` (same options required).
        stop_after: stop (resumably) after this many optimizer steps of this invocation.
        progress: called with a dict (step, steps, tokens, loss, tokens_per_s, eta_s) after each step.

    Returns:
        The report dict (empty on processes other than the main one), or None when stopped early by
        ``stop_after`` (nothing written to ``out``).

    Raises:
        AdaptError, OutputError, TextError, SourceError: bad input, before training starts.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mla_convert.artifacts.manifest import write_manifest
    from mla_convert.artifacts.output import save_checkpoint
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.validate.metrics import evaluate

    if not (ckpt / "config.json").is_file():
        raise AdaptError(f"{ckpt} has no config.json; pass a folder written by 'mla-convert factor'")
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("model_type") != "mla":
        raise AdaptError(
            f"{ckpt} holds a {cfg.get('model_type')!r} model; adapt takes a converted MLA checkpoint"
        )
    work = work_dir(out)
    state_opts = work / "options.json"
    if resume:
        if not state_opts.is_file():
            raise AdaptError(f"nothing to resume: {work} holds no adaptation run for {out}; drop --resume")
        # options added since the stopped run started take their defaults (unknown keys still refused)
        saved = json.loads(AdaptOptions.model_validate_json(state_opts.read_text()).model_dump_json())
        if saved != json.loads(options.model_dump_json()):
            diff = sorted(k for k in saved if saved[k] != options.model_dump().get(k))
            raise AdaptError(
                f"--resume with different options than the stopped run ({', '.join(diff)}); use the same"
            )
        if out.exists() and any(out.iterdir()) and not overwrite:
            raise OutputError(f"{out} exists and is not empty; pass --overwrite to replace it")
    else:
        check_output(out, overwrite, ckpt)
        if latest_checkpoint(work) is not None and not overwrite:
            raise AdaptError(
                f"a stopped adaptation run for {out} is in {work}; pass --resume to continue it "
                "or --overwrite to start over"
            )
    source = options.source or cfg.get("source", {}).get("origin")
    if not source:
        raise AdaptError(f"{ckpt}/config.json names no source model; pass --source")
    src = open_source(source)

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=options.mixed_precision,
    )
    if options.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise AdaptError("--mixed-precision fp16 needs a GPU; on the CPU use bf16 or no")
    world, rank = accelerator.num_processes, accelerator.process_index
    if options.objective == "attention-transfer" and world > 1:
        raise AdaptError("--objective attention-transfer runs in one process; launch it without accelerate")
    main = accelerator.is_main_process
    set_seed(options.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    data: AdaptData = build_data(tokenizer, options.text, options.seq_len, options.eval_windows)
    other = None
    if options.also_eval:
        other = build_data(tokenizer, options.also_eval, options.seq_len, options.eval_windows).validation
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    model.set_attention_path("absorbed")  # type: ignore[operator]
    inventory = select_trainable(model, options.trainable)
    if options.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    teacher = load_source_model(src).to(accelerator.device)
    teacher.requires_grad_(False)
    steps = total_steps(options, world)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=options.lr, betas=(options.beta1, options.beta2), weight_decay=options.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(options, steps))
    transfer = AttentionIO(teacher) if options.objective == "attention-transfer" else None
    rec = None
    if options.hidden_weight > 0:
        rec = (LayerOutputs(model), LayerOutputs(teacher))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    # accelerate wraps forward in autocast for mixed precision; training enters accelerator.autocast()
    # itself, and evaluation must stay float32 (comparable across runs), so drop the wrapper.
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)

    start_step = 0
    metrics: list[dict[str, Any]] = []
    metrics_path = work / "metrics.jsonl"
    if resume:
        found = latest_checkpoint(work)
        if found is not None:
            accelerator.load_state(str(found[0]))
            start_step = int(found[1]["step"])
        if metrics_path.exists():
            metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
            metrics = [m for m in metrics if m["step"] <= start_step]
    elif main:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        state_opts.write_text(options.model_dump_json(indent=2))
    accelerator.wait_for_everyone()

    def log(entry: dict[str, Any]) -> None:
        metrics.append(entry)
        if main:
            with metrics_path.open("w") as f:
                f.writelines(json.dumps(m) + "\n" for m in metrics)

    def run_eval(step: int) -> dict[str, Any]:
        res = None
        if main:
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.eval()
            ev = evaluate(unwrapped, data.validation.to(accelerator.device), teacher)
            res = {
                "kind": "eval",
                "step": step,
                "tokens": step * tokens_per_step(options, world),
                "perplexity": ev.perplexity,
                "source_perplexity": ev.reference_perplexity,
                "kl": ev.kl,
                "top1": ev.top1,
                "eval_tokens": ev.tokens,
            }
            if other is not None:
                ev2 = evaluate(unwrapped, other.to(accelerator.device), teacher)
                res.update(
                    other_text=options.also_eval,
                    other_perplexity=ev2.perplexity,
                    other_source_perplexity=ev2.reference_perplexity,
                    other_kl=ev2.kl,
                )
            unwrapped.train()
            log(res)
        accelerator.wait_for_everyone()
        return res or {}

    def save(step: int) -> None:
        tmp = work / f".tmp-step-{step:06d}"
        accelerator.save_state(str(tmp))
        if main:
            (tmp / "state.json").write_text(
                json.dumps({"step": step, "tokens": step * tokens_per_step(options, world)})
            )
            tmp.replace(work / f"step-{step:06d}")
            for old in sorted(work.glob("step-*"))[:-2]:  # keep the two newest
                shutil.rmtree(old)
        accelerator.wait_for_everyone()

    if start_step == 0:
        run_eval(0)
    model.train()
    t0 = time.perf_counter()
    done_here = 0
    step = start_step
    for step in range(start_step, steps):
        micro = step_rows(data.train, step, options.batch_size, options.grad_accum, world, rank, options.seed)
        totals: dict[str, float] = {}
        loss_sum = torch.zeros((), device=accelerator.device)
        for m, ids in enumerate(micro):
            ids = ids.to(accelerator.device)
            sync = m == len(micro) - 1
            ctx = accelerator.no_sync(model) if not sync else _null()
            with ctx:
                if transfer is not None:
                    with torch.no_grad(), accelerator.autocast():
                        transfer.enabled = True
                        teacher(input_ids=ids, use_cache=False)
                        transfer.enabled = False
                    with accelerator.autocast():
                        loss, parts = attention_transfer_loss(
                            accelerator.unwrap_model(model), transfer.take()
                        )
                    accelerator.backward(loss / len(micro))
                    loss_sum += loss.detach() / len(micro)
                    for k, v in parts.items():
                        totals[k] = totals.get(k, 0.0) + v / len(micro)
                    continue
                t_logits = None
                hidden = None
                if rec is not None:
                    rec[0].enabled = rec[1].enabled = True
                if options.objective != "lm":
                    with torch.no_grad(), accelerator.autocast():
                        t_logits = teacher(input_ids=ids, use_cache=False).logits
                elif rec is not None:  # only the layer outputs are needed: skip the source's LM head
                    with torch.no_grad(), accelerator.autocast():
                        teacher.model(input_ids=ids, use_cache=False)
                with accelerator.autocast():
                    logits = model(input_ids=ids, use_cache=False).logits
                if rec is not None:
                    hidden = (rec[0].take(), rec[1].take())
                    rec[0].enabled = rec[1].enabled = False
                loss, parts = objective_loss(options, logits, ids, t_logits, hidden)
                accelerator.backward(loss / len(micro))
            loss_sum += loss.detach() / len(micro)
            for k, v in parts.items():
                totals[k] = totals.get(k, 0.0) + v / len(micro)
        grad_norm = accelerator.clip_grad_norm_(params, options.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done_here += 1
        loss_all = float(accelerator.reduce(loss_sum, "mean"))
        elapsed = time.perf_counter() - t0
        rate = done_here * tokens_per_step(options, world) / elapsed
        entry = {
            "kind": "train",
            "step": step + 1,
            "tokens": (step + 1) * tokens_per_step(options, world),
            "loss": loss_all,
            **{f"{k}_rank0": v for k, v in totals.items()},
            "lr": scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": rate,
            "elapsed_s": elapsed,
        }
        log(entry)
        if progress and main:
            progress(
                {
                    **entry,
                    "steps": steps,
                    "eta_s": (steps - step - 1) * tokens_per_step(options, world) / rate,
                }
            )
        if options.eval_every and (step + 1) % options.eval_every == 0 and step + 1 < steps:
            run_eval(step + 1)
        stopping = stop_after is not None and done_here >= stop_after and step + 1 < steps
        if options.checkpoint_every and ((step + 1) % options.checkpoint_every == 0 or stopping):
            save(step + 1)
        elif stopping:
            save(step + 1)
        if stopping:
            return None
    final = run_eval(steps)
    wall = time.perf_counter() - t0
    report: dict[str, Any] = {}
    if main:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.eval()
        evals = [m for m in metrics if m["kind"] == "eval"]
        report = {
            "checkpoint": str(ckpt),
            "options": options.model_dump(),
            "processes": world,
            "steps": steps,
            "tokens_trained": steps * tokens_per_step(options, world),
            "before": evals[0],
            "after": final,
            "evaluations": evals,
            "train_wall_s_this_invocation": wall,
            "tokens_per_s": done_here * tokens_per_step(options, world) / max(wall, 1e-9),
            "data": {k: v for k, v in data.record.items() if not k.endswith("_documents")},
            "trainable": {k: v for k, v in inventory.items() if k not in ("trainable", "frozen")},
        }
        parent = {}
        if (ckpt / "mla_manifest.json").is_file():
            parent = json.loads((ckpt / "mla_manifest.json").read_text())
        manifest = {k: v for k, v in parent.items() if k not in ("outputs", "canonical_id", "run", "parent")}
        manifest["tool"] = {"name": "mla-convert", "version": __version__}
        manifest["parent"] = {"canonical_id": parent.get("canonical_id"), "checkpoint": ckpt.name}
        manifest["adaptation"] = {
            "data": data.record,
            "objective": {
                "name": options.objective,
                "temperature": options.temperature if options.objective in ("distill", "mix") else None,
                "mix_weight": options.mix_weight if options.objective == "mix" else None,
                "hidden_weight": options.hidden_weight,
                "teacher": src.origin if not Path(src.origin).exists() else Path(src.origin).name,
            },
            "optimizer": {
                "name": "AdamW",
                "lr": options.lr,
                "betas": [options.beta1, options.beta2],
                "weight_decay": options.weight_decay,
                "clip": options.clip,
            },
            "schedule": {
                "name": options.schedule,
                "warmup": options.warmup,
                "min_lr_ratio": options.min_lr_ratio,
                "decay_fraction": options.decay_fraction,
                "steps": steps,
            },
            "token_budget": options.tokens,
            "tokens_trained": report["tokens_trained"],
            "batch": {
                "seq_len": options.seq_len,
                "batch_size": options.batch_size,
                "grad_accum": options.grad_accum,
                "processes": world,
            },
            "trainable": inventory,
            "checkpoints": {"every": options.checkpoint_every, "kept_in": work.name},
            "seed": options.seed,
            "precision": {
                "mixed_precision": options.mixed_precision,
                "gradient_checkpointing": options.gradient_checkpointing,
            },
            "result": {
                "perplexity_before": round(evals[0]["perplexity"], 4),
                "perplexity_after": round(final["perplexity"], 4),
                "kl_after": round(final["kl"] or 0.0, 5),
                "perplexity_source": round(final["source_perplexity"] or 0.0, 4),
            },
        }
        manifest["run"] = {"wall_s": wall, "torch": torch.__version__, "processes": world}
        with atomic_folder(out) as tmp:
            extra = [p for p in ckpt.iterdir() if p.name.startswith("tokenizer") or p.suffix == ".jinja"]
            save_checkpoint(unwrapped, tmp, extra, _card(ckpt, options, report))
            (tmp / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
            _plot(metrics, tmp / "training.png", f"{ckpt.name}: {options.describe()}")
            (tmp / "adapt_report.json").write_text(json.dumps(report, indent=2) + "\n")
            write_manifest(tmp, manifest, sorted(p.name for p in tmp.iterdir() if p.is_file()))
        shutil.rmtree(work, ignore_errors=True)
    accelerator.wait_for_everyone()
    return report


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _card(ckpt: Path, o: AdaptOptions, report: dict[str, Any]) -> str:
    b, a = report["before"], report["after"]
    return (
        f"# {ckpt.name} adapted ({o.describe()})\n\n"
        f"MLA checkpoint from `mla-convert adapt`: {report['tokens_trained']} training tokens of {o.text} "
        f"(adaptation split). Held-out perplexity ({a['eval_tokens']} tokens of the evaluation split): "
        f"{b['perplexity']:.3f} before, {a['perplexity']:.3f} after; source {a['source_perplexity']:.3f}.\n\n"
        "Load with `import mla_convert` then `AutoModelForCausalLM.from_pretrained(...)`.\n"
    )
