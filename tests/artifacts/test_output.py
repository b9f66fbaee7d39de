"""OUT is built in a temporary sibling and appears complete, with the permissions a plain mkdir/open would give."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mla_convert.files import atomic_folder


def test_atomic_folder_has_usual_permissions(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with atomic_folder(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
        fd = os.open(tmp / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600)  # an owner-only writer
        os.close(fd)
        (tmp / "sub").mkdir(mode=0o700)
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask
    assert ((out / "model.safetensors").stat().st_mode & 0o777) == 0o666 & ~umask
    assert ((out / "sub").stat().st_mode & 0o777) == 0o777 & ~umask


def test_atomic_folder_leaves_nothing_on_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "out") as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []
