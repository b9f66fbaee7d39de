"""Adaptation data a user brings: ``--data`` specs, mixtures with weights, assistant-only loss masks, the
chat KL probe. Real tokenizer and real text (Wikipedia, Shakespeare, news); chat rows are built from news
articles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from chats import news_chats

from mla_convert.adapt.data import build_data, data_specs, mixture_schedule, step_rows
from mla_convert.adapt.objectives import objective_loss
from mla_convert.adapt.options import AdaptOptions
from mla_convert.text.corpora import TextError
from mla_convert.text.specs import DataSpec, parse_data_spec


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(news_chats())))
    return path


def test_spec_syntax(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.txt").write_text("y")
    spec = parse_data_spec(f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt'},weight=2.5")
    assert spec == DataSpec(source=f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}", weight=2.5)
    assert spec.kind == "local" and spec.label().endswith(",weight=2.5")
    chat = parse_data_spec(f" {tmp_path / 'a.txt'} , messages=conv , loss=assistant ")
    assert (chat.messages, chat.loss, chat.field) == ("conv", "assistant", "text")
    assert parse_data_spec("Shakespeare").kind == "bundled"
    assert parse_data_spec("HuggingFaceTB/smoltalk,messages=messages").kind == "hub"  # no such local path
    bad = {
        "wikipedia,colour=red": "unknown key 'colour'",
        "wikipedia,weight=0": "weight=0 is not a positive number",
        "wikipedia,weight=x": "weight=x is not a positive number",
        "wikipedia,weight=1,weight=2": "weight= given twice",
        "wikipedia,loss=some": "loss=some is not 'all' or 'assistant'",
        "wikipedia,loss=assistant": "loss=assistant needs chat data",
        "a.jsonl,field=t,messages=m": "not both",
        "weight=2": "names no source",
        str(tmp_path / "missing.jsonl"): "missing.jsonl: no such file or folder",
        "data/nope.jsonl": "data/nope.jsonl: no such file or folder",  # a missing relative file, not a hub id
        "wikipedia,field=body": "wikipedia is plain text; field=/messages= apply to data files",
    }
    for text, message in bad.items():
        with pytest.raises(TextError, match=message):
            parse_data_spec(text)


def test_options_check_specs_with_the_other_flags() -> None:
    assert AdaptOptions(data=["wikipedia", "shakespeare"]).data == ["wikipedia", "shakespeare"]
    assert AdaptOptions(data=[]).data is None  # typer passes an empty list for no --data
    with pytest.raises(ValueError, match="give --text or --data, not both"):
        AdaptOptions(text="news", data=["shakespeare"])
    with pytest.raises(ValueError, match="give weight= to every --data source or to none"):
        AdaptOptions(data=["wikipedia,weight=1", "shakespeare"])
    with pytest.raises(ValueError, match="unknown key"):
        AdaptOptions(data=["wikipedia,wieght=1"])


def test_shakespeare_is_pinned_and_split_by_play() -> None:
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import split_documents

    docs = load_documents("shakespeare")
    assert len(docs) == 42 and sum(len(d.text) for d in docs) == 5_057_197
    hamlet = next(d for d in docs if d.id == "shakespeare:hamlet_gut")
    assert hamlet.title == "HAMLET, PRINCE OF DENMARK" and "To be, or not to be" in hamlet.text
    roles = split_documents(docs)
    assert sum(len(v) for v in roles.values()) == 42 and all(roles.values())


def test_mixture_weights_set_each_sources_share_without_repeats(smol_tokenizer) -> None:
    plain = build_data(
        smol_tokenizer, data_specs("wikipedia", ["wikipedia", "shakespeare"]), 512, 2, 4, 2000, 0
    )
    wiki_rows, sh_rows = (s["train_rows"] for s in plain.record["sources"])
    assert (
        plain.schedule is None and plain.train.shape[0] == wiki_rows + sh_rows
    )  # concatenated, once per epoch
    assert wiki_rows > 700 and sh_rows > 1800  # ~380k + ~930k tokens: 1M tokens without a repeat
    only_wiki = build_data(smol_tokenizer, data_specs("wikipedia", None), 512, 2)
    assert torch.equal(only_wiki.train, plain.train[:wiki_rows])  # the first source's rows, unchanged
    assert torch.equal(only_wiki.validation, plain.validation)  # validation: the first source's held-out text

    total = 1200
    mixed = build_data(
        smol_tokenizer,
        data_specs("", ["wikipedia,weight=1", "shakespeare,weight=3"]),
        512,
        2,
        4,
        total,
        seed=7,
    )
    assert mixed.schedule is not None and mixed.schedule.numel() == total
    from_wiki = int((mixed.schedule < wiki_rows).sum())
    assert from_wiki == 300  # 1 : 3 of 1200 rows
    assert [s["rows_scheduled"] for s in mixed.record["sources"]] == [300, 900]
    assert mixed.schedule.unique().numel() == total  # both sources have enough rows: none repeats
    again, _ = mixture_schedule([wiki_rows, sh_rows], [1.0, 3.0], total, 7)
    assert torch.equal(again, mixed.schedule)  # a pure function of the seed: --resume is exact
    heavy, counts9 = mixture_schedule([wiki_rows, sh_rows], [9.0, 1.0], total, 7)
    wiki_part = heavy[heavy < wiki_rows]
    assert wiki_part.numel() == 1080 == counts9[0] > wiki_rows  # more than one pass over Wikipedia's rows
    counts = torch.bincount(wiki_part, minlength=wiki_rows)
    assert (
        int(counts.max()) - int(counts.min()) <= 1
    )  # repeats come in whole passes: no row twice before all once
    rows = step_rows(mixed, 5, 4, 1, 1, 0, 7)
    assert torch.equal(rows[0][0], mixed.train[mixed.schedule[20:24]]) and rows[0][1] is None
    assert len(mixed.record["schedule_sha256"]) == 64 and mixed.record["held_out_documents"]


def test_assistant_loss_masks_exactly_the_answers(smol_tokenizer, chat_file: Path) -> None:
    specs = data_specs("", [f"{chat_file},messages=messages,loss=assistant"])
    data = build_data(smol_tokenizer, specs, 64, 1, 2, 16)
    assert data.mask is not None and data.mask.shape == data.train.shape
    src = data.record["sources"][0]
    assert 0 < src["loss_tokens"] < 0.4 * src["train_tokens"]
    # The masked tokens decode to the assistant turns (content + end-of-turn), nothing else.
    ids = data.train.reshape(-1)[data.mask.reshape(-1)]
    text = smol_tokenizer.decode(ids)
    chats = {json.dumps(c) for c in news_chats()}
    answers = [m["content"] for c in map(json.loads, chats) for m in c if m["role"] == "assistant"]
    assert (
        "<|im_start|>" not in text and "Summarize in one sentence" not in text and "three words" not in text
    )
    assert sum(a in text for a in answers) >= len(answers) // 2  # the answers of the training split (60 %)
    # Every assistant token of a held-out conversation is a prompt boundary for the chat probe.
    assert data.chat_held_out and all(d.loss_spans for d in data.chat_held_out)
    # Plain text: no mask at all (every token counts).
    assert build_data(smol_tokenizer, data_specs("news", None), 64, 1).mask is None


def test_masked_objective_is_the_mean_over_answer_tokens(smol_tokenizer) -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 50)
    teacher = torch.randn(2, 9, 50)
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 3:6] = True
    mask[1, 8] = True
    o = AdaptOptions(objective="mix", mix_weight=0.25)
    loss, parts = objective_loss(o, logits, ids, teacher, None, mask)
    # independent: pick the positions predicting masked tokens by hand
    pos = [(0, 2), (0, 3), (0, 4), (1, 7)]
    ce = torch.stack([F.cross_entropy(logits[b, t][None], ids[b, t + 1][None]) for b, t in pos]).mean()
    kl = torch.stack([
        F.kl_div(F.log_softmax(logits[b, t], -1), F.log_softmax(teacher[b, t], -1), log_target=True, reduction="sum")
        for b, t in pos
    ]).mean()  # fmt: skip
    assert parts["lm"] == pytest.approx(float(ce), rel=1e-5) and parts["kl"] == pytest.approx(
        float(kl), rel=1e-5
    )
    assert float(loss) == pytest.approx(0.25 * float(kl) + 0.75 * float(ce), rel=1e-5)
    full, _ = objective_loss(o, logits, ids, teacher, None, torch.ones(2, 9, dtype=torch.bool))
    assert float(full) == pytest.approx(float(objective_loss(o, logits, ids, teacher)[0]), rel=1e-6)
    none, _ = objective_loss(o, logits, ids, teacher, None, torch.zeros(2, 9, dtype=torch.bool))
    assert float(none) == 0.0  # a micro-batch without answer tokens adds nothing


def test_bad_data_fails_before_any_model(smol_tokenizer, chat_file: Path, tmp_path: Path) -> None:
    with pytest.raises(TextError, match=r"one optimizer step needs 4096 rows \(2097152 tokens\)"):
        build_data(smol_tokenizer, data_specs("news", None), 512, 1, rows_per_step=4096)
    with pytest.raises(TextError, match="plain text; field=/messages= apply to data files"):
        build_data(smol_tokenizer, [DataSpec(source="news", messages="m")], 64, 1)
    txt = tmp_path / "notes.txt"
    txt.write_text("plain words " * 200)
    with pytest.raises(TextError, match="plain text has no conversation column for messages=m"):
        build_data(smol_tokenizer, [parse_data_spec(f"{txt},messages=m")], 64, 1)
    odd = tmp_path / "odd.jsonl"  # assistant turns the template cannot append: the system turn comes last
    odd.write_text(
        json.dumps({"messages": [{"role": "assistant", "content": "hi"}, {"role": "system", "content": "x"}]})
        + "\n"
    )
    with pytest.raises(TextError, match="odd.jsonl"):
        build_data(smol_tokenizer, [parse_data_spec(f"{odd},messages=messages,loss=assistant")], 8, 1)


def test_hub_ids_fail_in_one_line_without_the_hub(smol_tokenizer) -> None:
    """No network here: one connection attempt, one line (where the hub answers: its 'not found', one line)."""
    with pytest.raises(
        TextError,
        match=r"dataset 'nobody-here/no-such-set' (needs the Hugging Face hub|cannot be loaded from the Hugging Face hub)",
    ):
        build_data(smol_tokenizer, [parse_data_spec("nobody-here/no-such-set")], 64, 1)


def test_chat_probe_is_zero_against_itself_and_measures_a_conversion(
    smol_tokenizer, smol_model, reference_ckpt
):
    from transformers import AutoModelForCausalLM

    from mla_convert.adapt.chat import build_chat_probe, chat_divergence

    probe = build_chat_probe(smol_tokenizer, smol_model, [], count=2, answer_tokens=8)
    assert probe is not None and probe.record["count"] == 2 and probe.record["answer_tokens"] == 16
    assert probe.record["documents"][0].startswith("news:") and "Summarize" in probe.record["source"]
    same = chat_divergence(smol_model, smol_model, probe)
    assert same["chat_kl"] == pytest.approx(0.0, abs=1e-9) and same["chat_top1"] == 1.0
    mla = AutoModelForCausalLM.from_pretrained(str(reference_ckpt), dtype=torch.float32)
    res = chat_divergence(mla, smol_model, probe)
    assert 0.01 < res["chat_kl"] < 5 and 0 < res["chat_top1"] <= 1


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "arrow", "txt"])
def test_every_format_through_data_specs(tmp_path: Path, fmt: str, wiki_splits) -> None:
    """``--data PATH,field=body`` reads each listed format; rows are real Wikipedia paragraphs."""
    import datasets

    from mla_convert.text.specs import spec_documents

    paragraphs = [p for d in wiki_splits["adaptation"][:3] for p in d.text.split("\n") if len(p) > 200][:6]
    ds = datasets.Dataset.from_dict({"body": paragraphs, "n": list(range(len(paragraphs)))})
    if fmt == "arrow":
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    elif fmt == "txt":
        path = tmp_path / "texts"
        path.mkdir()
        for i, p in enumerate(paragraphs):
            (path / f"p{i}.txt").write_text(p)
    else:
        path = tmp_path / f"rows.{fmt}"
        {"jsonl": lambda: ds.to_json(str(path)), "json": lambda: path.write_text(json.dumps(ds.to_list())),
         "parquet": lambda: ds.to_parquet(str(path)), "csv": lambda: ds.to_csv(str(path), index=False)}[fmt]()  # fmt: skip
    spec = parse_data_spec(str(path) if fmt == "txt" else f"{path},field=body")
    docs = spec_documents(spec)
    assert sorted(d.text for d in docs) == sorted(p.strip() for p in paragraphs)
    assert len({d.id for d in docs}) == len(paragraphs)
