#!/usr/bin/env bash
# Recipe: train a DFlash 2 drafter for Qwen3-8B on one 8-GPU node (80 GB H100 class), evaluate it, export it.
#   TARGET   HF folder of Qwen3-8B (e.g. `huggingface-cli download Qwen/Qwen3-8B --local-dir ...`); the same
#            recipe fits Llama-3.1-8B-Instruct (its numbers below are within ~10 %). A Qwen3.5-family (hybrid
#            Gated DeltaNet) target trains with the same flags (make-data, train and eval-tau run it through
#            transformers; --target-layer-ids taps any of its layers, linear or attention); its export is step 5 of
#            export/qwen3.5-zlab-ort.sh (fp32, ONNX Runtime: TensorRT does not run such exports yet)
#   WORK     a folder on a disk with ~3 TB free (the feature store, see below)
# Status: written against the documented flags, NEVER RUN on a GPU; the CPU twins of
# every step (2-process torchrun make-data and train, kill + --resume, bf16) run in tests/test_train_distributed.py.
# Every figure below is an ESTIMATE with its arithmetic, not a measurement.
#
# Steps (docs/training.md): prompts (UltraChat-200k first turns, MIT licence; the benchmark 8-gram filter drops any that
# overlap HumanEval / MT-Bench) -> make-data (the target's own answers + its tap features, at the dtype it
# will be deployed in) -> train (DDP over 8 GPUs) -> eval-tau (offline τ on held-out shards) -> export (ONNX +
# TensorRT engines, as qwen3-zlab-trt.sh).
#
# DTYPE: the labels are the target's greedy chain *at this dtype* (meta.json records it); fp16 because the
# TensorRT export below runs the target in fp16. A bf16 deployment (vLLM, z-lab's code) wants DTYPE=bf16.
#
# -- Estimates (Qwen3-8B: 8.19 B params, H 4096, 36 layers, 8 KV heads x 128, vocab 151,936; taps 1,9,17,25,33) --
# make-data, per GPU, --batch 64, prompt <= 1024 + 1024 new tokens:
#   weights 8.19e9 x 2 B = 16.4 GB; KV cache 36 x 2 x 8 x 128 x 2 B = 147 KB/token x 64 x 2048 = 19.3 GB;
#   prefill hidden states (all 37 kept by output_hidden_states) 37 x 64 x 1024 x 4096 x 2 B = 19.9 GB, transient
#   -> peak <= ~62 GB of 80. Host RAM: a shard's features wait in memory until written: 128 rows x 2048 x 20480
#   x 2 B = 10.7 GB, x2 while concatenated = ~21 GB per rank, ~170 GB for 8 ranks (hence --shard-size 128).
# make-data, disk: 5 taps x 4096 x 2 B = 40 KB of features per token (+ 52 B ids / top-k);
#   64k prompts x ~950 tokens (150 prompt + ~800 answer) = 6.1e7 tokens x 41 KB = ~2.5 TB.
# make-data, time: batched HF decoding is memory-bound, ~30 ms per step of 64 rows -> ~2,100 tok/s per GPU,
#   ~17k tok/s per node; 64k x 800 = 5.1e7 tokens / 17k = 3,000 s, x1.5 for rows finishing early (the batch
#   shrinks) = ~1.3 h.
# train, per GPU: drafter 1.17 B params (5 layers 1,007 M + fc 84 M + selector 79 M; counted from
#   DFlash2Drafter); fp32 weights + grads + AdamW m, v = 16 B/param = 18.7 GB, DDP buckets +4.7 GB, frozen
#   embedding + LM head 2 x 151,936 x 4096 x 2 B = 2.5 GB -> ~26 GB static. A micro-batch of 4 rows x 64
#   anchors = 256 blocks: per-block context K/V 256 x 8 x 2048 x 128 x 2 B = 1.07 GB per K or V per layer x 10
#   = 10.7 GB, attention scores ~5 GB, full-vocabulary logits 256 x 15 x 151,936 x 4 B = 2.3 GB (x ~2.5 with
#   their gradient) -> ~25 GB of activations; peak ~51 GB of 80.
# train, time: per row (~1000 tokens, 64 anchors) forward = context 126 M params x 2 x 1000 = 0.25 TFLOP +
#   blocks 64 x 16 x 1,007 M x 2 = 2.06 + attention 0.26 + LM head 64 x 15 x 4096 x 151,936 x 2 = 1.19
#   = 3.8 TFLOP, x3 with backward = 11.3 TFLOP; 6 epochs x 64k rows = 3.84e5 rows -> 4.3e18 FLOP / (8 x 989
#   TFLOP/s x 25 % MFU) = 2,200 s; reading the feature store 6 x 2.5 TB at ~6 GB/s = 2,500 s (not overlapped
#   with compute) -> ~1.3 h, say 1.5-3 h.
# Whole recipe: ~3-5 h of one node. Scale: 2.5 TB per 64k prompts; published drafters use 0.8-2 M samples —
# that many need ~30-80 TB of features (or several nodes' disks: see multi-node below).
#
# -- Multi-node: torchrun's own rendezvous (WORK on a filesystem every node mounts; rank 0 writes meta.json,
# the log and the checkpoints, every rank writes its own shards), on each of N nodes:
#   torchrun --nnodes N --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HEAD_HOST:29500 \
#            --rdzv_id dflash2-qwen3 -m dflash2_trt.cli make-data|train ...
# (or the static form: --nnodes N --node_rank R --master_addr HEAD_HOST --master_port 29500).
set -euo pipefail
: "${TARGET:?set TARGET to the Qwen3-8B HF folder}"
WORK=${WORK:-./qwen3-8b-dflash2}
NPROC=${NPROC:-8}
DTYPE=${DTYPE:-fp16}
N_PROMPTS=${N_PROMPTS:-64000}
PLUGIN=${PLUGIN:-build/lib/libdflash2_plugins.so}
OUT=${OUT:-$WORK/export}  # the export folder
RUN="torchrun --standalone --nproc_per_node $NPROC -m dflash2_trt.cli"
mkdir -p "$WORK"

# 1. prompts: first user turns of UltraChat-200k (needs huggingface_hub + pyarrow)
if [ ! -f "$WORK/prompts.jsonl" ]; then
  huggingface-cli download HuggingFaceH4/ultrachat_200k --repo-type dataset --include "data/train_sft-*.parquet" \
    --local-dir "$WORK/ultrachat"
  python - "$WORK" <<'EOF'
import glob, json, sys
import pyarrow.parquet as pq
work = sys.argv[1]
with open(f"{work}/prompts.jsonl", "w") as f:
    for path in sorted(glob.glob(f"{work}/ultrachat/data/train_sft-*.parquet")):
        for text in pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist():
            if text and text.strip():
                f.write(json.dumps({"text": text, "chat": True}) + "\n")
EOF
fi

# 2. self-distilled data: the target answers (greedy; every 4th batch at T = 1), taps captured as it generates
$RUN make-data --target "$TARGET" --device cuda --dtype "$DTYPE" --prompt-file "$WORK/prompts.jsonl" \
  --prompts "$N_PROMPTS" --max-prompt-tokens 1024 --max-new-tokens 1024 --batch 64 --shard-size 128 \
  --out "$WORK/data"

# 3. train (resumable: after a failure rerun with --resume appended; a kill loses at most --checkpoint-every steps)
#    global batch 64 rows = 8 GPUs x 4 rows x --grad-accum 2; 6 epochs; full-vocabulary CE on GPUs
$RUN train --target "$TARGET" --data "$WORK/data" --out "$WORK/drafter" --device cuda --dtype "$DTYPE" \
  --layers 5 --init target --block-size 16 --selector-rank 256 --batch-seqs 64 --grad-accum 2 \
  --anchors-per-seq 64 --epochs 6 --lr 6e-4 --sampled-softmax 0 --checkpoint-every 200 --heldout-shards 2 \
  --eval-rows 200 --eval-every 1000

# 4. offline τ on the held-out shards (one GPU, seconds to minutes)
dflash2 eval-tau --target "$TARGET" --drafter "$WORK/drafter" --data "$WORK/data" --heldout-shards 2 \
  --rows 400 --device cuda --dtype "$DTYPE"

# The drafter folder is z-lab's format (config.json with architectures ["DFlash2DraftModel"] + dflash_config,
# model.safetensors with the released tensor names; fp32 master weights). z-lab's release ships bf16:
python -c "import sys, torch; from dflash2_trt.model import load_drafter, save_drafter; \
save_drafter(load_drafter(sys.argv[1]), sys.argv[2], torch.bfloat16)" "$WORK/drafter" "$WORK/drafter-bf16"

# 5. export (ONNX, fp16) and TensorRT engines on this machine (engines are tied to its GPU and TensorRT)
dflash2 export --target "$TARGET" --drafter "$WORK/drafter" --out "$OUT" --dtype fp16 --max-seq-len 4096
dflash2 build-engines "$OUT" --plugin "$PLUGIN" --selector plugin
dflash2 bench --model-dir "$OUT" --backend trt --prompts mtbench --limit 20 --max-new-tokens 256
