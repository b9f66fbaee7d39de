"""The llama.cpp parity a GGUF export carries: measured on the staged file before it is renamed into place
(:func:`measure_parity`, :func:`~mla_convert.engines.llamacpp.check.check_llamacpp`), summarised
(:func:`parity_summary`) and written into the file's reserved :data:`PARITY_KEY` field in place (:func:`fill_parity`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mla_convert.errors import ExportError

#: The GGUF string key that carries the export's llama.cpp parity (a JSON summary of
#: :func:`~mla_convert.engines.llamacpp.check.check_llamacpp`'s record, or why it was not measured): written as
#: :data:`PARITY_BYTES` spaces, then filled in place once the staged file has been served (:func:`fill_parity`), so
#: the file that is renamed into place carries what was measured on it.
PARITY_KEY = "mla_convert.parity"
PARITY_BYTES = 2048


def parity_summary(parity: dict[str, Any] | str) -> dict[str, Any]:
    """What the GGUF's :data:`PARITY_KEY` holds: the figures of a llama.cpp parity record (engine, text, log-prob
    differences, greedy agreement, cache row, thresholds, passed), or ``{"not_measured": why}``."""
    if isinstance(parity, str):
        return {"not_measured": parity}
    g = parity["greedy"]
    lossy = {}
    if "against_the_conversion" in parity:
        c = parity["against_the_conversion"]
        lossy = {"dropped_attention_biases": c["dropped_attention_biases"],
                 "against_the_conversion": {"logprob_abs_diff": c["logprob_abs_diff"],
                                            "greedy_argmax_equal": f"{c['greedy']['argmax_equal']}/{c['greedy']['count']}"}}
    return {
        "engine": parity["engine"],
        "text": parity["text"],
        "tokens_scored": parity["tokens_scored"],
        "logprob_abs_diff": parity["logprob_abs_diff"],
        "greedy_argmax_equal": f"{g['argmax_equal']}/{g['count']}",
        "greedy_max_margin": g["max_margin"],
        "kv_cache_values_per_token_per_layer": parity["kv_cache_values_per_token_per_layer"],
        "thresholds": None if parity["quantized"] else parity["thresholds"],
        "passed": parity["passed"],
        **lossy,
    }


def fill_parity(path: Path, parity: dict[str, Any] | str) -> None:
    """Write :func:`parity_summary` of ``parity`` into the GGUF at ``path`` in place: the value of its
    :data:`PARITY_KEY` string (reserved as :data:`PARITY_BYTES` spaces by :func:`~mla_convert.engines.llamacpp.gguf_file.write_gguf`), space-padded to the same
    length, so no offset in the file moves (llama.cpp's quantizer copies the key as it is).

    Raises:
        ExportError: the file has no reserved field, or the summary does not fit it (a bug).
    """
    text = json.dumps(parity_summary(parity), separators=(",", ":")).encode()
    if len(text) > PARITY_BYTES:
        raise ExportError(f"the parity summary is {len(text)} bytes, over the {PARITY_BYTES} reserved: a bug, please report it")
    key = PARITY_KEY.encode()
    # GGUF key/value: uint64 key length, key, uint32 type (8: string), uint64 string length, the string
    marker = len(key).to_bytes(8, "little") + key + (8).to_bytes(4, "little") + PARITY_BYTES.to_bytes(8, "little")
    with path.open("r+b") as f:
        head = f.read(1024 * 1024)  # the field precedes the vocabulary's keys (write_gguf): within the first KB
        at = head.find(marker)
        if at < 0 or head[at + len(marker) : at + len(marker) + PARITY_BYTES] != b" " * PARITY_BYTES:
            raise ExportError(f"{path} has no reserved {PARITY_KEY} field to record the parity in: a bug, please report it")
        f.seek(at + len(marker))
        f.write(text.ljust(PARITY_BYTES))


def measure_parity(
    ckpt: Path, path: Path, python: str | None, say: Callable[[str], None], dropped: bool = False
) -> dict[str, Any] | str:
    """llama.cpp's parity record for the staged file, or why it was not measured.

    Raises:
        ExportError: llama.cpp failed on the file, or a float file is over the thresholds.
    """
    if python is None:
        return ("parity in llama.cpp not measured: no llama.cpp found (bash scripts/llamacpp_env.sh builds one; "
                "MLA_LLAMACPP_PYTHON names its python)")
    from mla_convert.engines.llamacpp.check import check_llamacpp

    say("measuring parity: the file in llama.cpp against the MLA checkpoint (float32, real text)"
        + ("; without the dropped biases, and with them (the cost)" if dropped else ""))
    try:
        result = check_llamacpp(ckpt, path, python)
    except RuntimeError as exc:
        lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
        last = lines[-1] if len(lines) > 1 else ""
        raise ExportError(f"llama.cpp ({python}) could not run the GGUF export of {ckpt}: {lines[0] if lines else exc}"
                          f"{' ... ' + last if last else ''}; nothing was written. If that python has no "
                          "llama-cpp-python, point MLA_LLAMACPP_PYTHON at one (bash scripts/llamacpp_env.sh builds "
                          "it) or export with --no-check") from None
    if not result["passed"]:
        raise ExportError(f"llama.cpp does not run the GGUF export of {ckpt} as it computes: "
                          f"{'; '.join(result['reasons'])}; nothing was written: this is a bug, please report it")
    return result
