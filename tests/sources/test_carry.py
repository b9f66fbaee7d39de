"""Everything the source ships travels into the converted checkpoint unchanged (issue 12, item 5).

The generation config verbatim (eos lists, pad, sampling defaults), every tokenizer and chat-template
file, the license and the README (as ``SOURCE_README.md``, named in the model card). Checked on the
carry functions, on ``save_checkpoint`` with a tiny random Llama, and once end to end through
``mla-convert factor``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny import copy_tokenizer, write_tiny_llama

from mla_convert.artifacts.output import save_checkpoint
from mla_convert.sources.carry import (
    carried_files,
    copy_carried,
    model_card_source_files,
    tokenizer_files_in,
    write_generation_config,
)

#: A source's own generation config: an eos list, a pad id and sampling defaults (key order and
#: formatting as a hub repository might have them; it must travel byte for byte).
GENERATION = (
    '{\n  "bos_token_id": 1,\n  "do_sample": true,\n  "eos_token_id": [2, 0],\n  "pad_token_id": 0,\n'
    '  "temperature": 0.6,\n  "top_p": 0.9,\n  "transformers_version": "4.45.0"\n}\n'
)
LICENSE = "Apache License\nVersion 2.0, January 2004\n"
README = "---\nlicense: apache-2.0\n---\n# Tiny source\n\nThe source's own model card.\n"
TEMPLATE = {"chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"}


def _dress(folder: Path) -> None:
    """Give a tiny source what a hub repository ships: generation config, license, README, a
    template only in ``chat_template.json``."""
    (folder / "generation_config.json").write_text(GENERATION)
    (folder / "LICENSE").write_text(LICENSE)
    (folder / "README.md").write_text(README)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "chat_template.json").write_text(json.dumps(TEMPLATE, indent=2))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("carry") / "tiny-src"
    folder.mkdir()
    write_tiny_llama(folder)
    copy_tokenizer(folder)
    _dress(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(source: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(source))


def _same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


# ----------------------------------------------------------------------------------------------
# what is carried (no torch)
# ----------------------------------------------------------------------------------------------


def test_carried_files_names(tmp_path: Path) -> None:
    for name in (
        "config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
        "tokenizer.model", "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja",
        "LICENSE.txt", "license", "NOTICE", "USE_POLICY.md", "README.md", "notes.txt", "gguf_origin.json",
    ):  # fmt: skip
        (tmp_path / name).write_text(name)
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    got = carried_files(tmp_path)
    assert list(got) == sorted(got)
    assert set(got) == {
        "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.json",
        "chat_template.jinja", "additional_chat_templates/tool_use.jinja", "LICENSE.txt", "license",
        "NOTICE", "USE_POLICY.md", "SOURCE_README.md",
    }  # fmt: skip
    assert got["SOURCE_README.md"] == tmp_path / "README.md"
    assert "additional_chat_templates/tool_use.jinja" in tokenizer_files_in(tmp_path)

    out = tmp_path / "out"
    out.mkdir()
    names = copy_carried(tmp_path, out)
    assert names == list(got)
    for name, path in got.items():
        assert _same_bytes(out / name, path), name


def test_converted_checkpoint_passes_the_source_readme_on(tmp_path: Path) -> None:
    """Adapting a converted checkpoint: its README.md is our card; the source's SOURCE_README.md travels."""
    (tmp_path / "README.md").write_text("# MLA conversion card\n")
    (tmp_path / "SOURCE_README.md").write_text(README)
    got = carried_files(tmp_path)
    assert got == {"SOURCE_README.md": tmp_path / "SOURCE_README.md"}


def test_model_card_line() -> None:
    assert model_card_source_files([]) == ""
    assert model_card_source_files(["generation_config.json", "LICENSE"]) == (
        "Carried from the source, unchanged: `LICENSE`, `generation_config.json`."
    )


# ----------------------------------------------------------------------------------------------
# save_checkpoint
# ----------------------------------------------------------------------------------------------


def test_save_checkpoint_carries_everything(source: Path, tiny_model, tmp_path: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    out = tmp_path / "ckpt"
    out.mkdir()
    card = "# MLA conversion of tiny-src\n"
    carried = save_checkpoint(tiny_model, out, source, card)
    expected = set(carried_files(source))
    assert {"generation_config.json", "chat_template.json", "LICENSE", "SOURCE_README.md"} <= expected
    assert "tokenizer.json" in expected and "tokenizer_config.json" in expected
    assert set(carried) == expected
    for name in expected:
        assert _same_bytes(out / name, carried_files(source)[name]), name

    # generation config identical, and transformers reads the eos list, pad and sampling defaults
    assert (out / "generation_config.json").read_text() == GENERATION
    gen = GenerationConfig.from_pretrained(str(out))
    assert gen.eos_token_id == [2, 0] and gen.pad_token_id == 0
    assert gen.do_sample is True and gen.temperature == 0.6 and gen.top_p == 0.9

    # the template that was only in chat_template.json travels
    assert json.loads((out / "chat_template.json").read_text()) == TEMPLATE
    assert not (out / "chat_template.jinja").exists()
    AutoTokenizer.from_pretrained(str(out))  # the carried tokenizer loads

    # license and README travel; the card is ours and names them
    assert (out / "LICENSE").read_text() == LICENSE
    assert (out / "SOURCE_README.md").read_text() == README
    readme = (out / "README.md").read_text()
    assert readme.startswith(card)
    assert model_card_source_files(expected) in readme
    for name in ("LICENSE", "SOURCE_README.md", "generation_config.json", "chat_template.json"):
        assert f"`{name}`" in readme


def test_generation_config_from_model_config_without_one(source: Path, tiny_model, tmp_path: Path) -> None:
    bare = Path(shutil.copytree(source, tmp_path / "bare"))
    (bare / "generation_config.json").unlink()
    assert write_generation_config(tmp_path, bare, tiny_model.config) is False
    got = json.loads((tmp_path / "generation_config.json").read_text())
    cfg = tiny_model.config
    assert (got.get("bos_token_id"), got.get("eos_token_id")) == (cfg.bos_token_id, cfg.eos_token_id)
    assert got.get("pad_token_id") == cfg.pad_token_id
    assert "temperature" not in got and "do_sample" not in got

    out = tmp_path / "ckpt"
    out.mkdir()
    carried = save_checkpoint(tiny_model, out, bare, "# card\n")
    assert "generation_config.json" not in carried
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == cfg.eos_token_id
    assert "`generation_config.json`" not in (out / "README.md").read_text()


def test_save_checkpoint_older_file_list_form(source: Path, tiny_model, tmp_path: Path) -> None:
    """A list of the source's tokenizer files (the older call form) carries the whole folder."""
    out = tmp_path / "ckpt"
    out.mkdir()
    carried = save_checkpoint(
        tiny_model, out, [source / "tokenizer.json", source / "tokenizer_config.json"], "c\n"
    )
    assert set(carried) == set(carried_files(source))
    assert (out / "generation_config.json").read_text() == GENERATION


# ----------------------------------------------------------------------------------------------
# end to end: mla-convert factor
# ----------------------------------------------------------------------------------------------


def test_factor_carries_source_files(source: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mla_convert.artifacts.manifest import verify
    from mla_convert.cli.commands import app

    text = tmp_path / "text"
    text.mkdir()
    prose = "The river runs through the old town, past the mill and the church, and on toward the sea. "
    for i, word in enumerate(("north", "south", "west")):
        (text / f"doc{i}.txt").write_text(f"A story from the {word}. " + prose * 12, encoding="utf-8")
    out = tmp_path / "out"
    args = [
        "--quiet", "factor", str(source), str(out), "--text", str(text), "--window", "16",
        "--calib-tokens", "32", "--eval-windows", "1", "--rope-pairs", "2", "--kv-lora-rank", "8",
    ]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.output, res.exception)
    for name, path in carried_files(source).items():
        assert _same_bytes(out / name, path), name
    assert (out / "generation_config.json").read_text() == GENERATION
    readme = (out / "README.md").read_text()
    assert readme.startswith("---\nlibrary_name: transformers")  # our card, not the source's
    for name in ("LICENSE", "SOURCE_README.md", "generation_config.json", "chat_template.json"):
        assert f"`{name}`" in readme, name
    manifest = json.loads((out / "mla_manifest.json").read_text())
    assert {"LICENSE", "SOURCE_README.md", "generation_config.json", "chat_template.json"} <= set(
        manifest["outputs"]
    )
    verify(out)
