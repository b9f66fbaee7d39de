"""Reconstruction report: ``report.json``, ``report.md`` and a terminal table.

Every figure names what it was measured on (tokens, window, documents), and the report prints only
measured numbers (fields: docs/formats.md §report.json and report.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table


def layer_table(report: dict[str, Any]) -> Table:
    """A rich table of the per-layer records."""
    t = Table(title="Per-layer reconstruction", show_lines=False)
    for col in ("layer", "rope pairs", "rank d_c", "cache", "energy", "K/V err", "K/V err (act)", "attn err"):
        t.add_column(col, justify="right")
    for r in report["layers"]:
        pairs = sum(len(h) for h in r["rope_pairs"])
        t.add_row(
            str(r["layer"]),
            str(pairs),
            str(r["rank"]),
            str(r["cache_width"]),
            f"{r['energy']:.4f}",
            f"{r['rel_error']:.4f}",
            f"{r['rel_error_act']:.4f}",
            "-" if r["attn_rel_error"] is None else f"{r['attn_rel_error']:.4f}",
        )
    return t


def summary_table(report: dict[str, Any]) -> Table:
    """A rich table of the model-level measurements."""
    m = report["model"]
    t = Table(
        title=f"Model-level, on {m['eval']['tokens']} held-out tokens ({m['eval']['windows']} x {m['eval']['window']})"
    )
    t.add_column("measure")
    t.add_column("source", justify="right")
    t.add_column("converted", justify="right")
    e = m["eval"]
    t.add_row("perplexity", f"{e['reference_perplexity']:.3f}", f"{e['perplexity']:.3f}")
    t.add_row("perplexity ratio", "1.000", f"{e['perplexity'] / e['reference_perplexity']:.3f}")
    t.add_row("KL(source||converted) nats/token", "0", f"{e['kl']:.4f}")
    t.add_row("top-1 agreement", "1.000", f"{e['top1']:.4f}")
    c = m["cache"]
    t.add_row(
        "KV cache values / token / layer",
        f"{c['source']['values_per_token_per_layer']:.1f}",
        f"{c['converted']['values_per_token_per_layer']:.1f}",
    )
    t.add_row(
        "KV cache bytes / token / layer",
        f"{c['source']['bytes_per_token_per_layer']:.1f}",
        f"{c['converted']['bytes_per_token_per_layer']:.1f}",
    )
    t.add_row("cache ratio", "1.000", f"{c['ratio']:.4f}")
    return t


def _fitted_line(report: dict[str, Any]) -> list[str]:
    """One sentence on the fitted reconstruction where it ran (layers that kept their fit, held-out attention error
    before and after), then a blank line; none where it did not run."""
    fits = [r["reconstruct"] for r in report["layers"] if r.get("reconstruct")]
    if not fits:
        return []
    kept = sum(bool(f["kept"]) for f in fits)
    before, after = (sum(f[k] for f in fits) / len(fits) for k in ("before", "after"))
    return [
        f"Fitted reconstruction ({fits[0]['steps']} Adam steps per lossy layer): {kept} of {len(fits)} layers kept "
        f"their fit; mean held-out relative attention error {before:.4f} -> {after:.4f} "
        f"({sum(f['seconds'] for f in fits):.0f} s).",
        "",
    ]


def _refit_line(report: dict[str, Any]) -> str:
    """One sentence on the ``o_proj`` refit: which inputs it fitted on, and whether it was kept (mean next-token loss
    in nats on the held-out calibration windows before -> after)."""
    mode = report["options"].get("refit_o_proj", "none")
    refit = report["model"].get("o_proj_refit") or {}
    if mode == "none":
        return "o_proj refit: none."
    if refit.get("loss_before") is None:
        return f"o_proj refit ({mode}): not run (the conversion is lossless, or no held-out window decided it)."
    kept = "kept" if refit["kept"] else "reverted"
    return (f"o_proj refit ({mode}): {kept}; mean loss on the held-out calibration windows "
            f"{refit['loss_before']:.3f} -> {refit['loss_after']:.3f} nats.")


def _bfloat16_line(report: dict[str, Any]) -> str:
    """The bfloat16 check of the report (``model.bfloat16``, :mod:`mla_convert.precision`) as one sentence."""
    rec = report["model"].get("bfloat16")
    if not rec:
        return "bfloat16 precision: not measured by this version."
    if "skipped" in rec:
        return f"bfloat16 precision: skipped ({rec['skipped']})."
    from mla_convert.precision import gate_line

    return f"{gate_line(rec)} ({rec['measured_on']}; passed when the converted mean is within 2 x the source's)."


def _calibration_line(report: dict[str, Any]) -> str:
    """Which text the statistics came from: ``calibration on N tokens [of a mixture] from [k of] the m calibration
    documents`` (k is not counted where chat-templated turns hold EOS themselves)."""
    text = report["text"]
    mixture = report["options"].get("calib_data")
    used = text.get("calibration_documents_used")
    where = f"from {used} of the" if used else "drawn across the"
    what = f" of {text['name']} (one share per source, weighted)" if mixture else ""
    return f"calibration on {text['calibration_tokens']} tokens{what} {where} {len(text['calibration'])} calibration documents"


def _weights_lines(report: dict[str, Any]) -> list[str]:
    """The weights ledger's lines (what the converted model stores against the source, per engine, and the
    break-even), then a blank line; none for a report written before the ledger."""
    lines = (report.get("weights") or {}).get("lines") or []
    return ["Weights against the source:", "", *[f"- {line}" for line in lines], ""] if lines else []


def to_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown (``report.md``)."""
    m = report["model"]
    e, c = m["eval"], m["cache"]
    lines = [
        f"# MLA conversion report: {report['source']['origin']}",
        "",
        f"Source weights: {report['source'].get('weights', '?')}.",
        "",
        f"Options: `{json.dumps(report['options'], sort_keys=True)}`",
        "",
        f"Chosen for the cache budget: {report['run'].get('rope_pairs_chosen_by') or 'nothing (all given)'}.",
        "",
        f"Measured on {e['tokens']} held-out tokens ({e['windows']} windows of {e['window']}) of "
        f"{report['options'].get('text', report['text']['name'])} evaluation documents "
        f"({len(report['text']['evaluation'])} documents); {_calibration_line(report)} (disjoint from the evaluation "
        "ones); per-layer attention error on held-out calibration tokens.",
        "",
        *[f"**Warning:** {w}" + "\n" for w in report.get("warnings", [])],
        "| measure | source | converted |",
        "|---|---:|---:|",
        f"| perplexity | {e['reference_perplexity']:.3f} | {e['perplexity']:.3f} |",
        f"| perplexity ratio | 1.000 | {e['perplexity'] / e['reference_perplexity']:.3f} |",
        f"| KL(source‖converted), nats/token | 0 | {e['kl']:.4f} |",
        f"| top-1 agreement | 1.000 | {e['top1']:.4f} |",
        f"| KV cache values/token/layer (measured) | {c['source']['values_per_token_per_layer']:.1f} | "
        f"{c['converted']['values_per_token_per_layer']:.1f} |",
        f"| KV cache bytes/token/layer ({c['converted']['dtype']}) | {c['source']['bytes_per_token_per_layer']:.1f} | "
        f"{c['converted']['bytes_per_token_per_layer']:.1f} |",
        f"| cache ratio | 1.000 | {c['ratio']:.4f} |",
        "",
        _refit_line(report),
        "",
        *_fitted_line(report),
        _bfloat16_line(report),
        "",
        *_weights_lines(report),
        "| layer | rope pairs | rank d_c | cache | energy | K/V rel err | K/V rel err (act) | attn rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["layers"]:
        pairs = sum(len(h) for h in r["rope_pairs"])
        attn = "-" if r["attn_rel_error"] is None else f"{r['attn_rel_error']:.4f}"
        lines.append(
            f"| {r['layer']} | {pairs} | {r['rank']} | {r['cache_width']} | {r['energy']:.4f} | "
            f"{r['rel_error']:.4f} | {r['rel_error_act']:.4f} | {attn} |"
        )
    lines += [
        "",
        "Columns: *rope pairs* = RoPE pairs kept (all rope heads); *rank d_c* = latent width; *cache* = values per "
        "token cached by the layer (d_c + rope width); *energy* = share of the objective-weighted K/V energy the "
        "rank keeps (singular values squared); *K/V rel err* = ‖W − W_up W_down‖/‖W‖ of the stacked NoPE-key and "
        "value maps (plain, then weighted by the calibration activations C^½; energy is weighted by the "
        "objective, so the two can differ a lot); *attn rel err* = ‖a_mla − a_src‖/‖a_src‖ of the layer's attention output on "
        f"{report['text'].get('held_out_tokens', '?')} held-out calibration tokens, with the source's inputs.",
        "",
        f"Run: wall time {report['run']['wall_s']:.1f} s on {report['run']['threads']} CPU thread(s); peak resident "
        f"memory {report['run']['peak_rss_mb']:.0f} MB (ru_maxrss); torch {report['run']['torch']}.",
        "",
    ]
    return "\n".join(lines)


def write_report(folder: Path, report: dict[str, Any]) -> None:
    """Write ``report.json`` and ``report.md`` into ``folder``."""
    (folder / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    (folder / "report.md").write_text(to_markdown(report))
