# `pip install .` / `pip wheel .` (scikit-build-core, pyproject.toml): the CPU libraries into the package, each
# built where its dependencies are found and otherwise left out with one line saying why (the wheel is then the
# pure-Python runtime for that part). Included by the root CMakeLists.txt when SKBUILD is set; install prefix:
# the package folder (wheel.install-dir = "dflash2_trt").
#
#   lib/libdflash2_ort_ops.so   the ONNX Runtime op library (plugins/ortDecodeAttention; needs ONNX Runtime's C
#                               headers: ORT_INCLUDE_DIR, an installed libonnxruntime-dev, or Debian's package as
#                               scripts/build_ort_ops.sh --headers fetches it into build/ort-headers)
#   lib/libdflash2.so           the C API with its ONNX Runtime backend (runtime/; nlohmann-json3-dev, libvalijson-dev)
#   include/dflash2/dflash2.h   its header
#   lib/cmake/dflash2/          dflash2Config.cmake: find_package(dflash2) -> dflash2::dflash2
#   lib/pkgconfig/dflash2.pc    pkg-config --cflags --libs dflash2
# python -m dflash2_trt.native prints these folders. -Ccmake.define.DFLASH2_WHEEL_NO_FETCH=ON: no apt-get download of
# the headers (only the folders above are looked in).
set(_dfl2_root ${CMAKE_CURRENT_LIST_DIR}/..)
set(_dfl2_built "")

# ---- ONNX Runtime's C API headers (never vendored) ----------------------------------------------------------------
set(ORT_INCLUDE_DIR "$ENV{ORT_INCLUDE_DIR}" CACHE PATH "folder holding onnxruntime_c_api.h")
if(NOT EXISTS "${ORT_INCLUDE_DIR}/onnxruntime_c_api.h")
  foreach(_d /usr/include/onnxruntime /usr/local/include/onnxruntime
             ${_dfl2_root}/build/ort-headers/x/usr/include/onnxruntime)
    if(EXISTS "${_d}/onnxruntime_c_api.h")
      set(ORT_INCLUDE_DIR ${_d} CACHE PATH "folder holding onnxruntime_c_api.h" FORCE)
      break()
    endif()
  endforeach()
endif()
if(NOT EXISTS "${ORT_INCLUDE_DIR}/onnxruntime_c_api.h" AND NOT DFLASH2_WHEEL_NO_FETCH)
  execute_process(COMMAND bash ${_dfl2_root}/scripts/build_ort_ops.sh --headers
                  RESULT_VARIABLE _rc OUTPUT_VARIABLE _inc ERROR_VARIABLE _err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_rc EQUAL 0 AND EXISTS "${_inc}/onnxruntime_c_api.h")
    set(ORT_INCLUDE_DIR ${_inc} CACHE PATH "folder holding onnxruntime_c_api.h" FORCE)
  endif()
endif()

# ---- the op library ----------------------------------------------------------------------------------------------
if(EXISTS "${ORT_INCLUDE_DIR}/onnxruntime_c_api.h")
  add_subdirectory(${_dfl2_root}/plugins/ortDecodeAttention ort_ops)
  install(TARGETS dflash2_ort_ops LIBRARY DESTINATION lib)
  list(APPEND _dfl2_built "op library")
else()
  message(WARNING "dflash2: op library left out: no ONNX Runtime C headers (set ORT_INCLUDE_DIR, or install "
    "libonnxruntime-dev); the runtime runs the plain ONNX Runtime graph, ~2x slower")
endif()

# ---- libdflash2 --------------------------------------------------------------------------------------------------
find_package(nlohmann_json 3.10 QUIET)
find_path(VALIJSON_INCLUDE_DIR valijson/validator.hpp)
if(nlohmann_json_FOUND AND VALIJSON_INCLUDE_DIR)
  set(DFLASH2_RUNTIME_TENSORRT OFF CACHE BOOL "" FORCE)  # the wheel is the CPU build; TensorRT: CMake by hand
  set(DFLASH2_RUNTIME_ORT AUTO CACHE STRING "" FORCE)
  add_subdirectory(${_dfl2_root}/runtime runtime)
  # one file per library in a wheel (no symlinks): libdflash2.so, its own soname
  get_target_property(DFLASH2_VERSION dflash2 VERSION)
  set_property(TARGET dflash2 PROPERTY VERSION)
  set_property(TARGET dflash2 PROPERTY SOVERSION)
  set_target_properties(dflash2 PROPERTIES INSTALL_RPATH "$ORIGIN")
  configure_file(${CMAKE_CURRENT_LIST_DIR}/dflash2Config.cmake.in dflash2Config.cmake @ONLY)
  configure_file(${CMAKE_CURRENT_LIST_DIR}/dflash2.pc.in dflash2.pc @ONLY)
  include(CMakePackageConfigHelpers)
  write_basic_package_version_file(dflash2ConfigVersion.cmake VERSION ${DFLASH2_VERSION}
                                   COMPATIBILITY SameMajorVersion)
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/dflash2Config.cmake ${CMAKE_CURRENT_BINARY_DIR}/dflash2ConfigVersion.cmake
          DESTINATION lib/cmake/dflash2)
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/dflash2.pc DESTINATION lib/pkgconfig)
  list(APPEND _dfl2_built "libdflash2")
else()
  message(WARNING "dflash2: libdflash2 left out: nlohmann-json3-dev and libvalijson-dev not found (the Python "
    "runtime does not need it)")
endif()
list(JOIN _dfl2_built " + " _dfl2_built)
message(STATUS "dflash2: native parts in the package: ${_dfl2_built}")
