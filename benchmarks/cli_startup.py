"""How fast and how light `mla-convert` starts: wall time and peak RSS of `--help` for the CLI and every command.

Targets (issue 11): `mla-convert --help` under 1 s and under 150 MB. Each row is the median of --repeat fresh
processes of the installed console script (the same file a user runs), measured with `resource.getrusage` on the
child. Prints a markdown table.

    .venv/bin/python benchmarks/cli_startup.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = [
    "",
    "inspect",
    "factor",
    "eval",
    "generate",
    "validate",
    "adapt",
    "run",
    "init-recipe",
    "manifest verify",
]
TARGET_S, TARGET_MB = 1.0, 150.0


def measure(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak resident MB of one fresh process running ``argv`` (stdout discarded)."""
    probe = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True)\n"
        "dt = time.perf_counter() - t\n"
        "print(dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True)
    dt, mb = out.stdout.split()
    return float(dt), float(mb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per row (median)")
    args = parser.parse_args()
    exe = shutil.which("mla-convert", path=str(Path(sys.executable).parent)) or "mla-convert"
    print(
        f"`mla-convert ... --help`, median of {args.repeat} fresh processes; {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}; written by `python benchmarks/cli_startup.py` ({time.strftime('%Y-%m-%d')}).\n"
    )
    print("| command | wall s | peak RSS MB | within 1 s / 150 MB |")
    print("|---|---:|---:|---|")
    worst = 0.0
    for cmd in COMMANDS:
        runs = [measure([exe, *cmd.split(), "--help"]) for _ in range(args.repeat)]
        dt = statistics.median(r[0] for r in runs)
        mb = statistics.median(r[1] for r in runs)
        ok = dt < TARGET_S and mb < TARGET_MB
        worst = max(worst, dt)
        print(
            f"| `mla-convert {cmd + ' ' if cmd else ''}--help` | {dt:.2f} | {mb:.0f} | {'yes' if ok else 'NO'} |"
        )
    sys.exit(0 if worst < TARGET_S else 1)


if __name__ == "__main__":
    main()
