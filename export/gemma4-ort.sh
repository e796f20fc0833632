#!/usr/bin/env bash
# Recipe: a Gemma 4 target (transformers gemma4: the released multimodal folder, whose text model is the target, or
# gemma4_text) with its DFlash 2 / DFlash drafter -- z-lab's gemma-4-31B-it-DFlash (for google/gemma-4-31B-it) or
# gemma-4-26B-A4B-it-DFlash (for the MoE google/gemma-4-26B-A4B-it) -- on a CPU with ONNX Runtime.
#   TARGET   HF folder of the target (a local copy)
#   DRAFTER  drafter checkpoint folder (z-lab format: config.json + model.safetensors) trained for that target; this
#            recipe downloads nothing: fetch both checkpoints yourself (their repository ids are not given here)
# fp32 graphs. The drafter applies the target's sqrt(hidden) embedding scale and logit soft cap (taken from the
# target where its config leaves them unset). Global layers keep a KV cache of the context, sliding layers a ring
# of their window plus a verify's rows; every layer's keys are folded into one buffer shape, and a shared layer keeps
# a copy of its source layer's; the 26B-A4B's MoE layers route as graph ops (docs/targets.md). Refused by the export
# check in one line: per-layer-input embeddings (the small "E" models: run them on the PyTorch reference instead,
# `dflash2 generate --target "$TARGET" --drafter "$DRAFTER" --prompt ...`). Status: its commands verified on CPU with
# the tiny pair of `dflash2 make-tiny --arch gemma4 --accepting`; the 26B-A4B's shape tested on a tiny random target
# (tests/test_gemma_target.py); NEVER RUN on a full-size checkpoint here.
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the Gemma 4 target}"
: "${DRAFTER:?set DRAFTER to the drafter checkpoint folder}"
OUT=${OUT:-./gemma4-dflash2-ort}
MAX_SEQ_LEN=${MAX_SEQ_LEN:-4096}
dflash2 export --target "$TARGET" --drafter "$DRAFTER" --out "$OUT" --max-seq-len "$MAX_SEQ_LEN"
dflash2 generate --model-dir "$OUT" --backend ort --prompt "${PROMPT:-Write a haiku about speculative decoding.}" \
    --max-new-tokens "${MAX_NEW_TOKENS:-64}" --check-lossless
