"""The RoPE split search's outcome as the report keeps it and as the user reads it: the record of
:func:`~mla_convert.convert.pipeline.rope_split.choose_rope_pairs`'s result (JSON keys, rounded nats) and its sentences."""

from __future__ import annotations

from typing import Any


def split_record(split: dict[str, Any] | None) -> dict[str, Any] | None:
    """:func:`choose_rope_pairs`'s result as the report keeps it (JSON keys, rounded nats), None for none."""
    if split is None:
        return None
    return {
        "candidates": split["candidates"],
        "prior": split["prior"],
        "chosen": split["chosen"],
        "kl_nats_per_token": {str(r): round(v, 5) for r, v in sorted(split["kl"].items())},
        "loss_nats_per_token": {str(r): round(v, 5) for r, v in sorted(split["loss"].items())},
        "o_proj_refit_kept": {str(r): v for r, v in sorted(split["refit"].items())},
        "strategy": _lever_record(split.get("strategy")),
        "refit_mode": _lever_record(split.get("refit_mode")),
        "measured_on": f"{split['tokens']} held-out calibration-split tokens, each candidate with the o_proj "
        "refit where it lowers their loss (as the conversion keeps it)",
        "seconds": round(split["seconds"], 1),
    }


def _lever_record(lever: dict[str, Any] | None) -> dict[str, Any] | None:
    if not lever:
        return None
    return {
        "prior": lever["prior"],
        "chosen": lever["chosen"],
        "kl_nats_per_token": {k: round(v, 5) for k, v in lever["kl"].items()},
        "loss_nats_per_token": {k: round(v, 5) for k, v in lever["loss"].items()},
        "o_proj_refit_kept": dict(lever["refit"]),
    }


def outcome(record: dict[str, Any]) -> str:
    """The measured split in one sentence (``record``: :func:`split_record`'s), saying when the best is the smallest
    or largest candidate (the best may then lie beyond: ``--rope-pairs`` tries it), and the rope strategy and
    ``o_proj`` refit mode measured at the chosen pairs, where they were."""
    kl = record["kl_nats_per_token"]
    kls = ", ".join(f"{r}: {v:.4f}" for r, v in kl.items())
    chosen, cands = record["chosen"], record["candidates"]
    edge = ""
    if len(cands) > 1 and chosen in (cands[0], cands[-1]):
        side = "fewer" if chosen == cands[0] else "more"
        edge = (f"; the {'smallest' if side == 'fewer' else 'largest'} candidate tried: {side} pairs may do better "
                "still, --rope-pairs tries them")
    said = (f"--rope-pairs {chosen} measured best on this source (KL nats/token on the held-out windows: {kls}; "
            f"the prior was {record['prior']}{edge})")
    if record.get("strategy"):
        said += "; " + _lever_said("--rope-strategy", record["strategy"], f"at {chosen} pairs")
    if record.get("refit_mode"):
        said += "; " + _lever_said("--refit-o-proj", record["refit_mode"], "there")
    return said


def _lever_said(flag: str, lever: dict[str, Any], where: str) -> str:
    """One lever's outcome (``lever``: :func:`_lever_record`'s); a tie keeps the prior and says so (with why, where
    no candidate kept its ``o_proj`` refit: the refit modes then convert the same model)."""
    kl = lever["kl_nats_per_token"]
    kls = ", ".join(f"{k}: {v:.4f}" for k, v in kl.items())
    if len(kl) > 1 and len(set(kl.values())) == 1:
        why = "; no candidate kept its o_proj refit" if not any(lever["o_proj_refit_kept"].values()) else ""
        return f"{flag} {lever['chosen']} kept, the prior: every value measured the same {where} ({kls}{why})"
    return f"{flag} {lever['chosen']} measured best {where} ({kls}; the prior was {lever['prior']})"


def split_sentence(split: dict[str, Any] | None, why: str | None) -> str | None:
    """Why the conversion has its RoPE pairs: the resolution's ``why`` and, when measured, the outcome."""
    if split is None:
        return why
    record = split_record(split)
    assert record is not None
    said = outcome(record)
    return f"{why}; {said}" if why else said
