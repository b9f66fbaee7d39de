"""Compile the decode kernels for NVIDIA GPUs without a GPU: Triton's own compiler entry points, then ``cuobjdump``.

Every compiled variant of :func:`~mla_convert.kernels.latent_decode.latent_decode` is named by a
:class:`~mla_convert.kernels.latent_decode.LaunchKey` (dtype, latent and rope tiles, rows per tile, rope or not);
this module compiles a set of them for a GPU architecture (``sm_90``: Hopper, ``sm_80``: Ampere) down to a cubin,
fails on a compile error, and reads the registers and spill bytes of each from the cubin with the bundled
``cuobjdump``. Spills (a non-zero stack frame) are a
finding (slower), not an error.

It has to run in a process where Triton compiles: under the interpreter the kernels are not compilable objects,
and ``import mla_convert`` turns the interpreter on where there is no GPU unless ``TRITON_INTERPRET`` is set::

    TRITON_INTERPRET=0 python -m mla_convert.kernels.compile_check [--arch 90 --arch 80] [--set product|grid] [--json F]

``product`` is what the bundled model's conversions and DeepSeek-V3-shaped checkpoints launch, FP8 caches
included (the CI check); ``grid`` is every latent tile 16..512 x rope tile x dtype, FP8 with bfloat16 queries
included (``benchmarks/compile_kernels.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: (d_c, d_R) of the shapes the product launches, compiled in CI: the bundled SmolLM2-135M default conversion
#: (one rope head of 48 values, tiled as 64; per-layer latent ranks 18..92, i.e. latent tiles 32, 64 and 128:
#: tests/kernels/test_compile.py checks the cover against the converted checkpoint) and DeepSeek-V3 (512 + one
#: rope head of 64). The other tiles (other budgets and models) are in the ``grid`` set of the benchmark.
PRODUCT_SHAPES = ((32, 48), (64, 48), (128, 48), (512, 64))
DTYPES = ("float16", "bfloat16", "float32")
ARCHS = (90, 80)
_TL = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class Compiled:
    """One compiled kernel: which, for what, and what ``cuobjdump`` reports of its cubin.

    Attributes:
        kernel: ``split`` or ``merge``; arch: SM version (90, 80); key: the launch key's fields.
        registers: registers per thread (255 is the ceiling); stack_bytes: per-thread stack frame, where
            register spills go (0 = no spills); local_bytes: other local memory; shared_bytes: static shared
            memory per program; num_warps: warps per program; seconds: compile time.
    """

    kernel: str
    arch: int
    key: dict[str, Any]
    registers: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int
    num_warps: int
    seconds: float


def _cuobjdump() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():  # pragma: no cover - depends on the triton wheel
        raise RuntimeError(f"no cuobjdump at {path}; install a triton wheel with the NVIDIA backend")
    return str(path)


def _resources(cubin: bytes) -> tuple[int, int, int, int]:
    """(registers, stack bytes, local bytes, shared bytes) per thread of the kernel in ``cubin``, read with the
    bundled ``cuobjdump --dump-resource-usage`` (the cubin Triton assembled with its own ``ptxas``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        )
    log = res.stdout

    def field(name: str) -> int:
        found = re.search(rf"\b{name}:(\d+)", log)
        return int(found.group(1)) if found else -1

    return field("REG"), field("STACK"), field("LOCAL"), field("SHARED")


def compile_variant(kernel: str, key: Any, arch: int) -> Compiled:
    """Compile one kernel (``"split"`` or ``"merge"``) of ``key`` (a ``LaunchKey``) for ``sm_<arch>``.

    Raises:
        RuntimeError: under the Triton interpreter (nothing to compile); Triton's CompilationError on a
            kernel that does not compile for that target.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import latent_decode as ld

    if not hasattr(ld._split_kernel, "arg_names"):
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1; run with TRITON_INTERPRET=0")
    t = _TL[key.dtype]
    if kernel == "split":
        fn = ld._split_kernel
        pointers = {
            "q_abs_ptr": t, "q_rope_ptr": t, "cache_ptr": "u8" if key.fp8_group else t, "block_table_ptr": "i32", "seq_lens_ptr": "i32",
            "head_to_rope_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
        }  # fmt: skip
        consts = {
            "BLOCK_M": ld.BLOCK_M, "BLOCK_N": key.block_n, "BLOCK_DC": key.block_dc, "BLOCK_R": key.block_r,
            "HAS_ROPE": key.has_rope, "IEEE": key.dtype == "float32", "FP8_GROUP": key.fp8_group,
        }  # fmt: skip
    else:
        fn = ld._merge_kernel
        pointers = {"part_out_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": t, "lse_ptr": "fp32"}
        consts = {"BLOCK_M": ld.BLOCK_M, "BLOCK_DC": key.block_dc}
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(fn.arg_names):
        if name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif name in consts:
            signature[name] = "constexpr"
        elif name == "softmax_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in ("stride_cp", "stride_cs"):
                attrs[(i,)] = [["tt.divisibility", 16]]  # the paged cache pads rows to 16 elements
    start = time.perf_counter()
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    warps = key.num_warps if kernel == "split" else ld.MERGE_WARPS
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    seconds = time.perf_counter() - start
    regs, stack, local, smem = _resources(compiled.asm["cubin"])
    return Compiled(kernel, arch, asdict(key), regs, stack, local, smem, warps, round(seconds, 2))


def variants(which: str) -> list[Any]:
    """The launch keys of a set: ``product`` (:data:`PRODUCT_SHAPES` x dtypes, and FP8 caches with bfloat16
    queries at every scale group up to the latent tile) or ``grid`` (every latent tile 16..512 x rope tile {none,
    16, 32, 64} x dtype, FP8 at each width's default group)."""
    import torch

    from .latent_decode import launch_key

    shapes = list(PRODUCT_SHAPES)
    if which == "grid":
        shapes = [(d_c, d_r) for d_c in (16, 32, 64, 128, 256, 512) for d_r in (0, 16, 32, 64)]
    from .fp8 import default_group

    keys = []
    for dtype in DTYPES:
        for d_c, d_r in shapes:
            key = launch_key(getattr(torch, dtype), d_c, d_r)
            if key not in keys:
                keys.append(key)
    for d_c, d_r in shapes:  # FP8 caches are read with bfloat16 queries on a GPU; the scale group (16..128)
        for group in (16, 32, 64, 128):  # is the largest dividing the rank rounded up to 16, so any may come
            if group <= d_c and (group == default_group(d_c) or (which == "product" and d_c < 512)):
                key = launch_key(torch.bfloat16, d_c, d_r, fp8_group=group)
                if key not in keys:
                    keys.append(key)
    return keys


def _compile_job(job: tuple[str, Any, int]) -> Compiled:
    return compile_variant(*job)


def run(archs: list[int], which: str, jobs: int = 1) -> list[Compiled]:
    """Compile every split and merge kernel of ``variants(which)`` for each arch (merge kernels once per latent
    tile and dtype), ``jobs`` compiles at a time (processes; each compile is one CPU-bound ``ptxas``), results
    in a fixed order. Raises the first compile error."""
    todo: list[tuple[str, Any, int]] = []
    merged: set[tuple[int, str, int]] = set()
    for arch in archs:
        for key in variants(which):
            if (
                key.fp8_group and arch < 89
            ):  # E4M3 conversion exists from Ada/Hopper on; refused at launch below
                continue
            todo.append(("split", key, arch))
            if (arch, key.dtype, key.block_dc) not in merged:  # the merge kernel reads float32 partials only
                merged.add((arch, key.dtype, key.block_dc))
                todo.append(("merge", key, arch))
    if jobs <= 1:
        return [compile_variant(*job) for job in todo]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_compile_job, todo))


def main(argv: list[str] | None = None) -> int:
    """CLI: compile, print one line per kernel, optionally write JSON; exit 1 on a compile error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", choices=ARCHS, help="SM version (repeatable)")
    parser.add_argument("--set", dest="which", choices=("product", "grid"), default="product")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="compiles at a time (default: CPUs)"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "error: the Triton interpreter is on (TRITON_INTERPRET=1, which `import mla_convert` sets on a machine "
            "without a GPU); run with TRITON_INTERPRET=0 in the environment to compile",
            file=sys.stderr,
        )
        return 2
    try:
        results = run(args.arch or list(ARCHS), args.which, max(1, args.jobs))
    except Exception as err:  # noqa: BLE001 - any compile failure is the finding
        print(f"error: compile failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    for r in results:
        k = r.key
        print(
            f"sm_{r.arch} {r.kernel:5} {k['dtype']:8} fp8={k['fp8_group']:3} dc={k['block_dc']:3} r={k['block_r']:2} n={k['block_n']:2} "
            f"rope={int(k['has_rope'])} warps={r.num_warps} regs={r.registers:3} stack={r.stack_bytes} "
            f"local={r.local_bytes} smem={r.shared_bytes} {r.seconds:.1f}s"
        )
    spilled = [r for r in results if r.stack_bytes or r.local_bytes]
    print(
        f"{len(results)} kernels compiled for {', '.join(f'sm_{a}' for a in (args.arch or list(ARCHS)))}; "
        f"{len(spilled)} spill to local memory (stack > 0: slower, not an error)"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
