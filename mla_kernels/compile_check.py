"""Compile the decode kernels for NVIDIA GPUs without a GPU: Triton's own compiler entry points, then ``cuobjdump``.

What is compiled is what launches: for each shape of a set, :func:`~mla_convert.kernels.launch.plan_launch`
plans the two launches over the product's own paged cache rows (:class:`~mla_convert.runtime.paged_cache.
PagedLatentCache`, page size :data:`PAGE_SIZE`, rows padded as it pads them, FP8 rows included), and
:func:`~mla_convert.kernels.variants.launch_specialization` gives each launch's specialisation key -- the
constexprs, which integers are the constant 1 or divisible by 16, which pointers are aligned, the warps -- under
which Triton's JIT would cache it. Each distinct key is compiled for a GPU architecture (``sm_90``: Hopper,
``sm_80``: Ampere) down to a cubin with exactly that signature, a compile error fails, and the registers and
spill bytes of each are read from the cubin with the bundled ``cuobjdump``. Spills (a non-zero stack frame) are
a finding (slower), not an error.

It has to run in a process where Triton compiles: under the interpreter the kernels are not compilable objects,
and ``import mla_convert`` turns the interpreter on where there is no GPU unless ``TRITON_INTERPRET`` is set::

    TRITON_INTERPRET=0 python -m mla_convert.kernels.compile_check [--arch 90 --arch 80] [--set product|grid] [--json F]

``product`` is what the bundled model's default conversion and DeepSeek-V3-shaped checkpoints launch, FP8 caches
included (the CI check; ``tests/kernels/test_compile.py`` checks that every key the bundled conversion launches
is in it); ``grid`` is every power-of-two latent tile 16..512 x rope tile x dtype, FP8 with bfloat16 queries
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
#: (one rope head of 48 values, tiled as 64; per-layer latent ranks 18..92, none a multiple of 16: latent tiles 32,
#: 64 and 128, each with ``d_c`` not divisible by 16, which Triton specialises on) and DeepSeek-V3 (512 + one rope
#: head of 64). Multiples of 16 below 512 are in the ``grid`` set of the benchmark.
PRODUCT_SHAPES = ((18, 48), (56, 48), (88, 48), (512, 64))
#: tokens per page of the planned caches (the product's default; the page size picks no variant)
PAGE_SIZE = 16
#: query heads of the planned launches (a runtime integer: picks no variant)
HEADS = 16
DTYPES = ("float16", "bfloat16", "float32")
ARCHS = (90, 80)
_TL = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class Compiled:
    """One compiled kernel: which, for what, and what ``cuobjdump`` reports of its cubin.

    Attributes:
        kernel: ``split`` or ``merge``; arch: SM version (90, 80); key: the launch key's fields; shape: the
        planned ``d_c``, ``d_r``; spec: the specialisation key compiled (JSON lists of
        :func:`~mla_convert.kernels.variants.launch_specialization`).
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
    shape: dict[str, int]
    spec: list[Any]


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


@dataclass(frozen=True)
class Variant:
    """One kernel launch as Triton's JIT would compile it.

    Attributes:
        kernel: ``split`` or ``merge``; key: the :class:`~mla_convert.kernels.launch.LaunchKey`; spec: the
            specialisation key (:func:`~mla_convert.kernels.variants.launch_specialization`); d_c, d_r: the
            shape it was planned for (the first of the set with this key).
    """

    kernel: str
    key: Any
    spec: Any
    d_c: int
    d_r: int


def planned(dtype: str, d_c: int, d_r: int, fp8_group: int = 0) -> list[Variant]:
    """The split and merge launches of one layer of ``d_c`` latent and one rope head of ``d_r`` values, with
    ``dtype`` queries over the product's paged cache (FP8 rows of that scale group when ``fp8_group``), planned
    on CPU tensors as :func:`~mla_convert.kernels.latent_decode.latent_decode` plans them on a GPU (row blocks of
    16; the split count does not pick a variant)."""
    import torch

    from mla_convert.runtime.paged_cache import PagedLatentCache

    from . import latent_decode as ld
    from .fp8 import layout
    from .launch import plan_launch
    from .variants import launch_specialization

    dt = getattr(torch, dtype)
    lays = [layout(d_c, d_r, fp8_group)] if fp8_group else None
    cache = PagedLatentCache([d_c + d_r], PAGE_SIZE, 2, dtype=dt, fp8=lays)
    q_abs = torch.zeros(1, 1, HEADS, d_c, dtype=dt)
    q_rope = torch.zeros(1, 1, HEADS, d_r, dtype=dt)
    plan = plan_launch(
        q_abs,
        q_rope,
        cache.pages[0],
        torch.zeros(1, 2, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        torch.zeros(HEADS, dtype=torch.int32),
        0.125,
        max_seq_len=2 * PAGE_SIZE,
        fp8=lays[0] if lays else None,
        backend="triton-cuda",
        sm_count=132,
    )
    split = launch_specialization(ld._split_kernel, plan.split_args, plan.split_kwargs)
    merge = launch_specialization(ld._merge_kernel, plan.merge_args, plan.merge_kwargs)
    return [Variant("split", plan.key, split, d_c, d_r), Variant("merge", plan.key, merge, d_c, d_r)]


def compile_variant(variant: Variant, arch: int) -> Compiled:
    """Compile one planned launch for ``sm_<arch>`` with exactly its specialisation: the constexprs (and the
    integers specialised to 1) as constants, ``tt.divisibility = 16`` where the key says ``D``, the key's warps.

    Raises:
        RuntimeError: under the Triton interpreter (nothing to compile); Triton's CompilationError on a
            kernel that does not compile for that target.
    """
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    from . import latent_decode as ld

    if not hasattr(ld._split_kernel, "arg_names") or not hasattr(ld._split_kernel, "params"):
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1; run with TRITON_INTERPRET=0")
    fn = ld._split_kernel if variant.kernel == "split" else ld._merge_kernel
    entries, options = variant.spec
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (name, (ty, attr)) in enumerate(zip(fn.arg_names, entries, strict=True)):
        signature[name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    warps = dict(options)["num_warps"]
    start = time.perf_counter()
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    seconds = time.perf_counter() - start
    regs, stack, local, smem = _resources(compiled.asm["cubin"])
    return Compiled(
        variant.kernel,
        arch,
        asdict(variant.key),
        regs,
        stack,
        local,
        smem,
        warps,
        round(seconds, 2),
        {"d_c": variant.d_c, "d_r": variant.d_r},
        json.loads(json.dumps(variant.spec)),
    )


def variants(which: str) -> list[Variant]:
    """The distinct launches of a set (split and merge kernels, one per specialisation key): ``product``
    (:data:`PRODUCT_SHAPES` x dtypes, and FP8 caches with bfloat16 queries at every scale group that fits each
    latent width below 512, DeepSeek's 128 at 512) or ``grid`` (every latent tile 16..512 x rope tile {none,
    16, 32, 64} x dtype, FP8 at each width's default group)."""
    from .fp8 import default_group, layout

    shapes = list(PRODUCT_SHAPES)
    if which == "grid":
        shapes = [(d_c, d_r) for d_c in (16, 32, 64, 128, 256, 512) for d_r in (0, 16, 32, 64)]
    jobs = [(dtype, d_c, d_r, 0) for dtype in DTYPES for d_c, d_r in shapes]
    for d_c, d_r in shapes:  # FP8 caches are read with bfloat16 queries on a GPU
        for group in (16, 32, 64, 128):
            if group == default_group(d_c) or (which == "product" and d_c < 512):
                try:
                    layout(d_c, d_r, group)
                except ValueError:  # the group does not divide the padded latent width
                    continue
                jobs.append(("bfloat16", d_c, d_r, group))
    found: dict[tuple[str, Any], Variant] = {}
    for job in jobs:
        for v in planned(*job):
            found.setdefault((v.kernel, v.spec), v)
    return list(found.values())


def _compile_job(job: tuple[Variant, int]) -> Compiled:
    return compile_variant(*job)


def run(archs: list[int], which: str, jobs: int = 1) -> list[Compiled]:
    """Compile every distinct launch of ``variants(which)`` for each arch (FP8 rows only from sm_89 on: E4M3
    conversion exists from Ada/Hopper; refused at launch below), ``jobs`` compiles at a time (processes; each
    compile is one CPU-bound ``ptxas``), results in a fixed order. Raises the first compile error."""
    todo = [
        (v, arch)
        for arch in archs
        for v in variants(which)
        if not (v.key.fp8_group and v.kernel == "split" and arch < 89)
    ]
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
            f"sm_{r.arch} {r.kernel:5} {k['dtype']:8} fp8={k['fp8_group']:3} d_c={r.shape['d_c']:3} dc={k['block_dc']:3} "
            f"r={k['block_r']:2} n={k['block_n']:2} "
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
