"""The one base class of every error that is the user's to fix (bad input, not a bug).

Each stage raises its own subclass (``SourceError``, ``TextError``, ``OptionsError``, ``RopeError``,
``FactorError``, ``OutputError``, ``ManifestError``, ``ValidationError``, ``AdaptError``, ``RecipeError``,
``CacheError``, ``CheckpointError``, ``AssetError``, ``KernelUnavailable``) with a one-line message that says
what is wrong, where, and how to fix it. The CLI prints any :class:`UserError` as ``error: ...`` and exits 2;
this module imports nothing, so catching it costs nothing at start-up. docs/design.md, "A thin CLI".
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input or an environment the user must change; ``str(exc)`` is the one-line message."""


class ExportError(UserError):
    """(:mod:`mla_convert.engines.deepseek_v3`, here so that the model layer can read an export back) A checkpoint the DeepSeek-V3 format cannot express exactly, or a folder that is not an MLA checkpoint."""
