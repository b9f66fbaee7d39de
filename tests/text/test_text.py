"""Real-data tests for mla_convert.text (bundled Wikipedia/news text, real SmolLM2 tokenizer)."""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_convert.sources.assets import GGUF_SIZE, bundled_gguf_path, cache_dir
from mla_convert.text.corpora import (
    Document,
    TextError,
    load_documents,
    local_documents,
    news_documents,
    parse_text_spec,
    wikipedia_documents,
)
from mla_convert.text.wikitext import clean_wikitext
from mla_convert.text.windows import documents_record, split_documents, token_windows


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    gguf = bundled_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def wiki() -> list[Document]:
    return wikipedia_documents()


def _doc(i: int, chars: int) -> Document:
    return Document.make(f"test:{i}", f"t{i}", "x" * chars)


# ----------------------------------------------------------------------------------------------
# assets
# ----------------------------------------------------------------------------------------------


def test_bundled_gguf_is_verified_file() -> None:
    path = bundled_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == GGUF_SIZE
    start = time.perf_counter()
    assert bundled_gguf_path() == path
    assert time.perf_counter() - start < 0.5  # stamped: no rehash


def test_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "a" / "b"
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(target))
    assert cache_dir() == target
    assert target.is_dir()


# ----------------------------------------------------------------------------------------------
# documents
# ----------------------------------------------------------------------------------------------


def test_wikipedia_documents_are_clean(wiki: list[Document]) -> None:
    assert len(wiki) >= 90
    ids = [d.id for d in wiki]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"wiki:\d+", i) for i in ids)
    total = sum(len(d.text) for d in wiki)
    assert 2_000_000 < total < 4_000_000
    for doc in wiki:
        assert len(doc.text) >= 500
        assert doc.sha256 == hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
        for markup in ("[[", "]]", "{{", "}}", "|-", "{|", "<ref", "</ref", "thumb|", "''"):
            assert markup not in doc.text, (doc.id, markup)
        assert not re.search(r"^(?:Category|File|Image):", doc.text, re.MULTILINE), doc.id
        assert "\n\n\n" not in doc.text
    einstein = next(d for d in wiki if d.title == "Albert Einstein")
    assert einstein.text.startswith("Albert Einstein (14 March 1879")


def test_wikipedia_documents_cached_is_fast(wiki: list[Document]) -> None:
    start = time.perf_counter()
    again = wikipedia_documents()
    assert time.perf_counter() - start < 1.0
    assert again == wiki


def test_news_documents() -> None:
    docs = news_documents()
    assert len(docs) == 300
    assert docs[0].id == "news:1" and docs[-1].id == "news:300"
    assert docs[0].text.startswith("Hundreds of people have been forced to vacate their homes")
    assert load_documents("news") == docs


def test_local_documents_files_and_folders(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "b.txt").write_text("second file\n", encoding="utf-8")
    (folder / "a.txt").write_text("first file", encoding="utf-8")
    (folder / "skip.md").write_text("not a txt", encoding="utf-8")
    single = tmp_path / "c.txt"
    single.write_text("  third  ", encoding="utf-8")

    docs = local_documents([folder, single])
    assert [d.id for d in docs] == ["file:a.txt", "file:b.txt", "file:c.txt"]
    assert [d.text for d in docs] == ["first file", "second file", "third"]
    assert load_documents([folder, single]) == docs
    assert load_documents(str(single)) == docs[2:]


def test_local_documents_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(TextError, match=re.escape(str(empty))):
        local_documents([empty])

    binary = tmp_path / "latin1.txt"
    binary.write_bytes(b"caf\xe9")
    with pytest.raises(TextError, match="not valid UTF-8"):
        local_documents([binary])

    missing = tmp_path / "missing.txt"
    with pytest.raises(TextError, match="no such file"):
        local_documents([missing])

    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(TextError, match="no \\*.txt"):
        local_documents([bare])

    with pytest.raises(TextError, match="no text files"):
        local_documents([])

    with pytest.raises(TextError, match="unknown text source"):
        load_documents("wikitext-103")

    assert issubclass(TextError, ValueError)


def test_parse_text_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_text_spec("wikipedia") == "wikipedia"
    assert parse_text_spec(" News ") == "news"
    a, b = tmp_path / "a.txt", tmp_path / "b"
    a.write_text("alpha", encoding="utf-8")
    assert parse_text_spec(str(a)) == [a]
    assert parse_text_spec(f"{a}, {b}") == [a, b]  # several entries: local_documents checks each
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_text_spec("~/a.txt") == [a]

    with pytest.raises(TextError, match="unknown text source 'wikitext-103': no such file or folder"):
        parse_text_spec("wikitext-103")
    for bad in ("", " ", f"{a},", f"{a},,{a}"):
        with pytest.raises(TextError, match="has an empty entry"):
            parse_text_spec(bad)


def test_load_documents_reads_comma_separated_spec(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    (tmp_path / "b.txt").write_text("beta", encoding="utf-8")
    docs = load_documents(f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}")
    assert [d.id for d in docs] == ["file:a.txt", "file:b.txt"]
    assert load_documents(str(tmp_path)) == docs
    with pytest.raises(TextError, match="missing.txt: no such file or folder"):
        load_documents(f"{tmp_path / 'a.txt'},{tmp_path / 'missing.txt'}")


def test_clean_wikitext_strips_markup() -> None:
    raw = (
        "'''Albedo''' ({{IPAc-en|æ|l|ˈ|b|iː|d|oʊ}}; {{lang-la|albedo}}) is the "
        "[[reflection (physics)|fraction]] of light.<ref>{{cite web|url=x}}</ref> It is {{convert|5|km}} wide.\n"
        "[[File:Albedo.png|thumb|A picture]]\n{|\n| cell\n|}\n[[Category:Optics]]\n"
        "== Physics ==\nMore text.\n== See also ==\n* [[Reflectance]]\n"
    )
    assert (
        clean_wikitext(raw)
        == "Albedo (albedo) is the fraction of light. It is 5 km wide.\n\nPhysics\nMore text."
    )


# ----------------------------------------------------------------------------------------------
# splits
# ----------------------------------------------------------------------------------------------


def test_split_is_disjoint_complete_and_deterministic(wiki: list[Document]) -> None:
    split = split_documents(wiki)
    assert list(split) == ["evaluation", "calibration", "adaptation"]
    ids = [d.id for docs in split.values() for d in docs]
    assert len(ids) == len(set(ids)) == len(wiki)
    assert set(ids) == {d.id for d in wiki}

    total = sum(len(d.text) for d in wiki)
    for role, frac in {"evaluation": 0.2, "calibration": 0.2, "adaptation": 0.6}.items():
        share = sum(len(d.text) for d in split[role]) / total
        assert abs(share - frac) < 0.05, (role, share)

    assert split_documents(list(reversed(wiki))) == split
    assert split_documents(wiki) == split


def test_split_small_and_invalid() -> None:
    three = [_doc(i, 100) for i in range(3)]
    split = split_documents(three)
    assert all(len(v) == 1 for v in split.values())

    only_eval = split_documents(three, {"evaluation": 1.0, "calibration": 0.0})
    assert len(only_eval["evaluation"]) == 3 and only_eval["calibration"] == []

    with pytest.raises(TextError, match="no documents"):
        split_documents([])
    with pytest.raises(TextError, match="too short to cut into evaluation, calibration, adaptation parts by position"):
        split_documents([Document.make("file:tiny.txt", "tiny", "two words")])
    with pytest.raises(TextError, match="sum to 1"):
        split_documents(three, {"evaluation": 0.5, "adaptation": 0.6})
    with pytest.raises(TextError, match="duplicate"):
        split_documents([three[0], three[0], three[1]])


def test_documents_record() -> None:
    doc = Document.make("file:a.txt", "a", "héllo")
    assert documents_record([doc]) == [
        {"id": "file:a.txt", "sha256": hashlib.sha256("héllo".encode()).hexdigest(), "chars": 5}
    ]


# ----------------------------------------------------------------------------------------------
# token windows
# ----------------------------------------------------------------------------------------------


def test_token_windows_shapes(tokenizer: Any, wiki: list[Document]) -> None:
    windows = token_windows(tokenizer, wiki[:20], window=256, max_windows=8)
    assert windows.shape == (8, 256) and windows.dtype == torch.long
    assert bool((windows[:, 0] == tokenizer.bos_token_id).all())
    assert int((windows[:, 1:] == tokenizer.bos_token_id).sum()) == 0

    plain = token_windows(tokenizer, wiki[:3], window=128, max_windows=None, bos=False)
    stream: list[int] = []
    for doc in wiki[:3]:
        if stream:
            stream.append(tokenizer.eos_token_id)
        stream.extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
    count = len(stream) // 128
    assert plain.shape == (count, 128)
    assert plain.flatten().tolist() == stream[: count * 128]
    assert int((plain == tokenizer.eos_token_id).sum()) == stream[: count * 128].count(tokenizer.eos_token_id)


def test_token_windows_too_short(tokenizer: Any) -> None:
    short = [Document.make("file:s.txt", "s", "A short sentence of plain text.")]
    with pytest.raises(TextError, match=r"has only \d+ tokens; need at least 511 .*shorter --window"):
        token_windows(tokenizer, short, window=512, max_windows=None)
    with pytest.raises(ValueError, match="max_windows"):
        token_windows(tokenizer, short, window=4, max_windows=0)
    assert token_windows(tokenizer, short, window=4, max_windows=1).shape == (1, 4)


def test_one_long_document_is_split_by_position(wiki: list[Document]) -> None:
    """One book is normal user text: each role gets a consecutive piece of it (evaluation first), the pieces
    cover the text in order without overlap, and their ids say where they were cut."""
    book = Document.make("file:book.txt", "book", "\n\n".join(d.text for d in wiki[:5]))
    split = split_documents([book])
    pieces = [split[r][0] for r in ("evaluation", "calibration", "adaptation")]
    assert all(len(split[r]) == 1 for r in split)
    spans = [tuple(int(x) for x in p.id.split("@chars")[1].split("-")) for p in pieces]
    assert spans[0][0] == 0 and spans[-1][1] == len(book.text)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # consecutive, no overlap
    shares = [(e - s) / len(book.text) for s, e in spans]
    assert shares == pytest.approx([0.2, 0.2, 0.6], abs=0.01)
    assert all(p.text == book.text[s:e].strip() for p, (s, e) in zip(pieces, spans, strict=True))
    assert split_documents([book]) == split  # deterministic
    two = split_documents([book, Document.make("file:b.txt", "b", book.text[::-1])])
    assert all(len(v) == 2 for v in two.values())


def test_windows_start_as_served_prompts_do(tmp_path: Path) -> None:
    """Calibration, held-out and evaluation windows start with BOS exactly when the tokenizer puts one in front of
    a prompt (Llama-3 does; SmolLM2 does not, so its windows, and the pinned reference, are unchanged)."""
    import json

    from tiny import copy_tokenizer
    from transformers import AutoTokenizer

    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.convert.pipeline.text import prepare_text
    from mla_convert.text.windows import adds_bos

    plain = tmp_path / "plain"
    plain.mkdir()
    copy_tokenizer(plain)
    tok = AutoTokenizer.from_pretrained(str(plain))
    assert not adds_bos(tok)
    opts = ConvertOptions(text="news", window=64, calib_windows=4, eval_windows=2)
    text = prepare_text(tok, opts)
    assert (text.calibration[:, 0] != tok.bos_token_id).any()
    # the same tokenizer with a post-processor that adds BOS, as Llama-3's does
    bos = tmp_path / "bos"
    bos.mkdir()
    copy_tokenizer(bos)
    spec = json.loads((bos / "tokenizer.json").read_text())
    name = tok.bos_token
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {name: {"id": name, "ids": [tok.bos_token_id], "tokens": [name]}},
    }  # fmt: skip
    (bos / "tokenizer.json").write_text(json.dumps(spec))
    tok_bos = AutoTokenizer.from_pretrained(str(bos))
    assert adds_bos(tok_bos) and tok_bos("a")["input_ids"][0] == tok.bos_token_id
    text = prepare_text(tok_bos, opts)
    for rows in (text.calibration, text.held_out, text.evaluation):
        assert rows.shape[1] == 64 and (rows[:, 0] == tok.bos_token_id).all()
        assert (rows[:, 1:] != tok.bos_token_id).all()  # BOS opens the window, nowhere else


def test_factor_calibrates_on_chat_templated_text(tmp_path: Path) -> None:
    """``--text chats.jsonl,messages=messages`` renders each conversation with the tokenizer's chat template (as
    ``adapt --data`` does): the calibration windows hold the template's role tokens; adaptation keys are refused."""
    import json

    from chats import news_chats
    from tiny import copy_tokenizer
    from transformers import AutoTokenizer

    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.convert.pipeline.text import prepare_text, text_documents

    copy_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in news_chats(40)))
    docs, name = text_documents(f"{chats},messages=messages", tok)
    assert name == "local files,messages=messages" and len(docs) == 40
    assert docs[0].text.startswith("<|im_start|>") and "<|im_start|>assistant\n" in docs[0].text
    text = prepare_text(tok, ConvertOptions(text=f"{chats},messages=messages", window=64, calib_windows=4,
                                            eval_windows=1))  # fmt: skip
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert (text.calibration == start).sum() >= 4  # role tokens, tokenized as the special token they are
    with pytest.raises(TextError, match="weight= and loss= are adaptation keys"):
        text_documents(f"{chats},messages=messages,weight=2", tok)


def test_chat_text_too_short_for_the_budget_is_said(tmp_path: Path) -> None:
    """A chat file that gives fewer calibration windows than the budget asks is a warning in the report (and on
    the command line), and chat turns (each ending with EOS) are not counted as documents."""
    import json

    from chats import news_chats
    from tiny import copy_tokenizer
    from transformers import AutoTokenizer

    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.convert.pipeline.text import prepare_text

    copy_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in news_chats(40)))
    opts = ConvertOptions(text=f"{chats},messages=messages", window=64, calib_windows=4, eval_windows=1)
    text = prepare_text(tok, opts)
    assert text.calibration_documents is None  # not the count of EOS-ended turns
    plain = prepare_text(tok, ConvertOptions(text="wikipedia", window=64, calib_windows=4, eval_windows=1))
    assert plain.calibration_documents is not None and plain.calibration_documents >= 2
    short = prepare_text(tok, opts.model_copy(update={"calib_windows": 100000}))
    assert short.calibration.shape[0] < 100000
    # the command line says so, and so does the report
    from tiny import write_tiny_llama
    from typer.testing import CliRunner

    from mla_convert.cli.commands import app

    src = write_tiny_llama(tmp_path / "src")
    copy_tokenizer(src)
    out = tmp_path / "mla"
    res = CliRunner().invoke(app, ["factor", str(src), str(out), "--text", f"{chats},messages=messages", "--window",
                                   "64", "--calib-tokens", "25600", "--eval-windows", "1", "--dtype", "float32"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "warning: the calibration text gives" in res.output and "where 400 were asked" in res.output
    report = json.loads((out / "report.json").read_text())
    assert any("where 400 were asked" in w for w in report["warnings"])
    assert "**Warning:** the calibration text gives" in (out / "report.md").read_text()


def test_python_corpus_is_the_standard_library_and_splits_by_file():
    """``--text python``: the interpreter's own modules, one document per file; the evaluation split (what perplexity
    on code reads) shares no file with calibration (issue 50: calibration never reads evaluation data)."""
    import sys

    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import split_documents

    docs = load_documents("python")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert len(docs) > 100 and all(d.id.startswith(f"python:{version}/") for d in docs)
    assert any(d.id.endswith("/textwrap.py") and "def dedent(" in d.text for d in docs)
    parts = split_documents(docs)
    ids = {k: {d.id for d in v} for k, v in parts.items()}
    assert ids["evaluation"] and ids["calibration"] and not ids["evaluation"] & ids["calibration"]


def test_calibration_mixture_takes_each_source_by_weight_from_its_calibration_split(tmp_path: Path) -> None:
    """``--calib-data`` (issue 50): each source's share of the calibration windows is its weight, every window is
    cut from that source's *calibration* split (never an evaluation document), chat-templated windows hold the
    template's role tokens, code windows hold code, and the report's evaluation windows stay on ``--text``."""
    from tiny import copy_tokenizer
    from transformers import AutoTokenizer

    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.convert.pipeline.text import mixture_windows, prepare_text
    from mla_convert.text.specs import parse_data_spec, spec_documents

    copy_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    specs = ["wikipedia,weight=2", "wikipedia-chat", "code"]
    opts = ConvertOptions(calib_data=specs, window=256, calib_windows=16, eval_windows=2)  # a chat turn < 256
    text = prepare_text(tok, opts)
    assert text.name == "wikipedia,weight=2 + wikipedia-chat + code"
    assert text.calibration.shape == (16, 256) and text.held_out.shape == (4, 256)
    assert torch.equal(text.evaluation, prepare_text(tok, ConvertOptions(text="wikipedia", window=256,
                                                                         calib_windows=4, eval_windows=2)).evaluation)  # fmt: skip
    assert mixture_windows(tok, opts).counts == [8, 4, 4]
    splits = {s: split_documents(spec_documents(parse_data_spec(s), tok)) for s in specs}
    start = tok.convert_tokens_to_ids("<|im_start|>")
    kinds = []
    for window in text.calibration:
        piece = tok.decode(window[16:40]).strip()  # 24 tokens inside the window, as text
        homes = {s for s in specs for d in splits[s]["calibration"] if piece in d.text}
        assert homes, piece  # cut from a calibration document ...
        scored = splits["wikipedia,weight=2"]["evaluation"] + splits["code"]["evaluation"]
        assert not any(piece in d.text for d in scored), piece  # ... never a scored one (the chats quote calibration)
        kinds.append("code" if "code" in homes else "chat" if (window == start).any() else "wiki")
    assert sorted(kinds) == sorted(["wiki"] * 8 + ["chat"] * 4 + ["code"] * 4), kinds
    assert {r["id"].split(":")[0] for r in text.records["calibration"]} == {"wiki", "wikipedia-chat", "code"}


def test_code_calibration_corpus_is_not_the_evaluation_code() -> None:
    """``code`` (gensim's Python sources, to calibrate on) and ``python`` (the standard library, to score code on)
    share no document and no text."""
    from mla_convert.text.corpora import load_documents

    code, stdlib = load_documents("code"), load_documents("python")
    assert len(code) >= 50 and all(d.id.startswith("code:gensim-4.4.0/gensim/") for d in code)
    assert not any("/test/" in d.id for d in code)
    assert not {d.sha256 for d in code} & {d.sha256 for d in stdlib}


def test_calibration_mixture_errors_are_one_line(tmp_path: Path) -> None:
    """Bad ``--calib-data`` specs are refused before any work, every one in one line; a chat corpus on a
    tokenizer without a chat template says so."""
    from tiny import copy_tokenizer
    from transformers import AutoTokenizer

    from mla_convert.convert.options.options import ConvertOptions, OptionsError, check_options
    from mla_convert.convert.pipeline.text import prepare_text

    bad = ConvertOptions(calib_data=["wikipedia,weight=0", "code,loss=all", "news,field=x", str(tmp_path / "no.txt")])
    with pytest.raises(OptionsError) as err:
        check_options(bad, None)
    msg = str(err.value)
    assert "\n" not in msg and msg.count("--calib-data") == 3, msg
    assert "weight=0 is not a positive number" in msg and "news is plain text" in msg and "no such file" in msg
    copy_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = None
    with pytest.raises(TextError, match="no chat template"):
        prepare_text(tok, ConvertOptions(calib_data=["wikipedia", "wikipedia-chat"], window=64, calib_windows=4))


def test_factor_records_its_calibration_mixture(tmp_path: Path) -> None:
    """A conversion calibrated on a mixture records it: the manifest's options carry ``calib_data`` as typed, the
    report names the mixture and lists every source's calibration documents, and the manifest verifies."""
    import json

    from tiny import copy_tokenizer, write_tiny_llama
    from typer.testing import CliRunner

    from mla_convert.cli.commands import app

    src = tmp_path / "src"
    src.mkdir()
    write_tiny_llama(src)
    copy_tokenizer(src)
    out = tmp_path / "out"
    args = ["factor", str(src), str(out), "--calib-data", "wikipedia", "--calib-data", "code,weight=0.5",
            "--window", "32", "--calib-tokens", "256", "--eval-windows", "1", "--rope-pairs", "2",
            "--kv-lora-rank", "8", "--device", "cpu"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "mla_manifest.json").read_text())
    assert manifest["options"]["calib_data"] == ["wikipedia", "code,weight=0.5"]
    report = json.loads((out / "report.json").read_text())
    assert report["text"]["name"] == "wikipedia + code,weight=0.5"
    assert {r["id"].split(":")[0] for r in report["text"]["calibration"]} == {"wiki", "code"}
    assert CliRunner().invoke(app, ["manifest", "verify", str(out)]).exit_code == 0
    md = (out / "report.md").read_text()
    assert "of wikipedia evaluation documents" in md and "tokens of wikipedia + code,weight=0.5 (one share per source, weighted) from " in md
    # the weights ledger (issue 51): report, report.md and the model card; the mla row counts the written tensors
    import math

    from safetensors import safe_open

    stored = 0
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            stored += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if not k.endswith("rope_inv_freq"))
    assert report["weights"]["places"]["mla"]["model_params"] == stored
    assert "Weights against the source:" in md and "break-even" in md
    assert "## Weights and memory against the source" in (out / "README.md").read_text()


def test_default_calibration_is_prose_chat_and_code(tmp_path: Path) -> None:
    """Neither ``--calib-data`` nor ``--text`` given: the conversion calibrates on the default mixture (prose,
    chat-templated prose, code), written into the options and said in the choices; ``--text`` given: that text
    alone, as before; a tokenizer without a chat template: the mixture without its chat part, and the choice says
    why."""
    import json

    from tiny import copy_tokenizer, write_tiny_llama

    from mla_convert.convert.options.options import DEFAULT_CALIB_DATA, ConvertOptions
    from mla_convert.convert.options.resolve import resolve_options
    from mla_convert.sources.checkpoint import open_source

    write_tiny_llama(tmp_path)
    copy_tokenizer(tmp_path)
    src = open_source(tmp_path)
    res = resolve_options(ConvertOptions(), src)
    assert res.options.calib_data == ["wikipedia", "wikipedia-chat", "code"] == list(DEFAULT_CALIB_DATA)
    assert res.choices["calib_data"].startswith("default: wikipedia + wikipedia-chat + code, one share each")
    for given in (ConvertOptions(text="news"), ConvertOptions(calib_data=["code"])):
        res = resolve_options(given, src)
        assert res.options.calib_data == given.calib_data and "calib_data" not in res.choices
    assert resolve_options(ConvertOptions(), src, given=["text"]).options.calib_data is None  # --text typed
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    res = resolve_options(ConvertOptions(), open_source(tmp_path))
    assert res.options.calib_data == ["wikipedia", "code"]
    assert "wikipedia-chat left out: the tokenizer has no chat template" in res.choices["calib_data"]
