#!/usr/bin/env bash
# Recipe: a Qwen3.5-family target (hybrid Gated DeltaNet: transformers qwen3_5 / qwen3_5_moe / qwen3_next; a
# multimodal Qwen3.5 folder exports its text model) with its DFlash 2 drafter on an NVIDIA GPU with TensorRT (>= 10.3).
#   TARGET   HF folder of the target (e.g. a local copy of a Qwen3.5 / 3.8 checkpoint)
#   DRAFTER  DFlash 2 checkpoint folder (z-lab format: config.json + model.safetensors) trained for that target
# fp16 graphs (bf16 and --quantize are refused for these targets); the engines' profiles cover every linear layer's
# state inputs and the backend keeps that state on the GPU (docs/tensorrt.md). Build the DFlash2PathSelector plugin
# first (cmake -S . -B build && cmake --build build -j). Engines only load on the TensorRT version and GPU that built
# them: run this on the deployment machine. Status: written against the documented flags and tested against
# TensorRT fakes only; never run (no GPU with TensorRT here).
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the Qwen3.5-family target}"
: "${DRAFTER:?set DRAFTER to the DFlash 2 checkpoint folder}"
OUT=${OUT:-./qwen3.5-dflash2-trt}
PLUGIN=${PLUGIN:-build/lib/libdflash2_plugins.so}
dflash2 export --target "$TARGET" --drafter "$DRAFTER" --out "$OUT" --dtype fp16 --max-seq-len 4096
dflash2 build-engines "$OUT" --plugin "$PLUGIN" --selector plugin
dflash2 bench --model-dir "$OUT" --backend trt --prompts mtbench --limit 20 --max-new-tokens 256
