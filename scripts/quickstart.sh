#!/usr/bin/env bash
# The main job on the bundled real model: set up, convert SmolLM2-135M to MLA at 31.25 % of its KV cache
# (report + manifest in out/smollm2-mla), verify the manifest, validate it (kernel, decode, cache ledger),
# and generate text through the latent cache.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/mla-convert factor smollm2-135m out/smollm2-mla --overwrite "$@"
.venv/bin/mla-convert manifest verify out/smollm2-mla
.venv/bin/mla-convert validate out/smollm2-mla
.venv/bin/mla-convert generate out/smollm2-mla "The history of Paris" --max-new-tokens 32
