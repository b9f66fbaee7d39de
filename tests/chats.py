"""Chat data for the tests, built from real text (the bundled news corpus)."""

from __future__ import annotations


def news_chats(n: int = 40) -> list[list[dict[str, str]]]:
    """Conversations from real news articles: the user asks for a summary of an article's opening, the
    assistant answers with the article's first sentence."""
    from mla_convert.text.corpora import news_documents

    out = []
    for d in news_documents()[:n]:
        first = d.text.split(". ")[0].strip() + "."
        out.append([
            {"role": "user", "content": "Summarize in one sentence:\n\n" + d.text[:300]},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Thanks. And in three words?"},
            {"role": "assistant", "content": " ".join(first.split()[:3])},
        ])  # fmt: skip
    return out
