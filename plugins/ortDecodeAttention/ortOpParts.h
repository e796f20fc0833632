//! \file ortOpParts.h
//! What every op of the library's ONNX Runtime glue needs (ortCustomOp.cpp, ortSelectorOp.cpp,
//! ortDrafterLayerOp.cpp): a tensor's dimensions and data, the OrtCustomOp callbacks that are the same for all
//! of them (CPU provider, required inputs and outputs, default memory), the one way an op's OrtCustomOp is filled in
//! (makeCustomOp) and the one way a domain of ops is registered with a session (addDomain).
#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <initializer_list>
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

//! The callbacks that make one op what it is; the rest of its OrtCustomOp is the same for every op of the library.
struct OpCallbacks
{
    decltype(OrtCustomOp::GetName) name;
    decltype(OrtCustomOp::GetInputType) inputType;
    decltype(OrtCustomOp::GetInputTypeCount) inputCount;
    decltype(OrtCustomOp::GetOutputType) outputType;
    decltype(OrtCustomOp::GetOutputTypeCount) outputCount;
    decltype(OrtCustomOp::CreateKernelV2) create;
    decltype(OrtCustomOp::KernelComputeV2) compute;
    decltype(OrtCustomOp::KernelDestroy) destroy;
    decltype(OrtCustomOp::GetInputCharacteristic) inputCharacteristic = required;
    decltype(OrtCustomOp::GetInputMemoryType) inputMemory = defaultMemory;
};

//! An op on the CPU provider at the headers' API version, its outputs required, its kernels created and run
//! through the V2 callbacks.
inline OrtCustomOp makeCustomOp(OpCallbacks const& c)
{
    OrtCustomOp op{};
    op.version = ORT_API_VERSION;
    op.GetName = c.name;
    op.GetExecutionProviderType = cpuProvider;
    op.GetInputType = c.inputType;
    op.GetInputTypeCount = c.inputCount;
    op.GetOutputType = c.outputType;
    op.GetOutputTypeCount = c.outputCount;
    op.GetInputCharacteristic = c.inputCharacteristic;
    op.GetOutputCharacteristic = required;
    op.GetInputMemoryType = c.inputMemory;
    op.CreateKernelV2 = c.create;
    op.KernelComputeV2 = c.compute;
    op.KernelDestroy = c.destroy;
    return op;
}

//! A custom-op domain named `domainName` holding `ops` (which outlive every session), added to the session options
//! (which keep the domain alive); the first failing call's status.
inline OrtStatus* addDomain(
    OrtApi const* api, OrtSessionOptions* options, char const* domainName, std::initializer_list<OrtCustomOp*> ops)
{
    OrtCustomOpDomain* domain = nullptr;
    if (OrtStatus* st = api->CreateCustomOpDomain(domainName, &domain))
    {
        return st;
    }
    for (OrtCustomOp* op : ops)
    {
        if (OrtStatus* st = api->CustomOpDomain_Add(domain, op))
        {
            return st;
        }
    }
    return api->AddCustomOpDomain(options, domain);
}

} // namespace ort
} // namespace dflash2
