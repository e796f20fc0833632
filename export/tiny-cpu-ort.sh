#!/usr/bin/env bash
# Recipe: the tiny random pair (seconds) exported for ONNX Runtime on a CPU, then decoded with the runtime.
# Shows the whole flow; the drafter is random, so its drafts are rarely accepted.
set -euo pipefail
OUT=${OUT:-./tiny-export}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
dflash2 make-tiny --out "$WORK/pair" --block-size 8
dflash2 export --target "$WORK/pair/target" --drafter "$WORK/pair/drafter" --out "$OUT" --max-seq-len 512 --quiet
dflash2 generate --model-dir "$OUT" --backend ort --prompt "Hello world" --max-new-tokens 16 --check-lossless
