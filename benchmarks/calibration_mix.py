"""What the calibration text does to a conversion off its own domain (issue 50, Required 3): one row per calibration
(a single ``--text`` or a ``--calib-data`` mixture), the rest of the conversion fixed.

Each row converts the model in memory with the same levers (given, so the search does not differ between rows: the
searched default's choice for the model) from the calibration and held-out windows ``factor`` itself would take
(:func:`mla_convert.convert.pipeline.text.prepare_text`), then scores it against the source on text of four domains,
each its corpus's *evaluation* split, which no calibration reads: Wikipedia (prose: the old default's own domain),
news (a domain no row calibrates on), the Python standard library (code; calibration code is gensim's sources) and
Shakespeare (a domain no row calibrates on); plus the chat KL and top-1 agreement on the source's greedy 32-token answers
to 8 chat prompts (``adapt``'s probe, news-evaluation prompts) and the greedy continuation of "The capital of France is".

    .venv/bin/python benchmarks/calibration_mix.py [--model smollm2-135m|qwen2.5-coder-1.5b] [--rows NAME,...]
    .venv/bin/python benchmarks/calibration_mix.py --model M --rows NAME --ckpt OUT   # score a conversion factor wrote
    .venv/bin/python benchmarks/calibration_mix.py --collect    # the table (docs/results.md block calibration-mix;
                                                                # also python benchmarks/collect.py calibration-mix)

Rows are merged into ``benchmarks/results/calibration_mix.json`` as each finishes (a stopped run keeps its rows).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "calibration_mix.json"
#: The default mixture's row with the fitted reconstruction (issue 50 item 4).
RECONSTRUCTED = "wiki 1 : chat 1 : code 1 + reconstruction (50 steps)"
#: The default mixture at 18.75 % of the cache (issue 50, Required 2: each fraction of the second model).
AT_18_75 = "wiki 1 : chat 1 : code 1 at 18.75 % cache"
#: The calibrations compared (``--calib-data`` specs; one spec is a single text).
MIXTURES: dict[str, list[str]] = {
    "wikipedia": ["wikipedia"],
    "wiki 2 : chat 1 : code 1": ["wikipedia,weight=2", "wikipedia-chat", "code"],
    "wiki 1 : chat 1 : code 1": ["wikipedia", "wikipedia-chat", "code"],
    "wiki 1 : code 1": ["wikipedia", "code"],
    RECONSTRUCTED: ["wikipedia", "wikipedia-chat", "code"],
    AT_18_75: ["wikipedia", "wikipedia-chat", "code"],
}
#: Options of a row besides its calibration and the model's levers (the default mixture with the fitted
#: reconstruction: ``factor --reconstruct-steps 50``).
ROW_OPTIONS: dict[str, dict[str, Any]] = {RECONSTRUCTED: {"reconstruct_steps": 50}, AT_18_75: {"cache_fraction": 0.1875}}
#: Levers given per model: the searched default's choice (docs/results.md), so only the calibration differs.
LEVERS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"rope_pairs": 24, "rope_strategy": "2-norm", "refit_o_proj": "teacher"},
    "qwen2.5-coder-1.5b": {"rope_pairs": 24, "rope_strategy": "rotation", "refit_o_proj": "teacher"},
}
#: Levers of a (model, row) at another cache size than 31.25 %: the search's choice there (docs/results.md, second
#: model: Qwen2.5-Coder-1.5B at 18.75 % searched 21 pairs, rotation, and kept the sequential prior).
ROW_LEVERS: dict[tuple[str, str], dict[str, Any]] = {
    ("qwen2.5-coder-1.5b", AT_18_75): {"rope_pairs": 21, "rope_strategy": "rotation", "refit_o_proj": "sequential"},
}
#: Evaluation windows of 512 tokens per domain (each corpus's evaluation split).
EVALS = {"wikipedia": 16, "news": 8, "python": 8, "shakespeare": 4}
PROMPT = "The capital of France is"


def levers_of(model_name: str, row: str) -> dict[str, Any]:
    """The levers row ``row`` of ``model_name`` is converted with (:data:`LEVERS`, or :data:`ROW_LEVERS` at another
    cache size)."""
    return {**LEVERS[model_name], **ROW_LEVERS.get((model_name, row), {})}


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy tokens after ``ids [1, T]`` (full recomputation each step)."""
    for _ in range(n):
        nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, -n:]


def measure(model_name: str, rows: list[str], ckpt: Path | None = None) -> None:
    """Convert and score each row of ``rows`` (names of :data:`MIXTURES`), merging each into :data:`RESULTS`; with
    ``ckpt``, the one row is scored on that checkpoint (written by ``factor`` with that calibration and the levers of
    :data:`LEVERS`, which its manifest must show) instead of converting."""
    from transformers import AutoTokenizer

    from mla_convert.adapt.chat import build_chat_probe, chat_divergence
    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.convert.pipeline.build import convert_windows
    from mla_convert.convert.pipeline.text import prepare_text
    from mla_convert.metrics import evaluate
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    src = open_source(model_name)
    source = load_source_model(src).eval()
    tok = AutoTokenizer.from_pretrained(str(src.path))
    evals = {
        name: token_windows(tok, split_documents(load_documents(name))["evaluation"], 512, n, bos=adds_bos(tok))
        for name, n in EVALS.items()
    }
    probe = build_chat_probe(tok, source, [], count=8, answer_tokens=32)
    prompt = tok(PROMPT, return_tensors="pt")["input_ids"]
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    key = f"{model_name} source"
    if key not in results:
        results[key] = {
            "perplexity": {k: evaluate(source, v).perplexity for k, v in evals.items()},
            "paris": tok.decode(greedy(source, prompt, 6)),
        }
    for row in rows:
        started = time.perf_counter()
        if ckpt is not None:
            model, cache = checkpoint_row(ckpt, model_name, row)
        else:
            options = ConvertOptions(calib_data=MIXTURES[row], device="cpu", **levers_of(model_name, row),
                                     **ROW_OPTIONS.get(row, {}))
            text = prepare_text(tok, options)
            conv = convert_windows(src, options, text.calibration, text.held_out)
            model, cache = conv.model.eval(), conv.config.kv_lora_rank
        scored = {k: evaluate(model, v, source) for k, v in evals.items()}
        chat = chat_divergence(model, source, probe) if probe is not None else {}
        results[f"{model_name} {row}"] = {
            "model": model_name,
            "calibration": row,
            "calib_data": MIXTURES[row],
            "levers": levers_of(model_name, row),
            "cache": cache,
            "checkpoint": None if ckpt is None else ckpt.name,  # a factor output (its manifest checked: same row)
            "perplexity": {k: r.perplexity for k, r in scored.items()},
            "kl": {k: r.kl for k, r in scored.items()},
            **chat,
            "paris": tok.decode(greedy(model, prompt, 6)),
            "seconds": round(time.perf_counter() - started, 1),
            "machine": f"{platform.platform()}, {torch.get_num_threads()} threads",
        }
        # merged into the file as it is now (another model's run may have written rows since this one started)
        results = {**(json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}), **results}
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        print(table(results), flush=True)


def checkpoint_row(ckpt: Path, model_name: str, row: str) -> tuple[torch.nn.Module, Any]:
    """The MLA model ``factor`` wrote to ``ckpt`` and its latent widths, after checking that its manifest's
    calibration and levers are the row's.

    Raises:
        SystemExit: the checkpoint was made otherwise.
    """
    from mla_convert.mla.checkpoint import load_checkpoint

    options = json.loads((ckpt / "mla_manifest.json").read_text())["options"]
    calib = options.get("calib_data") or [options["text"]]
    expected = {"reconstruct_steps": 0, **levers_of(model_name, row), **ROW_OPTIONS.get(row, {})}
    wrong = {k: options.get(k, 0) for k, v in expected.items() if options.get(k, 0) != v}
    if calib != MIXTURES[row] or wrong:
        raise SystemExit(f"{ckpt}: calibration {calib} and levers {options} are not row {row!r}'s")
    model = load_checkpoint(ckpt).eval()
    return model, model.config.kv_lora_rank


def table(results: dict[str, Any]) -> str:
    """Every measured row as markdown: perplexity (x source) per domain, chat KL/top-1, the greedy capital."""
    lines = [
        "Calibration text against domains no calibration reads (each corpus's evaluation split, 512-token windows: "
        + ", ".join(f"{k} {n}" for k, n in EVALS.items())
        + "); levers given as the searched default chose them, 31.25 % cache unless the row says otherwise; chat KL / top-1 on the source's greedy "
        "32-token answers to 8 chat prompts. `code` is gensim's Python sources; the `python` column is the standard "
        "library. Written by `python benchmarks/calibration_mix.py --collect` from the rows "
        "`python benchmarks/calibration_mix.py --model MODEL` measured.",
        "",
        "| model | calibration | " + " | ".join(f"{k} (x source)" for k in EVALS) + " | chat KL | chat top-1 | "
        f"'{PROMPT}' |",
        "|---|---|" + "---:|" * len(EVALS) + "---:|---:|---|",
    ]
    for key, r in results.items():
        if key.endswith(" source"):
            continue
        base = results[f"{r['model']} source"]
        cells = [f"{r['perplexity'][k]:.2f} (x{r['perplexity'][k] / base['perplexity'][k]:.2f})" for k in EVALS]
        chat = f"{r['chat_kl']:.3f} | {r['chat_top1']:.3f}" if "chat_kl" in r else "- | -"
        lines.append(f"| {r['model']} | {r['calibration']} | " + " | ".join(cells) + f" | {chat} | {r['paris']!r} |")
    for key, r in results.items():
        if key.endswith(" source"):
            cells = ", ".join(f"{k} {v:.2f}" for k, v in r["perplexity"].items())
            lines.append(f"\nSource {key.removesuffix(' source')}: {cells}; capital {r['paris']!r}.")
    return "\n".join(lines)


def block() -> str:
    """The ``calibration-mix`` block (docs/results.md) from the stored rows."""
    return table(json.loads(RESULTS.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(LEVERS))
    ap.add_argument("--rows", default=",".join(MIXTURES), help="comma-separated names of MIXTURES")
    ap.add_argument("--ckpt", type=Path, help="score this factor output as the one row --rows names")
    ap.add_argument("--collect", action="store_true", help="measure nothing: the table into docs/results.md")
    args = ap.parse_args()
    if args.collect:
        from blocks import replace_block

        body = block()
        print(body)
        replace_block("calibration-mix", body)
        return
    measure(args.model, [r.strip() for r in args.rows.split(",")], args.ckpt)


if __name__ == "__main__":
    main()
