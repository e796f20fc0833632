#!/usr/bin/env bash
# GPU check for a machine WITHOUT TensorRT (an NVIDIA GPU, CUDA toolkit with nvcc, CMake, python3 with numpy
# and cuda-python; compute-sanitizer if present). Needs nothing but this repository and the kernel-lens wheel
# as a local file (it carries the TensorRT 10.14 headers, 235 kB; no network is used). Budget: 8 minutes.
#
#   plugins/tests/gpu_check.sh --kernel-lens kernel_lens-2.0.1-py3-none-any.whl [options]
#
#   --kernel-lens WHEEL   the kernel-lens wheel (local file) whose TensorRT headers the plugin compiles against
#   --trt-include DIR     use these TensorRT headers instead (NvInferRuntime.h; e.g. a TensorRT 11 install)
#   --build-dir DIR       build folder (default: build/gpu-check under the repository root)
#   --arch N              CUDA architecture to build (default 90 = H100/H200; native = the GPU present)
#   --python PY           python for the CUDA-layer check (default python3)
#   --budget-s N          total time budget in seconds (default 480); steps that no longer fit are skipped
#   --no-sanitizer        skip the compute-sanitizer runs
#   --no-werror           build without -Werror (a newer compiler's new warnings do not stop the GPU checks)
#   --log-dir DIR         also write exactly two files there: verdict.md and gpu-check-logs.tar.gz (every
#                         step's log + the verdict; the logs themselves stay in <build>/logs)
#   --build-only          stop after the build (no GPU needed: checks that everything compiles, -Werror)
#   --headers-only        extract the headers, print their version, stop
#   --dry-run             print the steps, run nothing
#   --no-gpu-probe        do not require nvidia-smi (the CPU tests run every step's plumbing this way)
#
# Steps (each one a row of the verdict table; a failing step does not stop the others):
#   1. TensorRT headers from the wheel (zip) -> <build>/trt-headers
#   2. build plugins/ for sm_<arch> with warnings as errors unless --no-werror (a wrapper project: only plugins/
#      is configured)
#   3. gpuCheck: selector kernel vs the CPU twin on random inputs (greedy, Viterbi, T = 0 / T > 0 with given
#      uniforms, ties, fp32/fp16/bf16) + timing table (CUDA-graph replay) against the < 5 us target at B = 1
#   4. pluginGpuCheck: libdflash2_plugins.so loaded, creator found and called as the ONNX parser does,
#      enqueue eager and under stream capture with graph replays, vs the CPU twin
#   5. host ctests of the build (CPU twin math, plugin host checks, load-time registration, major check)
#   6. cuda_layer_check.py: the runtime's CUDA layer (cuda_api, device buffers, KV growth, graph capture /
#      replay / invalidation, fallback after a failed capture) on real CUDA
#   7. compute-sanitizer memcheck (gpuCheck --quick, pluginGpuCheck), racecheck, synccheck (gpuCheck --quick)
#   8. the verdict table (markdown, also written to <build>/verdict.md; with --log-dir also there, beside one
#      tarball of every log); it states that TensorRT itself was not exercised. Exit 0 when no step failed, 1
#      otherwise, 2 on bad usage.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${repo}/build/gpu-check"
wheel=""
trt_include=""
arch="90"
py="python3"
budget=480
sanitizer=1
mode="full"
probe=1
werror=1
out_dir=""

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die_usage() { echo "gpu_check: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --kernel-lens) [[ $# -ge 2 ]] || die_usage "--kernel-lens needs a wheel file"; wheel="$2"; shift 2 ;;
    --trt-include) [[ $# -ge 2 ]] || die_usage "--trt-include needs a folder"; trt_include="$2"; shift 2 ;;
    --build-dir) [[ $# -ge 2 ]] || die_usage "--build-dir needs a folder"; build="$2"; shift 2 ;;
    --arch) [[ $# -ge 2 && "$2" =~ ^([0-9]+[a-z]?|native)$ ]] || die_usage "--arch needs a CUDA architecture (e.g. 90, native)"
            arch="$2"; shift 2 ;;
    --python) [[ $# -ge 2 ]] || die_usage "--python needs an interpreter"; py="$2"; shift 2 ;;
    --budget-s) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || die_usage "--budget-s needs a number of seconds"
                budget="$2"; shift 2 ;;
    --no-sanitizer) sanitizer=0; shift ;;
    --no-werror) werror=0; shift ;;
    --log-dir) [[ $# -ge 2 ]] || die_usage "--log-dir needs a folder"; out_dir="$2"; shift 2 ;;
    --build-only) mode="build"; shift ;;
    --headers-only) mode="headers"; shift ;;
    --dry-run) mode="dry"; shift ;;
    --no-gpu-probe) probe=0; shift ;;
    *) die_usage "unknown option $1 (see --help)" ;;
  esac
done
if [[ -z "${trt_include}" && -z "${wheel}" ]]; then
  die_usage "pass --kernel-lens <kernel_lens-*.whl> (a local file; pip download kernel-lens==2.0.1 --no-deps) or --trt-include DIR"
fi
if [[ -n "${wheel}" && ! -f "${wheel}" ]]; then
  die_usage "kernel-lens wheel not found: ${wheel}"
fi
if [[ -n "${trt_include}" && ! -f "${trt_include}/NvInferRuntime.h" ]]; then
  die_usage "no NvInferRuntime.h in ${trt_include}"
fi

# ---- verdict bookkeeping ------------------------------------------------------------------------------
declare -a rows=()
failures=0
t_start=$(date +%s)
logdir="${build}/logs"

row() {  # check result seconds detail
  rows+=("| $1 | $2 | $3 | $4 |")
  [[ "$2" == "FAIL" ]] && failures=$((failures + 1))
  printf 'gpu_check: %-58s %s (%ss) %s\n' "$1" "$2" "$3" "$4"
}

remaining() { echo $(( budget - ($(date +%s) - t_start) )); }

# run_step NAME TIMEOUT LOG CMD...: runs CMD with a timeout capped by the remaining budget; sets step_rc, step_s
run_step() {
  local name="$1" limit="$2" log="$3"; shift 3
  local left; left=$(remaining)
  (( left < limit )) && limit=${left}
  if (( limit < 10 )); then
    step_rc=124; step_s=0; echo "out of the time budget" > "${log}"; return
  fi
  echo "gpu_check: ${name} ..." >&2
  local t0; t0=$(date +%s.%N)
  timeout --kill-after=10 "${limit}" "$@" > "${log}" 2>&1
  step_rc=$?
  step_s=$(awk -v a="${t0}" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if (( step_rc == 124 || step_rc == 137 )); then echo "(timed out after ${limit}s)" >> "${log}"; fi
}

verdict() {
  local out="${build}/verdict.md"
  {
    echo "### DFlash2 GPU check without TensorRT — $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "${machine:-unknown machine}"
    echo
    echo "| check | result | seconds | detail |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo "| **TensorRT itself** (plugin registry, ONNX parser, builder, engines, the plugin inside an engine, \
the TensorRT backend) | **NOT EXERCISED** | - | no TensorRT on this machine: run benchmarks/trt_gpu_check.sh \
where TensorRT is installed |"
    echo
    echo "Total: $(( $(date +%s) - t_start )) s of a ${budget} s budget; ${failures} failing step(s)."
  } > "${out}"
  echo
  cat "${out}"
  if [[ -n "${out_dir}" ]]; then  # two files for whoever collects the results: the table and one tarball
    mkdir -p "${out_dir}"
    cp "${out}" "${out_dir}/verdict.md"
    tar -czf "${out_dir}/gpu-check-logs.tar.gz" -C "${build}" logs verdict.md
    echo "gpu_check: ${out_dir}/verdict.md, ${out_dir}/gpu-check-logs.tar.gz"
  fi
}

# ---- 1. headers -----------------------------------------------------------------------------------------
headers="${trt_include}"
if [[ "${mode}" == "dry" ]]; then
  cat <<EOF
gpu_check: dry run (nothing is executed)
  headers:   ${trt_include:-${wheel} -> ${build}/trt-headers}
  configure: cmake -S ${build}/project -B ${build}/cmake -DCMAKE_CUDA_ARCHITECTURES=${arch} -DDFLASH2_WERROR=$( ((werror)) && echo ON || echo OFF)
  build:     dflash2_plugins gpuCheck pluginGpuCheck and the host tests
  run:       gpuCheck; pluginGpuCheck; ctest; ${py} plugins/tests/cuda_layer_check.py
  sanitizer: $( ((sanitizer)) && echo "memcheck, racecheck, synccheck" || echo "off")
  budget:    ${budget} s
  logs:      ${build}/logs${out_dir:+ -> ${out_dir}/verdict.md + ${out_dir}/gpu-check-logs.tar.gz}
EOF
  exit 0
fi
mkdir -p "${logdir}"
if [[ -z "${headers}" ]]; then
  headers="${build}/trt-headers"
  t0=$(date +%s)
  # the wheel is a zip: its headers live under kernel_lens/include/tensorrt/ (python3 only, no pip, no network)
  if msg=$(python3 - "${wheel}" "${headers}" <<'PY' 2>&1
import os, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
prefix = "kernel_lens/include/tensorrt/"
try:
    zf = zipfile.ZipFile(wheel)
except (OSError, zipfile.BadZipFile) as e:
    sys.exit(f"not a wheel (zip) file: {e}")
names = [n for n in zf.namelist() if n.startswith(prefix) and n.endswith(".h")]
if not any(n.endswith("/NvInferRuntime.h") for n in names):
    sys.exit(f"{wheel} has no {prefix}NvInferRuntime.h (is it the kernel-lens wheel?)")
os.makedirs(dest, exist_ok=True)
for n in names:
    with zf.open(n) as src, open(os.path.join(dest, os.path.basename(n)), "wb") as out:
        out.write(src.read())
PY
  ); then :; else
    echo "gpu_check: ${msg}" >&2
    exit 2
  fi
fi
trt_version=$(awk '/^#define (TRT|NV_TENSORRT)_(MAJOR|MINOR|PATCH)(_ENTERPRISE)? [0-9]+/ {v[$2]=$3}
  END { M = v["TRT_MAJOR_ENTERPRISE"] ? v["TRT_MAJOR_ENTERPRISE"] : v["NV_TENSORRT_MAJOR"];
        m = v["TRT_MINOR_ENTERPRISE"] ? v["TRT_MINOR_ENTERPRISE"] : v["NV_TENSORRT_MINOR"];
        p = v["TRT_PATCH_ENTERPRISE"] ? v["TRT_PATCH_ENTERPRISE"] : v["NV_TENSORRT_PATCH"];
        if (M != "") printf "%s.%s.%s", M, m, p }' "${headers}/NvInferVersion.h" 2>/dev/null)
if [[ -z "${trt_version}" ]]; then
  echo "gpu_check: cannot read the TensorRT version from ${headers}/NvInferVersion.h" >&2
  exit 2
fi
row "TensorRT headers" "PASS" "0" "TensorRT ${trt_version} headers (${wheel:+kernel-lens wheel}${trt_include:+${trt_include}})"
if [[ "${mode}" == "headers" ]]; then
  echo "gpu_check: TensorRT ${trt_version} headers in ${headers}"
  exit 0
fi

# ---- machine ------------------------------------------------------------------------------------------
if [[ "${mode}" == "full" ]] && (( probe )); then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed); --build-only checks the build alone" >&2
    exit 1
  fi
  machine="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), "
fi
nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
[[ -x "${nvcc_bin}" ]] || { echo "gpu_check: nvcc not found (CUDA toolkit needed)" >&2; exit 1; }
command -v cmake >/dev/null 2>&1 || { echo "gpu_check: cmake not found" >&2; exit 1; }
machine="${machine:-}$("${nvcc_bin}" --version | grep -o 'release [0-9.]*' | head -1 | sed 's/release/nvcc/'), \
cmake $(cmake --version | head -1 | awk '{print $3}'), sm_${arch}, TensorRT ${trt_version} headers"

# ---- 2. build -----------------------------------------------------------------------------------------
# A wrapper project configures plugins/ alone (the repository root may add other native projects).
werror_cmake=$( ((werror)) && echo ON || echo OFF)
werror_label=$( ((werror)) && echo "-Werror" || echo "warnings allowed (--no-werror)")
mkdir -p "${build}/project"
cat > "${build}/project/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.24)
project(dflash2_gpu_check LANGUAGES CXX)
option(DFLASH2_BUILD_TESTS "" ON)
option(DFLASH2_WERROR "" ${werror_cmake})
enable_testing()
add_subdirectory("${repo}/plugins" plugins)
EOF
cfg_and_build() {
  cmake -S "${build}/project" -B "${build}/cmake" -DCMAKE_BUILD_TYPE=Release -DDFLASH2_WERROR="${werror_cmake}" \
    -DCMAKE_CUDA_COMPILER="${nvcc_bin}" -DCMAKE_CUDA_ARCHITECTURES="${arch}" \
    -DTensorRT_INCLUDE_DIR="${headers}" && \
  cmake --build "${build}/cmake" -j "$(nproc)" --target dflash2_plugins gpuCheck pluginGpuCheck testSelectorMath \
    testPluginHost testRegistration dflash2_fake_nvinfer
}
export -f cfg_and_build
export build nvcc_bin arch headers werror_cmake
run_step "build" 300 "${logdir}/build.log" bash -c cfg_and_build
if (( step_rc != 0 )); then
  row "build plugins/ for sm_${arch}, ${werror_label}" "FAIL" "${step_s}" "see ${logdir}/build.log"
  tail -30 "${logdir}/build.log" >&2
  verdict; exit 1
fi
row "build plugins/ for sm_${arch}, ${werror_label}" "PASS" "${step_s}" "nvcc + host compiler"
bin="${build}/cmake/plugins/tests"
lib="${build}/cmake/lib/libdflash2_plugins.so"
if [[ "${mode}" == "build" ]]; then
  verdict; exit $(( failures > 0 ))
fi

# ---- 3. kernel vs twin + timing ------------------------------------------------------------------------
run_step "gpuCheck" 150 "${logdir}/gpuCheck.log" "${bin}/gpuCheck"
detail="$(grep -m1 '^correctness:' "${logdir}/gpuCheck.log" || echo "see ${logdir}/gpuCheck.log")"
row "selector kernel = CPU twin (greedy, Viterbi, sampling, ties)" "$( ((step_rc == 0)) && echo PASS || echo FAIL)" \
  "${step_s}" "${detail}"
# timing rows: "B mode T type us/call"; the target is < 5 us per call at B = 1
worst=$(awk '$1 == "1" && $5 ~ /^[0-9.]+$/ { if ($5 > w) w = $5 } END { if (w != "") print w }' "${logdir}/gpuCheck.log")
if [[ -n "${worst}" ]]; then
  met=$(awk -v w="${worst}" 'BEGIN { print (w < 5.0) ? "PASS" : "BELOW TARGET" }')
  row "selector timing at B = 1 (target < 5 us)" "${met}" "-" "worst ${worst} us/call (table: ${logdir}/gpuCheck.log)"
else
  row "selector timing at B = 1 (target < 5 us)" "FAIL" "-" "no timing table in ${logdir}/gpuCheck.log"
fi
sed -n '/^timing/,$p' "${logdir}/gpuCheck.log"

# ---- 4. plugin driven as TensorRT drives it ------------------------------------------------------------
run_step "pluginGpuCheck" 90 "${logdir}/pluginGpuCheck.log" "${bin}/pluginGpuCheck" "${lib}"
row "plugin .so: creator as the ONNX parser calls it, enqueue eager + graph replay = twin" \
  "$( ((step_rc == 0)) && echo PASS || echo FAIL)" "${step_s}" \
  "$(grep -m1 '^pluginGpuCheck:' "${logdir}/pluginGpuCheck.log" || echo "see ${logdir}/pluginGpuCheck.log")"

# ---- 5. host tests ------------------------------------------------------------------------------------
run_step "ctest" 90 "${logdir}/ctest.log" ctest --test-dir "${build}/cmake" --output-on-failure -LE gpu
row "host ctests (twin math, plugin host, registration, major check)" "$( ((step_rc == 0)) && echo PASS || echo FAIL)" \
  "${step_s}" "$(grep -m1 'tests passed' "${logdir}/ctest.log" || echo "see ${logdir}/ctest.log")"

# ---- 6. the runtime's CUDA layer -----------------------------------------------------------------------
run_step "cuda_layer_check" 90 "${logdir}/cuda_layer.log" env PYTHONPATH="${repo}" "${py}" \
  "${repo}/plugins/tests/cuda_layer_check.py"
case ${step_rc} in
  0) res=PASS ;; 77) res=SKIP ;; *) res=FAIL ;;
esac
row "runtime CUDA layer (cuda_api, device KV, graphs, failed capture)" "${res}" "${step_s}" \
  "$(tail -1 "${logdir}/cuda_layer.log")"

# ---- 7. compute-sanitizer -----------------------------------------------------------------------------
san="$(command -v compute-sanitizer || true)"
[[ -z "${san}" && -x /usr/local/cuda/bin/compute-sanitizer ]] && san=/usr/local/cuda/bin/compute-sanitizer
for tool in memcheck racecheck synccheck; do
  if (( ! sanitizer )) || [[ -z "${san}" ]]; then
    row "compute-sanitizer ${tool}" "SKIP" "-" "$( ((sanitizer)) && echo "compute-sanitizer not found" || echo "--no-sanitizer")"
    continue
  fi
  run_step "${tool}" 150 "${logdir}/${tool}.log" "${san}" --tool "${tool}" --error-exitcode 3 \
    "${bin}/gpuCheck" --quick --no-timing
  rc=${step_rc}; secs=${step_s}
  if [[ "${tool}" == "memcheck" && ${rc} -eq 0 ]]; then
    run_step "memcheck plugin" 150 "${logdir}/memcheck-plugin.log" "${san}" --tool memcheck --error-exitcode 3 \
      "${bin}/pluginGpuCheck" "${lib}"
    rc=${step_rc}; secs=$(awk -v a="${secs}" -v b="${step_s}" 'BEGIN { printf "%.1f", a + b }')
  fi
  row "compute-sanitizer ${tool}$([[ ${tool} == memcheck ]] && echo " (kernel, plugin enqueue)" || echo " (kernel)")" \
    "$( ((rc == 0)) && echo PASS || echo FAIL)" "${secs}" \
    "$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY|out of the time budget|timed out' "${logdir}/${tool}.log" \
       || echo "see ${logdir}/${tool}.log")"
done

verdict
exit $(( failures > 0 ))
