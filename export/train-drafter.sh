#!/usr/bin/env bash
# Recipe: train a DFlash 2 drafter for a target, evaluate it, export it for ONNX Runtime -- the four steps the family
# recipes (gemma4-train.sh, nemotron-h-train.sh) run with their own defaults; call it directly for any other target.
#   TARGET      HF folder of the target
#   PROMPTS     a prompt file, one {"text": ..., "chat": true|false} per line (e.g. the UltraChat-200k first turns
#               that export/qwen3-8b-train-8gpu.sh writes)
#   INIT        where the drafter starts: a drafter folder to warm-start from, or `target` (the drafter's layers copy
#               the target's last layers' tensors where their shapes match)
#   WORK        a folder on a disk with room for the feature store (make-data: hidden x 2 bytes x taps per token)
#   ORT_RECIPE  the export recipe of step 4, a file of this folder (e.g. gemma4-ort.sh)
# More knobs, with their defaults below: NPROC, DEVICE, DTYPE, N_PROMPTS, MAX_NEW, STEPS, BATCH, SHARD, LAYERS,
# BLOCK_SIZE, BATCH_SEQS, ANCHORS, MAX_SEQ_LEN, RUN (how dflash2's training commands are started), OUT.
# Status: NEVER RUN on a GPU or a full-size checkpoint (see the family recipes for what did run).
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the target}"
: "${PROMPTS:?set PROMPTS to a prompt file (jsonl)}"
: "${INIT:?set INIT to a drafter folder to warm-start from, or to target}"
: "${WORK:?set WORK to a folder for the data, the drafter and the export}"
: "${ORT_RECIPE:?set ORT_RECIPE to the export recipe of step 4 (e.g. gemma4-ort.sh)}"
NPROC=${NPROC:-8}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
N_PROMPTS=${N_PROMPTS:-64000}
MAX_NEW=${MAX_NEW:-1024}
STEPS=${STEPS:-20000}
RUN=${RUN:-torchrun --standalone --nproc_per_node $NPROC -m dflash2_trt.cli}
OUT=${OUT:-$WORK/export}
mkdir -p "$WORK"
# 1. self-distilled data: the target's own answers at DTYPE, its taps captured as it generates
$RUN make-data --target "$TARGET" --device "$DEVICE" --dtype "$DTYPE" --prompt-file "$PROMPTS" \
  --prompts "$N_PROMPTS" --max-new-tokens "$MAX_NEW" --batch "${BATCH:-32}" --shard-size "${SHARD:-128}" \
  --out "$WORK/data"
# 2. train from INIT (resumable: rerun with --resume appended)
$RUN train --target "$TARGET" --data "$WORK/data" --out "$WORK/drafter" --device "$DEVICE" --dtype "$DTYPE" \
  --init "$INIT" --layers "${LAYERS:-5}" --block-size "${BLOCK_SIZE:-16}" --steps "$STEPS" \
  --batch-seqs "${BATCH_SEQS:-64}" --anchors-per-seq "${ANCHORS:-64}" --heldout-shards 1 --eval-rows 200
# 3. offline tau on the held-out shard
dflash2 eval-tau --target "$TARGET" --drafter "$WORK/drafter" --data "$WORK/data" --heldout-shards 1 \
  --device "$DEVICE" --dtype "$DTYPE"
# 4. export (fp32, ONNX Runtime) and a lossless check
TARGET="$TARGET" DRAFTER="$WORK/drafter" OUT="$OUT" MAX_SEQ_LEN="${MAX_SEQ_LEN:-4096}" \
  bash "$(dirname "$0")/$ORT_RECIPE"
