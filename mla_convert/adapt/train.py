"""``mla-convert adapt``: a short fine-tune that recovers what factorization lost (docs/math.md §Adaptation).

:func:`run_adapt` checks the input and the work folder, sets up the job (:func:`_setup`), evaluates,
trains (:func:`_train`, one optimizer step at a time, :func:`_train_step`) and writes OUT
(:func:`_finish`). What is trained and minimised lives in :mod:`~mla_convert.adapt.objectives`, the
data in :mod:`~mla_convert.adapt.data`, the resumable ``.OUT.adapt/`` folder in
:mod:`~mla_convert.adapt.workdir` and OUT's report, card and plot in :mod:`~mla_convert.adapt.report`.
Training runs on the absorbed path, so gradients reach every factor (``kv_b_proj`` through
``W_UK``/``W_UV`` views, never a detached product).

Runs under ``accelerate`` (one CPU process, or ``accelerate launch`` with several processes/machines and
DDP/FSDP from an accelerate config). OUT appears only at the end, complete (model, tokenizer, metrics,
plot, report, manifest with the parent's id).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mla_convert.adapt.chat import ChatProbe, build_chat_probe, chat_divergence
from mla_convert.adapt.data import AdaptData, build_data, data_specs, step_rows, validation_windows
from mla_convert.adapt.objectives import (
    AttentionIO,
    LayerOutputs,
    attention_transfer_loss,
    objective_loss,
    select_trainable,
)
from mla_convert.adapt.options import AdaptError, AdaptOptions, lr_lambda, tokens_per_step, total_steps
from mla_convert.adapt.report import adapt_report, write_adapted
from mla_convert.adapt.workdir import (
    check_data,
    check_start,
    close_work,
    open_work,
    save_step,
    work_dir,
    write_metrics,
)
from mla_convert.mla.checkpoint import load_checkpoint, read_checkpoint_config

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel

    from mla_convert.sources.checkpoint import SourceModel

ProgressFn = Callable[[dict[str, Any]], None]

__all__ = ["ProgressFn", "run_adapt"]


@dataclass
class _Job:
    """Everything one adaptation job trains with, after ``accelerator.prepare``."""

    options: AdaptOptions
    accelerator: Accelerator
    model: Any  # the prepared (possibly wrapped) MLA model
    teacher: PreTrainedModel  # the frozen source model
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    params: list[torch.nn.Parameter]  # the trainable ones of the prepared model (what clipping acts on)
    data: AdaptData
    other: torch.Tensor | None  # validation windows of --also-eval
    chat: ChatProbe | None  # chat prompts with the source's answers (None: no chat template)
    inventory: dict[str, Any]  # select_trainable's
    transfer: AttentionIO | None  # objective attention-transfer
    layers: tuple[LayerOutputs, LayerOutputs] | None  # (MLA, source) when hidden_weight > 0
    steps: int
    work: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def sharded(self) -> bool:
        """FSDP: the student's forward needs every process (its parameters are gathered from all shards)."""
        return _sharded(self.accelerator)

    @property
    def tokens_per_step(self) -> int:
        return tokens_per_step(self.options, self.accelerator.num_processes)


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
    from mla_convert.sources.checkpoint import open_source

    config = _open_checkpoint(ckpt)
    check_start(ckpt, out, options, resume, overwrite)
    source = options.source or config.get("source", {}).get("origin")
    if not source:
        raise AdaptError(f"{ckpt}/config.json names no source model; pass --source")
    src = open_source(source)
    job = _setup(ckpt, options, src, work_dir(out), resume)
    start_step, job.metrics = open_work(job.accelerator, job.work, options, resume, job.data.record)
    if start_step == 0:
        _evaluate(job, 0)
    job.model.train()
    t0 = time.perf_counter()
    steps_here = _train(job, start_step, t0, stop_after, progress)
    if steps_here is None:
        return None
    final = _evaluate(job, job.steps)
    return _finish(job, ckpt, out, src.origin, final, time.perf_counter() - t0, steps_here)


def _open_checkpoint(ckpt: Path) -> dict[str, Any]:
    """The config of the converted checkpoint ``ckpt`` (:func:`~mla_convert.mla.checkpoint.read_checkpoint_config`).

    Raises:
        CheckpointError: ``ckpt`` has no ``config.json`` or holds no MLA model.
    """
    return read_checkpoint_config(ckpt)


def _load_student(ckpt: Path, options: AdaptOptions) -> tuple[PreTrainedModel, dict[str, Any]]:
    """The MLA model of ``ckpt`` in float32 on the absorbed path, frozen but for ``options.trainable``;
    and :func:`select_trainable`'s inventory."""
    model = load_checkpoint(ckpt)
    model.set_attention_path("absorbed")  # type: ignore[operator]
    inventory = select_trainable(model, options.trainable)
    if options.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, inventory


def _setup(ckpt: Path, options: AdaptOptions, src: SourceModel, work: Path, resume: bool = False) -> _Job:
    """Accelerator, seeded data, student, frozen teacher, optimizer, schedule and hooks, prepared.

    ``resume``: the data must be that of the stopped run in ``work`` (checked before the models load).

    Raises:
        AdaptError: fp16 without a GPU, attention transfer over several processes, or ``resume`` on changed
            data (:func:`~mla_convert.adapt.workdir.check_data`).
        TextError: too little text for the data.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoTokenizer

    from mla_convert.sources.checkpoint import load_source_model

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=options.mixed_precision)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not _sharded(accelerator):
        if accelerator.is_main_process:  # accelerate builds FSDP only on accelerators; CPUs get DDP
            logging.getLogger(__name__).warning(
                "note: the accelerate config asks for FSDP, which accelerate builds on GPUs only; these %d CPU "
                "processes run data-parallel (DDP over gloo), each with a full copy of the model",
                accelerator.num_processes,
            )
    if options.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise AdaptError("--mixed-precision fp16 needs a GPU; on the CPU use bf16 or no")
    world = accelerator.num_processes
    if options.objective == "attention-transfer" and world > 1:
        raise AdaptError("--objective attention-transfer runs in one process; launch it without accelerate")
    set_seed(options.seed)
    from mla_convert import register

    register()  # model_type "mla" known before the tokenizer reads config.json (no transformers warning)
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    steps = total_steps(options, world)
    per_step = options.batch_size * options.grad_accum * world
    data = build_data(
        tokenizer,
        data_specs(options.text, options.data),
        options.seq_len,
        options.eval_windows,
        rows_per_step=per_step,
        rows_needed=steps * per_step,
        seed=options.seed,
    )
    if resume:
        check_data(work, data.record)
    other = None
    if options.also_eval:
        other = validation_windows(tokenizer, options.also_eval, options.seq_len, options.eval_windows)
    model, inventory = _load_student(ckpt, options)
    teacher = load_source_model(src).to(accelerator.device)
    teacher.requires_grad_(False)
    chat = None
    if (accelerator.is_main_process or _sharded(accelerator)) and options.chat_prompts:
        chat = build_chat_probe(tokenizer, teacher, data.chat_held_out, count=options.chat_prompts)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=options.lr,
        betas=(options.beta1, options.beta2),
        weight_decay=options.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(options, steps))
    transfer = AttentionIO(teacher) if options.objective == "attention-transfer" else None
    layers = (LayerOutputs(model), LayerOutputs(teacher)) if options.hidden_weight > 0 else None
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    # FSDP2 replaces the parameters with sharded ones (accelerate re-points the optimizer at them): clipping and
    # the logged gradient norm take the prepared model's, never tensors taken before prepare
    params = _trainable(model, optimizer)
    # accelerate wraps forward in autocast for mixed precision; training enters accelerator.autocast()
    # itself, and evaluation must stay float32 (comparable across runs), so drop the wrapper.
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    return _Job(
        options,
        accelerator,
        model,
        teacher,
        optimizer,
        scheduler,
        params,
        data,
        other,
        chat,
        inventory,
        transfer,
        layers,
        steps,
        work,
    )


def _trainable(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The trainable parameters of the prepared ``model``, which must be the ones ``optimizer`` steps.

    Raises:
        RuntimeError: the optimizer holds other tensors than the model's trainable parameters (``prepare``
            replaced the parameters without re-pointing the optimizer: training would not move the model).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if stepped != {id(p) for p in params}:
        raise RuntimeError(
            f"internal error: the optimizer holds {len(stepped)} tensors, not the prepared model's "
            f"{len(params)} trainable parameters; report this with the accelerate config used"
        )
    return params


def _sharded(accelerator: Accelerator) -> bool:
    from accelerate.utils import DistributedType

    return bool(accelerator.distributed_type == DistributedType.FSDP)


def _log(job: _Job, entry: dict[str, Any]) -> None:
    """Append a metrics row (every process) and rewrite ``metrics.jsonl`` (main process)."""
    job.metrics.append(entry)
    if job.main:
        write_metrics(job.work, job.metrics)


def _evaluate(job: _Job, step: int) -> dict[str, Any]:
    """Evaluate in float32 on the main process (on every process under FSDP, whose forward gathers the
    shards; only the main one logs) after ``step`` optimizer steps and log the row; every process waits.
    Returns the row (empty on other processes)."""
    from mla_convert.metrics import evaluate

    res: dict[str, Any] = {}
    if job.main or job.sharded:
        device = job.accelerator.device
        model = job.accelerator.unwrap_model(job.model)
        model.eval()
        ev = evaluate(model, job.data.validation.to(device), job.teacher)
        res = {
            "kind": "eval",
            "step": step,
            "tokens": step * job.tokens_per_step,
            "perplexity": ev.perplexity,
            "source_perplexity": ev.reference_perplexity,
            "kl": ev.kl,
            "top1": ev.top1,
            "eval_tokens": ev.tokens,
        }
        if job.other is not None:
            ev2 = evaluate(model, job.other.to(device), job.teacher)
            res.update(
                other_text=job.options.also_eval,
                other_perplexity=ev2.perplexity,
                other_source_perplexity=ev2.reference_perplexity,
                other_kl=ev2.kl,
            )
        if job.chat is not None:
            res.update(chat_divergence(model, job.teacher, job.chat))
        model.train()
        if job.main:
            _log(job, res)
        else:
            res = {}
    job.accelerator.wait_for_everyone()
    return res


def _train(
    job: _Job, start_step: int, t0: float, stop_after: int | None, progress: ProgressFn | None
) -> int | None:
    """Run optimizer steps ``start_step .. steps - 1``: log each, evaluate every ``eval_every`` and
    checkpoint every ``checkpoint_every`` steps.

    Args:
        t0: ``time.perf_counter()`` when this invocation's training started (for rates and ETA).

    Returns:
        the steps run by this invocation, or None when ``stop_after`` stopped it (after a checkpoint).
    """
    o = job.options
    steps_here = 0
    for step in range(start_step, job.steps):
        loss, parts, grad_norm = _train_step(job, step)
        steps_here += 1
        elapsed = time.perf_counter() - t0
        rate = steps_here * job.tokens_per_step / elapsed
        entry = {
            "kind": "train",
            "step": step + 1,
            "tokens": (step + 1) * job.tokens_per_step,
            "loss": loss,
            **{f"{k}_rank0": v for k, v in parts.items()},
            "lr": job.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "tokens_per_s": rate,
            "elapsed_s": elapsed,
        }
        _log(job, entry)
        if progress and job.main:
            progress(
                {**entry, "steps": job.steps, "eta_s": (job.steps - step - 1) * job.tokens_per_step / rate}
            )
        if o.eval_every and (step + 1) % o.eval_every == 0 and step + 1 < job.steps:
            _evaluate(job, step + 1)
        stopping = stop_after is not None and steps_here >= stop_after and step + 1 < job.steps
        if stopping or (o.checkpoint_every and (step + 1) % o.checkpoint_every == 0):
            save_step(job.accelerator, job.work, step + 1, (step + 1) * job.tokens_per_step)
        if stopping:
            return None
    return steps_here


def _train_step(job: _Job, step: int) -> tuple[float, dict[str, float], float | None]:
    """One optimizer step over this process's micro-batches of ``step`` (gradients synchronised on the
    last one only), clipped to ``clip``.

    Returns:
        the loss averaged over micro-batches and processes, this process's loss parts averaged over its
        micro-batches, and the gradient norm before clipping.
    """
    o, acc = job.options, job.accelerator
    micro = step_rows(
        job.data, step, o.batch_size, o.grad_accum, acc.num_processes, acc.process_index, o.seed
    )
    parts: dict[str, float] = {}
    loss_sum = torch.zeros((), device=acc.device)
    for m, (ids, mask) in enumerate(micro):
        ids = ids.to(acc.device)
        with acc.no_sync(job.model) if m < len(micro) - 1 else nullcontext():
            loss, micro_parts = _micro_loss(job, ids, None if mask is None else mask.to(acc.device))
            acc.backward(loss / len(micro))
        loss_sum += loss.detach() / len(micro)
        for k, v in micro_parts.items():
            parts[k] = parts.get(k, 0.0) + v / len(micro)
    grad_norm = acc.clip_grad_norm_(job.params, o.clip)
    job.optimizer.step()
    job.scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)
    loss_all = float(acc.reduce(loss_sum, "mean"))
    return loss_all, parts, float(grad_norm) if grad_norm is not None else None


def _micro_loss(
    job: _Job, ids: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective's loss (and parts) on one micro-batch ``ids [B, T]`` (``mask [B, T]``: the loss
    targets, None for all): the teacher's forward without gradients, the student's under autocast."""
    acc, teacher = job.accelerator, job.teacher
    if job.transfer is not None:
        with torch.no_grad(), acc.autocast():
            job.transfer.enabled = True
            teacher(input_ids=ids, use_cache=False)
            job.transfer.enabled = False
        with acc.autocast():
            return attention_transfer_loss(acc.unwrap_model(job.model), job.transfer.take())
    rec = job.layers
    if rec is not None:
        rec[0].enabled = rec[1].enabled = True
    t_logits = None
    if job.options.objective != "lm":
        with torch.no_grad(), acc.autocast():
            t_logits = teacher(input_ids=ids, use_cache=False).logits
    elif rec is not None:  # only the layer outputs are needed: skip the source's LM head
        with torch.no_grad(), acc.autocast():
            teacher.model(input_ids=ids, use_cache=False)
    with acc.autocast():
        logits = job.model(input_ids=ids, use_cache=False).logits
    hidden = None
    if rec is not None:
        hidden = (rec[0].take(), rec[1].take())
        rec[0].enabled = rec[1].enabled = False
    return objective_loss(job.options, logits, ids, t_logits, hidden, mask)


def _finish(
    job: _Job, ckpt: Path, out: Path, teacher: str, final: dict[str, Any], wall_s: float, steps_here: int
) -> dict[str, Any]:
    """Write OUT (report, manifest, checkpoint) on the main process and remove the work folder.

    Returns:
        the report (empty on other processes).
    """
    from mla_convert.adapt.manifest import adaptation_manifest

    report: dict[str, Any] = {}
    world = job.accelerator.num_processes
    # FSDP: gather the full weights (a collective: every process takes part); otherwise the model's own
    state = job.accelerator.get_state_dict(job.model) if job.sharded else None
    if job.main:
        model = job.accelerator.unwrap_model(job.model)
        model.eval()
        report = adapt_report(
            ckpt,
            job.options,
            world=world,
            steps=job.steps,
            metrics=job.metrics,
            final=final,
            wall_s=wall_s,
            steps_here=steps_here,
            data_record=job.data.record,
            inventory=job.inventory,
            chat=job.chat.record if job.chat is not None else None,
        )
        manifest = adaptation_manifest(
            ckpt,
            job.options,
            report,
            teacher=teacher,
            data_record=job.data.record,
            trainable=job.inventory,
            checkpoints_in=job.work.name,
            run={"wall_s": wall_s, "torch": torch.__version__, "processes": world},
        )
        write_adapted(out, ckpt, model, job.options, report, job.metrics, manifest, state_dict=state)
        close_work(job.work)
    job.accelerator.wait_for_everyone()
    return report
