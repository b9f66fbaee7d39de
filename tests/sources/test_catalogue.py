"""A catalogue of broken sources, each refused before any work (issue 12, item 6).

One tiny valid Llama is built per module, single-file and sharded. Each case copies it, damages one
part (a config field, a tensor, a shard, the shard index, the tokenizer) and runs the real
``mla-convert factor SRC OUT`` (typer's ``CliRunner``) with small options. Every case must end with exit
code 2, exactly one ``error:`` line naming the problem and no traceback, and OUT untouched: absent OUT
stays absent with no ``.OUT.tmp-*`` sibling left; an existing OUT (replaced only with ``--overwrite``)
keeps its marker file, byte for byte.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from tiny import (
    copy_tokenizer,
    drop_tensor,
    edit_config,
    leftovers,
    tree_digest,
    truncate_half,
    write_tiny_llama,
)
from typer.testing import CliRunner

from mla_convert.cli.commands import app

PROSE = "The river runs through the old town, past the mill and the church, and on toward the sea. "
INDEX = "model.safetensors.index.json"
Q0 = "model.layers.0.self_attn.q_proj.weight"
K1 = "model.layers.1.self_attn.k_proj.weight"
O0 = "model.layers.0.self_attn.o_proj.weight"
UP1 = "model.layers.1.mlp.up_proj.weight"
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny valid source, saved as one safetensors file and sharded (200 KB shards, an index)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("catalogue")
    single = root / "single"
    single.mkdir()
    write_tiny_llama(single)
    copy_tokenizer(single)
    sharded = root / "sharded"
    AutoModelForCausalLM.from_pretrained(str(single)).save_pretrained(str(sharded), max_shard_size="200KB")
    for f in single.iterdir():
        if not f.name.startswith("model") and not (sharded / f.name).exists():
            shutil.copy2(f, sharded / f.name)
    assert (sharded / INDEX).exists() and len(_shards(sharded)) >= 3
    return {"single": single, "sharded": sharded}


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("text")
    for i, word in enumerate(("north", "south", "west")):
        (folder / f"doc{i}.txt").write_text(f"A story from the {word}. " + PROSE * 12, encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------------------------
# damage helpers
# ----------------------------------------------------------------------------------------------


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


def _file_of(folder: Path, name: str) -> Path:
    index = folder / INDEX
    if index.exists():
        return folder / json.loads(index.read_text())["weight_map"][name]
    return folder / "model.safetensors"


def _set_tensor(folder: Path, name: str, change: Callable[..., object]) -> None:
    """Rewrite the file holding ``name`` with ``change(tensor)`` in its place (metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    file = _file_of(folder, name)
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, str(file), metadata=meta)


def _poison(value: float) -> Callable[..., object]:
    def change(t):  # noqa: ANN001, ANN202 - a torch tensor
        t[0, 0] = value
        return t

    return change


def _edit_index(folder: Path, edit: Callable[[dict], None]) -> None:
    index = folder / INDEX
    data = json.loads(index.read_text())
    edit(data["weight_map"])
    index.write_text(json.dumps(data, indent=2))


def _without(*keys: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        for k in keys:
            del cfg[k]
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))

    return damage


def _no_tokenizer(folder: Path) -> None:
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()


def _rope(params: dict) -> Callable[[Path], None]:
    return lambda folder: edit_config(folder, rope_parameters=params) and None


LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
    "original_max_position_embeddings": 128,
}  # fmt: skip
NAN = float("nan")
INF = float("inf")

#: id -> (base, damage, words the error line must contain; "{src}" is the source folder)
CASES: dict[str, tuple[str, Callable[[Path], None], tuple[str, ...]]] = {
    # config.json
    "config-missing-hidden_size": ("single", _without("hidden_size"), ("config.json",)),
    "config-kv-heads-not-dividing": (
        "single", lambda f: edit_config(f, num_key_value_heads=3) and None, ("num_key_value_heads",),
    ),
    "config-bad-model_type": (
        "single", lambda f: edit_config(f, model_type="gpt_fancy") and None, ("unsupported architecture 'gpt_fancy'",),
    ),
    "config-invalid-json": (
        "single", lambda f: (f / "config.json").write_text('{"model_type": "llama",') and None, ("not valid JSON",),
    ),
    "config-heads-vs-shapes": (
        "single", lambda f: edit_config(f, num_attention_heads=8) and None, (Q0, "does not match the weights"),
    ),
    "config-rope-longrope": ("single", _rope(LONGROPE), ("RoPE scaling 'longrope'",)),
    # tensors
    "tensor-missing-attention": (
        "single", lambda f: drop_tensor(f / "model.safetensors", K1), (K1, "is missing"),
    ),
    "tensor-misshaped-q_proj": (
        "single", lambda f: _set_tensor(f, Q0, lambda t: t[:48].contiguous()), (Q0, "[48, 64]"),
    ),
    "tensor-nan-k_proj": ("single", lambda f: _set_tensor(f, K1, _poison(NAN)), (K1, "layer 1", "NaN")),
    "tensor-inf-o_proj": ("single", lambda f: _set_tensor(f, O0, _poison(INF)), (O0, "layer 0", "Inf")),
    "tensor-missing-mlp": ("single", lambda f: drop_tensor(f / "model.safetensors", UP1), (UP1, "is missing")),
    "tensor-missing-embedding": (
        "single", lambda f: drop_tensor(f / "model.safetensors", EMBED), (EMBED, "is missing"),
    ),
    "tensor-nan-mlp": ("single", lambda f: _set_tensor(f, UP1, _poison(NAN)), (UP1, "NaN")),
    # shards
    "shard-missing-file": ("sharded", lambda f: _shards(f)[1].unlink(), ("named in the index is missing",)),
    "shard-truncated": (
        "sharded", lambda f: truncate_half(_shards(f)[1]) and None, ("is truncated or corrupt",),
    ),
    # the shard index
    "index-invalid-json": (
        "sharded", lambda f: (f / INDEX).write_text('{"weight_map": {') and None, (INDEX, "not a valid"),
    ),
    "index-names-missing-file": (
        "sharded",
        lambda f: _edit_index(f, lambda m: m.update({K1: "model-00099-of-00099.safetensors"})),
        ("model-00099-of-00099.safetensors",),
    ),
    "index-missing-tensor": ("sharded", lambda f: _edit_index(f, lambda m: m.pop(K1)), (K1, "is missing")),
    "index-wrong-shard-for-tensor": (
        "sharded",
        lambda f: _edit_index(f, lambda m: m.update({K1: m[EMBED]})),
        (K1, "does not hold it"),
    ),
    # tokenizer and generation config
    "tokenizer-none": ("single", _no_tokenizer, ("has no tokenizer files", "{src}")),
    "tokenizer-corrupt-json": (
        "single", lambda f: (f / "tokenizer.json").write_text('{"version": "1.0", "model": ') and None,
        ("tokenizer", "cannot be loaded"),
    ),
    "generation-config-invalid-json": (
        "single", lambda f: (f / "generation_config.json").write_text("{eos: 2") and None,
        ("generation_config.json", "not valid JSON"),
    ),
}  # fmt: skip

#: Cases a later stage checks: what they wait for (strict: an xpass means the check arrived).
LATER: dict[str, tuple[str, bool]] = {}  # cases refused later than they should be (none)


def _params() -> list:
    out = []
    for case in CASES:
        for where in ("absent", "existing"):
            marks = [pytest.mark.xfail(reason=LATER[case][0], strict=LATER[case][1])] if case in LATER else []
            out.append(pytest.param(case, where, id=f"{case}-{where}-out", marks=marks))
    return out


def _factor(src: Path, out: Path, text: Path, *extra: str) -> Result:
    args = [
        "factor", str(src), str(out), "--text", str(text), "--window", "16", "--calib-tokens", "32",
        "--eval-windows", "1", "--rope-pairs", "2", "--kv-lora-rank", "8", *extra,
    ]  # fmt: skip
    return CliRunner().invoke(app, args)


def test_control_converts(bases: dict[str, Path], text: Path, tmp_path: Path) -> None:
    """The undamaged sources with the same arguments convert (so each case fails for its damage)."""
    for kind, base in bases.items():
        res = _factor(base, tmp_path / kind, text)
        assert res.exit_code == 0, (kind, res.output, res.exception)


@pytest.mark.parametrize(("case", "where"), _params())
def test_broken_source_is_refused(
    case: str, where: str, bases: dict[str, Path], text: Path, tmp_path: Path
) -> None:
    base, damage, needles = CASES[case]
    src = Path(shutil.copytree(bases[base], tmp_path / "src"))
    damage(src)
    out = tmp_path / "out"
    extra: tuple[str, ...] = ()
    if where == "existing":
        out.mkdir()
        (out / "marker.txt").write_text("earlier results\n")
        extra = ("--overwrite",)
    before = tree_digest(out)
    source_before = tree_digest(src)

    res = _factor(src, out, text, *extra)

    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    assert errors[0] in res.stderr.splitlines(), res.stderr
    for needle in needles:
        needle = needle.replace("{src}", str(src))
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    if where == "absent":
        assert not out.exists()
    else:
        assert tree_digest(out) == before and (out / "marker.txt").read_text() == "earlier results\n"
    siblings = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers(out) == [] and siblings == []  # no temporary or work folder left next to OUT
    assert tree_digest(src) == source_before, "the source folder was modified"


# ----------------------------------------------------------------------------------------------
# the checks on their own (those open_source does not call yet)
# ----------------------------------------------------------------------------------------------


def test_check_index_names_the_shard_that_lacks_a_tensor(bases: dict[str, Path], tmp_path: Path) -> None:
    from mla_convert.sources.integrity import check_index
    from mla_convert.sources.locate import SourceError

    src = Path(shutil.copytree(bases["sharded"], tmp_path / "src"))
    weight_map = json.loads((src / INDEX).read_text())["weight_map"]
    check_index(src, weight_map)  # the undamaged index
    wrong = {**weight_map, K1: weight_map[EMBED]}
    with pytest.raises(
        SourceError, match=f"says tensor '{K1}' is in {weight_map[EMBED]}, but that file does not hold it"
    ):
        check_index(src, wrong)
    with pytest.raises(SourceError, match="model-00099-of-00099.safetensors', which is missing"):
        check_index(src, {**weight_map, K1: "model-00099-of-00099.safetensors"})


@pytest.mark.parametrize(
    ("field", "value"), [("hidden_size", None), ("vocab_size", 0), ("num_hidden_layers", "2")]
)
def test_check_config_fields(field: str, value: object, bases: dict[str, Path], tmp_path: Path) -> None:
    from mla_convert.sources.integrity import check_config_fields
    from mla_convert.sources.locate import SourceError

    src = Path(shutil.copytree(bases["single"], tmp_path / "src"))
    check_config_fields(src / "config.json")
    if value is None:
        _without(field)(src)
        expected = f"has no {field}; transformers would guess a default"
    else:
        edit_config(src, **{field: value})
        expected = f"{field} is {value!r}; it must be a positive integer"
    with pytest.raises(SourceError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        check_config_fields(src / "config.json")
