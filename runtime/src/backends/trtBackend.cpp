//! \file trtUnavailable.cpp
//! Built instead of trtBackend.cpp when the library is configured without TensorRT
//! (DFLASH2_RUNTIME_TENSORRT=OFF, e.g. the CPU and aarch64 cross builds).
#include "../model.h"

namespace dflash2
{

std::unique_ptr<Model> loadTensorRTModel(Manifest const&, std::string const& dir, Options const&)
{
    throw Error(DFL2_ERR_UNAVAILABLE,
        "cannot run " + dir + ": this libdflash2 was built without the TensorRT backend "
        "(configure with -DDFLASH2_RUNTIME_TENSORRT=ON on a machine with CUDA and TensorRT); "
        "use dfl2_model_create_callbacks to run other engines");
}

} // namespace dflash2
