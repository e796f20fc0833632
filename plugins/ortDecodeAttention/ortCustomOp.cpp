//! \file ortCustomOp.cpp
//! ONNX Runtime custom-op library: registers dflash2.DecodeAttention (CPU) through the ORT C API
//! (`SessionOptions.register_custom_ops_library(path)` calls RegisterCustomOps).
//!
//! Op contract (same inputs, attributes and outputs as com.microsoft.GroupQueryAttention as the fused target
//! graph uses it: packed QKV, do_rotary=1, rotary_interleaved=0, batch 1):
//!   inputs  qkv [1, S, (num_heads + 2 kv_num_heads) d] f32, past_key / past_value [1, kvh, C, d] f32,
//!           seqlens_k [1] i32 (= P + S - 1), total_sequence_length [] i32 (= P + S), cos / sin [R, d/2] f32
//!   outputs out [1, S, num_heads d] f32, present_key / present_value [1, kvh, max(C, P + S), d] f32
//!   attrs   num_heads, kv_num_heads (int), scale (float, 0 = 1/sqrt(d))
//! When present is bound to the same buffer as past (the runtime's IOBinding), the new rows are written in place
//! and nothing is copied; otherwise slots 0..P-1 are copied from past first.
//! Errors come back as OrtStatus (no exception crosses the library boundary).
#include "decodeAttention.h"

#include <onnxruntime_c_api.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace
{

OrtApi const* gApi = nullptr;

struct Kernel
{
    int64_t numHeads{0};
    int64_t kvHeads{0};
    float scale{0.F};
};

struct Shape
{
    std::vector<int64_t> dims;
};

OrtStatus* shapeOf(OrtValue const* v, Shape& out)
{
    OrtTensorTypeAndShapeInfo* info = nullptr;
    if (OrtStatus* st = gApi->GetTensorTypeAndShape(v, &info))
    {
        return st;
    }
    size_t n = 0;
    OrtStatus* st = gApi->GetDimensionsCount(info, &n);
    if (st == nullptr)
    {
        out.dims.resize(n);
        st = gApi->GetDimensions(info, out.dims.data(), n);
    }
    gApi->ReleaseTensorTypeAndShapeInfo(info);
    return st;
}

// An input's data. GetTensorData (const) is newer than the API version built against (Debian's 1.21 headers,
// ORT_API_VERSION 21); GetTensorMutableData has been there since version 1 and the kernel only reads.
OrtStatus* tensorData(OrtValue const* v, void const** out)
{
    void* p = nullptr;
    OrtStatus* st = gApi->GetTensorMutableData(const_cast<OrtValue*>(v), &p);
    *out = p;
    return st;
}

OrtStatus* fail(std::string const& msg)
{
    return gApi->CreateStatus(ORT_INVALID_ARGUMENT, ("dflash2.DecodeAttention: " + msg).c_str());
}

struct ParallelArgs
{
    dflash2::DecodeAttentionShape const* shape;
    float const *qkv, *cosTable, *sinTable, *keys, *values;
    float* out;
};

void runHead(void* user, size_t head)
{
    auto const* a = static_cast<ParallelArgs const*>(user);
    thread_local std::vector<float> scratch;
    size_t const need = static_cast<size_t>(dflash2::decodeAttentionScratch(*a->shape));
    if (scratch.size() < need)
    {
        scratch.resize(need);
    }
    dflash2::decodeAttentionHeads(*a->shape, a->qkv, a->cosTable, a->sinTable, a->keys, a->values, a->out,
        static_cast<int64_t>(head), static_cast<int64_t>(head) + 1, scratch.data());
}

OrtStatus* compute(Kernel const& k, OrtKernelContext* ctx)
{
    OrtValue const* in[7] = {};
    for (size_t i = 0; i < 7; ++i)
    {
        if (OrtStatus* st = gApi->KernelContext_GetInput(ctx, i, &in[i]))
        {
            return st;
        }
    }
    Shape qkvShape, pastShape, ropeShape;
    for (auto [v, s] : {std::pair{in[0], &qkvShape}, std::pair{in[1], &pastShape}, std::pair{in[5], &ropeShape}})
    {
        if (OrtStatus* st = shapeOf(v, *s))
        {
            return st;
        }
    }
    if (qkvShape.dims.size() != 3 || qkvShape.dims[0] != 1 || pastShape.dims.size() != 4 || pastShape.dims[0] != 1)
    {
        return fail("expects batch 1: qkv [1, S, (nh + 2 kvh) d], past [1, kvh, C, d]");
    }
    void const* p = nullptr;
    if (OrtStatus* st = tensorData(in[3], &p))
    {
        return st;
    }
    int32_t const seqlensK = *static_cast<int32_t const*>(p);
    dflash2::DecodeAttentionShape s{};
    s.rows = qkvShape.dims[1];
    s.past = static_cast<int64_t>(seqlensK) + 1 - s.rows;
    s.capacity = pastShape.dims[2];
    s.numHeads = k.numHeads;
    s.kvHeads = k.kvHeads;
    s.headDim = pastShape.dims[3];
    s.ropeRows = ropeShape.dims[0];
    s.scale = k.scale;
    if (pastShape.dims[1] != s.kvHeads || qkvShape.dims[2] != (s.numHeads + 2 * s.kvHeads) * s.headDim
        || s.headDim % 2 != 0 || ropeShape.dims.size() != 2 || ropeShape.dims[1] != s.headDim / 2)
    {
        return fail("shapes do not match num_heads / kv_num_heads / head size");
    }
    if (s.past < 0 || s.past + s.rows > s.ropeRows)
    {
        return fail("seqlens_k out of range (needs P + S - 1 with 0 <= P and P + S <= rows of cos/sin)");
    }
    int64_t const total = s.past + s.rows;
    int64_t const outDims[3] = {1, s.rows, s.numHeads * s.headDim};
    int64_t const presentDims[4] = {1, s.kvHeads, std::max(s.capacity, total), s.headDim};
    OrtValue* out[3] = {};
    if (OrtStatus* st = gApi->KernelContext_GetOutput(ctx, 0, outDims, 3, &out[0]))
    {
        return st;
    }
    for (size_t i = 1; i < 3; ++i)
    {
        if (OrtStatus* st = gApi->KernelContext_GetOutput(ctx, i, presentDims, 4, &out[i]))
        {
            return st;
        }
    }
    void const* data[7] = {};
    for (size_t i : {0, 1, 2, 5, 6})
    {
        if (OrtStatus* st = tensorData(in[i], &data[i]))
        {
            return st;
        }
    }
    void* outData[3] = {};
    for (size_t i = 0; i < 3; ++i)
    {
        if (OrtStatus* st = gApi->GetTensorMutableData(out[i], &outData[i]))
        {
            return st;
        }
    }
    auto* keys = static_cast<float*>(outData[1]);
    auto* values = static_cast<float*>(outData[2]);
    int64_t const presentCapacity = presentDims[2];
    if (keys != data[1] || values != data[2])
    {
        // not sharing past and present (a plain session.run): slots 0..P-1 of each head from past
        for (int64_t h = 0; h < s.kvHeads; ++h)
        {
            size_t const n = static_cast<size_t>(s.past * s.headDim) * sizeof(float);
            std::memcpy(keys + h * presentCapacity * s.headDim,
                static_cast<float const*>(data[1]) + h * s.capacity * s.headDim, n);
            std::memcpy(values + h * presentCapacity * s.headDim,
                static_cast<float const*>(data[2]) + h * s.capacity * s.headDim, n);
        }
    }
    s.capacity = presentCapacity;
    auto const* qkv = static_cast<float const*>(data[0]);
    auto const* cosTable = static_cast<float const*>(data[5]);
    auto const* sinTable = static_cast<float const*>(data[6]);
    dflash2::decodeAttentionWriteKv(s, qkv, cosTable, sinTable, keys, values);
    ParallelArgs args{&s, qkv, cosTable, sinTable, keys, values, static_cast<float*>(outData[0])};
    return gApi->KernelContext_ParallelFor(ctx, runHead, static_cast<size_t>(s.numHeads), 0, &args);
}

char const* ORT_API_CALL opName(OrtCustomOp const*)
{
    return "DecodeAttention";
}

char const* ORT_API_CALL opProvider(OrtCustomOp const*)
{
    return "CPUExecutionProvider";
}

ONNXTensorElementDataType ORT_API_CALL inputType(OrtCustomOp const*, size_t i)
{
    return (i == 3 || i == 4) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL inputCount(OrtCustomOp const*)
{
    return 7;
}

ONNXTensorElementDataType ORT_API_CALL outputType(OrtCustomOp const*, size_t)
{
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL outputCount(OrtCustomOp const*)
{
    return 3;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(OrtCustomOp const*, size_t)
{
    return INPUT_OUTPUT_REQUIRED;
}

OrtMemType ORT_API_CALL inputMemory(OrtCustomOp const*, size_t i)
{
    // seqlens_k / total_sequence_length are read on the host
    return (i == 3 || i == 4) ? OrtMemTypeCPUInput : OrtMemTypeDefault;
}

OrtStatus* ORT_API_CALL createKernel(OrtCustomOp const*, OrtApi const* api, OrtKernelInfo const* info, void** kernel)
{
    try
    {
        auto k = new Kernel();
        OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "num_heads", &k->numHeads);
        if (st == nullptr)
        {
            st = api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &k->kvHeads);
        }
        if (st == nullptr && (k->numHeads <= 0 || k->kvHeads <= 0 || k->numHeads % k->kvHeads != 0))
        {
            st = fail("num_heads must be a positive multiple of kv_num_heads");
        }
        if (st != nullptr)
        {
            delete k;
            return st;
        }
        if (OrtStatus* s2 = api->KernelInfoGetAttribute_float(info, "scale", &k->scale))
        {
            api->ReleaseStatus(s2); // optional attribute
            k->scale = 0.F;
        }
        *kernel = k;
        return nullptr;
    }
    catch (std::exception const& e)
    {
        return api->CreateStatus(ORT_FAIL, e.what());
    }
}

OrtStatus* ORT_API_CALL computeKernel(void* kernel, OrtKernelContext* ctx)
{
    try
    {
        return compute(*static_cast<Kernel*>(kernel), ctx);
    }
    catch (std::exception const& e)
    {
        return gApi->CreateStatus(ORT_FAIL, e.what());
    }
}

void ORT_API_CALL destroyKernel(void* kernel)
{
    delete static_cast<Kernel*>(kernel);
}

OrtCustomOp makeOp()
{
    OrtCustomOp op{};
    op.version = ORT_API_VERSION;
    op.GetName = opName;
    op.GetExecutionProviderType = opProvider;
    op.GetInputType = inputType;
    op.GetInputTypeCount = inputCount;
    op.GetOutputType = outputType;
    op.GetOutputTypeCount = outputCount;
    op.GetInputCharacteristic = required;
    op.GetOutputCharacteristic = required;
    op.GetInputMemoryType = inputMemory;
    op.CreateKernelV2 = createKernel;
    op.KernelComputeV2 = computeKernel;
    op.KernelDestroy = destroyKernel;
    return op;
}

OrtCustomOp gOp = makeOp();

} // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(
    OrtSessionOptions* options, OrtApiBase const* base) noexcept
{
    gApi = base->GetApi(ORT_API_VERSION);
    if (gApi == nullptr)
    {
        return nullptr == base ? nullptr : base->GetApi(1)->CreateStatus(ORT_FAIL,
                   "dflash2.DecodeAttention: this ONNX Runtime is older than the headers the library was built with");
    }
    OrtCustomOpDomain* domain = nullptr;
    if (OrtStatus* st = gApi->CreateCustomOpDomain("dflash2", &domain))
    {
        return st;
    }
    if (OrtStatus* st = gApi->CustomOpDomain_Add(domain, &gOp))
    {
        return st;
    }
    return gApi->AddCustomOpDomain(options, domain); // the session options keep the domain alive
}
