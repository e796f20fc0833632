#!/usr/bin/env bash
# GPU check of the TensorRT path, end to end (needs an NVIDIA GPU, CUDA toolkit + CMake, TensorRT >= 10.3 with
# its Python package, cuda-python, and this project installed with the export/ort extras):
#   1. builds plugins/ for the present GPU (CMAKE_CUDA_ARCHITECTURES=native) -> libdflash2_plugins.so;
#   2. exports a make-tiny pair and SmolLM2-135M with the packaged trained DFlash 2 drafter (dflash2 demo's);
#   3. builds their TensorRT engines (plugin variant) with dflash2 build-engines;
#   4. runs benchmarks/trt_gpu_check.py: TensorRT = ONNX Runtime token for token, graph replay = eager,
#      speculative vs autoregressive tokens/s, selector share of a cycle, launch gaps (prints the table).
# Usage: benchmarks/trt_gpu_check.sh [work-dir]   (default: build/trt-gpu-check under the repo root)
# Status: never run (written without a GPU).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:-${repo}/build/trt-gpu-check}"
shift || true  # the rest goes to trt_gpu_check.py
mkdir -p "${work}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "trt_gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed)" >&2
  exit 1
fi
nvidia-smi -L
python -c "import tensorrt, sys; print('TensorRT', tensorrt.__version__)" || {
  echo "trt_gpu_check: the tensorrt Python package is not importable" >&2; exit 1; }

trt_args=(-DDFLASH2_TRT_HEADERS_FROM_PIP=ON)
if [[ -n "${TensorRT_ROOT:-}${TRT_ROOT:-}" ]]; then
  trt_args=(-DTensorRT_ROOT="${TensorRT_ROOT:-${TRT_ROOT}}")
fi
nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
cmake -S "${repo}" -B "${work}/cmake" -DCMAKE_BUILD_TYPE=Release -DDFLASH2_BUILD_TESTS=OFF \
  -DCMAKE_CUDA_COMPILER="${nvcc_bin}" -DCMAKE_CUDA_ARCHITECTURES=native "${trt_args[@]}"
cmake --build "${work}/cmake" -j "$(nproc)"
plugin="$(find "${work}/cmake" -name libdflash2_plugins.so -print -quit)"
[[ -n "${plugin}" ]] || { echo "trt_gpu_check: libdflash2_plugins.so was not built" >&2; exit 1; }
export DFLASH2_PLUGIN_LIB="${plugin}"

cd "${repo}"
[[ -d "${work}/tiny" ]] || dflash2 make-tiny --out "${work}/tiny"
[[ -f "${work}/tiny-export/manifest.json" ]] || dflash2-export --target "${work}/tiny/target" \
  --drafter "${work}/tiny/drafter" --out "${work}/tiny-export" --max-seq-len 512 --quiet
drafter="$(python -c 'from dflash2_trt.bench.demo import demo_drafter_path; print(demo_drafter_path())')"
[[ -f "${work}/smollm2-export/manifest.json" ]] || dflash2-export --target smollm2 \
  --drafter "${drafter}" --out "${work}/smollm2-export" --max-seq-len 1024 --quiet

for d in tiny-export smollm2-export; do
  dflash2 build-engines "${work}/${d}" --plugin "${plugin}" --selector both
done
python benchmarks/trt_gpu_check.py "${work}/tiny-export" "${work}/smollm2-export" "$@"
