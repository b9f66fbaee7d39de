"""What an adaptation job leaves in OUT besides the weights: the report, the model card, the training
plot and the metrics, written together with the checkpoint into one atomically appearing folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mla_convert.adapt.options import AdaptOptions, tokens_per_step
from mla_convert.adapt.workdir import jsonl

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def adapt_report(
    ckpt: Path,
    options: AdaptOptions,
    *,
    world: int,
    steps: int,
    metrics: list[dict[str, Any]],
    final: dict[str, Any],
    wall_s: float,
    steps_here: int,
    data_record: dict[str, Any],
    inventory: dict[str, Any],
    chat: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``adapt_report.json``: options, token counts, the first and last evaluation, every evaluation,
    throughput and the data and trainable-parameter summaries.

    Args:
        world: processes; ``steps``: optimizer steps of the job.
        metrics: every logged row (``kind`` ``train`` or ``eval``); ``final``: the last evaluation.
        wall_s: seconds this invocation trained and evaluated; ``steps_here``: steps it ran.
        data_record: the data manifest (its per-document lists, also those per source, are left out here).
        inventory: :func:`~mla_convert.adapt.objectives.select_trainable`'s (name lists left out).
        chat: what the chat probe measured on (:class:`~mla_convert.adapt.chat.ChatProbe` ``.record``); its
            ``chat_kl`` / ``chat_top1`` are in every evaluation. None: the tokenizer has no chat template.
    """
    per_step = tokens_per_step(options, world)
    evals = [m for m in metrics if m["kind"] == "eval"]
    return {
        "checkpoint": str(ckpt),
        "options": options.model_dump(),
        "processes": world,
        "steps": steps,
        "tokens_trained": steps * per_step,
        "before": evals[0],
        "after": final,
        "evaluations": evals,
        "train_wall_s_this_invocation": wall_s,
        "tokens_per_s": steps_here * per_step / max(wall_s, 1e-9),
        "data": {
            **{k: v for k, v in data_record.items() if not k.endswith("_documents")},
            "sources": [
                {k: v for k, v in src.items() if not k.endswith("_documents")}
                for src in data_record.get("sources", [])
            ],
        },
        "trainable": {k: v for k, v in inventory.items() if k not in ("trainable", "frozen")},
        "chat_probe": chat,
    }


def model_card(ckpt: Path, o: AdaptOptions, report: dict[str, Any]) -> str:
    """The adapted checkpoint's ``README.md``: what was trained on and perplexity before/after/source."""
    b, a = report["before"], report["after"]
    return (
        f"# {ckpt.name} adapted ({o.describe()})\n\n"
        f"MLA checkpoint from `mla-convert adapt`: {report['tokens_trained']} training tokens of "
        f"{' + '.join(o.data) if o.data else o.text} (adaptation splits). Held-out perplexity "
        f"({a['eval_tokens']} tokens of the first source's evaluation split): "
        f"{b['perplexity']:.3f} before, {a['perplexity']:.3f} after; source {a['source_perplexity']:.3f}.\n\n"
        + (
            f"Chat: KL to the source {b['chat_kl']:.4f} -> {a['chat_kl']:.4f} nats/token, top-1 agreement "
            f"{b['chat_top1']:.3f} -> {a['chat_top1']:.3f}, on {report['chat_probe']['answer_tokens']} tokens of the "
            f"source's greedy answers to {report['chat_probe']['count']} chat prompts ({report['chat_probe']['source']}).\n\n"
            if report.get("chat_probe") and "chat_kl" in a and "chat_kl" in b
            else ""
        )
        + "Load with `import mla_convert` then `AutoModelForCausalLM.from_pretrained(...)`; for stock transformers "
        "write an exact DeepSeek-V3 copy with `mla-convert export PATH OUT --format deepseek-v3`.\n"
    )


def plot_metrics(metrics: list[dict[str, Any]], path: Path, title: str) -> None:
    """``training.png``: training loss and held-out perplexity (log scale, source as a line) against
    training tokens."""
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


def write_adapted(
    out: Path,
    ckpt: Path,
    model: PreTrainedModel,
    options: AdaptOptions,
    report: dict[str, Any],
    metrics: list[dict[str, Any]],
    manifest: dict[str, Any],
    state_dict: dict[str, Any] | None = None,
) -> None:
    """Write OUT in one step (it appears only when complete): the checkpoint with ``ckpt``'s tokenizer
    files and a model card (weights from ``state_dict`` when given: an FSDP run's gathered weights),
    ``metrics.jsonl``, ``training.png``, ``adapt_report.json`` and the manifest
    over all of them.

    Raises:
        OSError: OUT's folder cannot be written (nothing is left behind).
    """
    from mla_convert.artifacts.manifest import write_manifest
    from mla_convert.artifacts.output import save_checkpoint
    from mla_convert.files import atomic_folder

    with atomic_folder(out) as tmp:
        extra = [p for p in ckpt.iterdir() if p.name.startswith("tokenizer") or p.suffix == ".jinja"]
        save_checkpoint(model, tmp, extra, model_card(ckpt, options, report), state_dict=state_dict)
        (tmp / "metrics.jsonl").write_text(jsonl(metrics))
        plot_metrics(metrics, tmp / "training.png", f"{ckpt.name}: {options.describe()}")
        (tmp / "adapt_report.json").write_text(json.dumps(report, indent=2) + "\n")
        write_manifest(tmp, manifest, sorted(p.name for p in tmp.iterdir() if p.is_file()))
