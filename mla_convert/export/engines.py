"""Moved to :mod:`mla_convert.convert.precheck` (:func:`~mla_convert.convert.precheck.engine_table`: the model
card's table, which the conversion writes, and convert sits below export).

TODO(convert rewrite): ``convert/job.py`` still imports ``engine_table`` from here; once it imports it from
:mod:`mla_convert.convert.precheck`, this module goes.
"""

from __future__ import annotations

from mla_convert.convert.precheck import engine_table

__all__ = ["engine_table"]
