"""What a recipe may say: the :class:`Recipe` model, its sections, and the error that lists every problem.

A recipe is a :class:`Recipe` (pydantic, unknown keys refused at every level): ``factor`` takes every
:class:`~mla_convert.convert.options.options.ConvertOptions` key, ``adapt`` every
:class:`~mla_convert.adapt.options.AdaptOptions` key (``adapt: null`` skips the stage), ``validate`` the
ladder's :class:`~mla_convert.validate.options.LadderSettings` plus ``enabled``, ``export`` (optional)
:class:`ExportSettings`. Light on purpose (pydantic
only, no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mla_convert.adapt.options import AdaptOptions
from mla_convert.convert.options.fields import retired_fields
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.errors import UserError
from mla_convert.validate.options import LadderSettings

#: The float types an export writes itself (``deepseek-v3``: float16 is refused there, it cannot hold the latent norm).
EXPORT_FLOATS = ("auto", "float32", "bfloat16", "float16")
#: The quantized weight types of ``format: gguf``, through llama.cpp's own quantizer (the keys of
#: :data:`mla_convert.engines.llamacpp.gguf_file.GGUF_QUANTS`; a test keeps the two equal).
GGUF_QUANT_TYPES = (
    "q8_0",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q2_k",
    "q3_k_s",
    "q3_k_m",
    "q3_k_l",
    "q4_k_s",
    "q4_k_m",
    "q5_k_s",
    "q5_k_m",
    "q6_k",
)
ExportDtype = Literal[
    "auto", "float32", "bfloat16", "float16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m",
    "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
]

#: The resolved recipe (every default filled in) that ``run`` writes under the recipe's output folder.
RESOLVED_NAME = "recipe.resolved.yaml"


class RecipeError(UserError):
    """A recipe that cannot run. ``problems`` holds one line per problem (``path: message``)."""

    def __init__(self, file: str, problems: list[str]) -> None:
        self.file = file
        self.problems = problems
        super().__init__(self.lines()[0] if len(problems) == 1 else "\n".join(self.lines()))

    def lines(self) -> list[str]:
        """The report: one line for one problem; a count then one indented line each for several."""
        if len(self.problems) == 1:
            return [f"{self.file}: {self.problems[0]}"]
        return [f"{self.file} has {len(self.problems)} problems:"] + [
            f"  {self.file}: {p}" for p in self.problems
        ]


class ValidateSettings(LadderSettings):
    """The final ``validate`` stage: the ladder's settings, and whether it runs at all. The recipe supplies
    the source and the text (the conversion's evaluation windows) itself."""

    enabled: bool = Field(True, description="run the validation ladder at the end")

    def ladder(self) -> dict[str, Any]:
        """The ladder's keyword settings (everything but ``enabled``)."""
        return self.model_dump(exclude={"enabled"})


class ExportSettings(BaseModel):
    """The optional last stage: ``mla-convert export`` of the last checkpoint into ``<output>/export``."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["deepseek-v3", "gguf"] = Field(
        "deepseek-v3", description="target format (docs/export.md): deepseek-v3 (a folder) | gguf (export/model.gguf, "
        "llama.cpp deepseek2)"
    )
    dtype: ExportDtype = Field(
        "auto", description="written dtype (auto: the checkpoint's). deepseek-v3: auto | float32 | bfloat16 (float16 is "
        "refused: it cannot hold the latent norm); gguf: also float16 and llama.cpp's quantized types (q8_0, q4_k_m, "
        "q5_k_m, q6_k, ...) through llama.cpp's own quantizer"
    )
    target: Literal["transformers", "vllm", "vllm-cpu", "llama.cpp"] = Field(
        "transformers", description="engine shape: transformers | vllm (GPU, 512 + 64) | vllm-cpu (512 + 64, 128/128) | "
        "llama.cpp (the factor cache size is llama.cpp's served row: one rank and the fastest rope pairs; with format "
        "gguf)"
    )

    @field_validator("dtype")
    @classmethod
    def _gguf_types_need_gguf(cls, dtype: str, info: ValidationInfo) -> str:
        """A quantized weight type exists only in a GGUF (``format`` is validated first).

        Raises:
            ValueError: ``dtype`` one of :data:`GGUF_QUANT_TYPES` with ``format: deepseek-v3``.
        """
        if info.data.get("format", "gguf") != "gguf" and dtype in GGUF_QUANT_TYPES:
            raise ValueError(
                "a llama.cpp weight type: use format gguf, or dtype auto / float32 / "
                "bfloat16 for a DeepSeek-V3 folder"
            )
        return dtype


class Recipe(BaseModel):
    """One job: source -> factor -> (adapt) -> validate -> (export), written under ``output``."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, description="a short name for the job")
    description: str = ""
    source: str = Field(..., min_length=1, description="HF folder, .gguf file or 'smollm2-135m'")
    output: str = Field(..., min_length=1, description="root output folder of the stages")
    factor: ConvertOptions = Field(default_factory=ConvertOptions)  # type: ignore[arg-type]
    adapt: AdaptOptions | None = None
    validation: ValidateSettings = Field(default_factory=ValidateSettings, alias="validate")  # type: ignore[arg-type]
    export: ExportSettings | None = None

    @property
    def out(self) -> Path:
        """The output folder, ``~`` expanded."""
        return Path(self.output).expanduser()

    def dump(self) -> dict[str, Any]:
        """Plain JSON-compatible dict with the YAML key names (without the ``factor`` keys a recipe may no longer
        say, so that the resolved recipe runs again; the manifest records every option)."""
        return self.model_dump(mode="json", by_alias=True, exclude={"factor": set(retired_fields())})


#: Section path -> model that validates it (for "unknown key" suggestions).
SECTIONS: dict[tuple[str, ...], type[BaseModel]] = {
    (): Recipe,
    ("factor",): ConvertOptions,
    ("adapt",): AdaptOptions,
    ("validate",): ValidateSettings,
    ("export",): ExportSettings,
}


def allowed_keys(model: type[BaseModel]) -> list[str]:
    """The YAML keys a section accepts (aliases where a field has one)."""
    return [f.alias or name for name, f in model.model_fields.items()]
