"""Parity and cache of DeepSeek-V3 exports (issues 13, 26): stock transformers' DeepseekV3ForCausalLM against our
MLA model, per engine target, and what the format's constraints cost.

Rows: the bundled SmolLM2-135M converted with default options (the reference conversion) and with the
export-friendly selection (``--rope-strategy high --kv-lora-rank 72``: the same 120 cached values per token per
layer, the same frequencies and one rank in every layer, so no padding for ``--target transformers``), written in
bfloat16; a tiny random Llama with one KV head at full keep (the export is then the source). Each is exported
for ``--target transformers`` (float32 and bfloat16) and ``vllm-cpu`` (bfloat16). For each: perplexity of the MLA
checkpoint (its report), the cache per token per layer of the source, the MLA checkpoint and the export (what
the engine allocates), the rope table, and max |Δlogit| / greedy tokens equal measured by ``mla-convert export``
(float32 forward of both, 2 x 128 tokens of the wikipedia evaluation split). vLLM itself is run by
``scripts/serve_check.sh``.

    .venv/bin/python benchmarks/export.py [--readme] [--keep DIR]
    .venv/bin/python benchmarks/export.py --collect --readme     # the block again from results/export.json

Results go to ``benchmarks/results/export.json`` and ``export.md``; ``--readme`` writes the table between docs/results.md's
``<!-- export:start -->`` / ``<!-- export:end -->`` markers.
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

#: Every checkpoint is written in bfloat16 (as HF sources ship), so the float32 export measures the mapping alone
#: (it holds the bfloat16 weights exactly); a bfloat16 export also rounds the residual writers once more.
CONVERSIONS = {
    "SmolLM2-135M, default (2-norm, per-layer ranks)": ("smollm2-135m", ["--dtype", "bfloat16"]),
    "SmolLM2-135M, export-friendly (high, kv_lora_rank 72)": (
        "smollm2-135m",
        ["--rope-strategy", "high", "--kv-lora-rank", "72", "--dtype", "bfloat16"],
    ),
}
#: (target, dtype) of each export.
EXPORTS = (("transformers", "float32"), ("transformers", "bfloat16"), ("vllm-cpu", "bfloat16"))


def _run(args: list[str]) -> str:
    res = subprocess.run(CLI + ["--quiet", *args], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"error: {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")
    return res.stdout


def _tiny_sources(root: Path) -> dict[str, tuple[str, list[str]]]:
    """A tiny random Llama with one KV head at full keep (every RoPE pair, full rank): the export is the source."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import copy_tokenizer, write_tiny_llama  # the test suite's tiny sources

    folder = write_tiny_llama(root / "src-mqa", num_key_value_heads=1)
    copy_tokenizer(folder)
    flags = ["--rope-strategy", "high", "--rope-pairs", "8", "--kv-lora-rank", "16", "--calib-tokens", "256",
             "--window", "128", "--eval-windows", "2", "--dtype", "bfloat16"]
    return {"tiny llama (random, 1 KV head), full keep": (str(folder), flags)}


def transformers_block(rows: list[dict]) -> str:
    """The line (docs/results.md) on the reference conversion served by stock transformers, from ``export.json``'s rows of
    the default SmolLM2 conversion with ``--target transformers``."""
    ref = [r for r in rows if r["conversion"].startswith("SmolLM2-135M, default") and r["target"] == "transformers"]
    parts = [f"{r['export dtype']} export max |Δlogit| {r['max abs Δlogit']:.2e}, {r['greedy equal']} greedy tokens equal"
             for r in ref]  # fmt: skip
    c = ref[0]
    return (
        f"Stock `DeepseekV3ForCausalLM` on the reference conversion (written by `python benchmarks/export.py --readme` "
        f"from `benchmarks/results/export.json`): {'; '.join(parts)}; cache {c['cache export']:g} values per token per "
        f"layer (the checkpoint's {c['cache MLA']:g} with the per-layer ranks padded to the largest; source "
        f"{c['cache source']:g})."
    )


def table(rows: list[dict]) -> str:
    """The export table (caption and one line per export) of ``export.json``'s rows."""
    cols = list(rows[0])
    lines = [
        "Written by `python benchmarks/export.py --readme` (2-core CPU). Cache in values per token per layer; "
        "parity: stock `DeepseekV3ForCausalLM` vs our MLA checkpoint, both run in float32 on 2 x 128 tokens of "
        "the Wikipedia evaluation split; greedy tokens through stock `generate()`. The checkpoints are bfloat16, so "
        "the float32 exports measure the mapping alone; the bfloat16 ones also round the residual writers (times "
        "sqrt(1e-6 / eps), docs/export.md) once more. `cache export` is what the engine allocates.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = [f"{v:.2e}" if k == "max abs Δlogit" else (f"{v:g}" if isinstance(v, float) else str(v))
                 for k, v in r.items()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", action="store_true")
    ap.add_argument("--keep", type=Path, default=None, help="keep the checkpoints and exports here")
    ap.add_argument("--collect", action="store_true", help="measure nothing: the table again from results/export.json")
    a = ap.parse_args()
    if a.collect:
        text = table(json.loads((RESULTS / "export.json").read_text()))
        print(text)
        if a.readme:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from blocks import replace_block

            replace_block("export", text)
            replace_block("export-transformers", transformers_block(json.loads((RESULTS / "export.json").read_text())))
        return
    root = a.keep or Path(tempfile.mkdtemp(prefix="mla-export-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (source, flags) in {**CONVERSIONS, **_tiny_sources(root)}.items():
        ckpt = root / f"ckpt-{len(rows)}"
        print(f"{name}: factor {source} {' '.join(flags)}", flush=True)
        _run(["factor", source, str(ckpt), "--overwrite", *flags])
        report = json.loads((ckpt / "report.json").read_text())
        ev = report["model"]["eval"]
        for target, dtype in EXPORTS:
            out = root / f"{ckpt.name}-ds3-{target}-{dtype}"
            _run(["export", str(ckpt), str(out), "--overwrite", "--dtype", dtype, "--target", target])
            e = json.loads((out / "mla_manifest.json").read_text())["export"]
            p, cache = e["parity"], e["cache_values_per_token_per_layer"]
            rows.append({
                "conversion": name,
                "target": target,
                "export dtype": dtype,
                "perplexity (MLA)": round(ev["perplexity"], 3),
                "perplexity (source)": round(ev["reference_perplexity"], 3),
                "cache source": cache["source"],
                "cache MLA": cache["mla"],
                "cache export": cache["deepseek_v3"],
                "rope": f"theta {e['rope']['parameters']['rope_theta']:.4g} ({e['rope']['slots_used']}/{e['rope']['slots']} slots)",
                "max abs Δlogit": p["max_abs_logit_diff"],
                "greedy equal": f"{p['greedy_tokens_equal']}/{p['greedy_tokens']}" if "greedy_tokens" in p else "-",
            })
            print(rows[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "export.json").write_text(json.dumps(rows, indent=2) + "\n")
    table_text = table(rows)
    (RESULTS / "export.md").write_text(table_text + "\n")
    print(table_text)
    if a.readme:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from blocks import replace_block

        replace_block("export", table_text)
        replace_block("export-transformers", transformers_block(rows))


if __name__ == "__main__":
    main()
