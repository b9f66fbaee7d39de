#!/usr/bin/env bash
# Set up from nothing and run the checks: ruff, mypy on the package, then the test suite (with vLLM's CPU build
# and MLX-LM).
set -euo pipefail
cd "$(dirname "$0")/.."
# Under CI (CI set, as .ci/run and hosted CI set it) every engine test runs: the skip variables below are refused, not
# ignored quietly, and the suite itself fails when an engine test skipped or did not run (tests/ci_gate.py).
case "$(printf '%s' "${CI:-}" | tr '[:upper:]' '[:lower:]')" in
    "" | 0 | false | no | off) ;;
    *)
        for var in MLA_SKIP_VLLM MLA_SKIP_MLX MLA_SKIP_LLAMACPP; do
            if [ -n "${!var:-}" ] && [ "${!var}" != 0 ]; then
                echo "error: CI=${CI} and ${var}=${!var}: under CI every engine test runs; unset ${var}" >&2
                exit 2
            fi
        done
        ;;
esac
bash scripts/setup.sh
.venv/bin/ruff check mla_convert mla_kernels recipes tests benchmarks
# mypy's cache lives beside the engine venvs (per machine): a fresh clone re-checks only what changed (~40 s cold,
# most of it reading torch's and transformers' types; entries are validated by file hash, so a stale one is redone).
.venv/bin/mypy --cache-dir "$HOME/.cache/mla-convert/mypy" mla_convert mla_kernels
# The suite writes real 135M checkpoints (~0.5 GB each, about 2 GB at its peak) under the temp folder.
tmp=${TMPDIR:-/tmp}
free_mb=$(df -Pm "$tmp" | awk 'NR==2 {print $4}')
echo "free disk under $tmp: ${free_mb} MB (the tests need about 3000 MB)"
if [ "${free_mb:-0}" -lt 3000 ]; then
    echo "warning: less than 3000 MB free under $tmp; tests that save checkpoints may fail (set TMPDIR elsewhere)" >&2
fi
# A real engine: the vLLM CPU venv (built once per machine, ~90 s) for tests/export/test_vllm.py, which fail
# rather than skip here. MLA_SKIP_VLLM=1 skips them (a quick local run; refused under CI).
if [ "${MLA_SKIP_VLLM:-0}" != 1 ]; then
    MLA_VLLM_PYTHON=$(bash scripts/vllm_env.sh)
    export MLA_VLLM_PYTHON MLA_REQUIRE_VLLM=1
fi
# MLX-LM on the CPU (its own venv of MLX's Linux wheels, built once per machine, ~1-3 min) for tests/export/test_mlx.py,
# which fails rather than skips here. MLA_SKIP_MLX=1 skips it (refused under CI).
if [ "${MLA_SKIP_MLX:-0}" != 1 ]; then
    MLA_MLX_PYTHON=$(bash scripts/mlx_env.sh)
    export MLA_MLX_PYTHON MLA_REQUIRE_MLX=1
fi
# A real llama.cpp: llama-cpp-python built from its sdist once per machine (4-9 min on 2 cores) for
# tests/export/test_llamacpp.py, which fail rather than skip here. MLA_SKIP_LLAMACPP=1 skips them (refused
# under CI).
if [ "${MLA_SKIP_LLAMACPP:-0}" != 1 ]; then
    MLA_LLAMACPP_PYTHON=$(bash scripts/llamacpp_env.sh)
    export MLA_LLAMACPP_PYTHON MLA_REQUIRE_LLAMACPP=1
fi
# One pytest process by default. MLA_TEST_WORKERS=N runs N pytest-xdist workers (the test files that read the
# reference conversion as one unit in one of them: tests/conftest.py); on this 2-core machine two workers were slower
# (37 min against 34: the reference conversion competes with the other worker), so it is for machines with more cores.
workers=${MLA_TEST_WORKERS:-0}
.venv/bin/python -m pytest -q --durations=30 -n "$workers" tests "$@"
