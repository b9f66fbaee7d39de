"""Whether bfloat16 runs natively, read from the CPU's instruction sets (the CLI's warning: tests/cli/test_bad_inputs.py)."""

from __future__ import annotations

import pytest
import torch

from mla_convert.convert import device as dev


@pytest.mark.parametrize(("avx512_bf16", "amx", "warned"), [(False, False, True), (True, False, False), (False, True, False)])
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
