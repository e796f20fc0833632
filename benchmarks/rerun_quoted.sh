#!/usr/bin/env bash
# Reruns, one after another, the command of every result file that the docs quote and that was first written before
# the scripts recorded their machine (dflash2_trt.bench.machine.describe(): date, commit, CPU, SIMD flags, cores, ONNX
# Runtime version): each is written again with that record (all of them hold one now; rerun to measure them all again
# on one machine). Run it from the repository root on a quiet machine (nothing
# else running: the files' figures are speeds); it prints each command's elapsed time and, at the end, the files
# whose command failed.
#
#   benchmarks/rerun_quoted.sh                 # every file below, into benchmarks/results/
#   benchmarks/rerun_quoted.sh --list          # the file names, one a line; runs nothing
#   benchmarks/rerun_quoted.sh --dry-run       # the commands; runs nothing
#   RESULTS=/tmp/r benchmarks/rerun_quoted.sh verify_rows_codes.json   # some files, elsewhere
#
# Variables: PYTHON (default .venv/bin/python), PEERS_PYTHON (a Python with onnxruntime-genai and llama-cpp-python
# for the two side-by-side files; default $PYTHON), RESULTS (default benchmarks/results).
#
# Each command is the one benchmarks/results/README.md gives for its file, with the same prompt sets, prompt counts
# (20 a set), token counts and repeats as the figures quoted. One change, for cost: the pooled-τ runs decode each
# prompt once each way (`--repeats 1`, not the demo's 3) on 2 ONNX Runtime threads instead of 1 (their quoted figure
# is τ, which neither changes). On the quiet 2-core AMD EPYC VM the files come from, the whole run should take about
# 100-120 minutes (estimated from the files' own token counts and speeds; most of it the two side-by-side runs, ~45
# min), plus any export not yet in the cache (block sizes 4 and 6, the q8_0 drafter, the int4 target: a few minutes
# each) and onnxruntime-genai's model builds.
#
# After the run: tests/test_doc_figures.py names every passage whose figures moved (the text the document should
# read), and the files that now record their machine (to take out of its NO_MACHINE_BLOCK list).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
PEERS_PYTHON=${PEERS_PYTHON:-$PYTHON}
RESULTS=${RESULTS:-benchmarks/results}
SETS=(humaneval mtbench benchmarks/prompts/long_code.jsonl)
SBS=(--sets "${SETS[@]}" --limit 20 --max-new-tokens 128 --block-size 3 --draft-vocab 4096 --threads 2)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Each job: its result file's name, then the command that writes it (an environment assignment may come first).
jobs() {
  job side_by_side_codes.json "$PEERS_PYTHON" benchmarks/ort_side_by_side.py "${SBS[@]}" --precisions none \
    --proposers dflash2 auto --genai-precisions fp32 --out "$RESULTS/side_by_side_codes.json"
  job side_by_side_int4_panels.json "$PEERS_PYTHON" benchmarks/ort_side_by_side.py "${SBS[@]}" --precisions int4 \
    --proposers auto --genai-precisions int4 --out "$RESULTS/side_by_side_int4_panels.json"
  job cpu_options_codes_bs346.json "$PYTHON" benchmarks/cpu_options.py --exports 3:4096 4:4096 6:4096 --guard on \
    --prompts humaneval mtbench --limit 20 --max-new-tokens 128 --threads 2 \
    --out "$RESULTS/cpu_options_codes_bs346.json"
  job cpu_options_q8_0.json "$PYTHON" benchmarks/cpu_options.py --exports 0:4096 0:4096:q8_0 --guard on \
    --prompts humaneval mtbench --limit 20 --max-new-tokens 128 --out "$RESULTS/cpu_options_q8_0.json"
  job tau_pooled_humaneval.json demo_file tau_pooled_humaneval.json "" --prompts humaneval --limit 20 \
    --max-new-tokens 128 --no-guard --no-oracle --threads 2 --repeats 1 --json --proposer dflash2
  job tau_pooled_mtbench.json demo_file tau_pooled_mtbench.json "" --prompts mtbench --limit 20 \
    --max-new-tokens 128 --no-guard --no-oracle --threads 2 --repeats 1 --json --proposer dflash2
  job sampling_t08_panels.json sampling_t08
  job verify_rows_codes.json "$PYTHON" benchmarks/verify_rows.py --threads 2 1 --rows 1 2 3 4 --cached 256 1024 2032 \
    --attention decode --repeats 7 --out "$RESULTS/verify_rows_codes.json"
  job verify_rows_codes_off.json env DFLASH2_ORT_PANEL_CODES=0 "$PYTHON" benchmarks/verify_rows.py --threads 2 1 \
    --rows 1 2 3 4 --cached 256 1024 2032 --attention decode --repeats 7 --out "$RESULTS/verify_rows_codes_off.json"
  job batch_throughput_128.json "$PYTHON" benchmarks/batch_throughput.py --threads 2 --tokens 128 --repeats 2 \
    --streams 1 2 4 8 16 --spec --out "$RESULTS/batch_throughput_128.json"
  job batch_throughput_codes.json "$PYTHON" benchmarks/batch_throughput.py --threads 2 --tokens 64 --repeats 1 \
    --streams 1 8 16 --out "$RESULTS/batch_throughput_codes.json"
  job batch_step_profile.json "$PYTHON" benchmarks/batch_step_profile.py --batch 1 8 16 --threads 2 1 --cached 128 \
    --out "$RESULTS/batch_step_profile.json"
  job triton_throughput_adaptive_vs_ar.json env DFLASH2_ORT_SPINNING=0 "$PYTHON" benchmarks/triton_throughput.py \
    --servers batched_ar adaptive --streams 1 2 4 8 16 --tokens 128 --repeats 4 \
    --out "$RESULTS/triton_throughput_adaptive_vs_ar.json"
  job triton_throughput_codes.json env DFLASH2_ORT_SPINNING=0 "$PYTHON" benchmarks/triton_throughput.py \
    --servers batched_ar adaptive --streams 1 4 8 16 --tokens 128 --repeats 4 \
    --out "$RESULTS/triton_throughput_codes.json"
  job serve_concurrency.json env DFLASH2_ORT_SPINNING=0 "$PYTHON" benchmarks/serve_concurrency.py --threads 2 \
    --tokens 128 --repeats 3 --streams 1 4 8 16 --out "$RESULTS/serve_concurrency.json"
}

# `dflash2 demo --json` prints its figures without the machine: the machine module writes the file around them.
demo_file() {  # NAME SUFFIX DEMO-ARGS...
  local name=$1 suffix=$2
  shift 2
  "$PYTHON" -m dflash2_trt.cli demo "$@" > "$TMP/$name$suffix" || return 1
  [[ -z $suffix ]] || return 0  # a part of a joined file
  "$PYTHON" -m dflash2_trt.bench.machine --out "$RESULTS/$name" --command "dflash2 demo $*" "$TMP/$name"
}

sampling_t08() {  # the two sets' outputs joined under their names
  local args=(--limit 20 --temperature 0.8 --max-new-tokens 128 --json)
  demo_file sampling_t08_panels.json .humaneval --prompts humaneval "${args[@]}" &&
    demo_file sampling_t08_panels.json .mtbench --prompts mtbench "${args[@]}" &&
    "$PYTHON" -m dflash2_trt.bench.machine --out "$RESULTS/sampling_t08_panels.json" \
      --command "dflash2 demo --prompts humaneval ${args[*]}, then --prompts mtbench" \
      humaneval="$TMP/sampling_t08_panels.json.humaneval" mtbench="$TMP/sampling_t08_panels.json.mtbench"
}

MODE=run
WANT=()
for arg in "$@"; do
  case $arg in
    --list) MODE=list ;;
    --dry-run) MODE=dry ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "rerun_quoted.sh: unknown option $arg" >&2; exit 2 ;;
    *) WANT+=("$arg") ;;
  esac
done

NAMES=()
job() { NAMES+=("$1"); }
jobs
for w in "${WANT[@]}"; do
  [[ " ${NAMES[*]} " == *" $w "* ]] || { echo "rerun_quoted.sh: $w is not one of its files (--list)" >&2; exit 2; }
done

# ort_side_by_side.py leaves out a peer it cannot import: without both, its file would lack the quoted rows
if [[ $MODE == run && ( ${#WANT[@]} -eq 0 || " ${WANT[*]} " == *" side_by_side"* ) ]] &&
    ! "$PEERS_PYTHON" -c "import onnxruntime_genai, llama_cpp" 2>/dev/null; then
  echo "rerun_quoted.sh: the side-by-side files need onnxruntime-genai and llama-cpp-python in PEERS_PYTHON" \
    "($PEERS_PYTHON); name the other files to run them alone" >&2
  exit 2
fi

FAILED=()
T0=$SECONDS
job() {
  local name=$1
  shift
  [[ ${#WANT[@]} -eq 0 || " ${WANT[*]} " == *" $name "* ]] || return 0
  case $MODE in
    list) echo "$name"; return 0 ;;
    dry) echo "$name: $*"; return 0 ;;
  esac
  echo "== $name: $*"
  local t=$SECONDS
  "$@" || FAILED+=("$name")
  echo "== $name: $((SECONDS - t)) s"
}
[[ $MODE != run ]] || mkdir -p "$RESULTS"
jobs
[[ $MODE == run ]] || exit 0
echo "== all: $((SECONDS - T0)) s"
if ((${#FAILED[@]})); then
  echo "rerun_quoted.sh: failed: ${FAILED[*]}" >&2
  exit 1
fi
