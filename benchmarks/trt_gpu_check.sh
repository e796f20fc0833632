#!/usr/bin/env bash
# GPU check of the TensorRT path on a machine WITH TensorRT (NVIDIA GPU, CUDA toolkit + CMake, the tensorrt
# Python package 10.3+ or 11.x, cuda-python, and this project's torch/export/ort extras). Tiny export only;
# budget 10 minutes. For a GPU machine without TensorRT use plugins/tests/gpu_check.sh.
#
#   benchmarks/trt_gpu_check.sh [--work DIR] [--kernel-lens WHEEL | --trt-include DIR] [--arch N|native]
#                               [--python PY] [--dry-run] [-- trt_gpu_check.py options]
#
#   --work DIR          work folder (default build/trt-gpu-check under the repository root)
#   --kernel-lens WHEEL TensorRT 10.14 headers for the plugin build (TensorRT 10 hosts only)
#   --trt-include DIR   TensorRT headers of the installed major (needed for TensorRT 11: pip wheels ship none)
#   --arch              CUDA architecture of the plugin build (default native)
#
# Steps: 1. version check (python tensorrt major vs the headers' major: one build per major);
#        2. plugin library built (plugins/tests/gpu_check.sh --build-only, -Werror);
#        3. dflash2 make-tiny + dflash2 export (tiny pair, fp32, max 256 positions);
#        4. dflash2 build-engines --selector both (plugin and decomposed heads);
#        5. benchmarks/trt_gpu_check.py: double load_library, several contexts on one profile, capture/replay
#           bit-equal to eager, plugin head = decomposed head, target logits vs ORT (first divergence and its
#           logit margin), graph vs eager decoding token by token, verify-step timing; prints the table.
# Exit 0 when every check passes, 1 otherwise, 2 on bad usage. Status: never run (no machine with TensorRT).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${repo}/build/trt-gpu-check"
arch="native"
py="python3"
hdr_args=()
dry=0
extra=()

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die_usage() { echo "trt_gpu_check: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --work) [[ $# -ge 2 ]] || die_usage "--work needs a folder"; work="$2"; shift 2 ;;
    --kernel-lens) [[ $# -ge 2 && -f "$2" ]] || die_usage "--kernel-lens needs an existing wheel file"
                   hdr_args=(--kernel-lens "$2"); shift 2 ;;
    --trt-include) [[ $# -ge 2 && -f "$2/NvInferVersion.h" ]] || die_usage "--trt-include needs a folder with NvInferVersion.h"
                   hdr_args=(--trt-include "$2"); shift 2 ;;
    --arch) [[ $# -ge 2 ]] || die_usage "--arch needs a value"; arch="$2"; shift 2 ;;
    --python) [[ $# -ge 2 ]] || die_usage "--python needs an interpreter"; py="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) die_usage "unknown option $1 (see --help)" ;;
  esac
done
[[ ${#hdr_args[@]} -gt 0 ]] || die_usage "pass --kernel-lens WHEEL (TensorRT 10) or --trt-include DIR (headers of the installed TensorRT)"

if (( dry )); then
  echo "trt_gpu_check: dry run: work ${work}, arch ${arch}, headers ${hdr_args[*]}, python ${py}, extra: ${extra[*]:-none}"
  exit 0
fi
t0=$(date +%s)
step() { echo "trt_gpu_check: [$(( $(date +%s) - t0 ))s] $*" >&2; }

# 1. versions: the plugin is built per TensorRT major; the headers must match the installed tensorrt
trt_version=$("${py}" -c "import tensorrt; print(tensorrt.__version__)" 2>/dev/null) || {
  echo "trt_gpu_check: the tensorrt Python package is not importable by ${py}" >&2; exit 1; }
step "TensorRT ${trt_version}"
mkdir -p "${work}"
"${repo}/plugins/tests/gpu_check.sh" "${hdr_args[@]}" --build-dir "${work}/plugin" --headers-only > "${work}/headers.log" 2>&1 \
  || { cat "${work}/headers.log" >&2; exit 1; }
hdr_version=$(grep -o 'TensorRT [0-9.]* headers in' "${work}/headers.log" | awk '{print $2}')
if [[ "${hdr_version%%.*}" != "${trt_version%%.*}" ]]; then
  echo "trt_gpu_check: headers are TensorRT ${hdr_version}, the installed TensorRT is ${trt_version}: the plugin" \
       "library must be built against headers of the same major (pass --trt-include)" >&2
  exit 1
fi

# 2. plugin library
step "building the plugin library (sm ${arch})"
"${repo}/plugins/tests/gpu_check.sh" "${hdr_args[@]}" --build-dir "${work}/plugin" --arch "${arch}" --build-only \
  > "${work}/plugin.log" 2>&1 || { tail -30 "${work}/plugin.log" >&2; exit 1; }
plugin="${work}/plugin/cmake/lib/libdflash2_plugins.so"

# 3-4. tiny export and its engines
cd "${repo}"
export PYTHONPATH="${repo}${PYTHONPATH:+:${PYTHONPATH}}"
dflash2=("${py}" -m dflash2_trt.cli)
step "tiny export"
[[ -d "${work}/tiny" ]] || "${dflash2[@]}" make-tiny --out "${work}/tiny" || exit 1
[[ -f "${work}/tiny-export/manifest.json" ]] || "${dflash2[@]}" export --target "${work}/tiny/target" \
  --drafter "${work}/tiny/drafter" --out "${work}/tiny-export" --max-seq-len 256 --quiet || exit 1
step "building engines"
"${dflash2[@]}" build-engines "${work}/tiny-export" --plugin "${plugin}" --selector both --quiet || exit 1

# 5. the checks
step "checks"
"${py}" "${repo}/benchmarks/trt_gpu_check.py" "${work}/tiny-export" --plugin "${plugin}" "${extra[@]}"
rc=$?
step "done (exit ${rc})"
exit ${rc}
