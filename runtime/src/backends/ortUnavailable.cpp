//! \file ortUnavailable.cpp
//! Built instead of ortBackend.cpp when the library is configured without ONNX Runtime's C API headers
//! (DFLASH2_RUNTIME_ORT=OFF, or AUTO without them).
#include "../model.h"

namespace dflash2
{

std::unique_ptr<Model> loadOrtModel(Manifest const&, std::string const& dir, Options const&)
{
    throw Error(DFL2_ERR_UNAVAILABLE,
        "cannot run " + dir + " with ONNX Runtime: this libdflash2 was built without the ONNX Runtime backend "
        "(configure with -DORT_INCLUDE_DIR=<onnxruntime_c_api.h folder>; scripts/build_ort_ops.sh fetches them)");
}

} // namespace dflash2
