"""bfloat16 calibration: whether it runs natively (read from the CPU's instruction sets), and on a CPU without it
the linear layers computed as bfloat16 hardware computes them through float32 products (``bfloat16_autocast``),
against an oracle in float64 (the CLI's warning: tests/cli/test_bad_inputs.py)."""

from __future__ import annotations

import pytest
import torch

from mla_convert.convert.pipeline import device as dev


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "native"), [(False, False, False), (True, False, True), (False, True, True)]
)
def test_native_bfloat16_reads_the_cpu_and_a_cpu_is_never_warned(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, native: bool
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpu = torch.device("cpu")
    assert dev.native_bfloat16(cpu) is native
    assert dev.calib_precision_note("bfloat16", cpu) is None  # emulated or not, float32 speed
    assert dev.calib_precision_note("float32", cpu) is None


def test_a_gpu_without_bfloat16_is_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "native_bfloat16", lambda device: False)
    note = dev.calib_precision_note("bfloat16", torch.device("cuda"))
    assert note is not None and "--calib-precision float32" in note and "cuda has no bfloat16" in note
    assert dev.calib_precision_note("float32", torch.device("cuda")) is None


@pytest.mark.parametrize("bias", [False, True])
def test_emulated_linear_is_the_bfloat16_product(monkeypatch: pytest.MonkeyPatch, bias: bool) -> None:
    """Under ``bfloat16_autocast`` on a CPU without bfloat16, ``F.linear`` of float32 tensors returns what bfloat16
    hardware does: the operands rounded to bfloat16, their products summed (here in float64, the oracle), the sum
    rounded to bfloat16; the float32 sums differ from it by at most one unit in the last place, in few outputs, as
    torch's own autocast product does."""
    monkeypatch.setattr(dev, "native_bfloat16", lambda device: False)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 576, generator=g), torch.randn(384, 576, generator=g)
    b = torch.randn(384, generator=g) if bias else None
    r = [t.to(torch.bfloat16).double() if t is not None else None for t in (x, w, b)]
    oracle = torch.nn.functional.linear(*r).to(torch.bfloat16)  # type: ignore[arg-type]
    with dev.bfloat16_autocast(torch.device("cpu")):
        got = torch.nn.functional.linear(x, w, b)
        inside = torch.nn.Linear(576, 384, bias=bias)(x)  # nn.Linear goes through F.linear
    assert got.dtype == inside.dtype == torch.bfloat16
    with torch.autocast("cpu", torch.bfloat16):
        torch_own = torch.nn.functional.linear(x, w, b)
    for y in (got, torch_own):  # float32 sums round differently from float64 ones near a bfloat16 tie
        off = y != oracle
        assert off.float().mean().item() < 2e-3
        ulp = torch.finfo(torch.bfloat16).eps * oracle[off].double().abs().clamp_min(1.0)  # x 1 near cancellation
        assert ((y[off].double() - oracle[off].double()).abs() <= ulp).all()
    # outside the context, float32 again
    assert torch.nn.functional.linear(x, w, b).dtype == torch.float32


def test_native_cpu_keeps_torch_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has bfloat16 products, the context is torch's autocast alone (no float32 detour)."""
    monkeypatch.setattr(dev, "native_bfloat16", lambda device: True)
    x, w = torch.randn(8, 64), torch.randn(16, 64)
    with torch.autocast("cpu", torch.bfloat16):
        want = torch.nn.functional.linear(x, w)
    with dev.bfloat16_autocast(torch.device("cpu")):
        assert torch.equal(torch.nn.functional.linear(x, w), want)
    with dev.bfloat16_autocast(torch.device("cpu"), enabled=False):
        assert torch.nn.functional.linear(x, w).dtype == torch.float32
