"""The HumanEval harness: truncation at the paper's stop sequences, scoring, resuming, refusing to overwrite, and an
end-to-end run on the real SmolLM2 through transformers (the source, and a conversion decoding through its latent
cache)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from mla_convert.errors import UserError
from mla_convert.sources.humaneval import humaneval_problems
from mla_convert.tasks.complete import TorchCompleter
from mla_convert.tasks.humaneval import STOP, run_humaneval, truncate


class Scripted:
    """A completer that answers from a table (the canonical body, a wrong one, a body with trailing code)."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.calls = answers, 0

    def describe(self) -> dict[str, Any]:
        return {"model": "scripted", "engine": "none"}

    def complete(
        self,
        prompts: Sequence[str],
        max_new_tokens: int,
        stop: Sequence[str],
        done: Callable[[int, str], None],
    ) -> list[str]:
        out = []
        for i, prompt in enumerate(prompts):
            self.calls += 1
            out.append(self.answers[prompt])
            done(i, out[-1])
        return out


@pytest.fixture(scope="module")
def problems():
    return humaneval_problems()[:6]


def test_truncate_cuts_at_top_level_code():
    body = "    return x + 1\n"
    assert truncate(body + "\n\ndef other():\n    pass\n") == body + "\n"
    assert truncate(body + "\nif __name__ == '__main__':\n    main()") == body
    assert truncate(body + "\n# a test\nprint(f(1))") == body
    assert truncate(body) == body
    assert STOP == ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def test_scores_resumes_and_refuses_to_overwrite(problems, tmp_path):
    answers = {p.prompt: p.canonical_solution + "\n\nprint('trailing code is cut')\n" for p in problems[:4]}
    answers.update({p.prompt: "    return None\n" for p in problems[4:]})
    out = tmp_path / "he"
    summary = run_humaneval(Scripted(answers), problems, out)
    assert (summary["passed"], summary["problems"], summary["pass@1"]) == (4, 6, 4 / 6)
    rows = [json.loads(line) for line in (out / "humaneval.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in rows] == [p.task_id for p in problems]
    assert [r["status"] for r in rows] == ["passed"] * 4 + ["failed"] * 2
    assert "trailing" not in rows[0]["completion"]
    with pytest.raises(UserError, match="already exists"):
        run_humaneval(Scripted(answers), problems, out)
    # an interrupted run: the partial folder keeps its rows, and a rerun completes only what is missing
    partial = tmp_path / "he2.partial"
    partial.mkdir()
    (partial / "settings.json").write_text(
        json.dumps({"ran": {"model": "scripted", "engine": "none"}, "max_new_tokens": 384, "timeout_s": 10.0})
    )
    (partial / "humaneval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + '{"torn')
    again = Scripted(answers)
    assert run_humaneval(again, problems, tmp_path / "he2")["passed"] == 4
    assert again.calls == 3 and not partial.exists()


def test_end_to_end_through_transformers_source_and_latent_cache(
    smol_head, smol_tokenizer, smol_default, problems, tmp_path
):
    """SmolLM2's first layers and their default conversion on two problems, 24 tokens each: the converted model decodes through
    its latent cache (absorbed), and both runs write a row per problem and a summary."""
    for name, m in (("source", smol_head[1]), ("converted", smol_default.model)):
        completer = TorchCompleter(m, smol_tokenizer, name)
        summary = run_humaneval(completer, problems[:2], tmp_path / name, max_new_tokens=24)
        assert summary["problems"] == 2 and summary["ran"]["model"] == name
        rows = [json.loads(line) for line in (tmp_path / name / "humaneval.jsonl").read_text().splitlines()]
        assert all(r["raw"] for r in rows)  # the model wrote something for each prompt
    assert summary["ran"]["attention"] == "MLA latent cache (absorbed)"


def test_a_partial_run_with_other_settings_needs_overwrite(problems, tmp_path):
    """A partial run made with other settings (another model, engine or thread count) is never mixed into this one:
    refused with how to go on, and discarded with ``--overwrite`` (every problem then runs again)."""
    answers = {p.prompt: p.canonical_solution for p in problems}
    partial = tmp_path / "he.partial"
    partial.mkdir()
    (partial / "settings.json").write_text(json.dumps({"ran": {"model": "other"}, "max_new_tokens": 1}))
    (partial / "humaneval.jsonl").write_text(json.dumps({"task_id": problems[0].task_id, "status": "failed"}) + "\n")
    with pytest.raises(UserError, match="rerun with those settings to resume it, or pass --overwrite"):
        run_humaneval(Scripted(answers), problems, tmp_path / "he")
    again = Scripted(answers)
    summary = run_humaneval(again, problems, tmp_path / "he", overwrite=True)
    assert again.calls == len(problems) and summary["passed"] == len(problems) and not partial.exists()


def test_the_command_keeps_engines_apart_and_refuses_a_file_in_the_way(problems, tmp_path, monkeypatch):
    """``eval X --task humaneval``: the default folder names llama.cpp runs apart (a checkpoint and its GGUF, or a
    source in both engines, no longer share ``humaneval-NAME``, where ``--overwrite`` would have deleted the other
    engine's results); an ``--out`` that is, or lies under, a file is one error line before the model loads (it was
    a traceback, after the whole run); the line names the summary and the rows by absolute path."""
    from typer.testing import CliRunner

    from mla_convert.cli.commands import app
    from mla_convert.tasks import complete

    answers = {p.prompt: p.canonical_solution for p in problems[:1]}
    monkeypatch.setattr(complete, "torch_completer", lambda ckpt, dtype: Scripted(answers))
    monkeypatch.setattr(complete, "llamacpp_completer", lambda ckpt, threads: Scripted(answers))
    monkeypatch.chdir(tmp_path)
    for args, folder in ((["model"], "humaneval-model"), (["model.gguf"], "humaneval-model-llamacpp"),
                         (["model", "--engine", "llama.cpp"], "humaneval-model-llamacpp")):
        res = CliRunner().invoke(app, ["eval", *args, "--task", "humaneval", "--limit", "1", "--overwrite"])
        assert res.exit_code == 0, res.output
        text = " ".join(res.output.split())
        assert f"summary {tmp_path / folder / 'humaneval.json'}, a row per problem in" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["humaneval-model", "humaneval-model-llamacpp"]
    (tmp_path / "afile").write_text("x")
    for out, why, *extra in ((tmp_path / "afile" / "sub", "is a file, not a folder", "--overwrite"),
                             (tmp_path / "afile", "is a file; the results are a folder", "--overwrite"),
                             (tmp_path / "afile", "is a file; the results are a folder")):  # not "pass --overwrite"
        res = CliRunner().invoke(app, ["eval", "model", "--task", "humaneval", "--out", str(out), *extra])
        assert res.exit_code == 2 and why in " ".join(res.output.split()), res.output
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "afile.partial").exists()
