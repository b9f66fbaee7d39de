"""``mla-convert validate``: the numerical ladder every converted checkpoint must pass.

:func:`validate` opens the checkpoint, its source and the held-out text, then runs the seven rungs of
:mod:`.rungs` (what each compares and its tolerances: :mod:`.spec`; why, and the faults each catches:
docs/validation.md). Every number is measured on named real data; nothing is written here
(:func:`~mla_convert.validate.report.write_validation` writes ``validation.json`` and ``validation.md``).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mla_convert.mla.checkpoint import checkpoint_dtype, load_checkpoint, read_checkpoint_config
from mla_convert.validate import decode_rung, rungs
from mla_convert.validate.options import ValidateOptions
from mla_convert.validate.report import validation_markdown, write_validation
from mla_convert.validate.result import Check, Rung, ValidationError, ValidationResult, format_value
from mla_convert.validate.spec import tolerances_for

if TYPE_CHECKING:
    from mla_convert.mla.modeling import MLAForCausalLM
    from mla_convert.sources.checkpoint import SourceModel

#: The bundled demo source, which opens without a local path.
BUNDLED_SOURCE = "smollm2-135m"
#: Tokens of rung 1's pass and of rung 5's source-cache probe (the first tokens of window 0).
PROBE_TOKENS = 128


def conversion_options(ckpt: Path) -> dict[str, Any]:
    """The ``options`` the conversion recorded in ``ckpt/report.json`` (empty when there is none)."""
    report = _report(ckpt)
    return dict(report.get("options", {}))


def recorded_figures(ckpt: Path, text: str, window: int, windows: int) -> dict[str, float] | None:
    """The conversion-time ``perplexity`` and ``kl`` when ``text``/``window``/``windows`` are the conversion's,
    else None."""
    report = _report(ckpt)
    opts = report.get("options", {})
    ev = report.get("model", {}).get("eval", {})
    if (opts.get("text"), opts.get("window"), opts.get("eval_windows")) != (text, window, windows):
        return None
    if not ev or ev.get("kl") is None:
        return None
    return {"perplexity": float(ev["perplexity"]), "kl": float(ev["kl"])}


def _report(ckpt: Path) -> dict[str, Any]:
    try:
        report = json.loads((ckpt / "report.json").read_text())
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def resolve_options(ckpt: Path, config: dict[str, Any], options: ValidateOptions) -> ValidateOptions:
    """``options`` with the ``None`` inputs filled from the checkpoint: the source recorded in its config,
    the conversion's text, window length and window count (``wikipedia``, 512, 8 when unrecorded).

    Raises:
        ValidationError: a recorded window length or count below 2.
    """
    opts = conversion_options(ckpt)
    filled = options.model_copy(
        update={
            "source": options.source or config.get("source", {}).get("origin"),
            "text": options.text if options.text is not None else opts.get("text", "wikipedia"),
            "window": options.window if options.window is not None else int(opts.get("window", 512)),
            "windows": options.windows if options.windows is not None else int(opts.get("eval_windows", 8)),
        }
    )
    assert filled.window is not None and filled.windows is not None
    if filled.window < 2 or filled.windows < 2:
        raise ValidationError(
            f"--window {filled.window} / --windows {filled.windows}: need at least 2 of each "
            f"({ckpt / 'report.json'} records fewer; pass --window and --windows)"
        )
    return filled


def open_ladder_source(asked: str | None, recorded: str | None) -> SourceModel | None:
    """The source to compare with: ``asked`` (``--source``) must open; the ``recorded`` one is used when it
    is the bundled model or a path that exists, else the ladder runs without a source (rung 4 partial).

    Raises:
        SourceError: ``asked`` does not open.
    """
    from mla_convert.sources.checkpoint import open_source

    if asked is not None:
        return open_source(asked)
    if recorded and (recorded == BUNDLED_SOURCE or Path(recorded).exists()):
        return open_source(recorded)
    return None


def evaluation_ids(ckpt: Path, options: ValidateOptions) -> torch.Tensor:
    """``[N, T]`` token windows of the evaluation split of ``options.text`` (tokenizer of ``ckpt``).

    Raises:
        ValidationError: fewer than 2 windows, or windows shorter than ``prompt_tokens + new_tokens``.
        TextError: text that cannot be read.
    """
    from transformers import AutoTokenizer

    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    assert options.text is not None and options.window is not None and options.windows is not None
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    docs = split_documents(load_documents(options.text))["evaluation"]
    ids = token_windows(tok, docs, options.window, options.windows, bos=adds_bos(tok))
    need = options.prompt_tokens + options.new_tokens
    if ids.shape[0] < 2 or ids.shape[1] < need:
        raise ValidationError(
            f"the {options.text} evaluation split gives {ids.shape[0]} window(s) of {ids.shape[1]} tokens; "
            f"need 2 windows of >= {need} (use more text or fewer --prompt-tokens)"
        )
    return ids


def matrix_ids(ckpt: Path, options: ValidateOptions) -> torch.Tensor:
    """``[1, T]`` the first ``T = matrix_max_history`` tokens of the evaluation split as one stream (fewer when
    the split is shorter: rung 6 then records the histories it could not measure).

    Raises:
        TextError: text that cannot be read.
    """
    from transformers import AutoTokenizer

    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import split_documents, token_windows

    assert options.text is not None
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    docs = split_documents(load_documents(options.text))["evaluation"]
    stream = token_windows(tok, docs, 1, options.matrix_max_history, bos=False)  # [T, 1] one token per row
    return stream.reshape(1, -1)


@dataclass
class _Ladder:
    """What every rung reads: the loaded model (float32), the dtype its weights are stored in, the source (or
    None), the evaluation windows, the settings."""

    ckpt: Path
    model: MLAForCausalLM
    src: SourceModel | None
    source_model: Any
    ids: torch.Tensor
    options: ValidateOptions
    say: Callable[[str], None]
    dtype: str = "float32"

    @property
    def data(self) -> str:
        return f"{self.options.text} evaluation split"

    def run(self) -> list[Rung]:
        """Rungs 1-7 in order (rung 5 measures rung 3's cache; rung 7 casts the model and the source to bfloat16, so
        it runs last)."""
        self.say("rung 1: naive vs absorbed")
        probe = self.ids[:1, :PROBE_TOKENS]
        one = rungs.rung_paths(self.model, probe, f"{self.data}, window 0, first {probe.shape[1]} tokens")
        self.say("rung 2: kernel vs reference")
        two = self.rung_kernel()
        self.say("rung 3: decode vs recompute")
        three, cache = self.rung_decode()
        self.say("rung 4: converted vs source")
        four = self.rung_source()
        self.say("rung 5: cache ledger")
        five = rungs.rung_ledger(self.model, cache, self.source_model, probe)
        self.say("rung 6: kernel matrix")
        six = self.rung_matrix()
        self.say("rung 7: bfloat16 vs source")
        seven = self.rung_precision()
        return [one, two, three, four, five, six, seven]

    def rung_precision(self) -> Rung:
        from transformers import AutoTokenizer

        from mla_convert.validate.precision_rung import rung_precision

        tok = AutoTokenizer.from_pretrained(str(self.ckpt))
        source = self.source_model if self.src is not None else None
        return rung_precision(self.model, source, tok, self.ids, self.data)

    def rung_matrix(self) -> Rung:
        """Layer 0 over the first ``matrix_max_history`` tokens of the evaluation split as one request."""
        from mla_convert.validate.matrix import rung_matrix

        o = self.options
        ids = matrix_ids(self.ckpt, o)
        data = (
            f"{self.data}, first {ids.shape[1]} tokens as one request (documents joined by EOS), layer 0, "
            f"page size {o.page_size}, shuffled pages"
        )
        return rung_matrix(self.model, ids, o.page_size, data, o.matrix_max_history)

    def rung_kernel(self) -> Rung:
        """Two requests: the prompt of rung 3 (window 0) and a shorter one (window 1)."""
        long, short = self.options.prompt_tokens, max(2, self.options.prompt_tokens // 2 + 3)
        prompts = [self.ids[:1, :long], self.ids[1:2, :short]]
        data = (
            f"{self.data}, two requests: prompts of {long} tokens (window 0) and {short} tokens (window 1); "
            f"the first {long - 1} and {short - 1} tokens prefilled into one paged cache with shuffled pages, "
            "the query of each prompt's last token attending over its cached rows"
        )
        return rungs.rung_kernel(self.model, prompts, self.options.page_size, data, self.dtype)

    def rung_decode(self) -> tuple[Rung, Any]:
        o = self.options
        pair_freq = rungs.source_pair_frequencies(self.model.config, self.src.inv_freq if self.src else None)
        freq_source = (
            "source RoPE table at the recorded pair indices" if self.src else "recorded config frequencies"
        )
        data = (
            f"{self.data}, window 0: {o.prompt_tokens}-token prompt prefilled, then {o.new_tokens} greedy "
            f"tokens ({o.new_tokens - 1} one-token decode steps through the cache), page size {o.page_size}, "
            "shuffled pages"
        )
        prompt = self.ids[:1, : o.prompt_tokens]
        return decode_rung.rung_decode(
            self.model, prompt, o.new_tokens, o.backend, o.page_size, pair_freq, freq_source, data, self.dtype
        )

    def rung_source(self) -> Rung:
        o = self.options
        if self.src is None or self.source_model is None:
            return rungs.rung_scale_only(self.model, f"{self.data} (source {o.source!r} not available)")
        assert o.text is not None and o.window is not None and o.windows is not None
        recorded = recorded_figures(self.ckpt, o.text, o.window, o.windows)
        n, t = self.ids.shape
        data = f"{self.data}: {n} x {t} tokens"
        return rungs.rung_source(
            self.model, self.source_model, self.src.softmax_scale, self.ids, recorded, data
        )


def environment() -> dict[str, Any]:
    """Where the ladder ran: kernel backend, library versions, machine, GPU, ``TRITON_INTERPRET``."""
    import triton

    from mla_convert.kernels import kernel_backend

    return {
        "kernel_backend": kernel_backend(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    }


def dtype_record(dtype: str) -> dict[str, Any]:
    """``validation.json``'s ``dtype``: the dtype the checkpoint's weights are stored in, how the ladder loads
    them, and the tolerance set (row of :data:`~mla_convert.validate.spec.TOLERANCES`) of the checks that run
    in that dtype."""
    return {
        "checkpoint": dtype,
        "loaded_as": "float32" if dtype == "float32" else f"float32 (the {dtype} weights upcast exactly)",
        "float32_checks": "float32 tolerances (spec.RUNGS)",
        "tolerance_set": dtype,
        "tolerances": tolerances_for(dtype).as_dict(),
    }


def validate(
    ckpt: Path,
    options: ValidateOptions | None = None,
    progress: Callable[[str], None] | None = None,
    **settings: Any,
) -> ValidationResult:
    """Run the seven rungs on a converted checkpoint.

    Args:
        ckpt: a folder written by ``mla-convert factor`` (or ``adapt``).
        options: the ladder's settings (:class:`~mla_convert.validate.options.ValidateOptions`); or give its
            fields as keywords (``source=..., new_tokens=4``), checked by the same model. Without a source
            (none given, the recorded one absent), rung 4 checks only the scale and rung 3 uses the
            recorded frequencies.
        progress: called with a short line before each step.

    Returns:
        The :class:`ValidationResult`, its ``settings`` the options with every default filled in; nothing is
        written here (see :func:`~mla_convert.validate.report.write_validation`).

    Raises:
        CheckpointError: not a loadable converted checkpoint. ValidationError: text too short for the
        settings, a corrupt RoPE record. SourceError, TextError: a bad source or text.
        pydantic.ValidationError: invalid keyword settings.

    A float16/bfloat16 checkpoint is loaded in float32 (exact), so every check keeps its float32 tolerance;
    rungs 2, 3 and 5 add checks in the checkpoint's own dtype, with that dtype's tolerances
    (:data:`~mla_convert.validate.spec.TOLERANCES`); ``ValidationResult.dtype`` records which.
    """
    from mla_convert import register
    from mla_convert.sources.checkpoint import load_source_model

    register()  # first: on a CPU it sets TRITON_INTERPRET before anything imports Triton (rung 2)
    if options is not None and settings:
        raise TypeError("validate() takes options or keyword settings, not both")
    asked = options if options is not None else ValidateOptions.model_validate(settings)
    say = progress or (lambda _m: None)
    config = read_checkpoint_config(ckpt)  # before anything slow
    opts = resolve_options(ckpt, config, asked)
    src = open_ladder_source(asked.source, opts.source)
    dtype = checkpoint_dtype(ckpt)
    say(
        f"loading checkpoint ({dtype} weights, computed in float32)"
        if dtype != "float32"
        else "loading checkpoint"
    )
    model = load_checkpoint(ckpt)
    ids = evaluation_ids(ckpt, opts)
    source_model = load_source_model(src) if src is not None else None
    ladder = _Ladder(ckpt, model, src, source_model, ids, opts, say, dtype)
    rung_list = ladder.run()
    settings_out = {**opts.model_dump(), "dtype": "float32"}
    return ValidationResult(str(ckpt), rung_list, settings_out, environment(), dtype_record(dtype))


__all__ = [
    "Check",
    "Rung",
    "ValidationError",
    "ValidationResult",
    "format_value",
    "validate",
    "validation_markdown",
    "write_validation",
]
