"""Everything mla-convert writes follows the user's umask, like any tool (issue 12, item 7).

Under umask 0022 an output folder is ``drwxr-xr-x`` and its files ``-rw-r--r--``; under 0077 both are
owner-only. Checked for :func:`atomic_folder` (files made owner-only by their writer, sub-folders,
a sharded checkpoint, a replaced OUT), :func:`atomic_write_bytes` (new and replaced files) and
``mla-convert init-recipe``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from mla_convert.files import atomic_folder, atomic_write_bytes, atomic_write_text, current_umask

#: umask -> (folder mode, file mode) a plain mkdir/open gives.
MODES = {0o022: (0o755, 0o644), 0o077: (0o700, 0o600)}


@pytest.fixture(params=sorted(MODES), ids=lambda m: f"umask-{m:04o}")
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test under the given umask (process-wide), restoring the previous one afterwards."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _assert_tree(folder: Path, umask: int) -> None:
    dir_mode, file_mode = MODES[umask]
    assert _mode(folder) == dir_mode, f"{folder}: {_mode(folder):o}"
    for p in folder.rglob("*"):
        want = dir_mode if p.is_dir() else file_mode
        assert _mode(p) == want, f"{p.relative_to(folder)}: {_mode(p):o}, expected {want:o}"


def test_current_umask_reads_without_changing(umask: int) -> None:
    assert current_umask() == umask
    assert current_umask() == umask


def test_atomic_folder_follows_umask(umask: int, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with atomic_folder(out) as tmp:
        assert _mode(tmp) == 0o700  # mkdtemp: private while it is being built
        fd = os.open(tmp / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600)  # an owner-only writer
        os.close(fd)
        (tmp / "report.json").write_text("{}")
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "t.jinja").write_text("x")
        os.chmod(tmp / "sub" / "t.jinja", 0o640)
    _assert_tree(out, umask)


def test_replaced_out_follows_umask(umask: int, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    (out / "old.txt").write_text("old")
    with atomic_folder(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    _assert_tree(out, umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_sharded_checkpoint_follows_umask(umask: int, tmp_path: Path) -> None:
    """Shards, index, config, carried files and the card of a checkpoint written by save_checkpoint."""
    from tiny import TINY
    from transformers import LlamaConfig, LlamaForCausalLM

    from mla_convert.artifacts.output import save_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    (src / "LICENSE").write_text("license")
    os.chmod(src / "LICENSE", 0o600)  # copy2 keeps the source's mode; the folder must not
    (src / "tokenizer_config.json").write_text("{}")
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": 256}))
    out = tmp_path / "out"
    with atomic_folder(out) as tmp:
        save_checkpoint(model, tmp, src, "# card\n", max_shard_size="100KB")
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    assert (out / "LICENSE").exists() and (out / "model.safetensors.index.json").exists()
    _assert_tree(out, umask)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "replaced"])
def test_atomic_write_bytes_follows_umask(umask: int, existing: bool, tmp_path: Path) -> None:
    path = tmp_path / "deep" / "cache.bin"
    if existing:
        path.parent.mkdir()
        path.write_bytes(b"old")
        os.chmod(path, 0o600)
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"
    assert _mode(path) == MODES[umask][1]
    atomic_write_text(tmp_path / "x.txt", "text")
    assert _mode(tmp_path / "x.txt") == MODES[umask][1]
    assert sorted(p.name for p in path.parent.iterdir()) == ["cache.bin"]  # no temporary file left


def test_init_recipe_follows_umask(umask: int, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mla_convert.cli.commands import app
    from mla_convert.recipes.catalog import bundled_names

    name = bundled_names()[0]
    dest = tmp_path / "recipes" / "mine.yaml"
    dest.parent.mkdir()
    res = CliRunner().invoke(app, ["init-recipe", name, str(dest)])
    assert res.exit_code == 0, res.output
    assert _mode(dest) == MODES[umask][1]
