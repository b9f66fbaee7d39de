"""Every generated block's text, regenerated from stored results alone (no measuring): block name -> writer.

Each entry is the ``--collect`` path of the benchmark that writes the block (the same function its ``--readme``
uses), reading ``benchmarks/results/*``, the pinned manifest or the code. ``tests/docs/test_generated_blocks.py``
compares each with the text in README.md / docs/*.md; a block with no entry here fails that test.

    .venv/bin/python benchmarks/collect.py [NAME ...]     # rewrite these blocks (all: none named) from stored results
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
PINNED = BENCH.parent / "manifests" / "smollm2-135m-reference.json"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def _mod(name: str) -> ModuleType:
    return importlib.import_module(name)


def _json(name: str) -> object:
    return json.loads((RESULTS / name).read_text())


def _text(name: str) -> str:
    return (RESULTS / name).read_text()


def _perplexity() -> str:
    lines = _text("perplexity.md").splitlines()
    summary, _ = _mod("perplexity").summarize(lines)
    return "\n".join([*lines, "", *summary])


def _validate() -> str:
    result = _json("validation.json")
    assert isinstance(result, dict)
    return str(_mod("readme").validate_block(result, result["checkpoint"]))


#: block name -> () -> the block's text, from stored results
COLLECTORS: dict[str, Callable[[], str]] = {
    "rungs": lambda: _mod("readme").rungs_block(),
    "reference": lambda: _mod("readme").reference_block(json.loads(PINNED.read_text())),
    "recipe": lambda: _mod("readme").recipe_block(json.loads(PINNED.read_text())),
    "validate": _validate,
    "vllm-parity": lambda: _mod("readme").vllm_parity_block(_json("vllm_parity.json")),
    "engine-parity": lambda: _mod("engine_parity").block(_json("engine_parity.json")),
    "decode": lambda: _mod("decode").collect_block(RESULTS / "decode.md"),
    # the run folders (metrics.jsonl) are not in git: the table their last --collect stored is the record
    "adapt": lambda: _mod("adapt").recorded_table(),
    "scale": lambda: _mod("scale").collect_block(),
    "second-model": lambda: _mod("second_model").block(),
    "perplexity": _perplexity,
    "levers": lambda: _mod("levers").block(_text("levers.md").splitlines()),
    "calibration": lambda: _mod("calibration").block(
        [json.loads(x) for x in _text("calibration.jsonl").splitlines()], 16
    ),
    "chat-calibration": lambda: _mod("chat_calibration").collect_block(),
    "calibration-mix": lambda: _mod("calibration_mix").block(),
    "quality": lambda: _mod("quality").block(),
    "nope-bound": lambda: _mod("nope_rank").block(),
    "reconstruct": lambda: _mod("reconstruct").block(),
    "quality-targets": lambda: _mod("quality").targets_block(),
    "export": lambda: _mod("export").table(_json("export.json")),  # type: ignore[arg-type]
    "export-transformers": lambda: _mod("export").transformers_block(_json("export.json")),  # type: ignore[arg-type]
    "engine-shape": lambda: _mod("engine_shape").collect_block(),
    "llamacpp-bench": lambda: _mod("llamacpp").block(_json("llamacpp.json")),  # type: ignore[arg-type]
    "bfloat16": lambda: _mod("bfloat16").block(),
    "humaneval": lambda: _mod("humaneval").block(),
    "gguf-biases": lambda: _mod("gguf_biases").block(),
}


def main() -> None:
    from blocks import replace_block

    names = sys.argv[1:] or list(COLLECTORS)
    unknown = [n for n in names if n not in COLLECTORS]
    if unknown:
        raise SystemExit(f"error: no writer for block(s) {', '.join(unknown)}; known: {', '.join(COLLECTORS)}")
    for name in names:
        print(f"{name}: {replace_block(name, COLLECTORS[name]())}")


if __name__ == "__main__":
    main()
