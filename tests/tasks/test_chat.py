"""``eval --task chat``: fixed questions through the chat template, greedy answers scored against the source's."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from mla_convert.cli.commands import app
from mla_convert.tasks.chat import QUESTIONS, run_chat


def test_the_source_agrees_with_itself_and_a_conversion_is_measured(smol_head, smol_tokenizer, smol_default):
    """On SmolLM2's first layers: the source against itself answers every question the same (KL 0, top-1 1); its
    default conversion, decoding through its latent cache, is scored on the same answers (KL above 0)."""
    source = smol_head[1]
    same = run_chat(source, source, smol_tokenizer, "source", answer_tokens=12)
    assert same["same_answers"] == len(QUESTIONS) and same["prefix_match"] == 1.0
    assert abs(same["chat_kl"]) < 1e-9 and same["chat_top1"] == 1.0
    assert all(a for a in same["source_answers"])  # the source says something to every question
    ours = run_chat(smol_default.model, source, smol_tokenizer, "converted", answer_tokens=12)
    assert ours["source_answers"] == same["source_answers"]
    assert 0 < ours["chat_kl"] < 20 and 0 <= ours["chat_top1"] <= 1 and 0 <= ours["prefix_match"] <= 1
    assert len(ours["answers"]) == len(QUESTIONS)


def test_chat_without_a_source_to_compare_is_refused(tmp_path: Path) -> None:
    """A folder whose manifest names no built-in source needs --against: one line, exit 2; perplexity's flags are
    refused for the chat task."""
    (tmp_path / "config.json").write_text("{}")
    res = CliRunner().invoke(app, ["eval", str(tmp_path), "--task", "chat"])
    assert res.exit_code == 2 and "--against SOURCE" in res.stderr and len(res.stderr.splitlines()) == 1
    res = CliRunner().invoke(app, ["eval", str(tmp_path), "--task", "chat", "--windows", "2"])
    assert res.exit_code == 2 and "--windows does not apply to --task chat" in res.stderr
