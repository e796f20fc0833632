#!/usr/bin/env bash
# dflash2 bench on SmolLM2-135M-Instruct with ONNX Runtime (CPU): the figures the README quotes.
# The drafter is a random, identity-initialised DFlash 2 drafter (bs 8, 1 layer, rank 64) until a trained
# one exists, so tau ~ 1 and speculative decoding is slower than autoregressive decoding here; what the run
# shows is the pipeline, losslessness, and that tokens/s holds from 128 to 1024 generated tokens (the KV
# cache costs O(length) per cycle, not O(length^2)).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-${DFLASH2_CACHE:-$HOME/.cache/dflash2_trt}/bench}
[ -f "$OUT/drafter/config.json" ] || python benchmarks/make_smollm2_drafter.py --out "$OUT/drafter"
[ -f "$OUT/smollm2/manifest.json" ] || dflash2-export --target smollm2 --drafter "$OUT/drafter" --out "$OUT/smollm2" \
  --max-seq-len 2048
dflash2 bench --model-dir "$OUT/smollm2" --backend ort --prompts mtbench --limit 3 --max-new-tokens 128 \
  --ignore-eos --plot "$OUT/mtbench_acceptance.png"
dflash2 bench --model-dir "$OUT/smollm2" --backend ort --prompts humaneval --limit 1 --max-new-tokens 1024 \
  --ignore-eos --no-oracle
