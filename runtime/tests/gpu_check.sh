#!/usr/bin/env bash
# GPU check of the C API's TensorRT backend (needs a GPU, TensorRT >= 10.3, an export folder with engines):
#   runtime/tests/gpu_check.sh EXPORT_DIR [BUILD_DIR]
# Builds the root CMake project (plugins + runtime with the TensorRT backend) if BUILD_DIR has no generate
# binary, then for a few prompts compares the token ids that examples/generate.c streams with the Python
# runtime's (dflash2_trt.runtime.decoder over the TensorRT backend), greedy, both selector modes; then the same
# prompts as one dfl2_batch (generate -b: the batched TensorRT runner, up to the engines' --max-batch slots), each
# request against the same Python output. Prints one line per case and exits 1 on any difference.
set -euo pipefail
EXPORT=${1:?usage: gpu_check.sh EXPORT_DIR [BUILD_DIR]}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${2:-$REPO/build/gpu-check}
PY=${PYTHON:-$REPO/.venv/bin/python}
if [ ! -x "$BUILD/bin/generate" ]; then
  cmake -S "$REPO" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release ${TensorRT_ROOT:+-DTensorRT_ROOT=$TensorRT_ROOT}
  cmake --build "$BUILD" -j"$(nproc)"
fi
status=0
PROMPTS=("1 2 3 4" "17 9 250 31 7 100" "42")
declare -A WANT
for mode in greedy viterbi; do
  for prompt in "${PROMPTS[@]}"; do
    want=$(PYTHONPATH=$REPO "$PY" - "$EXPORT" "$mode" $prompt <<'PY'
import sys
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.backends import open_backend
from dflash2_trt.runtime.request import GenerationRequest
be, _ = open_backend(sys.argv[1], "trt")
ids = [int(t) for t in sys.argv[3:]]
req = GenerationRequest(max_new_tokens=32, eos_ids=set(), proposer="dflash2", guard=False)
res = D.speculative_generate(be.target_runner(), be.draft_runner(sys.argv[2]), ids, req)
print(" ".join(map(str, res.tokens)))
PY
)
    got=$("$BUILD/bin/generate" "$EXPORT" $prompt -o max_new_tokens=32 -o eos_ids= -o draft_mode=$mode | tr '\n' ' ' | sed 's/ *$//')
    if [ "$got" == "$want" ]; then echo "ok   $mode [$prompt]"; else echo "DIFF $mode [$prompt]: C '$got' vs Python '$want'"; status=1; fi
    WANT["$mode|$prompt"]=$want
  done
done
for mode in greedy viterbi; do
  args=()
  for prompt in "${PROMPTS[@]}"; do args+=(${args[@]:+,} $prompt); done
  mapfile -t lines < <("$BUILD/bin/generate" "$EXPORT" -b "${args[@]}" -o max_new_tokens=32 -o eos_ids= \
    -o draft_mode=$mode -o adaptive=false || echo "generate -b failed")
  for i in "${!PROMPTS[@]}"; do
    prompt=${PROMPTS[$i]}
    got=${lines[$i]:-}
    want=${WANT["$mode|$prompt"]}
    if [ "$got" == "$want" ]; then echo "ok   batch $mode [$prompt]"; else echo "DIFF batch $mode [$prompt]: C '$got' vs Python '$want'"; status=1; fi
  done
done
exit $status
