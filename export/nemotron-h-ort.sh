#!/usr/bin/env bash
# Recipe: a Nemotron-H target (transformers nemotron_h: Mamba-2, MoE and attention layers) with its DFlash drafter --
# NVIDIA's DFlash drafter for Nemotron-3.5-Lightning-30B-A3B -- on a CPU with ONNX Runtime.
#   TARGET   HF folder of the target at full precision (a local copy that transformers loads as nemotron_h; the NVFP4
#            checkpoint made for DGX Spark / Jetson Thor is not loaded by this export: untested here)
#   DRAFTER  the drafter's folder (config.json + safetensors). This recipe downloads nothing and names no repository:
#            NVIDIA's drafter repository id is not known here for certain -- fetch it yourself. A drafter whose
#            config is not z-lab's DFlash / DFlash 2 format is refused by `dflash2 export` in one line.
# fp32 graphs (fp16 exports but is not run here; bf16 and --quantize are refused for these targets). Each Mamba-2
# layer's convolution and SSM state are graph inputs / outputs, one SSM state per verify row, and the runtime keeps
# the state after each accepted prefix; MoE layers route as graph ops (docs/targets.md). libdflash2 runs such an
# export on ONNX Runtime too (runtime/README.md). Status: its commands verified on CPU with the tiny pair of
# `dflash2 make-tiny --arch nemotron_h --accepting`; NEVER RUN on a full-size checkpoint or NVIDIA's drafter here.
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the Nemotron-H target}"
: "${DRAFTER:?set DRAFTER to the drafter checkpoint folder}"
OUT=${OUT:-./nemotron-h-dflash2-ort}
MAX_SEQ_LEN=${MAX_SEQ_LEN:-4096}
dflash2 export --target "$TARGET" --drafter "$DRAFTER" --out "$OUT" --max-seq-len "$MAX_SEQ_LEN"
dflash2 generate --model-dir "$OUT" --backend ort --prompt "${PROMPT:-Write a haiku about speculative decoding.}" \
    --max-new-tokens "${MAX_NEW_TOKENS:-64}" --check-lossless
