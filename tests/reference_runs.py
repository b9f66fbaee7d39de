"""The README's reference conversion (``tests/convert/test_reference.py`` pins it) and how to make one.

A plain module, not a conftest: test modules import it by name (``conftest`` is ambiguous, one per folder).

The pinned manifest is ``mla-convert factor smollm2-135m OUT --device cpu`` with default options: the conversion
searches the RoPE pairs, the rope strategy and the ``o_proj`` refit mode on the held-out windows and converts the
best (``mla_convert/convert/pipeline/rope_split.py``). The suite converts the reference with those three choices given as
the pin recorded them (:func:`pinned_levers`): the same passes on the same statistics with the search left out
(about two thirds of the conversion: 357 s of 536 s in a fresh-clone quick start), so the same weights, ranks and figures, and the pinned canonical id once the
``choices`` say where the levers came from (``test_reference.py`` checks exactly that). The search itself is
checked on tiny sources against the levers given (``tests/convert/test_rope_split.py``: the lever not chosen,
given, writes the KL the search recorded; the choice given writes the same bytes), and on this model by
``python tests/convert/test_reference.py --repin`` (which runs it) and by the quick start
(``MLA_CONVERT_TEST_REFERENCE=out/smollm2-mla pytest tests/convert/test_reference.py`` then checks the searched
conversion against the pin).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

PINNED = Path(__file__).resolve().parents[1] / "manifests" / "smollm2-135m-reference.json"
#: The options the default conversion measures on the source and the pinned reference recorded.
LEVERS = ("rope_pairs", "rope_strategy", "refit_o_proj")


def pinned_levers() -> list[str]:
    """The flags that give the pinned reference's measured choices (``--rope-pairs 24 --rope-strategy 2-norm
    --refit-o-proj teacher`` for the current pin)."""
    options = json.loads(PINNED.read_text())["options"]
    return [a for k in LEVERS for a in (f"--{k.replace('_', '-')}", str(options[k]))]


def run_reference(out: Path, *, search: bool = False) -> dict:
    """``mla-convert factor smollm2-135m OUT --device cpu`` through the CLI, on up to 2 torch threads whatever the
    test process uses (as pinned: float sums may split by thread); returns its manifest.

    Args:
        out: the output folder (must not exist).
        search: True for the default options as the README runs them (the search measures the levers: how the
            pin is made); False (the suite) gives the levers the pin recorded (:func:`pinned_levers`).
    """
    from typer.testing import CliRunner

    from mla_convert.cli.commands import app

    cmd = ["--quiet", "factor", "smollm2-135m", str(out), "--device", "cpu"]  # cpu: GPU hosts too
    if not search:
        cmd += pinned_levers()
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    try:
        res = CliRunner().invoke(app, cmd)
    finally:
        torch.set_num_threads(before)
    assert res.exit_code == 0, res.output + str(res.exception)
    return json.loads((out / "mla_manifest.json").read_text())


def as_searched(manifest: dict) -> dict:
    """A reference conversion's manifest as the default conversion writes it: where the levers were given (the
    suite's run), their ``choices`` replaced by the pin's (what the search recorded); unchanged otherwise. Its
    canonical id (recomputed) is then the pin's when the conversion is the pinned one."""
    if any(manifest["choices"].get(k) != "given" for k in LEVERS):
        return manifest
    pinned = json.loads(PINNED.read_text())
    assert {k: manifest["options"][k] for k in LEVERS} == {k: pinned["options"][k] for k in LEVERS}, (
        "the reference was converted with levers other than the pin's"
    )
    from mla_convert.artifacts.manifest import canonical_id

    searched = {**manifest, "choices": {**manifest["choices"], **{k: pinned["choices"][k] for k in LEVERS}}}
    return {**searched, "canonical_id": canonical_id(searched)}
