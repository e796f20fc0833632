#!/usr/bin/env bash
# Recipe: train a DFlash 2 drafter for a Nemotron-H target (NVIDIA's Nemotron-3.5-Lightning-30B-A3B: a local copy at
# full precision that transformers loads as nemotron_h), evaluate it, export it for ONNX Runtime.
#   TARGET   HF folder of the target
#   PROMPTS  a prompt file, one {"text": ..., "chat": true|false} per line (e.g. the UltraChat-200k first turns that
#            export/qwen3-8b-train-8gpu.sh writes)
#   INIT     a drafter folder to warm-start from (required: the target's attention has no position embeddings, so it
#            gives the drafter no RoPE, and `train` keeps the warm-start drafter's; e.g. NVIDIA's DFlash drafter for
#            this target if its config is z-lab's format -- fetched yourself: its repository id is not known here)
#   WORK     a folder on a disk with room for the feature store (make-data: hidden x 2 bytes x taps per token)
# The drafter's norm epsilon is the target's layer_norm_epsilon (docs/training.md). Status: NEVER RUN on a GPU or a
# full-size checkpoint; its commands run end to end on the CPU with the tiny pair of
# `dflash2 make-tiny --arch nemotron_h --accepting` (tests/test_target_families.py runs make-data, train and eval-tau
# on it).
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the Nemotron-H target}"
: "${PROMPTS:?set PROMPTS to a prompt file (jsonl)}"
: "${INIT:?set INIT to a drafter folder to warm-start from: the target gives no RoPE}"
WORK=${WORK:-./nemotron-h-dflash2}
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
  bash "$(dirname "$0")/nemotron-h-ort.sh"
