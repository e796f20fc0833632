#!/usr/bin/env bash
# Recipe: a sliding-window target (transformers gpt_oss: gpt-oss-20b / 120b; muse_glimmer: a Muse Glimmer folder,
# whose text model is the target) with its DFlash 2 / DFlash drafter on an NVIDIA GPU with TensorRT (>= 10.3).
#   TARGET   HF folder of the target
#   DRAFTER  drafter checkpoint folder (z-lab format: config.json + model.safetensors) trained for that target
# fp16 graphs; each sliding layer keeps a ring buffer of window + a verify's rows on the GPU (the engines' profiles
# fix its size; docs/tensorrt.md). Build the DFlash2PathSelector plugin first (cmake -S . -B build && cmake --build
# build -j). Engines only load on the TensorRT version and GPU that built them: run this on the deployment machine.
# Status: written against the documented flags and tested against TensorRT fakes only; never run (no GPU with
# TensorRT here).
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the gpt-oss or Muse Glimmer target}"
: "${DRAFTER:?set DRAFTER to the drafter checkpoint folder}"
OUT=${OUT:-./sliding-dflash2-trt}
PLUGIN=${PLUGIN:-build/lib/libdflash2_plugins.so}
dflash2 export --target "$TARGET" --drafter "$DRAFTER" --out "$OUT" --dtype fp16 --max-seq-len 4096
dflash2 build-engines "$OUT" --plugin "$PLUGIN" --selector plugin
dflash2 bench --model-dir "$OUT" --backend trt --prompts mtbench --limit 20 --max-new-tokens 256
