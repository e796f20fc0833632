#!/usr/bin/env bash
# Recipe: a Qwen3.5-family target (hybrid Gated DeltaNet: transformers qwen3_5 / qwen3_5_moe; a
# multimodal Qwen3.5 folder exports its text model) with its DFlash 2 drafter, on a CPU with ONNX Runtime.
#   TARGET   HF folder of the target (e.g. a local copy of a Qwen3.5 / 3.8 checkpoint)
#   DRAFTER  DFlash 2 checkpoint folder (z-lab format: config.json + model.safetensors) trained for that target
# fp32 graphs (fp16 also exports and is checked at its bounds; bf16 and --quantize are refused for
# these targets). The target graph carries every linear layer's convolution and recurrent state; the runtime keeps
# the state after each accepted prefix (docs/targets.md); libdflash2 runs such an export on ONNX Runtime too
# (runtime/README.md; TensorRT: qwen3.5-zlab-trt.sh). Status: verified on CPU with tiny hybrid pairs (the test suite
# runs this script on `dflash2 make-tiny --arch qwen3_5 --accepting`); never run on a full-size checkpoint here.
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the Qwen3.5-family target}"
: "${DRAFTER:?set DRAFTER to the DFlash 2 checkpoint folder}"
OUT=${OUT:-./qwen3.5-dflash2-ort}
MAX_SEQ_LEN=${MAX_SEQ_LEN:-4096}
dflash2 export --target "$TARGET" --drafter "$DRAFTER" --out "$OUT" --max-seq-len "$MAX_SEQ_LEN"
dflash2 generate --model-dir "$OUT" --backend ort --prompt "${PROMPT:-Write a haiku about speculative decoding.}" \
    --max-new-tokens "${MAX_NEW_TOKENS:-64}" --check-lossless
