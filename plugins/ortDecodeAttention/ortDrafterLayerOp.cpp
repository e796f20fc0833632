//! \file ortDrafterLayerOp.cpp
//! dflash2.DrafterLayer (CPU): one DFlash 2 drafter decoder layer in one node (drafterLayer.h), what the ONNX Runtime
//! flavour of the drafter's block graph runs in place of the layer's ≈ 170 small nodes.
//! Op contract (dflash2_trt/export/onnx_graphs.py, FusedDrafterLayer):
//!   inputs  0 h [B, S, H], 1 cos [B, S, d], 2 sin [B, S, d], 3 ctx_k / 4 ctx_v [B or 1, kvh, C, d],
//!           5 ctx_bias [B, 1, rep S, C], 6 blk_bias [B, 1, rep S, S] (additive: 0 or -inf), all f32;
//!           constants (f32, MatMul layout [in, out]): 7 input_norm [H], 8 post_norm [H], 9 q [H, nh d],
//!           10 k [H, kvh d], 11 v [H, kvh d], 12 o [nh d, H], 13 q_norm [d], 14 k_norm [d], 15 gate [H, I],
//!           16 up [H, I], 17 down [I, H]; with convolutions also 18 attn_kernel [H, 2 kc G], 19 attn_base [2, kc, H],
//!           20 mlp_kernel [H, 2 kc G], 21 mlp_base [2, kc, H]
//!   output  [B, S, H]
//!   attrs   num_heads, kv_num_heads, epsilon (float), activation ("silu" | "gelu" | "gelu_tanh" | "relu"),
//!           conv_group_size (0: no convolutions), conv_kernel_size
#include "ortDrafterLayerOp.h"

#include "drafterLayer.h"
#include "ortOpParts.h"
#include "panelMatMul.h"

#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace
{

constexpr size_t kInputs = 22;

struct LayerKernel
{
    OrtApi const* api;
    dflash2::DrafterLayerWeights w;
};

OrtStatus* fail(OrtApi const* api, std::string const& msg)
{
    return api->CreateStatus(ORT_INVALID_ARGUMENT, ("dflash2.DrafterLayer: " + msg).c_str());
}

OrtStatus* dataOf(OrtApi const* api, OrtValue const* v, float const** out)
{
    void const* p = nullptr;
    OrtStatus* st = dflash2::ort::tensorData(api, v, &p);
    *out = static_cast<float const*>(p);
    return st;
}

//! constant input i with the expected dims (-1: any) -> its data
OrtStatus* constant(OrtApi const* api, OrtKernelInfo const* info, size_t i, std::vector<int64_t> const& expect,
    float const** data, std::vector<int64_t>& dims)
{
    int isConstant = 0;
    OrtValue const* v = nullptr;
    if (OrtStatus* st = api->KernelInfoGetConstantInput_tensor(info, i, &isConstant, &v))
    {
        return st;
    }
    if (isConstant == 0 || v == nullptr)
    {
        return fail(api, "input " + std::to_string(i) + " (a weight) must be a constant");
    }
    if (OrtStatus* st = dflash2::ort::tensorDims(api, v, dims))
    {
        return st;
    }
    bool ok = dims.size() == expect.size();
    for (size_t k = 0; ok && k < dims.size(); ++k)
    {
        ok = expect[k] < 0 || expect[k] == dims[k];
    }
    if (!ok)
    {
        return fail(api, "weight input " + std::to_string(i) + " has an unexpected shape");
    }
    return dataOf(api, v, data);
}

OrtStatus* vectorInput(OrtApi const* api, OrtKernelInfo const* info, size_t i, int64_t n, std::vector<float>& out)
{
    float const* p = nullptr;
    std::vector<int64_t> dims;
    if (OrtStatus* st = constant(api, info, i, {n}, &p, dims))
    {
        return st;
    }
    out.assign(p, p + n);
    return nullptr;
}

OrtStatus* matrixInput(OrtApi const* api, OrtKernelInfo const* info, size_t i, int64_t K, int64_t N,
    dflash2::PanelWeight& out)
{
    float const* p = nullptr;
    std::vector<int64_t> dims;
    if (OrtStatus* st = constant(api, info, i, {K, N < 0 ? -1 : N}, &p, dims))
    {
        return st;
    }
    if (dims[1] % dflash2::kPanelWidth != 0)
    {
        return fail(api, "weight input " + std::to_string(i) + ": its output size must be a multiple of 16");
    }
    out.set(p, dims[0], dims[1]);
    return nullptr;
}

OrtStatus* create(OrtApi const* api, OrtKernelInfo const* info, LayerKernel& k)
{
    auto& w = k.w;
    if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "num_heads", &w.heads))
    {
        return st;
    }
    if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &w.kvHeads))
    {
        return st;
    }
    if (OrtStatus* st = api->KernelInfoGetAttribute_float(info, "epsilon", &w.eps))
    {
        return st;
    }
    if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "conv_group_size", &w.convGroup))
    {
        return st;
    }
    if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "conv_kernel_size", &w.convTaps))
    {
        return st;
    }
    size_t size = 0;
    if (OrtStatus* st = api->KernelInfoGetAttribute_string(info, "activation", nullptr, &size))
    {
        return st;
    }
    std::vector<char> buf(size);
    if (OrtStatus* st = api->KernelInfoGetAttribute_string(info, "activation", buf.data(), &size))
    {
        return st;
    }
    std::string const act(buf.data());
    using A = dflash2::Activation;
    if (act == "silu")
        w.act = A::Silu;
    else if (act == "gelu")
        w.act = A::Gelu;
    else if (act == "gelu_tanh")
        w.act = A::GeluTanh;
    else if (act == "relu")
        w.act = A::Relu;
    else
        return fail(api, "activation must be silu, gelu, gelu_tanh or relu, got " + act);
    if (w.heads <= 0 || w.kvHeads <= 0 || w.heads % w.kvHeads != 0)
    {
        return fail(api, "num_heads must be a positive multiple of kv_num_heads");
    }
    float const* p = nullptr;
    std::vector<int64_t> dims;
    if (OrtStatus* st = constant(api, info, 9, {-1, -1}, &p, dims)) // q [H, nh d]
    {
        return st;
    }
    w.hidden = dims[0];
    w.headDim = dims[1] / w.heads;
    if (w.headDim * w.heads != dims[1] || w.headDim % 2 != 0 || w.headDim > 512)
    {
        return fail(api, "q's output size must be num_heads x an even head size <= 512");
    }
    if (OrtStatus* st = constant(api, info, 15, {w.hidden, -1}, &p, dims)) // gate [H, I]
    {
        return st;
    }
    w.inter = dims[1];
    int64_t const H = w.hidden, d = w.headDim;
    OrtStatus* st = vectorInput(api, info, 7, H, w.inputNorm);
    st = st != nullptr ? st : vectorInput(api, info, 8, H, w.postNorm);
    st = st != nullptr ? st : matrixInput(api, info, 9, H, w.heads * d, w.q);
    st = st != nullptr ? st : matrixInput(api, info, 10, H, w.kvHeads * d, w.k);
    st = st != nullptr ? st : matrixInput(api, info, 11, H, w.kvHeads * d, w.v);
    st = st != nullptr ? st : matrixInput(api, info, 12, w.heads * d, H, w.o);
    st = st != nullptr ? st : vectorInput(api, info, 13, d, w.qNorm);
    st = st != nullptr ? st : vectorInput(api, info, 14, d, w.kNorm);
    st = st != nullptr ? st : matrixInput(api, info, 15, H, w.inter, w.gate);
    st = st != nullptr ? st : matrixInput(api, info, 16, H, w.inter, w.up);
    st = st != nullptr ? st : matrixInput(api, info, 17, w.inter, H, w.down);
    if (st != nullptr || w.convGroup == 0)
    {
        return st;
    }
    if (w.convGroup < 0 || H % w.convGroup != 0 || w.convTaps < 1)
    {
        return fail(api, "conv_group_size must divide the hidden size and conv_kernel_size be >= 1");
    }
    int64_t const dynN = 2 * w.convTaps * (H / w.convGroup);
    st = matrixInput(api, info, 18, H, dynN, w.attnKernel);
    st = st != nullptr ? st : matrixInput(api, info, 20, H, dynN, w.mlpKernel);
    for (auto [i, base] : {std::pair<size_t, std::vector<float>*>{19, &w.attnBase}, {21, &w.mlpBase}})
    {
        if (st == nullptr)
        {
            st = constant(api, info, i, {2, w.convTaps, H}, &p, dims);
            if (st == nullptr)
            {
                base->assign(p, p + 2 * w.convTaps * H);
            }
        }
    }
    return st;
}

struct Parallel
{
    OrtApi const* api;
    OrtKernelContext* ctx;
    OrtStatus* status;
};

void parallelFor(void* user, void (*body)(void*, size_t), size_t items, void* job)
{
    auto* p = static_cast<Parallel*>(user);
    if (p->status != nullptr)
    {
        return;
    }
    p->status = p->api->KernelContext_ParallelFor(p->ctx, body, items, 0, job);
}

OrtStatus* compute(LayerKernel const& k, OrtKernelContext* ctx)
{
    OrtApi const* api = k.api;
    auto const& w = k.w;
    OrtValue const* in[7] = {};
    std::vector<int64_t> dims[7];
    float const* data[7] = {};
    for (size_t i = 0; i < 7; ++i)
    {
        if (OrtStatus* st = api->KernelContext_GetInput(ctx, i, &in[i]))
        {
            return st;
        }
        if (OrtStatus* st = dflash2::ort::tensorDims(api, in[i], dims[i]))
        {
            return st;
        }
        if (OrtStatus* st = dataOf(api, in[i], &data[i]))
        {
            return st;
        }
    }
    auto const& hd = dims[0];
    if (hd.size() != 3 || hd[2] != w.hidden)
    {
        return fail(api, "h must be [B, S, hidden]");
    }
    int64_t const B = hd[0], S = hd[1], d = w.headDim, rep = w.heads / w.kvHeads;
    auto const& kd = dims[3];
    if (kd.size() != 4 || (kd[0] != B && kd[0] != 1) || kd[1] != w.kvHeads || kd[3] != d || dims[4] != kd)
    {
        return fail(api, "ctx_k and ctx_v must be [B or 1, kv_num_heads, C, head size]");
    }
    int64_t const C = kd[2];
    if (dims[1] != std::vector<int64_t>{B, S, d} || dims[2] != dims[1]
        || dims[5] != std::vector<int64_t>{B, 1, rep * S, C} || dims[6] != std::vector<int64_t>{B, 1, rep * S, S})
    {
        return fail(api, "cos / sin must be [B, S, d], ctx_bias [B, 1, rep S, C] and blk_bias [B, 1, rep S, S]");
    }
    OrtValue* out = nullptr;
    if (OrtStatus* st = api->KernelContext_GetOutput(ctx, 0, hd.data(), hd.size(), &out))
    {
        return st;
    }
    void* y = nullptr;
    if (OrtStatus* st = api->GetTensorMutableData(out, &y))
    {
        return st;
    }
    std::vector<float> scratch(static_cast<size_t>(dflash2::drafterLayerScratch(w, S, C)));
    Parallel par{api, ctx, nullptr};
    for (int64_t b = 0; b < B; ++b)
    {
        int64_t const kb = kd[0] == 1 ? 0 : b;
        dflash2::drafterLayer(w, S, data[0] + b * S * w.hidden, data[1] + b * S * d, data[2] + b * S * d,
            data[3] + kb * w.kvHeads * C * d, data[4] + kb * w.kvHeads * C * d, C, data[5] + b * rep * S * C,
            data[6] + b * rep * S * S, static_cast<float*>(y) + b * S * w.hidden, scratch.data(), parallelFor, &par);
        if (par.status != nullptr)
        {
            return par.status;
        }
    }
    return nullptr;
}

char const* ORT_API_CALL name(OrtCustomOp const*)
{
    return "DrafterLayer";
}

ONNXTensorElementDataType ORT_API_CALL floatType(OrtCustomOp const*, size_t)
{
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL inputCount(OrtCustomOp const*)
{
    return kInputs;
}

size_t ORT_API_CALL outputCount(OrtCustomOp const*)
{
    return 1;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL inputCharacteristic(OrtCustomOp const*, size_t i)
{
    return i < 18 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL; // the convolutions' weights
}

OrtStatus* ORT_API_CALL createKernel(OrtCustomOp const*, OrtApi const* api, OrtKernelInfo const* info, void** kernel)
{
    *kernel = nullptr;
    try
    {
        auto k = std::make_unique<LayerKernel>();
        k->api = api;
        if (OrtStatus* st = create(api, info, *k))
        {
            return st;
        }
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
    auto const* k = static_cast<LayerKernel const*>(kernel);
    try
    {
        return compute(*k, ctx);
    }
    catch (std::exception const& e)
    {
        return k->api->CreateStatus(ORT_FAIL, e.what());
    }
}

void ORT_API_CALL destroyKernel(void* kernel)
{
    delete static_cast<LayerKernel*>(kernel);
}

OrtCustomOp makeOp()
{
    return dflash2::ort::makeCustomOp({name, floatType, inputCount, floatType, outputCount, createKernel,
        computeKernel, destroyKernel, inputCharacteristic});
}

OrtCustomOp gLayerOp = makeOp();

} // namespace

OrtCustomOp* dflash2::drafterLayerOp()
{
    return &gLayerOp;
}
