//! \file ortCustomOp.cpp
//! ONNX Runtime custom-op library: registers dflash2.DecodeAttention, dflash2.PanelMatMul and dflash2.PanelMatMulQ4
//! (CPU) through the ORT C API (`SessionOptions.register_custom_ops_library(path)` calls RegisterCustomOps), and the
//! path selector's TensorRT plugin node trt.plugins.DFlash2PathSelector (ortSelectorOp.cpp).
//!
//! dflash2.PanelMatMul (panelMatMul.h): inputs x [..., K] f32, packed [N/16, K, 16] f32 (a constant: the [K, N]
//! weight reshaped and transposed, folded at session load); output y [..., N] f32 = x @ W. Row i of y depends on
//! row i of x alone, computed the same way whatever the number of rows. Its kernel reads an exact code of the
//! weights instead where one reproduces them bit for bit (panelCodes.h: the same numbers).
//! dflash2.PanelMatMulQ4 (panelMatMul.h): the same over MatMulNBits' symmetric 4-bit weights: inputs x [..., K] f32,
//! packed [N/16, K/2, 16] uint8, scales [N/16, K/B, 16] f32 (both constants folded at load from MatMulNBits' B and
//! scales); output y [..., N] f32; the block size B = K / scales' second dimension.
//!
//! dflash2.DecodeAttention:
//! Op contract (the inputs, attributes and outputs of com.microsoft.GroupQueryAttention as the fused target graph
//! uses it: packed QKV, do_rotary=1, rotary_interleaved=0; plus one optional input for ragged rows):
//!   inputs  qkv [B, S, (num_heads + 2 kv_num_heads) d] f32, past_key / past_value [B, kvh, C, d] f32,
//!           seqlens_k [B] i32, total_sequence_length [] i32 (read by nobody: sizes come from seqlens_k),
//!           cos / sin [R, d/2] f32, past_seqlens [B] i32 (optional)
//!   outputs out [B, S, num_heads d] f32, present_key / present_value [B, kvh, max(C, max_b T_b), d] f32
//!   attrs   num_heads, kv_num_heads (int), scale (float, 0 = 1/sqrt(d))
//! Sequence b has P_b valid cached slots (its own length in the shared capacity buffer) and S_b <= S new rows at
//! positions P_b .. P_b+S_b-1; seqlens_k[b] = T_b - 1 with T_b = P_b + S_b, as GroupQueryAttention defines it:
//!   * without past_seqlens (GroupQueryAttention's own inputs): every row is new, S_b = S, P_b = seqlens_k[b] + 1 - S;
//!   * with past_seqlens: P_b = past_seqlens[b], S_b = seqlens_k[b] + 1 - P_b (0 <= S_b <= S; 0: b takes no part).
//!     Rows S_b .. S-1 of b are padding: right-aligned after its real rows, their outputs are zeros, they write no
//!     cache slot and cost no attention.
//! Sequence b's real rows are computed exactly as a batch-1 call on b alone would compute them (the same kernel
//! call on b's rows and b's buffers): batching never changes a sequence's numbers.
//! When present is bound to the same buffer as past (the runtime's IOBinding), the new rows are written in place
//! and nothing is copied; otherwise slots 0..P_b-1 of every b are copied from past first.
//! Errors come back as OrtStatus (no exception crosses the library boundary).
#include "decodeAttention.h"
#include "ortDrafterLayerOp.h"
#include "ortOpParts.h"
#include "ortSelectorOp.h"
#include "panelCodes.h"
#include "panelMatMul.h"

#include <onnxruntime_c_api.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
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
    return dflash2::ort::tensorDims(gApi, v, out.dims);
}

OrtStatus* tensorData(OrtValue const* v, void const** out)
{
    return dflash2::ort::tensorData(gApi, v, out);
}

OrtStatus* fail(std::string const& msg)
{
    return gApi->CreateStatus(ORT_INVALID_ARGUMENT, ("dflash2.DecodeAttention: " + msg).c_str());
}

//! One sequence of the batch: its shape (rows = S_b real rows, past = P_b) and its slices of the tensors.
struct Sequence
{
    dflash2::DecodeAttentionShape shape;
    float const* qkv;    //!< [S, W]: its rows (the first S_b real)
    float* keys;         //!< [kvh, C', d]: its present buffer
    float* values;       //!< [kvh, C', d]
    float* out;          //!< [S, nh d]
};

//! One unit of the parallel loop: queries [queryBegin, queryEnd) of one sequence (query i = head i / S_b, row
//! i % S_b), all of heads sharing one key/value head (they read its keys and values once, see
//! decodeAttentionQueries): a group's heads whole, or a piece of them cut between rows.
struct Item
{
    int32_t sequence;
    int64_t queryBegin;
    int64_t queryEnd;
    int64_t cost; //!< keys its queries attend to
};

struct ParallelArgs
{
    std::vector<Sequence> const* seqs;
    std::vector<Item> const* items; //!< costliest first
    float const *cosTable, *sinTable;
};

void runItem(void* user, size_t i)
{
    auto const* a = static_cast<ParallelArgs const*>(user);
    Item const& it = (*a->items)[i];
    Sequence const& q = (*a->seqs)[static_cast<size_t>(it.sequence)];
    thread_local std::vector<float> scratch;
    size_t const need = static_cast<size_t>(dflash2::decodeAttentionScratch(q.shape));
    if (scratch.size() < need)
    {
        scratch.resize(need);
    }
    dflash2::decodeAttentionQueries(q.shape, q.qkv, a->cosTable, a->sinTable, q.keys, q.values, q.out,
        it.queryBegin, it.queryEnd, scratch.data());
}

OrtStatus* int32Values(OrtValue const* v, int64_t expected, char const* name, int32_t const** out)
{
    Shape shape;
    if (OrtStatus* st = shapeOf(v, shape))
    {
        return st;
    }
    int64_t n = 1;
    for (int64_t x : shape.dims)
    {
        n *= x;
    }
    if (n != expected)
    {
        return fail(std::string(name) + " must hold one value per sequence (" + std::to_string(expected) + "), got "
            + std::to_string(n));
    }
    void const* p = nullptr;
    OrtStatus* st = tensorData(v, &p);
    *out = static_cast<int32_t const*>(p);
    return st;
}

OrtStatus* compute(Kernel const& k, OrtKernelContext* ctx)
{
    size_t nIn = 0;
    if (OrtStatus* st = gApi->KernelContext_GetInputCount(ctx, &nIn))
    {
        return st;
    }
    OrtValue const* in[8] = {};
    for (size_t i = 0; i < std::min<size_t>(nIn, 8); ++i)
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
    if (qkvShape.dims.size() != 3 || pastShape.dims.size() != 4 || pastShape.dims[0] != qkvShape.dims[0])
    {
        return fail("expects qkv [B, S, (nh + 2 kvh) d] and past [B, kvh, C, d] of the same B");
    }
    int64_t const batch = qkvShape.dims[0];
    int64_t const S = qkvShape.dims[1];
    int64_t const capacity = pastShape.dims[2];
    int64_t const d = pastShape.dims[3];
    if (pastShape.dims[1] != k.kvHeads || qkvShape.dims[2] != (k.numHeads + 2 * k.kvHeads) * d || d % 2 != 0
        || ropeShape.dims.size() != 2 || ropeShape.dims[1] != d / 2)
    {
        return fail("shapes do not match num_heads / kv_num_heads / head size");
    }
    int64_t const ropeRows = ropeShape.dims[0];
    int32_t const* seqlensK = nullptr;
    int32_t const* pastSeqlens = nullptr; // null: GroupQueryAttention's convention (all S rows new)
    if (OrtStatus* st = int32Values(in[3], batch, "seqlens_k", &seqlensK))
    {
        return st;
    }
    if (in[7] != nullptr)
    {
        if (OrtStatus* st = int32Values(in[7], batch, "past_seqlens", &pastSeqlens))
        {
            return st;
        }
    }
    std::vector<Sequence> seqs(static_cast<size_t>(batch));
    int64_t total = 0; // max_b T_b
    for (int64_t b = 0; b < batch; ++b)
    {
        dflash2::DecodeAttentionShape& s = seqs[static_cast<size_t>(b)].shape;
        s.past = pastSeqlens ? pastSeqlens[b] : static_cast<int64_t>(seqlensK[b]) + 1 - S;
        s.rows = static_cast<int64_t>(seqlensK[b]) + 1 - s.past;
        s.numHeads = k.numHeads;
        s.kvHeads = k.kvHeads;
        s.headDim = d;
        s.ropeRows = ropeRows;
        s.scale = k.scale;
        if (s.past < 0 || s.rows < 0 || s.rows > S || s.past > capacity || s.past + s.rows > ropeRows)
        {
            return fail("seqlens_k out of range for sequence " + std::to_string(b) + " (needs P + S_b - 1 with 0 <= P "
                "<= capacity, 0 <= S_b <= S and P + S_b <= rows of cos/sin; P = past_seqlens, or seqlens_k + 1 - S "
                "without it)");
        }
        total = std::max(total, s.past + s.rows);
    }
    int64_t const outDims[3] = {batch, S, k.numHeads * d};
    int64_t const presentDims[4] = {batch, k.kvHeads, std::max(capacity, total), d};
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
    auto* attnOut = static_cast<float*>(outData[0]);
    auto const* qkv = static_cast<float const*>(data[0]);
    auto const* cosTable = static_cast<float const*>(data[5]);
    auto const* sinTable = static_cast<float const*>(data[6]);
    int64_t const presentCapacity = presentDims[2];
    int64_t const rowWidth = qkvShape.dims[2];
    int64_t const outWidth = k.numHeads * d;
    bool const inPlace = keys == data[1] && values == data[2];
    std::vector<Item> items;
    items.reserve(static_cast<size_t>(batch * k.numHeads));
    // items: the queries of heads sharing a key/value head, whole groups or pieces of equal cost
    // (decodeAttentionPieces: B = 1 with 3 key/value heads, two pieces each)
    int64_t const pieces = dflash2::decodeAttentionPieces(batch * k.kvHeads);
    std::vector<dflash2::QueryRange> ranges;
    for (int64_t b = 0; b < batch; ++b)
    {
        Sequence& q = seqs[static_cast<size_t>(b)];
        q.shape.capacity = presentCapacity;
        q.qkv = qkv + b * S * rowWidth;
        q.keys = keys + b * k.kvHeads * presentCapacity * d;
        q.values = values + b * k.kvHeads * presentCapacity * d;
        q.out = attnOut + b * S * outWidth;
        if (!inPlace)
        {
            // not sharing past and present (a plain session.run): slots 0..P_b-1 of each head from past
            size_t const n = static_cast<size_t>(q.shape.past * d) * sizeof(float);
            for (int64_t h = 0; h < k.kvHeads; ++h)
            {
                int64_t const from = (b * k.kvHeads + h) * capacity * d;
                std::memcpy(q.keys + h * presentCapacity * d, static_cast<float const*>(data[1]) + from, n);
                std::memcpy(q.values + h * presentCapacity * d, static_cast<float const*>(data[2]) + from, n);
            }
        }
        // padding rows: zeros
        std::fill(q.out + q.shape.rows * outWidth, q.out + S * outWidth, 0.F);
        if (q.shape.rows == 0)
        {
            continue;
        }
        dflash2::decodeAttentionWriteKv(q.shape, q.qkv, cosTable, sinTable, q.keys, q.values);
        ranges.clear();
        dflash2::decodeAttentionCut(q.shape, pieces, ranges);
        for (auto const& r : ranges)
        {
            items.push_back({static_cast<int32_t>(b), r.begin, r.end, r.cost});
        }
    }
    // costliest first, so a long prefill's pieces are not left for the end of the parallel loop
    std::stable_sort(items.begin(), items.end(), [](auto const& x, auto const& y) { return x.cost > y.cost; });
    if (items.empty())
    {
        return nullptr;
    }
    ParallelArgs args{&seqs, &items, cosTable, sinTable};
    return gApi->KernelContext_ParallelFor(ctx, runItem, items.size(), 0, &args);
}

char const* ORT_API_CALL opName(OrtCustomOp const*)
{
    return "DecodeAttention";
}

ONNXTensorElementDataType ORT_API_CALL inputType(OrtCustomOp const*, size_t i)
{
    return (i == 3 || i == 4 || i == 7) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL inputCount(OrtCustomOp const*)
{
    return 8;
}

ONNXTensorElementDataType ORT_API_CALL outputType(OrtCustomOp const*, size_t)
{
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL outputCount(OrtCustomOp const*)
{
    return 3;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL inputCharacteristic(OrtCustomOp const*, size_t i)
{
    return i == 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED; // past_seqlens
}

OrtMemType ORT_API_CALL inputMemory(OrtCustomOp const*, size_t i)
{
    // seqlens_k / total_sequence_length / past_seqlens are read on the host
    return (i == 3 || i == 4 || i == 7) ? OrtMemTypeCPUInput : OrtMemTypeDefault;
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
    return dflash2::ort::makeCustomOp({opName, inputType, inputCount, outputType, outputCount, createKernel,
        computeKernel, destroyKernel, inputCharacteristic, inputMemory});
}

// -- dflash2.PanelMatMul and dflash2.PanelMatMulQ4 ---------------------------------------------------------------

//! One call of either panel op: x [..., K] (rows = the product of its leading dimensions), weights in N/16 panels,
//! y [..., N]; run over items of a few panels each (enough for the pool's threads, each long enough to stream its
//! weights).
struct PanelCall
{
    float const* x;
    int64_t rows, K, N;
    void const* weights[2]; //!< the op's constant inputs 1.. (panels; Q4: and scales)
    int64_t blockSize;      //!< Q4: k per scale
    float* y;
    int64_t panelsPerItem;
    dflash2::CodedPanels const* coded; //!< fp32: the weights' exact code (panelCodes.h), or nullptr
};

void runPanels(void* user, size_t i)
{
    auto const* a = static_cast<PanelCall const*>(user);
    int64_t const begin = static_cast<int64_t>(i) * a->panelsPerItem;
    int64_t const end = std::min(a->N / dflash2::kPanelWidth, begin + a->panelsPerItem);
    if (a->coded != nullptr)
    {
        dflash2::panelMatMulCoded(a->x, a->rows, *a->coded, a->y, begin, end);
    }
    else if (a->blockSize == 0)
    {
        dflash2::panelMatMul(a->x, a->rows, a->K, static_cast<float const*>(a->weights[0]), a->N, a->y, begin, end);
    }
    else
    {
        dflash2::panelMatMulQ4(a->x, a->rows, a->K, static_cast<uint8_t const*>(a->weights[0]),
            static_cast<float const*>(a->weights[1]), a->blockSize, a->N, a->y, begin, end);
    }
}

//! The shared part of both ops: n inputs (x, then the constants), their shapes checked by `valid` (which also
//! returns the Q4 block size, 0 for fp32), the output y [..., N] with N = 16 x panels, the parallel loop; fp32
//! computes from `coded` where the kernel found an exact code of its weights.
template <size_t n, class Valid>
OrtStatus* computePanels(OrtKernelContext* ctx, char const* op, char const* expects, Valid valid,
    dflash2::CodedPanels const* coded = nullptr)
{
    OrtValue const* in[n] = {};
    Shape shapes[n];
    for (size_t i = 0; i < n; ++i)
    {
        if (OrtStatus* st = gApi->KernelContext_GetInput(ctx, i, &in[i]))
        {
            return st;
        }
        if (OrtStatus* st = shapeOf(in[i], shapes[i]))
        {
            return st;
        }
    }
    auto const& xd = shapes[0].dims;
    auto const& wd = shapes[1].dims;
    int64_t blockSize = 0;
    if (xd.empty() || wd.size() != 3 || wd[2] != dflash2::kPanelWidth || !valid(shapes, blockSize))
    {
        return gApi->CreateStatus(ORT_INVALID_ARGUMENT, (std::string(op) + ": expects " + expects).c_str());
    }
    int64_t const K = xd.back();
    int64_t const N = wd[0] * dflash2::kPanelWidth;
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < xd.size(); ++i)
    {
        rows *= xd[i];
    }
    std::vector<int64_t> outDims = xd;
    outDims.back() = N;
    OrtValue* out = nullptr;
    if (OrtStatus* st = gApi->KernelContext_GetOutput(ctx, 0, outDims.data(), outDims.size(), &out))
    {
        return st;
    }
    if (rows == 0)
    {
        return nullptr;
    }
    void const* data[n] = {};
    for (size_t i = 0; i < n; ++i)
    {
        if (OrtStatus* st = tensorData(in[i], &data[i]))
        {
            return st;
        }
    }
    void* y = nullptr;
    if (OrtStatus* st = gApi->GetTensorMutableData(out, &y))
    {
        return st;
    }
    int64_t const panels = N / dflash2::kPanelWidth;
    int64_t const perItem = std::max<int64_t>(1, panels / 64);
    bool const useCode = coded != nullptr && coded->code != dflash2::PanelCode::None && coded->K == K
        && coded->N == N && rows <= dflash2::kCodedMaxRows;
    PanelCall call{static_cast<float const*>(data[0]), rows, K, N, {data[1], n > 2 ? data[n - 1] : nullptr},
        blockSize, static_cast<float*>(y), perItem, useCode ? coded : nullptr};
    return gApi->KernelContext_ParallelFor(ctx, runPanels, static_cast<size_t>((panels + perItem - 1) / perItem), 0,
        &call);
}

//! PanelMatMul's kernel: the exact code of its constant weights, if one fits (panelCodes.h).
struct MatMulKernel
{
    dflash2::CodedPanels coded;
};


OrtStatus* computeMatMul(OrtKernelContext* ctx, MatMulKernel const* kernel)
{
    return computePanels<2>(
        ctx, "dflash2.PanelMatMul", "x [..., K] and packed weights [N/16, K, 16]",
        [](Shape const* s, int64_t&) { return s[0].dims.back() == s[1].dims[1]; },
        kernel != nullptr ? &kernel->coded : nullptr);
}

char const* ORT_API_CALL matMulName(OrtCustomOp const*)
{
    return "PanelMatMul";
}

size_t ORT_API_CALL matMulInputCount(OrtCustomOp const*)
{
    return 2;
}

size_t ORT_API_CALL matMulOutputCount(OrtCustomOp const*)
{
    return 1;
}

//! The kernel looks for an exact code of its weights when it is created (once, as the session loads), unless the
//! node's optional attribute ``codes`` is 0 (the runtime's weight_codes=False) or DFLASH2_ORT_PANEL_CODES=0 is in
//! the environment; weights that are not a constant keep the fp32 kernel.
OrtStatus* ORT_API_CALL createMatMul(OrtCustomOp const*, OrtApi const* api, OrtKernelInfo const* info, void** kernel)
{
    *kernel = nullptr;
    try
    {
        auto k = std::make_unique<MatMulKernel>();
        int64_t codes = 1;
        if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "codes", &codes))
        {
            api->ReleaseStatus(st); // no attribute: look for a code
            codes = 1;
        }
        char const* const env = std::getenv("DFLASH2_ORT_PANEL_CODES");
        int isConstant = 0;
        OrtValue const* w = nullptr;
        if (codes != 0 && !(env != nullptr && std::string(env) == "0"))
        {
            if (OrtStatus* st = api->KernelInfoGetConstantInput_tensor(info, 1, &isConstant, &w))
            {
                return st;
            }
        }
        Shape shape;
        void const* data = nullptr;
        if (isConstant != 0 && w != nullptr)
        {
            if (OrtStatus* st = shapeOf(w, shape))
            {
                return st;
            }
            auto const& d = shape.dims;
            if (d.size() == 3 && d[2] == dflash2::kPanelWidth)
            {
                if (OrtStatus* st = tensorData(w, &data))
                {
                    return st;
                }
                k->coded = dflash2::codePanels(static_cast<float const*>(data), d[1], d[0] * dflash2::kPanelWidth);
            }
        }
        dflash2::countPanelCode(k->coded.code);
        *kernel = k.release();
        return nullptr;
    }
    catch (std::exception const& e)
    {
        return api->CreateStatus(ORT_FAIL, e.what());
    }
}

OrtStatus* ORT_API_CALL createStateless(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const*, void** kernel)
{
    *kernel = nullptr;
    return nullptr;
}

OrtStatus* ORT_API_CALL computeMatMulKernel(void* kernel, OrtKernelContext* ctx)
{
    try
    {
        return computeMatMul(ctx, static_cast<MatMulKernel const*>(kernel));
    }
    catch (std::exception const& e)
    {
        return gApi->CreateStatus(ORT_FAIL, e.what());
    }
}

void ORT_API_CALL destroyMatMul(void* kernel)
{
    delete static_cast<MatMulKernel*>(kernel);
}

OrtCustomOp makeMatMulOp()
{
    // every input and the output: float
    return dflash2::ort::makeCustomOp({matMulName, outputType, matMulInputCount, outputType, matMulOutputCount,
        createMatMul, computeMatMulKernel, destroyMatMul});
}

// -- dflash2.PanelMatMulQ4 ----------------------------------------------------------------------------------------

OrtStatus* computeMatMulQ4(OrtKernelContext* ctx)
{
    return computePanels<3>(ctx, "dflash2.PanelMatMulQ4",
        "x [..., K], packed [N/16, K/2, 16] uint8 and scales [N/16, K/B, 16] (B even)",
        [](Shape const* s, int64_t& blockSize) {
            auto const& wd = s[1].dims;
            auto const& sd = s[2].dims;
            int64_t const K = s[0].dims.back();
            if (sd.size() != 3 || sd[0] != wd[0] || sd[2] != dflash2::kPanelWidth || sd[1] < 1 || K != 2 * wd[1]
                || K % sd[1] != 0 || (K / sd[1]) % 2 != 0)
            {
                return false;
            }
            blockSize = K / sd[1];
            return true;
        });
}

char const* ORT_API_CALL q4Name(OrtCustomOp const*)
{
    return "PanelMatMulQ4";
}

size_t ORT_API_CALL q4InputCount(OrtCustomOp const*)
{
    return 3;
}

ONNXTensorElementDataType ORT_API_CALL q4InputType(OrtCustomOp const*, size_t index)
{
    return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

OrtStatus* ORT_API_CALL computeQ4Kernel(void*, OrtKernelContext* ctx)
{
    try
    {
        return computeMatMulQ4(ctx);
    }
    catch (std::exception const& e)
    {
        return gApi->CreateStatus(ORT_FAIL, e.what());
    }
}

OrtCustomOp makeQ4Op()
{
    return dflash2::ort::makeCustomOp({q4Name, q4InputType, q4InputCount, outputType, matMulOutputCount,
        createStateless, computeQ4Kernel, [](void*) {}});
}

OrtCustomOp gOp = makeOp();
OrtCustomOp gMatMulOp = makeMatMulOp();
OrtCustomOp gQ4Op = makeQ4Op();

} // namespace

//! How many PanelMatMul kernels this process created with `code` (0 none, 1 Affine4, 2 Scaled8, 3 bf16, 4 fp16:
//! panelCodes.h); -1 for another code. For tests and reports (ctypes on the library ORT loaded).
extern "C" __attribute__((visibility("default"))) int64_t dflash2OrtPanelCodes(int32_t code) noexcept
{
    return dflash2::panelCodeCount(code);
}

//! The instruction set this process's panel and attention kernels run (chosen once, panelMatMulWide): 512 = AVX-512, 256 = AVX2 +
//! FMA (the library's baseline on x86-64), 0 = the portable C++ kernels (another architecture).
extern "C" __attribute__((visibility("default"))) int32_t dflash2OrtKernelIsa() noexcept
{
#if defined(__x86_64__)
    return dflash2::panelMatMulWide() ? 512 : 256;
#else
    return 0;
#endif
}

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(
    OrtSessionOptions* options, OrtApiBase const* base) noexcept
{
    gApi = base->GetApi(ORT_API_VERSION);
    if (gApi == nullptr)
    {
        return nullptr == base ? nullptr : base->GetApi(1)->CreateStatus(ORT_FAIL,
                   "dflash2.DecodeAttention: this ONNX Runtime is older than the headers the library was built with");
    }
    if (OrtStatus* st
        = dflash2::ort::addDomain(gApi, options, "dflash2", {&gOp, &gMatMulOp, &gQ4Op, dflash2::drafterLayerOp()}))
    {
        return st;
    }
    return dflash2::addPathSelectorDomain(gApi, options);
}
