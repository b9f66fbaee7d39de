#!/usr/bin/env bash
# Set up from nothing and run the checks: ruff, mypy on the package, then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check mla_convert tests benchmarks
.venv/bin/mypy mla_convert
.venv/bin/python -m pytest -q --durations=15 tests "$@"
