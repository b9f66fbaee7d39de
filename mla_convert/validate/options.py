"""The settings of the validation ladder, written once: ``validate()``, the CLI and recipes all read them here.

Light on purpose (pydantic only): the CLI generates ``mla-convert validate``'s flags from
:class:`ValidateOptions` at start-up (``@options_from``), and a recipe's ``validate:`` section is
:class:`LadderSettings` plus ``enabled`` (the recipe supplies the source and the text itself).
The field descriptions are the CLI's help texts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Backend = Literal["triton", "absorbed"]


class LadderSettings(BaseModel):
    """How the rungs run: prefill and decode lengths, cache page size, decode backend (unknown keys refused)."""

    model_config = ConfigDict(extra="forbid")
    prompt_tokens: int = Field(61, ge=2, description="prefill tokens of rungs 2-3")
    new_tokens: int = Field(16, ge=2, description="decode steps of rung 3")
    page_size: int = Field(16, ge=1, le=128, description="paged-cache page size, 1..128")
    backend: Backend = Field("triton", description="decode backend of rung 3: triton | absorbed")
    matrix_max_history: int = Field(
        4096,
        ge=1,
        description="longest history of rung 6's kernel matrix (cells 1, 127, 128, 129, 4096 rows up to it)",
    )


class LadderInputs(BaseModel):
    """What the ladder compares against and reads; ``None`` takes the checkpoint's own record."""

    model_config = ConfigDict(extra="forbid")
    source: str | None = Field(None, description="source model; default: the one recorded in the checkpoint")
    text: str | None = Field(None, description="held-out text (evaluation split); default: the conversion's")
    window: int | None = Field(
        None, ge=2, description="tokens per evaluation window; default: the conversion's"
    )
    windows: int | None = Field(
        None, ge=2, description="evaluation windows for rung 4; default: the conversion's"
    )


class ValidateOptions(LadderSettings, LadderInputs):
    """Every setting of one ``mla-convert validate`` run (fields in CLI order: inputs, then the ladder's).

    ``validate()`` fills the ``None`` inputs from the checkpoint (its recorded source, the conversion's
    text, window and window count) and records the filled-in copy in ``validation.json``'s ``settings``.
    """
