"""The recipe dry-run's memory estimate against a measurement: the factor stage's estimate for the default
options on the bundled model must cover the resident peak that the pinned reference conversion measured
(``run.peak_rss_mb`` of ``manifests/smollm2-135m-reference.json``), without overstating it by more than half.

Fast: ``open_source`` reads only the bundled model's config and safetensors headers.
"""

from __future__ import annotations

import json
from pathlib import Path

from mla_convert.convert.options import ConvertOptions
from mla_convert.recipes.memory import factor_phases, peak
from mla_convert.sources.checkpoint import open_source

PINNED = Path(__file__).resolve().parents[2] / "manifests" / "smollm2-135m-reference.json"


def test_factor_estimate_covers_the_measured_peak():
    manifest = json.loads(PINNED.read_text())
    options = ConvertOptions()
    assert ConvertOptions.model_validate(manifest["options"]) == options  # the reference ran the defaults
    assert manifest["source"]["origin"] == "smollm2-135m"
    measured = manifest["run"]["peak_rss_mb"] * 1024 * 1024  # ru_maxrss KiB / 1024 -> bytes
    phases = factor_phases(options, open_source("smollm2-135m"))
    top = peak(phases)
    assert measured <= top.total <= 1.5 * measured, (top.name, top.total / 1e9, measured / 1e9)
    assert top.name == "calibration"  # where the default conversion peaks: the kept calibration captures
