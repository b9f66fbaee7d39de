"""Moved to :mod:`mla_convert.convert.precheck` (the conversion reads it, and convert sits below export).

TODO(convert rewrite): ``convert/resolve.py`` still imports ``scaled_rope_problem`` and ``steer_for_export`` from
here; once it imports them from :mod:`mla_convert.convert.precheck`, this module goes.
"""

from __future__ import annotations

from mla_convert.convert.precheck import scaled_rope_problem, steer_for_export

__all__ = ["scaled_rope_problem", "steer_for_export"]
