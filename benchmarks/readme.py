"""Write the generated blocks (README.md, docs/*.md) from recorded artifacts, so no figure there is typed by hand.

    .venv/bin/python benchmarks/readme.py reference            # reference table <- manifests/smollm2-135m-reference.json
    .venv/bin/python benchmarks/readme.py recipe               # recipe factor line <- the same manifest
    .venv/bin/python benchmarks/readme.py validate out/smollm2-mla   # validate block <- CKPT/validation.json
                                                               # (kept as benchmarks/results/validation.json)
    .venv/bin/python benchmarks/readme.py rungs                # rung table <- mla_convert/validate/spec.py
    .venv/bin/python benchmarks/readme.py vllm-parity          # vLLM table <- results/vllm_parity.json

The other blocks are written by the benchmarks themselves (``perplexity.py --readme``, ``decode.py
--readme``, ``adapt.py --collect --readme``, ...); every writer puts its block with
:func:`blocks.replace_block` into README.md or the page of docs/ that holds its markers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from blocks import replace_block

from mla_convert.validate.report import table_cell
from mla_convert.validate.result import format_value
from mla_convert.validate.spec import RUNGS

ROOT = Path(__file__).resolve().parents[1]
PINNED = ROOT / "manifests" / "smollm2-135m-reference.json"
RESULTS = ROOT / "benchmarks" / "results"


def reference_block(manifest: dict[str, Any]) -> str:
    """The reference conversion's table, every figure read from its pinned manifest."""
    rec, run, cache = manifest["reconstruction"], manifest["run"], manifest["cache_schema"]
    cal = manifest["calibration"]
    opts = manifest["options"]
    widths = cache["values_per_token_per_layer"]
    mean_width = sum(widths) / len(widths)
    t = run["timings"]
    refit = rec.get("o_proj_refit")
    lines = [
        f"Pinned manifest `manifests/smollm2-135m-reference.json` (canonical id `{manifest['canonical_id'][:16]}…`), "
        f"written by `mla-convert factor smollm2-135m out/smollm2-mla --device cpu` (default options; the device "
        f"is a recorded option, so a GPU host converts as a CPU does with `cpu`; CPUs of other instruction sets round the last digits differently and get another id, their figures within 0.5 % of these: tests/convert/test_reference.py); this table by "
        f"`python benchmarks/readme.py reference`. Perplexity on {opts['eval_windows']} x {opts['window']} tokens "
        f"of the Wikipedia evaluation split (one article; 40 windows: docs/results.md).",
        "",
        "| | source | MLA |",
        "|---|---:|---:|",
        f"| KV cache values / token / layer (mean over layers) | 384 | {mean_width:g} ({mean_width / 384:.2%}) |",
        f"| perplexity | {rec['perplexity_source']:.2f} | {rec['perplexity']:.2f} "
        f"(x{rec['perplexity'] / rec['perplexity_source']:.2f}) |",
        f"| KL(source ‖ MLA), nats/token | | {rec['kl']:.3f} |",
        f"| top-1 agreement | | {rec['top1']:.1%} |",
        f"| mean held-out attention-output error per layer | | {rec['mean_attn_rel_error']:.3f} |",
        f"| calibration | | {cal['tokens']:,} tokens "
        + (f"of {cal['text']} (the default mixture, one share each), drawn across the {len(cal['documents'])} "
           "documents of their calibration splits |" if opts.get("calib_data") else
           f"spread across the {len(cal['documents'])} documents of the calibration split |"),
        f"| time: source pass / convert + eval passes / whole command ({run['threads']} threads, on the machine "
        f"that made the pin; timings by stage on an idle machine are in the scale table of docs/results.md) | | "
        f"{t['source_pass_s']:.0f} s / {t['convert_pass_s']:.0f} s / {run['wall_s']:.0f} s |",
        f"| peak resident memory | | {run['peak_rss_mb'] / 1024:.1f} GB |",
    ]
    if refit:
        lines.append(
            f"| o_proj refit: mean loss on {refit['held_out_windows']} held-out calibration windows, before -> "
            f"after (per-window change) | | {refit['loss_before']:.3f} -> {refit['loss_after']:.3f} nats "
            f"({refit['delta_min']:+.3f} .. {refit['delta_max']:+.3f}), {'kept' if refit['kept'] else 'reverted'} |"
        )
    return "\n".join(lines)


def rungs_block() -> str:
    """The rung table (rung, what it compares, tolerances) from :data:`mla_convert.validate.spec.RUNGS`, the
    table each checkpoint's ``validation.md`` also prints."""
    lines = [
        "Written by `python benchmarks/readme.py rungs` from `mla_convert/validate/spec.py`, the table the "
        "rungs check against and each `validation.md` repeats.",
        "",
        "| rung | compares | tolerance (float32) |",
        "|---|---|---|",
    ]
    for s in RUNGS:
        lines.append(f"| {s.number} {s.name} | {table_cell(s.compares)} | {table_cell(s.tolerances)} |")
    return "\n".join(lines)


def validate_block(result: dict[str, Any], ckpt: str) -> str:
    """The validation ladder's block (docs/validation.md) from ``validation.json`` (one row per rung)."""
    env = result["environment"]
    lines = [
        f"Measured by `mla-convert validate {ckpt}` on the reference conversion; this block by "
        f"`python benchmarks/readme.py validate {ckpt}`. Backend {env.get('kernel_backend')} (triton "
        f"{env.get('triton')}, torch {env.get('torch')}), float32. Verdict: "
        f"{'PASSED' if result['passed'] else 'FAILED'}.",
        "",
        "| rung | data | measured (tolerance) | s |",
        "|---|---|---|---:|",
    ]
    for r in result["rungs"]:
        checks = table_cell(
            "; ".join(
                f"{c['name']} {format_value(c['value'])}" + (f" ({c['tolerance']})" if c["tolerance"] else "")
                for c in r["checks"]
            )
        )
        verdict = "" if r["passed"] else " **FAIL**"
        data = table_cell(r["data"])
        lines.append(f"| {r['number']} {r['name']}{verdict} | {data} | {checks} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def recipe_block(manifest: dict[str, Any]) -> str:
    """The factor stage's line that ``mla-convert run`` prints for the quick-start recipe, from the pinned
    manifest of the same conversion (the recipe's factor stage is ``factor``'s defaults)."""
    rec, opts, widths = manifest["reconstruction"], manifest["options"], manifest["cache_schema"]["values_per_token_per_layer"]
    mean = sum(widths) / len(widths)
    scored = opts["eval_windows"] * (opts["window"] - 1)  # each window scores its next-token predictions
    return (
        f"    factor: perplexity {rec['perplexity']:.3f} (source {rec['perplexity_source']:.3f}, "
        f"x{rec['perplexity'] / rec['perplexity_source']:.2f}) on {scored} held-out tokens of {opts['text']}; "
        f"cache {mean:g} values/token/layer ({mean / 384:.2%} of the source)"
    )


def vllm_parity_block(record: dict[str, Any]) -> str:
    """The vLLM parity table of ``scripts/serve_check.sh`` from its stored record (``vllm_parity.json``)."""
    from mla_convert.engines.vllm.check import table

    return table(record, "bash scripts/serve_check.sh")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="block", required=True)
    sub.add_parser("reference", help="the reference conversion table from the pinned manifest")
    sub.add_parser("recipe", help="the quick-start recipe's factor line from the pinned manifest")
    sub.add_parser("rungs", help="the validation ladder's rung table from mla_convert/validate/spec.py")
    sub.add_parser("vllm-parity", help="the vLLM parity table from benchmarks/results/vllm_parity.json")
    v = sub.add_parser("validate", help="the validation block from CKPT/validation.json (stored as results/validation.json)")
    v.add_argument("ckpt", nargs="?", help="a checkpoint folder that `mla-convert validate` has run on "
                   "(none: the stored benchmarks/results/validation.json)")  # fmt: skip
    args = ap.parse_args()
    if args.block == "reference":
        replace_block("reference", reference_block(json.loads(PINNED.read_text())))
    elif args.block == "recipe":
        replace_block("recipe", recipe_block(json.loads(PINNED.read_text())))
    elif args.block == "rungs":
        replace_block("rungs", rungs_block())
    elif args.block == "vllm-parity":
        replace_block("vllm-parity", vllm_parity_block(json.loads((RESULTS / "vllm_parity.json").read_text())))
    else:
        if args.ckpt:
            path = Path(args.ckpt) / "validation.json"
            if not path.exists():
                raise SystemExit(f"error: {path} not found; run `mla-convert validate {args.ckpt}` first")
            (RESULTS / "validation.json").write_text(path.read_text())
        result = json.loads((RESULTS / "validation.json").read_text())
        replace_block("validate", validate_block(result, result["checkpoint"]))
    print(f"updated the {args.block} block")


if __name__ == "__main__":
    main()
