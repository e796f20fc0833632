#!/usr/bin/env bash
# Recipe: train a DFlash 2 drafter for a Gemma 4 target (google/gemma-4-31B-it or the MoE gemma-4-26B-A4B-it: a local
# copy of the released multimodal folder, whose text model is the target), evaluate it, export it for ONNX Runtime.
#   TARGET   HF folder of the target
#   PROMPTS  a prompt file, one {"text": ..., "chat": true|false} per line (e.g. the UltraChat-200k first turns that
#            export/qwen3-8b-train-8gpu.sh writes)
#   INIT     where the drafter starts: a drafter folder to warm-start from (e.g. z-lab's gemma-4-31B-it-DFlash,
#            fetched yourself: no repository id is given here), or `target` (the drafter's layers copy the target's
#            last layers' tensors where their shapes match)
#   WORK     a folder on a disk with room for the feature store (default ./gemma4-dflash2)
# and the knobs of train-drafter.sh, which runs the four steps (make-data, train, eval-tau, gemma4-ort.sh).
# The drafter takes the target's sliding layers' heads, the global layers' RoPE theta and the target's sqrt(hidden)
# embedding scale and logit soft cap (docs/training.md). Status: NEVER RUN on a GPU or a full-size checkpoint; its
# commands run end to end on the CPU with the tiny pair of `dflash2 make-tiny --arch gemma4 --accepting`
# (tests/test_target_families.py runs make-data, train and eval-tau on it).
set -euo pipefail
: "${TARGET:?set TARGET to the HF folder of the Gemma 4 target}"
export INIT=${INIT:-target}
export WORK=${WORK:-./gemma4-dflash2} ORT_RECIPE=gemma4-ort.sh
exec bash "$(dirname "$0")/train-drafter.sh"
