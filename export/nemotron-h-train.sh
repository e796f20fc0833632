#!/usr/bin/env bash
# Recipe: train a DFlash 2 drafter for a Nemotron-H target (NVIDIA's Nemotron-3.5-Lightning-30B-A3B: a local copy at
# full precision that transformers loads as nemotron_h), evaluate it, export it for ONNX Runtime.
#   TARGET   HF folder of the target
#   PROMPTS  a prompt file, one {"text": ..., "chat": true|false} per line (e.g. the UltraChat-200k first turns that
#            export/qwen3-8b-train-8gpu.sh writes)
#   INIT     a drafter folder to warm-start from (required: the target's attention has no position embeddings, so it
#            gives the drafter no RoPE, and `train` keeps the warm-start drafter's; e.g. NVIDIA's DFlash drafter for
#            this target if its config is z-lab's format -- fetched yourself: its repository id is not known here)
#   WORK     a folder on a disk with room for the feature store (default ./nemotron-h-dflash2)
# and the knobs of train-drafter.sh, which runs the four steps (make-data, train, eval-tau, nemotron-h-ort.sh).
# The drafter's norm epsilon is the target's layer_norm_epsilon (docs/training.md). Status: NEVER RUN on a GPU or a
# full-size checkpoint; its commands run end to end on the CPU with the tiny pair of
# `dflash2 make-tiny --arch nemotron_h --accepting` (tests/test_target_families.py runs make-data, train and eval-tau
# on it).
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the Nemotron-H target}"
: "${INIT:?set INIT to a drafter folder to warm-start from: the target gives no RoPE}"
export INIT
export WORK=${WORK:-./nemotron-h-dflash2} ORT_RECIPE=nemotron-h-ort.sh
exec bash "$(dirname "$0")/train-drafter.sh"
