"""Training-free perplexity of SmolLM2-135M converted to MLA at 31.25 / 18.75 / 12.5 % of its KV cache.

Rows: plain re-implementations of the anchors' recipes (MHA2MLA: per-head partial RoPE by 2-norm +
weight SVD; per-head `high` + activation PCA with K/V balance; TransMLA: shared RoRoPE head +
activation PCA with K/V balance) and mla-convert's options, all on the same model, calibration text
(Wikipedia calibration split) and held-out text (Wikipedia evaluation split), measured at 512- and
2048-token windows. Prints a Markdown table and writes it to ``benchmarks/results/perplexity.md``.

    .venv/bin/python benchmarks/perplexity.py            # quick grid (anchors + best splits), ~60 min here
    .venv/bin/python benchmarks/perplexity.py --full     # strategy x objective x joint/split at each size
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import protocol
from blocks import replace_block

from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.pipeline.build import convert_windows
from mla_convert.convert.pipeline.text import HELD_OUT_WINDOWS
from mla_convert.metrics import evaluate

DEV_WINDOWS = 8
SPLITS = Path(__file__).resolve().parents[1] / "mla_convert" / "convert" / "measured_splits.json"
SIZES = {120: "31.25 %", 72: "18.75 %", 48: "12.5 %"}
ANCHORS: dict[str, dict[str, Any]] = {
    "MHA2MLA-style (per-head 2-norm r=4, weight SVD, joint)": dict(
        rope_mode="per-head",
        rope_strategy="2-norm",
        rope_pairs=4,
        objective="weight",
        kv_balance=False,
        refit_o_proj="none",
    ),
    "per-head high r=4, activation PCA + K/V balance": dict(
        rope_mode="per-head", rope_strategy="high", rope_pairs=4, objective="activation", refit_o_proj="none"
    ),
    "TransMLA-style (shared RoRoPE head, activation PCA + K/V balance)": dict(
        rope_mode="shared", rope_strategy="high", rope_pairs=32, objective="activation", refit_o_proj="none"
    ),
}


def measured_levers(size: int) -> dict[str, str]:
    """The rope strategy and ``o_proj`` refit ``factor`` takes at ``size`` (``measured_splits.json``'s ``levers``,
    written by ``benchmarks/levers.py --readme``); 2-norm and the teacher-forced refit where none is recorded."""
    levers = {"rope_strategy": "2-norm", "refit_o_proj": "teacher"}
    if SPLITS.exists():
        for entry in json.loads(SPLITS.read_text())["splits"]:
            if entry["cache_budget"] == size:
                levers.update(entry.get("levers", {}))
    return levers


def ours(size: int) -> dict[str, dict[str, Any]]:
    """mla-convert rows: a shared complex-PCA rope head chosen by the measured strategy, output-aware joint SVD,
    the measured o_proj refit (:func:`measured_levers`); the split between RoPE pairs and latent rank is swept at
    each cache size."""
    pairs = {120: (20, 24, 28), 72: (12, 16, 20), 48: (8, 12, 16)}[size]
    lv = measured_levers(size)
    refit = "o_proj refit" if lv["refit_o_proj"] == "teacher" else f"{lv['refit_o_proj']} o_proj refit"
    return {
        f"mla-convert: shared {lv['rope_strategy']} r={p}, output-aware, joint, {refit}": dict(
            rope_mode="shared",
            rope_strategy=lv["rope_strategy"],
            rope_pairs=p,
            objective="output",
            refit_o_proj=lv["refit_o_proj"],
        )
        for p in pairs
    }


def full_grid(size: int, refit: str) -> dict[str, dict[str, Any]]:
    rows = {}
    ropes = [("per-head", s, 4) for s in ("high", "low", "uniform", "2-norm", "rotation")]
    ropes += [
        ("shared", "high", {120: 32, 72: 16, 48: 8}[size]),
        ("shared", "2-norm", {120: 24, 72: 16, 48: 8}[size]),
    ]
    for (mode, strat, r), obj, fac in itertools.product(
        ropes, ("weight", "activation", "output"), ("joint", "split")
    ):
        rows[f"{mode} {strat} r={r}, {obj}, {fac}, refit {refit}"] = dict(
            rope_mode=mode,
            rope_strategy=strat,
            rope_pairs=r,
            objective=obj,
            factorization=fac,
            refit_o_proj=refit,
        )
    return rows


#: Training-free targets of issue 27 (ratio to the source's perplexity, 40 Wikipedia windows of 512).
TARGETS = {120: 2.0, 72: 4.0, 48: 9.0}


def summarize(lines: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """From the table's rows: per cache size the mla-convert row with the lowest dev ratio (the suggested
    split), its evaluation ratios, the best anchor row and the target. Returns (summary lines, splits)."""
    rows = []
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0][:1].isdigit():
            size = int(cells[0].split()[0])
            rows.append((size, cells[0], cells[1], [float(c) for c in cells[2:6]]))
    out, splits = [], []
    for size in sorted({r[0] for r in rows}, reverse=True):
        ours_rows = [r for r in rows if r[0] == size and r[2].startswith("mla-convert")]
        anchors = [r for r in rows if r[0] == size and not r[2].startswith("mla-convert")]
        if not ours_rows:
            continue
        best = min(ours_rows, key=lambda r: r[3][0])
        pairs = int(best[2].split("r=")[1].split(",")[0])
        anchor = min(anchors, key=lambda r: r[3][1]) if anchors else None
        target = TARGETS.get(size)
        met = "met" if target and best[3][1] <= target else "not met"
        line = (
            f"- {best[1]}: chosen on dev, {best[2].split(': ', 1)[1]}: x{best[3][1]:.2f} wiki @512, "
            f"x{best[3][2]:.2f} @2048, x{best[3][3]:.2f} news"
        )
        if anchor:
            line += f"; best anchor ({anchor[2].split(' (')[0]}) x{anchor[3][1]:.2f} wiki @512"
        if target:
            line += f"; target <= x{target:g}: {met}"
        out.append(line + ".")
        splits.append(
            {
                "cache_budget": size,
                "cache_fraction": round(size / 384, 4),
                "rope_pairs": pairs,
                "rope_share": round(2 * pairs / size, 4),
                "dev_ratio": best[3][0],
                "wiki_ratio": best[3][1],
            }
        )
    return out, splits


def header(described: str, calib_tokens: int, documents: int | None, dev_windows: int, held_windows: int) -> list[str]:
    """The table's caption and column header (``described``: the source's perplexity on each window set)."""
    return [
        f"Source SmolLM2-135M-Instruct: perplexity {described}; wiki = the Wikipedia evaluation split, news = the "
        f"news corpus's evaluation split (never calibrated on), dev = {dev_windows} windows spread across the "
        f"Wikipedia adaptation split, which no conversion reads (they choose the suggested split; evaluation "
        f"windows never choose). Calibration: `factor`'s default, {calib_tokens} tokens spread across "
        f"{documents} documents of the disjoint Wikipedia calibration split; the o_proj refit is kept only if it "
        f"lowers the mean loss on {held_windows} held-out calibration windows spread the same way. Cells: "
        f"perplexity ratio to the source (`python benchmarks/perplexity.py --readme`).",
        "",
        "| cache (values/token/layer) | method | x dev @512 | x wiki @512 | x wiki @2048 | x news @512 | refit kept "
        "| convert s |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]


def header_from_log(log: Path) -> list[str] | None:
    """Rebuild the header from a run's printed ``calibration: N tokens in S s; source perplexity ...`` line."""
    for line in log.read_text().splitlines():
        if line.startswith("calibration: ") and "; source perplexity " in line:
            tokens = int(line.split()[1])
            described = line.split("; source perplexity ", 1)[1].strip()
            docs = line.split(" tokens from ")[1].split()[0] if " tokens from " in line else None
            return header(described, tokens, int(docs) if docs else None, DEV_WINDOWS, HELD_OUT_WINDOWS)
    return None


def merge_rows(lines: list[str], sources: list[Path]) -> list[str]:
    """The table ``lines`` with the rows found in ``sources`` added (one row per size and method)."""

    def is_row(x: str) -> bool:
        return x.startswith("| ") and x[2:3].isdigit()

    head = [x for x in lines if not is_row(x)]
    rows: dict[tuple[str, str], str] = {}
    for x in [y for src in sources for y in src.read_text().splitlines() if is_row(y)] + [
        y for y in lines if is_row(y)
    ]:
        cells = [c.strip() for c in x.strip("|").split("|")]
        rows.setdefault((cells[0], cells[1]), x.strip())
    ordered = sorted(rows.items(), key=lambda kv: -int(kv[0][0].split()[0]))
    return head + [x for _, x in ordered]


def publish(lines: list[str], readme: bool) -> None:
    """Print the summary; with ``readme``, write its block (docs/results.md: table + summary) and the measured splits."""
    summary, splits = summarize(lines)
    print("\n".join(summary))
    if not readme:
        return
    replace_block("perplexity", "\n".join([*lines, "", *summary]))
    previous = json.loads(SPLITS.read_text()) if SPLITS.exists() else {"splits": []}
    old = {e["cache_budget"]: e for e in previous["splits"]}
    for entry in splits:  # benchmarks/levers.py's choice stays while it was measured at this split
        prev = old.get(entry["cache_budget"], {})
        if "levers" in prev and prev["rope_pairs"] == entry["rope_pairs"]:
            entry["levers"], entry["levers_evidence"] = prev["levers"], prev["levers_evidence"]
        elif "levers" in prev:
            print(f"{entry['cache_budget']} values: the split moved, re-run benchmarks/levers.py at r={entry['rope_pairs']}")
    SPLITS.write_text(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct",
                "shape": {"head_dim": 64, "num_kv_heads": 3, "num_attention_heads": 9},
                "measured_by": "benchmarks/perplexity.py --readme: per cache size the mla-convert row with the "
                "lowest perplexity ratio on the dev windows (Wikipedia adaptation split, unused by the conversion)",
                "splits": splits,
                # what other benchmarks recorded (engine_shape.py's llama.cpp row) stays
                **{k: v for k, v in previous.items() if k not in ("model", "shape", "measured_by", "splits")},
            },
            indent=2,
        )
        + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the whole strategy x objective x factorization grid")
    ap.add_argument("--calib-tokens", type=int, default=None, help="calibration budget (default: factor's)")
    ap.add_argument("--refit", default="teacher", choices=["none", "teacher", "sequential"], help="o_proj refit in --full")
    ap.add_argument("--windows-512", type=int, default=40, help="Wikipedia evaluation windows of 512 tokens")
    ap.add_argument("--windows-2048", type=int, default=2, help="Wikipedia evaluation windows of 2048 tokens")
    ap.add_argument(
        "--news-windows", type=int, default=8, help="news evaluation windows of 512 (never calibrated on)"
    )
    ap.add_argument("--sizes", default="120,72,48", help="cache sizes (values per token per layer)")
    ap.add_argument("--pairs", default="", help="only these splits of ours, e.g. 120:24,72:16 (default: the sweep)")
    ap.add_argument("--anchors", default="", help="only the anchor rows whose name contains one of these (comma-separated)")
    ap.add_argument(
        "--readme", action="store_true", help="also replace the table between its markers (docs/results.md)"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "perplexity.md")
    ap.add_argument(
        "--collect", action="store_true", help="no measuring: re-derive summary and splits from --out's table"
    )
    ap.add_argument(
        "--rows-from",
        type=Path,
        nargs="*",
        default=[],
        help="with --collect: add the table rows printed in these logs or tables (a grid split across runs "
        "with the same windows and calibration); rows are ordered by cache size, first seen first",
    )
    args = ap.parse_args()
    if args.collect:
        lines = args.out.read_text().splitlines() if args.out.exists() else []
        logged = [h for h in map(header_from_log, args.rows_from) if h]
        if logged:  # the logged run's own header and rows replace the file (which may predate the run)
            lines = logged[0]
        if args.rows_from:
            lines = merge_rows(lines, args.rows_from)
            args.out.write_text("\n".join(lines) + "\n")
        publish(lines, args.readme)
        print("\n".join(lines))
        return
    proto = protocol.load(args.calib_tokens, DEV_WINDOWS, {
        "wiki@512": args.windows_512, "wiki@2048": args.windows_2048, "news@512": args.news_windows,
    })  # fmt: skip
    src, model, calib, held = proto.src, proto.model, proto.calibration, proto.held_out
    # dev windows (adaptation split, never read by a conversion) choose the suggested split; the evaluation
    # columns are reported, never used to choose.
    evals = {"dev@512": proto.dev, **proto.evals}
    t0 = time.perf_counter()
    tokens = int(calib.numel())
    base = {ctx: evaluate(model, ids).perplexity for ctx, ids in evals.items()}
    described = ", ".join(
        f"{base[k]:.2f} on {k} ({ids.shape[0]} windows, {ids.numel():,} tokens)" for k, ids in evals.items()
    )
    print(
        f"calibration: {tokens} tokens from {proto.documents} documents; source scored in {time.perf_counter() - t0:.0f} s; source perplexity {described}"
    )
    lines = header(described, tokens, proto.documents, proto.dev.shape[0], held.shape[0])
    for size in [int(x) for x in args.sizes.split(",")]:
        label = SIZES[size]
        rows = full_grid(size, args.refit) if args.full else {**ANCHORS, **ours(size)}
        keep = {tuple(int(v) for v in x.split(":")) for x in args.pairs.split(",") if x}
        picks = [x for x in args.anchors.split(",") if x]
        rows = {
            k: v for k, v in rows.items()
            if (not k.startswith("mla-convert") and (not picks or any(p in k for p in picks)))
            or (k.startswith("mla-convert") and (not keep or (size, v["rope_pairs"]) in keep))
        }  # fmt: skip
        for name, kw in rows.items():
            if kw["rope_mode"] == "shared" and 2 * kw["rope_pairs"] >= size:
                kw = {**kw, "rope_pairs": {72: 16, 48: 8}.get(size, kw["rope_pairs"])}
                name = name.replace("r=32", f"r={kw['rope_pairs']}")
            opts = ConvertOptions(cache_budget=size, dtype="float32", **kw)
            t = time.perf_counter()
            try:
                mla = convert_windows(src, opts, calib, held).model
            except ValueError as exc:
                print(f"skip {name} @ {size}: {exc}")
                continue
            secs = time.perf_counter() - t
            ratio = {k: evaluate(mla, ids).perplexity / base[k] for k, ids in evals.items()}
            refit = mla.config.source.get("o_proj_refit")
            kept = "n/a" if refit is None else ("yes" if refit["kept"] else "no")
            cells = " | ".join(f"{ratio[k]:.2f}" for k in evals)
            line = f"| {size} ({label}) | {name} | {cells} | {kept} | {secs:.0f} |"
            print(line, flush=True)
            lines.append(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    publish(lines, args.readme and not args.full)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
