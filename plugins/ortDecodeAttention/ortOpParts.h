//! \file ortOpParts.h
//! What every op of the library's ONNX Runtime glue needs (ortCustomOp.cpp, ortSelectorOp.cpp,
//! ortDrafterLayerOp.cpp): a tensor's dimensions and data, and the OrtCustomOp callbacks that are the same for all
//! of them (CPU provider, required inputs and outputs, default memory).
#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <vector>

namespace dflash2
{
namespace ort
{

inline OrtStatus* tensorDims(OrtApi const* api, OrtValue const* v, std::vector<int64_t>& dims)
{
    OrtTensorTypeAndShapeInfo* info = nullptr;
    if (OrtStatus* st = api->GetTensorTypeAndShape(v, &info))
    {
        return st;
    }
    size_t n = 0;
    OrtStatus* st = api->GetDimensionsCount(info, &n);
    if (st == nullptr)
    {
        dims.resize(n);
        st = api->GetDimensions(info, dims.data(), n);
    }
    api->ReleaseTensorTypeAndShapeInfo(info);
    return st;
}

//! An input's data. GetTensorData (const) is newer than the API version built against (Debian's 1.21 headers,
//! ORT_API_VERSION 21); GetTensorMutableData has been there since version 1 and the kernels only read.
inline OrtStatus* tensorData(OrtApi const* api, OrtValue const* v, void const** out)
{
    void* p = nullptr;
    OrtStatus* st = api->GetTensorMutableData(const_cast<OrtValue*>(v), &p);
    *out = p;
    return st;
}

inline char const* ORT_API_CALL cpuProvider(OrtCustomOp const*)
{
    return "CPUExecutionProvider";
}

inline OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(OrtCustomOp const*, size_t)
{
    return INPUT_OUTPUT_REQUIRED;
}

inline OrtMemType ORT_API_CALL defaultMemory(OrtCustomOp const*, size_t)
{
    return OrtMemTypeDefault;
}

} // namespace ort
} // namespace dflash2
