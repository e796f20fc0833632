#!/usr/bin/env bash
# Recipe: a sliding-window target (transformers gpt_oss: gpt-oss-20b / 120b; muse_glimmer: a Muse Glimmer folder,
# whose text model is the target) with its DFlash 2 / DFlash drafter, on a CPU with ONNX Runtime.
#   TARGET   HF folder of the target
#   DRAFTER  drafter checkpoint folder (z-lab format: config.json + model.safetensors) trained for that target
# fp32 graphs. Full-attention layers keep a KV cache of the context; each sliding layer keeps a ring buffer of its
# window plus a verify's rows (manifest target.sliding_window), so its memory does not grow with the context
# (docs/targets.md). The C API's own backends refuse such an export in one line (TensorRT: sliding-window-trt.sh). Status:
# verified on CPU with a tiny random gpt-oss pair (the test suite runs this script on `dflash2 make-tiny --arch
# gpt_oss`); never run on a full-size checkpoint here.
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the gpt-oss or Muse Glimmer target}"
: "${DRAFTER:?set DRAFTER to the drafter checkpoint folder}"
OUT=${OUT:-./sliding-dflash2-ort}
MAX_SEQ_LEN=${MAX_SEQ_LEN:-4096}
dflash2 export --target "$TARGET" --drafter "$DRAFTER" --out "$OUT" --max-seq-len "$MAX_SEQ_LEN"
dflash2 generate --model-dir "$OUT" --backend ort --prompt "${PROMPT:-Write a haiku about speculative decoding.}" \
    --max-new-tokens "${MAX_NEW_TOKENS:-64}" --check-lossless
