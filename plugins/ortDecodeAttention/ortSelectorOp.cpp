//! \file ortSelectorOp.cpp
//! trt.plugins::DFlash2PathSelector as an ONNX Runtime custom op (CPU): the node of the drafter head's
//! `.plugin.onnx` graph runs in ORT as it runs in TensorRT, through the selector's CPU twin
//! (plugins/pathSelector/pathSelectorHost.cpp, the same math header as the CUDA kernel, bit for bit). The contract
//! (inputs, outputs, attributes) is dflash2_trt/export/selector_contract.py; hidden_proj and the two codebooks share
//! one type (float, float16 or bfloat16), the op accepts any and the twin refuses the others.
#include "ortSelectorOp.h"

#include "ortOpParts.h"
#include "pathSelectorHost.h"

#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace
{

constexpr size_t kInputs = 8;
constexpr size_t kOutputs = 2;

struct SelectorKernel
{
    OrtApi const* api;
    int64_t topK{0};
    int64_t rank{0};
    int32_t mode{DFL2_MODE_GREEDY};
};

OrtStatus* fail(OrtApi const* api, std::string const& msg)
{
    return api->CreateStatus(ORT_INVALID_ARGUMENT, ("trt.plugins.DFlash2PathSelector: " + msg).c_str());
}

struct Tensor
{
    void const* data{nullptr};
    std::vector<int64_t> dims;
    ONNXTensorElementDataType type{ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED};
};

OrtStatus* readInput(OrtApi const* api, OrtKernelContext* ctx, size_t i, Tensor& t)
{
    OrtValue const* v = nullptr;
    if (OrtStatus* st = api->KernelContext_GetInput(ctx, i, &v))
    {
        return st;
    }
    if (OrtStatus* st = dflash2::ort::tensorDims(api, v, t.dims))
    {
        return st;
    }
    OrtTensorTypeAndShapeInfo* info = nullptr;
    if (OrtStatus* st = api->GetTensorTypeAndShape(v, &info))
    {
        return st;
    }
    OrtStatus* st = api->GetTensorElementType(info, &t.type);
    api->ReleaseTensorTypeAndShapeInfo(info);
    return st != nullptr ? st : dflash2::ort::tensorData(api, v, &t.data);
}

int32_t elemType(ONNXTensorElementDataType t)
{
    switch (t)
    {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return DFL2_ELEM_FLOAT32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return DFL2_ELEM_FLOAT16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return DFL2_ELEM_BFLOAT16;
    default: return -1;
    }
}

OrtStatus* compute(SelectorKernel const& k, OrtKernelContext* ctx)
{
    OrtApi const* api = k.api;
    Tensor in[kInputs];
    for (size_t i = 0; i < kInputs; ++i)
    {
        if (OrtStatus* st = readInput(api, ctx, i, in[i]))
        {
            return st;
        }
    }
    Tensor const &cand = in[0], &unary = in[1], &hidden = in[2], &anchor = in[3], &pred = in[4], &succ = in[5],
                 &temp = in[6], &unif = in[7];
    if (cand.dims.size() != 3 || cand.dims[2] != k.topK || unary.dims != cand.dims)
    {
        return fail(api, "cand_ids and unary must be [B, L, top_k] (top_k = " + std::to_string(k.topK) + ")");
    }
    int64_t const B = cand.dims[0], L = cand.dims[1], K = cand.dims[2];
    int32_t const et = elemType(hidden.type);
    if (et < 0 || pred.type != hidden.type || succ.type != hidden.type)
    {
        return fail(api, "hidden_proj, pred_codebook and succ_codebook must share one type: float, float16 or "
                         "bfloat16");
    }
    if (hidden.dims != std::vector<int64_t>{B, L, k.rank} || pred.dims.size() != 2 || pred.dims[1] != k.rank
        || succ.dims != pred.dims)
    {
        return fail(api, "hidden_proj must be [B, L, rank] and both codebooks [V, rank] (rank = "
                + std::to_string(k.rank) + ")");
    }
    if (anchor.dims != std::vector<int64_t>{B} || temp.dims != std::vector<int64_t>{B}
        || unif.dims != std::vector<int64_t>{B, L})
    {
        return fail(api, "anchor_ids and temperature must be [B], uniforms [B, L]");
    }
    if (cand.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 || anchor.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32)
    {
        return fail(api, "cand_ids and anchor_ids must be int32");
    }
    int64_t const outPathDims[2] = {B, L};
    int64_t const outProbDims[3] = {B, L, K};
    OrtValue* outPath = nullptr;
    OrtValue* outProb = nullptr;
    if (OrtStatus* st = api->KernelContext_GetOutput(ctx, 0, outPathDims, 2, &outPath))
    {
        return st;
    }
    if (OrtStatus* st = api->KernelContext_GetOutput(ctx, 1, outProbDims, 3, &outProb))
    {
        return st;
    }
    void* path = nullptr;
    void* prob = nullptr;
    if (OrtStatus* st = api->GetTensorMutableData(outPath, &path))
    {
        return st;
    }
    if (OrtStatus* st = api->GetTensorMutableData(outProb, &prob))
    {
        return st;
    }
    if (B == 0)
    {
        return nullptr;
    }
    int32_t const status = dfl2SelectPathsHost(static_cast<int32_t const*>(cand.data),
        static_cast<float const*>(unary.data), hidden.data, static_cast<int32_t const*>(anchor.data), pred.data,
        succ.data, static_cast<float const*>(temp.data), static_cast<float const*>(unif.data),
        static_cast<int32_t>(B), static_cast<int32_t>(L), static_cast<int32_t>(K), static_cast<int32_t>(k.rank),
        static_cast<int32_t>(pred.dims[0]), et, k.mode, static_cast<int32_t*>(path), static_cast<float*>(prob),
        nullptr);
    return status == DFL2_SELECTOR_OK ? nullptr : fail(api, "the selector refused its arguments");
}

char const* ORT_API_CALL name(OrtCustomOp const*)
{
    return "DFlash2PathSelector";
}

//! cand_ids, anchor_ids: int32; hidden_proj and the codebooks: any (checked at run time); the rest float.
ONNXTensorElementDataType ORT_API_CALL inputType(OrtCustomOp const*, size_t i)
{
    if (i == 0 || i == 3)
    {
        return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    }
    return (i == 2 || i == 4 || i == 5) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL inputCount(OrtCustomOp const*)
{
    return kInputs;
}

ONNXTensorElementDataType ORT_API_CALL outputType(OrtCustomOp const*, size_t i)
{
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL outputCount(OrtCustomOp const*)
{
    return kOutputs;
}

OrtStatus* ORT_API_CALL create(OrtCustomOp const*, OrtApi const* api, OrtKernelInfo const* info, void** kernel)
{
    *kernel = nullptr;
    try
    {
        auto k = std::make_unique<SelectorKernel>();
        k->api = api;
        if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "top_k", &k->topK))
        {
            return st;
        }
        if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "rank", &k->rank))
        {
            return st;
        }
        if (k->topK < 1 || k->rank < 1)
        {
            return fail(api, "top_k and rank must be positive");
        }
        std::string mode = "greedy";
        size_t size = 0;
        if (OrtStatus* st = api->KernelInfoGetAttribute_string(info, "mode", nullptr, &size))
        {
            api->ReleaseStatus(st); // optional attribute, default "greedy"
        }
        else
        {
            std::vector<char> buf(size);
            if (OrtStatus* st2 = api->KernelInfoGetAttribute_string(info, "mode", buf.data(), &size))
            {
                return st2;
            }
            mode.assign(buf.data());
        }
        if (mode != "greedy" && mode != "viterbi")
        {
            return fail(api, "mode must be \"greedy\" or \"viterbi\", got \"" + mode + "\"");
        }
        k->mode = mode == "greedy" ? DFL2_MODE_GREEDY : DFL2_MODE_VITERBI;
        *kernel = k.release();
        return nullptr;
    }
    catch (std::exception const& e)
    {
        return api->CreateStatus(ORT_FAIL, e.what());
    }
}

OrtStatus* ORT_API_CALL computeKernel(void* kernel, OrtKernelContext* ctx)
{
    auto const* k = static_cast<SelectorKernel const*>(kernel);
    try
    {
        return compute(*k, ctx);
    }
    catch (std::exception const& e)
    {
        return k->api->CreateStatus(ORT_FAIL, e.what());
    }
}

void ORT_API_CALL destroy(void* kernel)
{
    delete static_cast<SelectorKernel*>(kernel);
}

OrtCustomOp makeOp()
{
    return dflash2::ort::makeCustomOp(
        {name, inputType, inputCount, outputType, outputCount, create, computeKernel, destroy});
}

OrtCustomOp gSelectorOp = makeOp();

} // namespace

OrtStatus* dflash2::addPathSelectorDomain(OrtApi const* api, OrtSessionOptions* options)
{
    return dflash2::ort::addDomain(api, options, kSelectorDomain, {&gSelectorOp});
}
