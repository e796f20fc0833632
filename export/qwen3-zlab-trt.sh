#!/usr/bin/env bash
# Recipe: a Qwen3 target with a z-lab DFlash 2 drafter on an NVIDIA GPU with TensorRT (>= 10.3).
#   TARGET   HF folder of the target (e.g. a local copy of Qwen3-8B)
#   DRAFTER  z-lab DFlash 2 checkpoint folder (config.json + model.safetensors) trained for that target
# fp16 graphs; engines with the DFlash2PathSelector plugin (build it first: cmake -S . -B build &&
# cmake --build build -j). Engines only load on the TensorRT version and GPU that built them: run this on the
# deployment machine. Status: written against the documented flags, never run (no GPU with TensorRT here).
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the target}"
: "${DRAFTER:?set DRAFTER to the z-lab DFlash 2 checkpoint folder}"
OUT=${OUT:-./qwen3-dflash2-trt}
PLUGIN=${PLUGIN:-build/lib/libdflash2_plugins.so}
PG=${PG:-$OUT.polygraphy}     # a few real input sets per TensorRT-bound graph, for Polygraphy (docs/tensorrt.md)
dflash2 export --target "$TARGET" --drafter "$DRAFTER" --out "$OUT" --dtype fp16 --max-seq-len 4096 \
    --polygraphy-inputs "$PG"
dflash2 build-engines "$OUT" --plugin "$PLUGIN" --selector plugin
# An engine whose outputs look wrong: build it with Polygraphy from the same graph and compare with ONNX Runtime on
# the recorded inputs, one graph at a time (target, drafter_context, drafter_block, drafter_head_greedy):
#   polygraphy run "$OUT/target.onnx" --trt --onnxrt --load-inputs "$PG/target.inputs.json"
dflash2 bench --model-dir "$OUT" --backend trt --prompts mtbench --limit 20 --max-new-tokens 256
