#!/usr/bin/env bash
# GPU check of the DFlash2PathSelector kernel (run from anywhere on a machine with an NVIDIA GPU):
#   1. builds plugins/ for the present GPU only (CMAKE_CUDA_ARCHITECTURES=native), -Werror;
#   2. runs gpuCheck: the kernel against the CPU twin on random inputs with poisoned outputs over
#      many sizes, both modes, T = 0 / T > 0, fp32/fp16/bf16 (ids must match exactly, proposals
#      bit for bit), then prints the timing table (CUDA-graph replay, B = 1, 8, 64, 256 at
#      L = 15, K = 16, r = 256);
#   3. runs the host ctests of the same build.
# TensorRT headers: $TensorRT_ROOT / $TRT_ROOT when set, else the pip wheel kernel-lens.
# Usage: plugins/tests/gpu_check.sh [build-dir]   (default: build/gpu-check under the repo root)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-${repo}/build/gpu-check}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed)" >&2
  exit 1
fi
nvidia-smi -L

trt_args=(-DDFLASH2_TRT_HEADERS_FROM_PIP=ON)
if [[ -n "${TensorRT_ROOT:-}${TRT_ROOT:-}" ]]; then
  trt_args=(-DTensorRT_ROOT="${TensorRT_ROOT:-${TRT_ROOT}}")
fi
nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"

cmake -S "${repo}" -B "${build}" -DCMAKE_BUILD_TYPE=Release -DDFLASH2_WERROR=ON \
  -DCMAKE_CUDA_COMPILER="${nvcc_bin}" -DCMAKE_CUDA_ARCHITECTURES=native "${trt_args[@]}"
cmake --build "${build}" -j "$(nproc)"

"${build}/plugins/tests/gpuCheck"
ctest --test-dir "${build}" --output-on-failure
