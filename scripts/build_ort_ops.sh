#!/usr/bin/env bash
# Builds the ONNX Runtime custom-op library (plugins/ortDecodeAttention -> build/ort_ops/libdflash2_ort_ops.so).
# It needs ONNX Runtime's C API headers, which no PyPI wheel ships. In order: ORT_INCLUDE_DIR=<dir>; the headers of
# an installed libonnxruntime-dev; else Debian's libonnxruntime-dev (ONNX Runtime >= 1.21, API version 21 <= the
# runtime's) downloaded with apt-get into build/ort-headers and unpacked there (nothing is installed). The package
# comes from the machine's configured apt sources; where they do not carry it (Debian 12 has no onnxruntime), from
# suite DFLASH2_ORT_HEADERS_SUITE (default trixie) of the Debian mirror those sources name — through a private
# list in build/ort-headers, so the system's apt configuration is not touched. No package host is written here.
# Idempotent: an existing library is rebuilt only where its sources changed (CMake).
# --headers: only find or fetch the headers and print their folder (what `pip install .` builds the library with).
set -euo pipefail
cd "$(dirname "$0")/.."
headers_only=
[ "${1:-}" != --headers ] || { headers_only=1; exec 3>&1 1>&2; }  # the folder on stdout, apt's noise on stderr
inc=${ORT_INCLUDE_DIR:-}
for d in /usr/include/onnxruntime /usr/local/include/onnxruntime; do
  [ -n "$inc" ] || [ ! -f "$d/onnxruntime_c_api.h" ] || inc=$d
done
if [ -z "$inc" ]; then
  dir=$PWD/build/ort-headers
  inc=$dir/x/usr/include/onnxruntime
  if [ ! -f "$inc/onnxruntime_c_api.h" ]; then
    command -v apt-get >/dev/null || { echo "build_ort_ops: apt-get not found; set ORT_INCLUDE_DIR" >&2; exit 1; }
    rm -rf "$dir" && mkdir -p "$dir"
    sandbox=()
    [ "$(id -u)" != 0 ] || sandbox=(-o APT::Sandbox::User=root)  # root: no _apt user switch for a private folder
    if ! (cd "$dir" && apt-get "${sandbox[@]}" download libonnxruntime-dev); then
      suite=${DFLASH2_ORT_HEADERS_SUITE:-trixie}
      mirror=$(apt-get indextargets --format '$(REPO_URI) $(LABEL)' | awk '$2 == "Debian" { print $1; exit }')
      [ -n "$mirror" ] || { echo "build_ort_ops: no Debian source in the machine's apt configuration for" \
        "libonnxruntime-dev; install it, or set ORT_INCLUDE_DIR" >&2; exit 1; }
      echo "build_ort_ops: libonnxruntime-dev is not in the configured suites; taking it from $suite of $mirror" >&2
      mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
      echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" >"$dir/sources.list"
      opts=("${sandbox[@]}" -o "Dir::Etc::SourceList=$dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir/cache")
      apt-get "${opts[@]}" update
      (cd "$dir" && apt-get "${opts[@]}" download libonnxruntime-dev)
    fi
    dpkg-deb -x "$dir"/libonnxruntime-dev_*.deb "$dir/x"
  fi
fi
if [ -n "$headers_only" ]; then echo "$inc" >&3; exit 0; fi
cmake -S plugins/ortDecodeAttention -B build/ort_ops -DCMAKE_BUILD_TYPE=Release -DORT_INCLUDE_DIR="$inc"
cmake --build build/ort_ops -j2
