#!/usr/bin/env bash
# Set-up (idempotent) + the demo: a tiny random target/drafter pair, then lossless speculative decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
out=${DEMO_DIR:-out/demo}
dflash2 make-tiny --out "$out"
dflash2 generate --target "$out/target" --drafter "$out/drafter" --prompt "Hello world" \
  --max-new-tokens 32 --check-lossless "$@"
