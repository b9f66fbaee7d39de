#!/usr/bin/env bash
# Build (once per machine) the venv that runs a real llama.cpp (llama-cpp-python from its sdist, CPU), and print
# its python.
#
#   bash scripts/llamacpp_env.sh        -> prints e.g. ~/.cache/mla-convert/llamacpp-3f2a.../bin/python
#
# The venv lives in $MLA_LLAMACPP_VENV_ROOT (default ~/.cache/mla-convert), named by a hash of this script and
# scripts/llamacpp.txt: a change of pins or build flags builds a new one (about 9 minutes on 2 cores). It is built
# in a temporary sibling and renamed into place only when llama_cpp imports, so an interrupted build is never
# reused. GGML_NATIVE=OFF: the library runs on any x86-64 with AVX2 (a cache copied to another CPU still works);
# tests, examples, tools and the server are not built. The sdist's llama.cpp sources (convert_hf_to_gguf.py and
# gguf-py, for the converter check) are kept under $venv/llama.cpp.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pins="$here/llamacpp.txt"
root="${MLA_LLAMACPP_VENV_ROOT:-$HOME/.cache/mla-convert}"
hash=$(cat "$pins" "$here/llamacpp_env.sh" | sha256sum | cut -c1-12)
venv="$root/llamacpp-$hash"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
    echo "$venv/bin/python"
    exit 0
fi
mkdir -p "$root"
tmp="$root/.llamacpp-$hash.tmp.$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
echo "llamacpp_env: building $venv (about 9 minutes on 2 cores; once per machine)" >&2
PY=${PYTHON:-python3}
"$PY" -m venv "$tmp" >&2
"$tmp/bin/python" -m pip install -q --upgrade pip >&2 2>/dev/null || true
spec=$(grep -E '^llama-cpp-python==' "$pins")
"$tmp/bin/python" -m pip download -q --no-deps --no-binary :all: "$spec" -d "$tmp/sdist" >&2
mkdir -p "$tmp/src"
tar xzf "$tmp"/sdist/*.tar.gz -C "$tmp/src" --strip-components 1
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=ON"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
grep -vE '^llama-cpp-python==' "$pins" | "$tmp/bin/python" -m pip install -q -r /dev/stdin >&2
"$tmp/bin/python" -m pip install -q "$tmp/src" >&2
mkdir -p "$tmp/llama.cpp"
cp "$tmp/src/vendor/llama.cpp/convert_hf_to_gguf.py" "$tmp/llama.cpp/"
cp -r "$tmp/src/vendor/llama.cpp/gguf-py" "$tmp/llama.cpp/"
[ -d "$tmp/src/vendor/llama.cpp/conversion" ] && cp -r "$tmp/src/vendor/llama.cpp/conversion" "$tmp/llama.cpp/"
rm -rf "$tmp/src" "$tmp/sdist"
"$tmp/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)" >&2
touch "$tmp/.complete"
rm -rf "$venv"
mv "$tmp" "$venv"
trap - EXIT
echo "llamacpp_env: built in $(( $(date +%s) - start )) s" >&2
echo "$venv/bin/python"
