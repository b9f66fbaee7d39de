"""Parity and cache of DeepSeek-V3 exports (issue 13): stock transformers' DeepseekV3ForCausalLM against our MLA
model, and what the format's constraints cost.

Rows: the bundled SmolLM2-135M converted with default options (the reference conversion) and with the
export-friendly selection (``--rope-strategy high --kv-lora-rank 72``: the same 120 cached values per token per
layer, the same frequencies in every layer, a plain ``rope_theta``), written in bfloat16 and each exported in
float32 and bfloat16;
tiny random Llama (GQA), Mistral and Qwen2 (random q/k/v biases) at full keep. For each: perplexity of the MLA
checkpoint (from its report), the export's cache width, rope type, and max |Δlogit| / greedy tokens equal
measured by ``mla-convert export`` (float32 forward of both, 2 x 128 tokens of the wikipedia evaluation split).

    .venv/bin/python benchmarks/export.py [--readme] [--keep DIR]

Results go to ``benchmarks/results/export.json`` and ``export.md``; ``--readme`` writes the table between
README.md's ``<!-- export:start -->`` / ``<!-- export:end -->`` markers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [str(ROOT / ".venv" / "bin" / "mla-convert")]
RESULTS = ROOT / "benchmarks" / "results"

#: Every checkpoint is written in bfloat16 (as HF sources ship), so both exports measure the mapping alone: the
#: float32 export holds the bfloat16 weights exactly, the bfloat16 one rounds nothing the checkpoint did not.
CONVERSIONS = {
    "SmolLM2-135M, default (2-norm, per-layer ranks)": ("smollm2-135m", ["--dtype", "bfloat16"]),
    "SmolLM2-135M, export-friendly (high, kv_lora_rank 72)": (
        "smollm2-135m",
        ["--rope-strategy", "high", "--kv-lora-rank", "72", "--dtype", "bfloat16"],
    ),
}


def _run(args: list[str]) -> str:
    res = subprocess.run(CLI + ["--quiet", *args], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"error: {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")
    return res.stdout


def _tiny_sources(root: Path) -> dict[str, tuple[str, list[str]]]:
    """Tiny random sources of three families at full keep (every RoPE component, full rank)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import copy_tokenizer
    from tiny import write_tiny_family as _write  # the test suite's tiny sources

    out = {}
    for family in ("llama", "mistral", "qwen2"):
        folder = _write(root / f"src-{family}", family)
        copy_tokenizer(folder)
        out[f"tiny {family} (random{', q/k/v biases' if family == 'qwen2' else ''}), full keep"] = (
            str(folder),
            ["--rope-strategy", "rotation", "--rope-pairs", "16", "--kv-lora-rank", "32", "--calib-windows", "2",
             "--window", "128", "--eval-windows", "2", "--dtype", "bfloat16"],
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", action="store_true")
    ap.add_argument("--keep", type=Path, default=None, help="keep the checkpoints and exports here")
    a = ap.parse_args()
    root = a.keep or Path(tempfile.mkdtemp(prefix="mla-export-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (source, flags) in {**CONVERSIONS, **_tiny_sources(root)}.items():
        ckpt = root / f"ckpt-{len(rows)}"
        print(f"{name}: factor {source} {' '.join(flags)}", flush=True)
        _run(["factor", source, str(ckpt), "--overwrite", *flags])
        report = json.loads((ckpt / "report.json").read_text())
        ev = report["model"]["eval"]
        for dtype in ("float32", "bfloat16"):
            out = root / f"{ckpt.name}-ds3-{dtype}"
            _run(["export", str(ckpt), str(out), "--overwrite", "--dtype", dtype])
            e = json.loads((out / "mla_manifest.json").read_text())["export"]
            p = e["parity"]
            rows.append({
                "conversion": name,
                "export dtype": dtype,
                "perplexity (MLA)": round(ev["perplexity"], 3),
                "perplexity (source)": round(ev["reference_perplexity"], 3),
                "cache MLA": e["cache_values_per_token_per_layer"]["mla"],
                "cache export": e["cache_values_per_token_per_layer"]["deepseek_v3"],
                "rope": f"{e['rope']['kind']} ({e['rope']['slots']} pairs)",
                "max abs Δlogit": p["max_abs_logit_diff"],
                "greedy equal": f"{p['greedy_tokens_equal']}/{p['greedy_tokens']}",
            })
            print(rows[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "export.json").write_text(json.dumps(rows, indent=2) + "\n")
    cols = list(rows[0])
    lines = [
        "Written by `python benchmarks/export.py --readme` (2-core CPU). Cache in values per token per layer; "
        "parity: stock `DeepseekV3ForCausalLM` vs our MLA checkpoint, both run in float32 on 2 x 128 tokens of "
        "the Wikipedia evaluation split; greedy tokens through stock `generate()`. The checkpoints are bfloat16, so "
        "both exports measure the mapping, not bfloat16 rounding (a bfloat16 export of a float32 checkpoint "
        "also rounds every weight).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = [f"{v:.2e}" if k == "max abs Δlogit" else (f"{v:g}" if isinstance(v, float) else str(v))
                 for k, v in r.items()]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (RESULTS / "export.md").write_text(table + "\n")
    print(table)
    if a.readme:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from readme import replace_block

        replace_block("export", table)


if __name__ == "__main__":
    main()
