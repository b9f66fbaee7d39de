"""The defaults of the command-line flags outside the option models, shared by every command that has them and by
the rendering (below both, so neither imports the other)."""

from __future__ import annotations

#: The defaults of the flags outside the option models, shared by every command that has them (the option models'
#: fields hold the others; ``--target``'s engine shape and the options not given are resolved at run time by
#: :func:`mla_convert.convert.options.resolve.resolve_options`). The library's own shard default is
#: :data:`mla_convert.artifacts.shards.DEFAULT_MAX_SHARD_SIZE` (a test keeps the two equal; that module imports torch).
TARGET_DEFAULT = "transformers"
SHARD_SIZE_DEFAULT = "2GB"
