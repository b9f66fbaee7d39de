"""MediaWiki sources -> plain text: pages of an XML export, and their wikitext cleaned into prose.

:func:`iter_pages` reads the article pages of a bz2 MediaWiki XML export; :func:`clean_wikitext`
strips one page's markup (templates, tables, citations, media and category links, reference
sections) and renders the rest with ``mwparserfromhell``.
"""

from __future__ import annotations

import bz2
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

__all__ = ["clean_wikitext", "iter_pages"]

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
    """Tag name without its ``{namespace}``."""
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


def iter_pages(path: Path) -> Iterator[tuple[str, str, str]]:
    """Yield ``(page id, title, wikitext)`` for the namespace-0, non-redirect pages of a bz2 XML export.

    Args:
        path: A ``.xml.bz2`` MediaWiki export.

    Raises:
        xml.etree.ElementTree.ParseError, OSError, EOFError: The file is not a readable bz2 XML export.
    """
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
