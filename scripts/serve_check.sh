#!/usr/bin/env bash
# A real engine on the reference export: build (once) the vLLM CPU venv, convert the bundled SmolLM2 with the
# README's defaults (or take CKPT), export it with --target vllm-cpu, serve it with vLLM's offline LLM and compare
# with our model (mla_convert/engines/vllm/check.py). Writes benchmarks/results/vllm_parity.{json,md} and the
# vllm-parity block (benchmarks/readme.py vllm-parity); exits 1 when vLLM does not compute what our model computes.
#
#   bash scripts/serve_check.sh [CKPT] [--no-readme]
#
# About 4 minutes here without CKPT (the conversion is 2 of them), plus 90 s the first time for the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
ckpt="" readme=1
for arg in "$@"; do
    case "$arg" in
        --no-readme) readme=0 ;;
        *) ckpt="$arg" ;;
    esac
done
vpy=$(bash scripts/vllm_env.sh)
work=$(mktemp -d "${TMPDIR:-/tmp}/mla-serve-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ -z "$ckpt" ]; then
    ckpt="$work/smollm2-mla"
    echo "serve_check: converting the reference (mla-convert factor smollm2-135m, --device cpu)"
    .venv/bin/mla-convert --quiet factor smollm2-135m "$ckpt" --device cpu
fi
echo "serve_check: exporting $ckpt with --target vllm-cpu"
.venv/bin/mla-convert export "$ckpt" "$work/export" --target vllm-cpu
echo "serve_check: vLLM's CPU rotary kernel on DeepSeek's shapes (the fault the workaround avoids):"
"$vpy" scripts/vllm_rotary_check.py 2>/dev/null | tail -1
mkdir -p benchmarks/results
status=0
.venv/bin/python -m mla_convert.engines.vllm.check "$ckpt" "$work/export" --vllm-python "$vpy" \
    --json benchmarks/results/vllm_parity.json --table benchmarks/results/vllm_parity.md \
    --what "bash scripts/serve_check.sh" || status=$?
if [ "$readme" = 1 ] && [ "$status" = 0 ]; then
    .venv/bin/python benchmarks/readme.py vllm-parity  # the block from vllm_parity.json (README or docs/)
fi
exit $status
