"""The manifest of an ``adapt`` output (:func:`adaptation_manifest`), written like every manifest by
:func:`~mla_convert.artifacts.manifest.write_manifest`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mla_convert.adapt.options import AdaptOptions
from mla_convert.artifacts.manifest import MANIFEST, origin_name, tool_record


def adaptation_manifest(
    ckpt: Path,
    options: AdaptOptions,
    report: Mapping[str, Any],
    teacher: str,
    data_record: dict[str, Any],
    trainable: dict[str, Any],
    checkpoints_in: str,
    run: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of an ``adapt`` output: the parent checkpoint's semantic fields (read from
    ``ckpt/mla_manifest.json`` when it has one), the parent's canonical id and the adaptation.

    Args:
        ckpt: the adapted (parent) checkpoint folder.
        options: the adaptation options.
        report: the adaptation report (``steps``, ``tokens_trained``, ``processes``, ``before`` and
            ``after`` evaluations with ``perplexity``, ``kl``, ``source_perplexity``).
        teacher: the teacher/reference model's origin (recorded by :func:`origin_name`).
        data_record: the data manifest (documents per role, token counts, tensor hashes).
        trainable: the trainable-parameter inventory.
        checkpoints_in: name of the folder that held the training checkpoints.
        run: timings and host facts (not part of the canonical id).
    """
    parent: dict[str, Any] = {}
    if (ckpt / MANIFEST).is_file():
        parent = json.loads((ckpt / MANIFEST).read_text())
    o = options
    before, after = report["before"], report["after"]
    manifest = {k: v for k, v in parent.items() if k not in ("outputs", "canonical_id", "run", "parent")}
    manifest["tool"] = tool_record()
    manifest["parent"] = {"canonical_id": parent.get("canonical_id"), "checkpoint": ckpt.name}
    manifest["adaptation"] = {
        "data": data_record,
        "objective": {
            "name": o.objective,
            "temperature": o.temperature if o.objective in ("distill", "mix") else None,
            "mix_weight": o.mix_weight if o.objective == "mix" else None,
            "hidden_weight": o.hidden_weight,
            "teacher": origin_name(teacher),
        },
        "optimizer": {
            "name": "AdamW",
            "lr": o.lr,
            "betas": [o.beta1, o.beta2],
            "weight_decay": o.weight_decay,
            "clip": o.clip,
        },
        "schedule": {
            "name": o.schedule,
            "warmup": o.warmup,
            "min_lr_ratio": o.min_lr_ratio,
            "decay_fraction": o.decay_fraction,
            "steps": report["steps"],
        },
        "token_budget": o.tokens,
        "tokens_trained": report["tokens_trained"],
        "batch": {
            "seq_len": o.seq_len,
            "batch_size": o.batch_size,
            "grad_accum": o.grad_accum,
            "processes": report["processes"],
        },
        "trainable": trainable,
        "checkpoints": {"every": o.checkpoint_every, "kept_in": checkpoints_in},
        "seed": o.seed,
        "precision": {
            "mixed_precision": o.mixed_precision,
            "gradient_checkpointing": o.gradient_checkpointing,
        },
        "result": {
            "perplexity_before": round(before["perplexity"], 4),
            "perplexity_after": round(after["perplexity"], 4),
            "kl_after": round(after["kl"] or 0.0, 5),
            "perplexity_source": round(after["source_perplexity"] or 0.0, 4),
        },
    }
    manifest["run"] = run
    return manifest
