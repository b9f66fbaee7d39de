"""Where and in what dtype a conversion runs, and handing freed memory back between layers."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mla_convert.sources.checkpoint import SourceModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def trim_heap() -> None:
    """Hand freed heap pages back to the system (glibc ``malloc_trim``; a no-op elsewhere), so the resident
    set after a layer is what the next layer holds, not the high-water mark of the last one."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: Parameters per decoder layer from which a conversion hands its freed temporaries back as it goes
#: (:func:`map_large_blocks`, the search's trims): Llama-3.2-3B's layers (~100M) and larger. Below it the page faults
#: of fresh mappings cost more than they save: a SmolLM2-135M conversion (3.5M a layer) took 594 s with them, 516 s
#: without, at the same 1.02 GB peak.
LARGE_LAYER_PARAMS = 64_000_000


def large_layers(hidden: int, intermediate: int) -> bool:
    """Whether a decoder layer of ``hidden`` x ``intermediate`` (a gated MLP, ``3 D I`` parameters, and attention
    counted as multi-head, ``4 D^2``: an upper bound for GQA) has :data:`LARGE_LAYER_PARAMS` or more."""
    return hidden * (4 * hidden + 3 * intermediate) >= LARGE_LAYER_PARAMS


#: glibc's ``M_MMAP_THRESHOLD`` parameter of ``mallopt``.
_M_MMAP_THRESHOLD = -3


def map_large_blocks(threshold: int = 4 << 20) -> None:
    """Serve every allocation of ``threshold`` bytes or more (4 MiB) with its own mapping, returned to the system
    when freed (glibc ``mallopt(M_MMAP_THRESHOLD)``; a no-op elsewhere). By default glibc raises that threshold
    toward 32 MiB after such a block is freed, so the 4-32 MiB temporaries of the refit and the forward chunks pile
    up in its heaps; a conversion's search at Llama-3-8B's shapes then held 3 GB more than its live tensors.
    The memory's contents and every computed bit are unchanged."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside, :func:`trim_heap`'s ``gc.collect`` skips every Python object that existed on entry (``gc.freeze``):
    a process holding a tokenizer and the transformers modules has ~375k of them, and a full collection over them
    cost 0.25 s per layer on a 2-core CPU (25 s of a SmolLM2 conversion). On exit they are collectable again
    (``gc.unfreeze``). Objects made inside are collected as before; frozen ones freed by reference count still are.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def resolve_device(spec: str) -> torch.device:
    """``auto`` (a CUDA GPU when present, else the CPU), ``cpu`` or ``cuda[:N]``.

    Raises:
        OptionsError: a CUDA device this torch build or machine does not have.
    """
    from mla_convert.convert.options.options import OptionsError

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionsError(f"--device {spec}: this torch build or machine has no CUDA GPU; use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise OptionsError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def resolve_dtype(spec: str, src: SourceModel) -> torch.dtype:
    """The written checkpoint's dtype: ``auto`` is the source config's ``dtype``/``torch_dtype`` (float32 when
    it names none or another type), else the named one."""
    if spec != "auto":
        return DTYPES[spec]
    named = getattr(src.config, "dtype", None) or getattr(src.config, "torch_dtype", None)
    name = str(named).replace("torch.", "") if named is not None else "float32"
    return DTYPES.get(name, torch.float32)


def native_bfloat16(device: torch.device) -> bool:
    """Whether bfloat16 matrix products run in hardware on ``device``: a CUDA GPU that supports them, or a CPU with
    AVX512-BF16 or AMX tiles (what oneDNN uses). Elsewhere (an AVX2-only CPU) torch emulates them: measured on a
    2-core AVX2 AMD EPYC, a 2048 x 1536 x 8960 product ran at 9 GFLOP/s in bfloat16 against 72 in float32, hence
    :func:`bfloat16_autocast`."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def calib_precision_note(calib_precision: str, device: torch.device) -> str | None:
    """A one-line warning when ``--calib-precision bfloat16`` would run emulated on ``device`` (None otherwise): a
    GPU without bfloat16. A CPU without it computes the calibration's linear layers through float32 GEMMs
    (:func:`bfloat16_autocast`), at float32 speed; the default stays bfloat16 everywhere, because the precision
    is a recorded option: the same command gives the same checkpoint on every machine."""
    if calib_precision != "bfloat16" or device.type == "cpu" or native_bfloat16(device):
        return None
    return (
        f"--calib-precision bfloat16 (the default) runs emulated here ({device} has no bfloat16): the calibration "
        "pass takes several times longer than in float32; pass --calib-precision float32 for speed (a slightly "
        "different checkpoint)"
    )


class _Bfloat16Linear(torch.overrides.TorchFunctionMode):
    """``F.linear`` as bfloat16 hardware computes it: inputs, weight and bias rounded to bfloat16, their exact
    products summed in float32 (through the float32 GEMM), the output rounded to bfloat16. CPU autocast computes the
    same, but without AVX512-BF16 or AMX through torch's emulated bfloat16 GEMM (measured ~8x slower than float32 on
    a 2-core AVX2 AMD EPYC; a SmolLM2 decoder layer over 4 x 512 tokens: 0.80 s in autocast, 0.14 s this way, 0.12 s
    in float32). Operands autocast leaves alone (float64, integer) pass through unchanged."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.linear:
            return func(*args, **kwargs)
        x, weight, bias = _linear_args(*args, **kwargs)
        lower = (torch.float32, torch.bfloat16, torch.float16)
        if x.dtype not in lower or weight.dtype not in lower:
            return func(*args, **kwargs)

        def up(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.bfloat16).float()

        with torch.autocast("cpu", enabled=False):
            out = torch.nn.functional.linear(up(x), up(weight), None if bias is None else up(bias))
        return out.to(torch.bfloat16)


def _linear_args(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``F.linear``'s arguments by name, however they were passed."""
    return input, weight, bias


@contextmanager
def bfloat16_autocast(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """``torch.autocast(device, bfloat16)``; on a CPU without native bfloat16 products (:func:`native_bfloat16`),
    its linear layers computed as the hardware would (bfloat16 operands, float32 sums, bfloat16 output) through
    float32 GEMMs instead of torch's emulated bfloat16 GEMM (the linear layers at float32 speed; attention's own
    products stay in autocast). The same function either way: the two differ only in the order of float32 sums
    (1 bfloat16 ulp in ~1e-4 of the outputs), as two CPUs do. ``enabled=False``: no autocast (float32)."""
    with torch.autocast(device.type, torch.bfloat16, enabled=enabled):
        if enabled and device.type == "cpu" and not native_bfloat16(device):
            with _Bfloat16Linear():
                yield
        else:
            yield
