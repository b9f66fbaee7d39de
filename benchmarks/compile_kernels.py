"""Registers and spills of every decode-kernel variant, compiled for sm_90 and sm_80 without a GPU (issue 14).

Runs :mod:`mla_convert.kernels.compile_check` over the whole tile grid (latent tile 16..512 x rope tile
{none, 16, 32, 64} x float16/bfloat16/float32; split and merge kernels) in a process with the Triton interpreter
off, and writes ``benchmarks/results/kernel_compile.json`` and ``kernel_compile.md`` (a table: one row per
compiled specialisation -- what a launch of that shape compiles, integer specialisation included, so ``d_c``
is shown: a width divisible by 16 and one that is not are different kernels -- and architecture; a non-zero
stack frame is where registers spill).

    .venv/bin/python benchmarks/compile_kernels.py [--set grid|product] [--arch 90 --arch 80]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def table(rows: list[dict]) -> str:
    """Markdown table of compile_check's JSON rows."""
    head = (
        "| arch | kernel | queries | FP8 group | d_c | d_c tile | d_R tile | rows/tile | rope | warps | registers "
        "| stack (spill) bytes | shared bytes |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in sorted(rows, key=lambda r: (-r["arch"], r["kernel"], r["key"]["dtype"], r["key"]["block_dc"],
                                         r["shape"]["d_c"], r["key"]["block_r"], r["key"]["has_rope"],
                                         r["key"]["fp8_group"])):  # fmt: skip
        k = r["key"]
        lines.append(
            f"| sm_{r['arch']} | {r['kernel']} | {k['dtype']} | {k['fp8_group'] or '-'} | {r['shape']['d_c']} "
            f"| {k['block_dc']} | {k['block_r']} | {k['block_n']} "
            f"| {'yes' if k['has_rope'] else 'no'} | {r['num_warps']} | {r['registers']} | {r['stack_bytes']} "
            f"| {r['shared_bytes']} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="which", choices=("grid", "product"), default="grid")
    parser.add_argument("--arch", type=int, action="append", choices=(90, 80))
    args = parser.parse_args()
    out = RESULTS / "kernel_compile.json"
    cmd = [sys.executable, "-m", "mla_convert.kernels.compile_check", "--set", args.which, "--json", str(out)]
    for arch in args.arch or (90, 80):
        cmd += ["--arch", str(arch)]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run(cmd, env=env, cwd=ROOT)
    if res.returncode:
        return res.returncode
    rows = json.loads(out.read_text())
    spilled = [r for r in rows if r["stack_bytes"] > 0]
    import triton

    md = (
        f"# Decode kernel variants compiled without a GPU\n\nBy `python benchmarks/compile_kernels.py --set "
        f"{args.which}` (Triton {triton.__version__}, cubins read with the bundled cuobjdump). {len(rows)} kernels "
        f"compiled, {len(spilled)} with a stack frame (register spills).\n\n" + table(rows)
    )
    (RESULTS / "kernel_compile.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
