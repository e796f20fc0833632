#!/usr/bin/env bash
# Set-up (idempotent) + the demo: a tiny random target/drafter pair -> dflash2-export (ONNX, atomic)
# -> lossless speculative decoding with the runtime (TensorRT when it can run, else ONNX Runtime).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
out=${DEMO_DIR:-out/demo}
dflash2 make-tiny --out "$out"
dflash2-export --target "$out/target" --drafter "$out/drafter" --out "$out/export"
dflash2 generate --model-dir "$out/export" --backend auto --prompt "Hello world" --max-new-tokens 32 \
  --check-lossless "$@"
