#!/usr/bin/env bash
# Build (once per machine) the venv that runs MLX-LM on the CPU (MLX's Linux CPU wheels), and print its python.
#
#   bash scripts/mlx_env.sh            -> prints e.g. ~/.cache/mla-convert/mlx-3f2a.../bin/python
#
# The venv lives in $MLA_MLX_VENV_ROOT (default ~/.cache/mla-convert), named by a hash of scripts/mlx.txt: a
# change of pins builds a new one. It is built in a temporary sibling and renamed into place only when mlx_lm
# imports, so an interrupted build is never reused. No torch: mla_convert/engines/mlx/probe.py imports only MLX-LM.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pins="$here/mlx.txt"
root="${MLA_MLX_VENV_ROOT:-$HOME/.cache/mla-convert}"
hash=$(sha256sum "$pins" | cut -c1-12)
venv="$root/mlx-$hash"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
    echo "$venv/bin/python"
    exit 0
fi
mkdir -p "$root"
tmp="$root/.mlx-$hash.tmp.$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
echo "mlx_env: building $venv (about 60 s with the package registry; once per machine)" >&2
PY=${PYTHON:-python3}
"$PY" -m venv "$tmp" >&2
"$tmp/bin/python" -m pip install -q --upgrade pip >&2 2>/dev/null || true
"$tmp/bin/python" -m pip install -q -r "$pins" >&2 2> >(grep -v "^WARNING: Location" >&2)
"$tmp/bin/python" -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx_lm', mlx_lm.__version__, mx.default_device())" >&2
touch "$tmp/.complete"
# venvs hard-code their path in scripts; python -m works from any path, and we only call bin/python
rm -rf "$venv"
mv "$tmp" "$venv"
# the console scripts (vllm, mlx_lm.generate, ...) and bin/activate name the build folder: point them at the venv
grep -rlI -- "$tmp" "$venv/bin" 2>/dev/null | while read -r f; do sed -i "s|$tmp|$venv|g" "$f"; done
trap - EXIT
echo "mlx_env: built in $(( $(date +%s) - start )) s" >&2
echo "$venv/bin/python"
