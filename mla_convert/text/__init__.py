"""Real text for calibration, adaptation and evaluation.

* :mod:`mla_convert.text.corpora`: documents from the bundled Wikipedia/news corpora or local ``.txt``
  files, and the one reader of a ``--text`` spec (:func:`~mla_convert.text.corpora.parse_text_spec`).
* :mod:`mla_convert.text.wikitext`: MediaWiki XML export pages and wikitext -> plain prose.
* :mod:`mla_convert.text.windows`: disjoint by-document role splits, token windows, manifest records.
"""
