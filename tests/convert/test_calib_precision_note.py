"""Whether bfloat16 runs natively, read from the CPU's instruction sets (the CLI's warning: tests/cli/test_bad_inputs.py)."""

from __future__ import annotations

import pytest
import torch

from mla_convert.convert import device as dev


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "warned"), [(False, False, True), (True, False, False), (False, True, False)]
)
def test_bfloat16_calibration_on_a_cpu_without_it_is_said(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, warned: bool
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpu = torch.device("cpu")
    assert dev.native_bfloat16(cpu) is (not warned)
    note = dev.calib_precision_note("bfloat16", cpu)
    assert (note is not None) is warned
    if note is not None:
        assert "--calib-precision float32" in note and "AVX512-BF16" in note
    assert dev.calib_precision_note("float32", cpu) is None  # float32 never emulates


def test_inspect_estimate_says_when_this_machine_emulates_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The time estimate is for the reference CPU (native bfloat16): on one without it, inspect adds the note."""
    from mla_convert.convert.estimate import factor_lines
    from mla_convert.convert.options import ConvertOptions
    from mla_convert.sources.checkpoint import open_source

    src = open_source("smollm2-135m")
    for native in (True, False):
        monkeypatch.setattr(dev, "native_bfloat16", lambda device, native=native: native)
        lines = factor_lines(ConvertOptions(device="cpu"), src)
        assert len(lines) == (3 if native else 4)
        assert native or lines[3].startswith(
            "this machine: --calib-precision bfloat16 (the default) runs emulated"
        )
        assert len(factor_lines(ConvertOptions(device="cpu", calib_precision="float32"), src)) == 3
