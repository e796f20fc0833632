//! \file ortSelectorOp.h
//! trt.plugins::DFlash2PathSelector for ONNX Runtime (CPU), registered by the library's RegisterCustomOps.
#ifndef DFLASH2_ORT_SELECTOR_OP_H
#define DFLASH2_ORT_SELECTOR_OP_H

#include <onnxruntime_c_api.h>

namespace dflash2
{

//! The domain of the TensorRT plugin node (selector_contract.DOMAIN).
constexpr char const* kSelectorDomain = "trt.plugins";

//! Adds the domain holding DFlash2PathSelector to `options`.
OrtStatus* addPathSelectorDomain(OrtApi const* api, OrtSessionOptions* options);

} // namespace dflash2

#endif // DFLASH2_ORT_SELECTOR_OP_H
