"""Data files a user brings (JSON lines, JSON, Parquet, CSV, saved ``datasets`` folders) as documents: one per
row, read through ``datasets``; chat conversations rendered with the model's template; bad data is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla_convert.text.corpora import TextError, load_documents
from mla_convert.text.datafiles import table_documents

ROWS = [
    "The Eiffel Tower was completed in 1889 for the World's Fair.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "",
    "A paged cache stores one latent row per token.",
]


def _write(folder: Path, fmt: str) -> Path:
    import datasets

    ds = datasets.Dataset.from_dict({"text": ROWS, "n": list(range(len(ROWS)))})
    if fmt == "arrow":
        ds.save_to_disk(str(folder / "saved"))
        return folder / "saved"
    path = folder / f"rows.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(ROWS)))
    elif fmt == "json":
        path.write_text(json.dumps([{"text": t, "n": i} for i, t in enumerate(ROWS)]))
    elif fmt == "parquet":
        ds.to_parquet(str(path))
    else:
        ds.to_csv(str(path), index=False)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "arrow"])
def test_every_format_gives_one_document_per_nonempty_row(tmp_path: Path, fmt: str) -> None:
    path = _write(tmp_path, fmt)
    docs = load_documents(str(path))  # the --text spec of factor, eval and adapt
    assert [d.text for d in docs] == [t for t in ROWS if t]
    assert [d.id.split("#")[1] for d in docs] == ["0", "1", "3"]  # row numbers name the rows used
    assert len({d.id for d in docs}) == 3


def test_a_folder_mixes_text_and_data_files(tmp_path: Path) -> None:
    _write(tmp_path, "jsonl")
    (tmp_path / "book.txt").write_text("Chapter one. It was a bright cold day in April.")
    docs = load_documents(str(tmp_path))
    assert [d.id for d in docs] == [
        "file:book.txt",
        "jsonl:rows.jsonl#0",
        "jsonl:rows.jsonl#1",
        "jsonl:rows.jsonl#3",
    ]


def test_bad_data_is_one_clear_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "jsonl")
    with pytest.raises(TextError, match=r"no column 'body' \(columns: text, n\); name the text column"):
        table_documents(path, field="body")
    with pytest.raises(TextError, match=r"column 'n' holds int \(row 0\), not text"):
        table_documents(path, field="n")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TextError, match="file is empty"):
        load_documents(str(tmp_path / "empty.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(TextError, match=r"cannot be read as jsonl \(JSON parse error: .*\); fix the file") as err:
        load_documents(str(tmp_path / "broken.jsonl"))
    assert "An error occurred while generating" not in str(err.value)  # the parser's words, not datasets' wrapper
    (tmp_path / "blank.jsonl").write_text('{"text": "  "}\n')
    with pytest.raises(TextError, match="has no non-empty row"):
        load_documents(str(tmp_path / "blank.jsonl"))


def test_chat_messages_render_with_the_models_template(tmp_path: Path, smol_tokenizer) -> None:
    chats = [
        [{"role": "user", "content": "What is MLA?"}, {"role": "assistant", "content": "A latent KV cache."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"conversation": c}) + "\n" for c in chats))
    docs = table_documents(path, messages="conversation", tokenizer=smol_tokenizer)
    assert [d.text for d in docs] == [
        smol_tokenizer.apply_chat_template(c, tokenize=False).strip() for c in chats
    ]
    assert "<|im_start|>assistant" in docs[0].text and "A latent KV cache." in docs[0].text
    with pytest.raises(TextError, match="need a tokenizer with a chat template"):
        table_documents(path, messages="conversation")
    path.write_text(json.dumps({"conversation": "not a list"}) + "\n")
    with pytest.raises(TextError, match=r"row 0 is not a list of \{'role', 'content'\} messages"):
        table_documents(path, messages="conversation", tokenizer=smol_tokenizer)


def test_a_messages_column_is_chat_data(tmp_path: Path, smol_tokenizer) -> None:
    """A table whose only column is ``messages`` (role/content lists, TRL's convention) is read as
    ``messages=messages``; where a hint is given, it names the conversation column as ``messages=NAME``."""
    from mla_convert.text.specs import parse_data_spec, spec_documents

    chats = [
        [{"role": "user", "content": "What is MLA?"}, {"role": "assistant", "content": "A latent KV cache."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    rendered = [smol_tokenizer.apply_chat_template(c, tokenize=False).strip() for c in chats]
    docs = spec_documents(parse_data_spec(str(path)), smol_tokenizer)  # adapt --data chats.jsonl
    assert [d.text for d in docs] == rendered
    assert [d.id for d in docs] == ["jsonl:chats.jsonl#0", "jsonl:chats.jsonl#1"]
    explicit = table_documents(path, messages="messages", tokenizer=smol_tokenizer)
    assert [(d.id, d.sha256) for d in docs] == [(d.id, d.sha256) for d in explicit]
    # without a template at hand (factor --text): one line saying what the column is, not "field=NAME"
    with pytest.raises(TextError, match="its 'messages' column holds chat conversations") as err:
        load_documents(str(path))
    assert "field=NAME" not in str(err.value)
    # a conversation column of another name: the hint is messages=NAME with that name
    other = tmp_path / "conv.jsonl"
    other.write_text("".join(json.dumps({"conversation": c, "n": i}) + "\n" for i, c in enumerate(chats)))
    with pytest.raises(
        TextError,
        match=r"no column 'text' \(columns: conversation, n\); column 'conversation' holds conversations: "
        r"name it with messages=conversation$",
    ):
        table_documents(other, tokenizer=smol_tokenizer)
    with pytest.raises(
        TextError, match="column 'conversation' holds conversations: name it with messages=conversation"
    ):
        table_documents(other, messages="chat", tokenizer=smol_tokenizer)
    with pytest.raises(TextError, match=r"column 'conversation' holds chat conversations \(row 0\), not text; name it "
                       r"with messages=conversation$"):  # fmt: skip
        table_documents(other, field="conversation", tokenizer=smol_tokenizer)
    # a text column wins over the messages column (field= defaults to text)
    both = tmp_path / "both.jsonl"
    both.write_text(
        "".join(json.dumps({"text": f"row {i}", "messages": c}) + "\n" for i, c in enumerate(chats))
    )
    assert [d.text for d in table_documents(both, tokenizer=smol_tokenizer)] == ["row 0", "row 1"]
