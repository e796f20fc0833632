# Cross-compiling libdflash2 for aarch64 Linux (Jetson Orin / Thor user space) on an x86-64 host with Debian's
# g++-aarch64-linux-gnu:
#   cmake -S runtime -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=runtime/cmake/aarch64-linux-gnu.cmake
# The ctests then run through qemu-user when CMAKE_CROSSCOMPILING_EMULATOR is set, e.g.
#   -DCMAKE_CROSSCOMPILING_EMULATOR="qemu-aarch64;-L;/usr/aarch64-linux-gnu"
# This builds the CPU parts (core, callbacks backend, example, tests). The TensorRT backend for a Jetson is
# built on the device (JetPack ships CUDA + TensorRT; see runtime/README.md) or with a JetPack sysroot passed as
# CMAKE_SYSROOT plus -DDFLASH2_RUNTIME_TENSORRT=ON.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(DFLASH2_CROSS_PREFIX aarch64-linux-gnu- CACHE STRING "Cross tool prefix")
set(CMAKE_C_COMPILER ${DFLASH2_CROSS_PREFIX}gcc)
set(CMAKE_CXX_COMPILER ${DFLASH2_CROSS_PREFIX}g++)

# Libraries and headers of the target come from the cross root only; arch-independent CMake package files
# (nlohmann_json, header-only) may come from the host.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
