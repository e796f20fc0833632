#!/usr/bin/env bash
# Builds the ONNX Runtime custom-op library (plugins/ortDecodeAttention -> build/ort_ops/libdflash2_ort_ops.so).
# It needs ONNX Runtime's C API headers, which no PyPI wheel ships: Debian's libonnxruntime-dev (trixie, ONNX
# Runtime 1.21, API version 21 <= the runtime's) is downloaded with apt-get into build/ort-headers and unpacked
# there (nothing is installed; the system's apt configuration is not touched). ORT_INCLUDE_DIR=<dir> skips the
# download. Idempotent: an existing library is rebuilt only where its sources changed (CMake).
set -euo pipefail
cd "$(dirname "$0")/.."
inc=${ORT_INCLUDE_DIR:-}
if [ -z "$inc" ]; then
  dir=$PWD/build/ort-headers
  inc=$dir/x/usr/include/onnxruntime
  if [ ! -f "$inc/onnxruntime_c_api.h" ]; then
    command -v apt-get >/dev/null || { echo "build_ort_ops: apt-get not found; set ORT_INCLUDE_DIR" >&2; exit 1; }
    rm -rf "$dir" && mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
      >"$dir/sources.list"
    opts=(-o "Dir::Etc::SourceList=$dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir/cache")
    [ "$(id -u)" != 0 ] || opts+=(-o APT::Sandbox::User=root)  # root: no _apt user switch for a private folder
    apt-get "${opts[@]}" update
    (cd "$dir" && apt-get "${opts[@]}" download libonnxruntime-dev)
    dpkg-deb -x "$dir"/libonnxruntime-dev_*.deb "$dir/x"
  fi
fi
cmake -S plugins/ortDecodeAttention -B build/ort_ops -DCMAKE_BUILD_TYPE=Release -DORT_INCLUDE_DIR="$inc"
cmake --build build/ort_ops -j2
