"""Real text for calibration, adaptation and evaluation: documents, disjoint splits and token windows.

Sources (see :mod:`mla_convert.assets`; nothing comes from a model hub):

* ``"wikipedia"``: 104 English Wikipedia articles (2.8 MB of clean prose, ~629k SmolLM2 tokens) parsed from the MediaWiki
  XML export bundled in the gensim 4.4.0 archive, markup stripped with ``mwparserfromhell``.
* ``"news"``: the Lee background corpus, 300 short news articles, one per line.
* local ``.txt`` files or folders of them.

Documents are split between roles *by document* (never by window), so that calibration, adaptation
and evaluation text are disjoint, and :func:`documents_record` gives the ids and hashes to put in a
manifest.
"""

from __future__ import annotations

import bz2
import hashlib
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mla_convert.sources.assets import NEWS_MEMBER, WIKI_MEMBER, cache_dir, gensim_text_file, sha256_file

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_FRACTIONS",
    "Document",
    "TextError",
    "clean_wikitext",
    "documents_record",
    "load_documents",
    "local_documents",
    "news_documents",
    "split_documents",
    "token_windows",
    "wikipedia_documents",
]

#: Default split: fractions of total characters per role, assigned in this order.
DEFAULT_FRACTIONS: Mapping[str, float] = MappingProxyType(
    {"evaluation": 0.2, "calibration": 0.2, "adaptation": 0.6}
)
#: Wikipedia articles shorter than this (characters, after cleaning) are skipped.
MIN_WIKI_CHARS = 500
#: Bump when the cleaning changes so cached parses are rebuilt.
_WIKI_PARSER_VERSION = 5
#: Sections from which the rest of an article is dropped (reference apparatus, link lists).
_TAIL_SECTIONS = (
    "see also",
    "references",
    "notes",
    "footnotes",
    "citations",
    "sources",
    "bibliography",
    "further reading",
    "external links",
    "notes and references",
    "references and notes",
)
_DROP_LINK_NAMESPACES = frozenset({"file", "image", "media", "category"})


class TextError(ValueError):
    """Text input is unusable (missing, empty, unreadable or too short); the message is one line."""


@dataclass(frozen=True)
class Document:
    """One document of plain text.

    Attributes:
        id: Stable unique id: ``wiki:<page id>``, ``news:<line number>`` or ``file:<file name>``.
        title: Human-readable title.
        text: The plain text.
        sha256: Hex sha256 of ``text`` encoded as UTF-8.
    """

    id: str
    title: str
    text: str
    sha256: str

    @classmethod
    def make(cls, id: str, title: str, text: str) -> Document:
        """Build a document, computing ``sha256`` from ``text``."""
        return cls(id=id, title=title, text=text, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())


# ----------------------------------------------------------------------------------------------
# Wikipedia
# ----------------------------------------------------------------------------------------------


def _remove_balanced(text: str, opener: str, closer: str, start_re: re.Pattern[str] | None = None) -> str:
    """Remove every balanced ``opener ... closer`` span (nesting allowed).

    Args:
        text: Input text.
        opener: Opening marker, e.g. ``"{{"``.
        closer: Closing marker, e.g. ``"}}"``.
        start_re: If given, only spans whose start matches this pattern (which must begin with
            ``opener``) are removed; nested spans inside them go too.

    Returns:
        The text without those spans. An opener that is never closed is dropped on its own and the text
        after it is kept.
    """
    out: list[str] = []
    pos = 0
    n = len(text)
    while pos < n:
        if start_re is None:
            start = text.find(opener, pos)
        else:
            match = start_re.search(text, pos)
            start = match.start() if match else -1
        if start < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        depth = 0
        i = start
        end = -1
        while i < n:
            if text.startswith(opener, i):
                depth += 1
                i += len(opener)
            elif text.startswith(closer, i):
                depth -= 1
                i += len(closer)
                if depth == 0:
                    end = i
                    break
            else:
                i += 1
        if end < 0:  # unclosed: drop just the opener
            pos = start + len(opener)
        else:
            pos = end
    return "".join(out)


_COMMENT_RE = re.compile(r"<!--.*?(?:-->|$)", re.DOTALL)
_REF_SELF_RE = re.compile(r"<ref\b[^>]*/\s*>", re.IGNORECASE)
_REF_PAIR_RE = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_REF_STRAY_RE = re.compile(r"</?ref\b[^>]*>|<references\b[^>]*/?>|</references\s*>", re.IGNORECASE)
_TAIL_RE = re.compile(
    r"^==\s*(?:" + "|".join(re.escape(s) for s in _TAIL_SECTIONS) + r")\s*==\s*$",
    re.IGNORECASE | re.MULTILINE,
)
_DROP_LINE_RE = re.compile(r"^\s*(?:\{\||\|\}|\||!|(?:category|file|image|media)\s*:|thumb\|)", re.IGNORECASE)
_INTERWIKI_RE = re.compile(r"^[a-z]{2,3}(?:-[a-z0-9]{2,8})*:", re.IGNORECASE)
_MEDIA_LINK_RE = re.compile(r"\[\[\s*(?:file|image|media|category)\s*:", re.IGNORECASE)
_INLINE_TEMPLATE_RE = re.compile(r"\{\{\s*([A-Za-z][\w -]*?)\s*\|([^{}]*)\}\}")
_KEEP_LAST_TEMPLATES = frozenset(
    {"nowrap", "nobr", "transl", "small", "smaller", "em", "sic", "not a typo", "lang"}
)
_LEFTOVER_LINK_RE = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]|]*)\]\]")
_QUOTES_RE = re.compile(r"'{2,}")
_PARAM_SPLIT_RE = re.compile(r"\|(?![^\[]*\]\])")  # a "|" that is not inside [[...|...]]
_MAGIC_WORD_RE = re.compile(r"__[A-Z]+__")
#: Punctuation left behind by removed templates, e.g. "Aristotle (; Greek ...)" or "Albedo () or".
_TIDY_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\(\s*(?:[;,]\s*)+"), "("),
    (re.compile(r"\s*[;,]\s*\)"), ")"),
    (re.compile(r" ?\(\s*\)"), ""),
    (re.compile(r"\(\s+"), "("),
    (re.compile(r"\s+,"), ","),
)
_SPACES_RE = re.compile(r"[ \t\u00a0]+")
_BLANKS_RE = re.compile(r"\n{3,}")


def _inline_template(match: re.Match[str]) -> str:
    """Render a few common inline templates as their text (``lang``, ``nowrap``, ``convert``, ...)."""
    name = match.group(1).strip().lower()
    positional = [p.strip() for p in _PARAM_SPLIT_RE.split(match.group(2)) if "=" not in p]
    if name == "convert" and len(positional) >= 2:
        return f"{positional[0]} {positional[1]}"
    if (name in _KEEP_LAST_TEMPLATES or name.startswith("lang-")) and positional:
        return positional[-1]
    return match.group(0)


def clean_wikitext(wikitext: str) -> str:
    """Turn one article's wikitext into plain prose.

    Drops comments, ``<ref>`` citations, templates ``{{...}}``, tables ``{|...|}``, File/Image/Category
    and interlanguage links, the trailing reference/link sections (See also, References, External
    links, ...), and table or category leftovers line by line; the rest is rendered with
    ``mwparserfromhell``'s ``strip_code`` (link text kept, headings kept as their own lines).
    Whitespace runs are collapsed and blank lines reduced to one.

    Args:
        wikitext: Raw MediaWiki markup of one page.

    Returns:
        Plain text (may be empty).
    """
    import mwparserfromhell

    text = _MAGIC_WORD_RE.sub("", _COMMENT_RE.sub("", wikitext))
    tail = _TAIL_RE.search(text)
    if tail is not None:
        text = text[: tail.start()]
    text = _REF_SELF_RE.sub("", text)
    text = _REF_PAIR_RE.sub("", text)
    text = _REF_STRAY_RE.sub("", text)
    text = _INLINE_TEMPLATE_RE.sub(_inline_template, text)
    text = _remove_balanced(text, "{{", "}}")
    text = _remove_balanced(text, "[[", "]]", start_re=_MEDIA_LINK_RE)
    text = _remove_balanced(text, "{|", "|}")

    code = mwparserfromhell.parse(text)
    for link in code.filter_wikilinks(recursive=True):
        title = str(link.title).strip()
        namespace = title.split(":", 1)[0].strip().lower() if ":" in title else ""
        drop = (namespace in _DROP_LINK_NAMESPACES and not title.startswith(":")) or (
            link.text is None and _INTERWIKI_RE.match(title) is not None and namespace not in {"wikt"}
        )
        if drop:
            try:
                code.remove(link)
            except ValueError:  # already gone with an enclosing link
                pass
    plain = code.strip_code(normalize=True, collapse=True)
    plain = _REF_STRAY_RE.sub("", plain)
    plain = _LEFTOVER_LINK_RE.sub(r"\1", plain)  # links the parser gave up on
    plain = _QUOTES_RE.sub("", plain.replace("'''s", "'s"))  # unbalanced bold/italic

    lines = []
    for line in plain.splitlines():
        line = _SPACES_RE.sub(" ", line).strip()
        if line.startswith("' "):  # leftover of an emptied ''{{template}}''
            line = line[2:]
        for pattern, replacement in _TIDY_RULES:
            line = pattern.sub(replacement, line)
        if _DROP_LINE_RE.match(line):
            continue
        lines.append(line)
    return _BLANKS_RE.sub("\n\n", "\n".join(lines)).strip()


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _child_text(elem: ET.Element, name: str) -> str | None:
    for child in elem:
        if _local(child.tag) == name:
            return child.text
    return None


def _child(elem: ET.Element, name: str) -> ET.Element | None:
    for child in elem:
        if _local(child.tag) == name:
            return child
    return None


def _iter_wiki_pages(path: Path) -> Iterable[tuple[str, str, str]]:
    """Yield ``(page id, title, wikitext)`` for namespace-0, non-redirect pages of a bz2 XML export."""
    with bz2.open(path, "rb") as fh:
        for _event, elem in ET.iterparse(fh, events=("end",)):
            if _local(elem.tag) != "page":
                continue
            ns = (_child_text(elem, "ns") or "").strip()
            redirect = _child(elem, "redirect")
            revision = _child(elem, "revision")
            body = _child_text(revision, "text") if revision is not None else None
            if ns == "0" and redirect is None and body and not body.lstrip().lower().startswith("#redirect"):
                page_id = (_child_text(elem, "id") or "").strip()
                title = (_child_text(elem, "title") or "").strip()
                yield page_id, title, body
            elem.clear()


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
        mla_convert.assets.AssetError: The source cannot be obtained.
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
        for page_id, title, body in _iter_wiki_pages(source):
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
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return [Document.make(str(d["id"]), str(d["title"]), str(d["text"])) for d in raw["documents"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cached_documents(path: Path, docs: Sequence[Document]) -> None:
    """Best-effort atomic JSON cache write (a failure only means the next call parses again)."""
    payload = {"documents": [{"id": d.id, "title": d.title, "text": d.text} for d in docs]}
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return
    for stale in path.parent.glob("wikipedia-*-v*.json"):  # older parser versions or sources
        if stale != path:
            try:
                stale.unlink()
            except OSError:
                pass


# ----------------------------------------------------------------------------------------------
# News and local files
# ----------------------------------------------------------------------------------------------


def news_documents() -> list[Document]:
    """Return the Lee background news corpus, one document per non-empty line.

    Returns:
        300 documents with ids ``news:<line number>`` (1-based), about 360 KB of text.

    Raises:
        mla_convert.assets.AssetError: The source cannot be obtained.
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


def local_documents(paths: Sequence[Path]) -> list[Document]:
    """Read local text files, one document per file.

    Args:
        paths: Files and/or folders. A folder contributes every ``*.txt`` directly inside it, sorted by
            name; a file given explicitly is read whatever its suffix. Files must be UTF-8.

    Returns:
        Documents in the given order, ids ``file:<file name>``, titles the file stems.

    Raises:
        TextError: No path given, a path does not exist, a folder has no ``*.txt``, a file is
            unreadable, not UTF-8 or empty (whitespace only), or two files share a name.
    """
    if isinstance(paths, (str, Path)):
        paths = [Path(paths)]
    if not paths:
        raise TextError("no text files given; pass .txt files or folders containing them")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.glob("*.txt") if p.is_file())
            if not found:
                raise TextError(f"{path}: folder has no *.txt files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise TextError(f"{path}: no such file or folder")
    docs: list[Document] = []
    seen: dict[str, Path] = {}
    for path in files:
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


def load_documents(spec: str | Path | Sequence[Path]) -> list[Document]:
    """Load documents by source name or from local paths.

    Args:
        spec: ``"wikipedia"``, ``"news"``, a single path (str or Path) or a sequence of paths.

    Returns:
        The documents.

    Raises:
        TextError: See :func:`local_documents`; also an unknown name that is not an existing path.
        mla_convert.assets.AssetError: A bundled source cannot be obtained.
    """
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name == "wikipedia":
            return wikipedia_documents()
        if name == "news":
            return news_documents()
        path = Path(spec).expanduser()
        if not path.exists():
            raise TextError(f"unknown text source {spec!r}; use 'wikipedia', 'news' or paths to .txt files")
        return local_documents([path])
    if isinstance(spec, Path):
        return local_documents([spec])
    return local_documents([Path(p) for p in spec])


# ----------------------------------------------------------------------------------------------
# Splits, windows, records
# ----------------------------------------------------------------------------------------------


def _id_key(doc: Document) -> tuple[str, str]:
    return hashlib.sha256(doc.id.encode("utf-8")).hexdigest(), doc.id


def split_documents(
    docs: Sequence[Document], fractions: Mapping[str, float] = DEFAULT_FRACTIONS
) -> dict[str, list[Document]]:
    """Split documents between roles, disjointly and deterministically, by characters.

    Documents are ordered by ``sha256(doc.id)`` and dealt out in that order to the roles in the order
    given (``evaluation`` first by default): a role keeps taking the next document while the midpoint of
    that document stays within the role's cumulative share of the total characters, and the last role
    takes the rest. Each role with a positive fraction gets at least one document. The result depends
    only on the ids, lengths and fractions, not on the input order.

    Args:
        docs: Documents with unique ids.
        fractions: Role name -> fraction of total characters; each >= 0, summing to 1.

    Returns:
        Role -> documents (in sha256(id) order), with the roles of ``fractions`` in the same order.
        Every document is in exactly one role.

    Raises:
        TextError: Bad fractions, duplicate ids, or fewer documents than roles with positive fraction.
    """
    roles = list(fractions)
    if not roles:
        raise TextError("no split roles given")
    values = [float(fractions[r]) for r in roles]
    if any(not v >= 0.0 for v in values) or abs(sum(values) - 1.0) > 1e-6:
        raise TextError(f"split fractions must be >= 0 and sum to 1, got {dict(fractions)}")
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise TextError(f"duplicate document ids {dup[:3]}; each document must have a unique id")
    positive = [r for r, v in zip(roles, values, strict=True) if v > 0]
    if len(docs) < len(positive):
        raise TextError(
            f"only {len(docs)} documents for {len(positive)} split roles {positive}; use more documents"
        )

    ordered = sorted(docs, key=_id_key)
    total = sum(len(d.text) for d in ordered)
    out: dict[str, list[Document]] = {r: [] for r in roles}
    pos = 0
    consumed = 0  # characters assigned so far
    boundary = 0.0  # cumulative character target up to the current role
    for k, (role, frac) in enumerate(zip(roles, values, strict=True)):
        boundary += frac * total
        if k == len(roles) - 1:
            out[role] = ordered[pos:]
            break
        if frac <= 0:
            continue
        later_positive = sum(1 for v in values[k + 1 :] if v > 0)
        while pos < len(ordered) and len(ordered) - pos > later_positive:
            size = len(ordered[pos].text)
            if out[role] and consumed + size / 2 > boundary:
                break
            out[role].append(ordered[pos])
            consumed += size
            pos += 1
    return out


def token_windows(
    tokenizer: Any,
    docs: Sequence[Document],
    window: int,
    max_windows: int | None,
    bos: bool = True,
) -> torch.Tensor:
    """Tokenize documents into non-overlapping fixed-length windows.

    Documents are tokenized without special tokens and concatenated, separated by the tokenizer's
    ``eos_token_id``; the stream is cut into consecutive chunks and the remainder is dropped. With
    ``bos`` (and a tokenizer that has ``bos_token_id``) each window is ``[bos] + window - 1`` stream
    tokens, so every row is a standalone sequence; otherwise each window is ``window`` stream tokens.
    Tokenization stops early once ``max_windows`` windows are covered.

    Args:
        tokenizer: A Hugging Face (fast) tokenizer; called as ``tokenizer(texts, add_special_tokens=False)``.
        docs: Documents, in the order to use.
        window: Tokens per window (>= 1, >= 2 with a BOS).
        max_windows: Keep at most this many windows (the first ones); None keeps all.
        bos: Start every window with the BOS token.

    Returns:
        ``torch.long`` tensor of shape ``[N, window]``, ``1 <= N <= max_windows``.

    Raises:
        TextError: No documents, or too little text for one window.
        ValueError: ``window`` or ``max_windows`` out of range, or the tokenizer has no EOS token.
    """
    import torch

    bos_id = getattr(tokenizer, "bos_token_id", None) if bos else None
    prefix = [int(bos_id)] if bos_id is not None else []
    body = window - len(prefix)
    if body < 1:
        raise ValueError(f"window must be >= {len(prefix) + 1}, got {window}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token_id to separate documents")
    if not docs:
        raise TextError("no documents to tokenize; use more text")

    needed = None if max_windows is None else max_windows * body
    stream: list[int] = []
    batch = 16
    for start in range(0, len(docs), batch):
        chunk = docs[start : start + batch]
        encoded = tokenizer([d.text for d in chunk], add_special_tokens=False)["input_ids"]
        for ids in encoded:
            if stream:
                stream.append(int(eos_id))
            stream.extend(int(t) for t in ids)
        if needed is not None and len(stream) >= needed:
            break

    count = len(stream) // body
    if count < 1:
        raise TextError(
            f"text ({len(docs)} documents) has only {len(stream)} tokens; need at least {body} for one "
            f"{window}-token window (use more text or a shorter --window)"
        )
    if max_windows is not None:
        count = min(count, max_windows)
    rows = torch.tensor(stream[: count * body], dtype=torch.long).view(count, body)
    if prefix:
        rows = torch.cat([torch.full((count, 1), prefix[0], dtype=torch.long), rows], dim=1)
    return rows


def documents_record(docs: Sequence[Document]) -> list[dict[str, Any]]:
    """Describe documents for a manifest.

    Args:
        docs: Documents.

    Returns:
        ``[{"id": str, "sha256": str, "chars": int}, ...]`` in the given order.
    """
    return [{"id": d.id, "sha256": d.sha256, "chars": len(d.text)} for d in docs]
