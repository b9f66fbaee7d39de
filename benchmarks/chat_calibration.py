"""Calibrate on what is served (issue 34, item 6): SmolLM2-135M-Instruct converted by ``factor`` at its default size
on plain Wikipedia text and on chat-templated conversations, scored as it is served.

Rows: the source; ``factor smollm2-135m`` (16,384 Wikipedia tokens, the default); ``factor --text
chats.jsonl,messages=messages`` (conversations built from the Wikipedia *calibration* split's articles: a user asks
for a summary of a 1,200-character passage, the assistant answers with its first sentences; rendered with the model's
chat template). Columns: perplexity on 8 x 512 Wikipedia evaluation-split tokens whose windows start with the
tokenizer's BOS (``<|im_start|>``, what every chat prompt opens with) and without it, the chat KL to the source
and top-1 agreement on its greedy 32-token answers to 8 news-evaluation prompts (``adapt``'s chat probe), and the
greedy continuation of "The capital of France is" (plain, 8 tokens) and the chat answer to "What is the capital of
France?" (through the chat template, 12 tokens).

    .venv/bin/python benchmarks/chat_calibration.py [--readme]   # --readme: results/chat_calibration.md + its block (docs/results.md)

Conversions are written to ``benchmarks/runs/chat-calib/`` and reused when present (delete them to re-run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

RUNS = Path(__file__).resolve().parent / "runs" / "chat-calib"
RESULT = Path(__file__).resolve().parent / "results" / "chat_calibration.md"


def calibration_chats(path: Path) -> Path:
    """Write the ``wikipedia-chat`` corpus's conversations (:func:`mla_convert.text.chats.wikipedia_conversations`:
    built from the Wikipedia calibration split's articles) to ``path`` as JSON lines, the file this table's row
    calibrated on (``factor --text wikipedia-chat`` now reads the same conversations directly)."""
    from mla_convert.text.chats import wikipedia_conversations

    path.write_text("".join(json.dumps({"messages": m}) + "\n" for _, m in wikipedia_conversations()))
    return path


def convert(name: str, extra: list[str]) -> Path:
    """``mla-convert factor smollm2-135m RUNS/name *extra`` unless already there."""
    from typer.testing import CliRunner

    from mla_convert.cli.commands import app

    out = RUNS / name
    if not (out / "mla_manifest.json").exists():
        res = CliRunner().invoke(app, ["factor", "smollm2-135m", str(out), "--device", "cpu", "--overwrite", *extra])
        if res.exit_code != 0:
            raise SystemExit(f"factor {name} failed:\n{res.output}")
    return out


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """exp of the mean next-token loss over ``windows [N, T]``."""
    import torch.nn.functional as F

    total = count = 0.0
    for row in windows:
        logits = model(input_ids=row[None], use_cache=False).logits[0, :-1].double()
        total += float(F.cross_entropy(logits, row[1:], reduction="sum"))
        count += row.numel() - 1
    return float(torch.tensor(total / count).exp())


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: torch.Tensor, n: int, tok: object) -> str:
    """The greedy continuation of ``ids [1, T]`` (``n`` tokens), decoded."""
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,  # type: ignore[attr-defined]
                         do_sample=False, pad_token_id=tok.eos_token_id)  # type: ignore[attr-defined]  # fmt: skip
    return str(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))  # type: ignore[attr-defined]


def collect_block() -> str:
    """The ``chat-calibration`` block from the table the last measuring run stored (``RESULT``)."""
    return RESULT.read_text().strip("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", action="store_true", help="also write results/chat_calibration.md and its block (docs/results.md)")
    ap.add_argument("--collect", action="store_true", help="measure nothing: the block again from results/chat_calibration.md")
    args = ap.parse_args()
    if args.collect:
        table = collect_block()
        print(table)
        if args.readme:
            from blocks import replace_block

            replace_block("chat-calibration", table)
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from transformers import AutoTokenizer

    from mla_convert.adapt.chat import build_chat_probe, chat_divergence
    from mla_convert.mla.checkpoint import load_checkpoint
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import split_documents, token_windows

    RUNS.mkdir(parents=True, exist_ok=True)
    chats = calibration_chats(RUNS / "chats.jsonl")
    rows = {"wikipedia (default)": convert("wiki", []),
            "chat-templated": convert("chat", ["--text", f"{chats},messages=messages"])}  # fmt: skip
    src = open_source("smollm2-135m")
    source = load_source_model(src).eval()
    tok = AutoTokenizer.from_pretrained(str(src.path))
    docs = split_documents(load_documents("wikipedia"))["evaluation"]
    with_bos = token_windows(tok, docs, 512, 8, bos=True)
    plain = token_windows(tok, docs, 512, 8, bos=False)
    probe = build_chat_probe(tok, source, [], count=8, answer_tokens=32)
    assert probe is not None
    prompt = tok("The capital of France is", add_special_tokens=False, return_tensors="pt").input_ids
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
    ref_bos, ref_plain = perplexity(source, with_bos), perplexity(source, plain)
    lines = [
        "| calibration (tokens) | ppl wiki, BOS-opened (x source) | ppl wiki, no BOS (x source) | chat KL | chat top-1 | "
        "'The capital of France is' | chat: 'What is the capital of France?' |",
        "|---|---:|---:|---:|---:|---|---|",  # fmt: skip
        f"| source | {ref_bos:.2f} | {ref_plain:.2f} | 0 | 1 | {greedy(source, prompt, 8, tok)!r} | "
        f"{greedy(source, chat, 12, tok)!r} |",
    ]
    for name, folder in rows.items():
        model = load_checkpoint(folder).eval()
        bos, no_bos = perplexity(model, with_bos), perplexity(model, plain)
        div = chat_divergence(model, source, probe)
        tokens = json.loads((folder / "report.json").read_text())["text"]["calibration_tokens"]
        lines.append(f"| {name} ({tokens:,}) | {bos:.2f} (x{bos / ref_bos:.2f}) | {no_bos:.2f} (x{no_bos / ref_plain:.2f}) | "
                     f"{div['chat_kl']:.3f} | {div['chat_top1']:.3f} | {greedy(model, prompt, 8, tok)!r} | "
                     f"{greedy(model, chat, 12, tok)!r} |")  # fmt: skip
    head = ("SmolLM2-135M-Instruct at its default size (120 of 384 values, 31.25 %), `factor` defaults otherwise; "
            "8 x 512 Wikipedia evaluation tokens; chat KL/top-1 on the source's greedy 32-token answers to 8 "
            "news-evaluation prompts. Written by `python benchmarks/chat_calibration.py --readme`.")
    table = "\n".join([head, "", *lines, ""])
    print(table)
    if args.readme:
        from blocks import replace_block

        RESULT.write_text(table)
        replace_block("chat-calibration", table)


if __name__ == "__main__":
    main()
