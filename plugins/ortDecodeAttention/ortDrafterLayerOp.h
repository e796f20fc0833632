//! \file ortDrafterLayerOp.h
//! dflash2.DrafterLayer for ONNX Runtime (CPU), added to the dflash2 domain by the library's RegisterCustomOps.
#ifndef DFLASH2_ORT_DRAFTER_LAYER_OP_H
#define DFLASH2_ORT_DRAFTER_LAYER_OP_H

#include <onnxruntime_c_api.h>

namespace dflash2
{

OrtCustomOp* drafterLayerOp();

} // namespace dflash2

#endif // DFLASH2_ORT_DRAFTER_LAYER_OP_H
