/*
 * dflash2_trt — CPU twin of the DFlash2PathSelector kernel. See pathSelectorHost.h.
 *
 * The loop structure differs from the kernel (sequential here, lanes there) but every number is
 * produced by the same functions of pathSelectorMath.h in the same order, so results match the
 * kernel bit for bit (plugins/tests/gpu_check.sh verifies that on a GPU).
 */
#include "pathSelectorHost.h"

#include "pathSelectorMath.h"

#include <exception>
#include <vector>

namespace
{
namespace sel = dflash2::selector;

//! Lattice of one sequence b: out [L, K, K].
template <typename T>
void latticeOne(int32_t const* candIds, float const* unary, T const* hidden, int32_t anchor, T const* predCb,
    T const* succCb, int32_t L, int32_t K, int32_t r, int32_t V, float* out)
{
    for (int32_t t = 0; t < L; ++t)
    {
        T const* g = hidden + static_cast<int64_t>(t) * r; // [r]
        // row 0: the anchor is the only predecessor, computed once (i = 0) and repeated
        int32_t const nI = t == 0 ? 1 : K;
        for (int32_t i = 0; i < nI; ++i)
        {
            int32_t const pred = t == 0 ? anchor : candIds[(t - 1) * K + i];
            T const* a = predCb + static_cast<int64_t>(sel::clampId(pred, V)) * r; // [r]
            for (int32_t j = 0; j < K; ++j)
            {
                T const* b = succCb + static_cast<int64_t>(sel::clampId(candIds[t * K + j], V)) * r; // [r]
                out[(t * K + i) * K + j] = sel::latticeEntry(unary[t * K + j], sel::pairDot(a, g, b, r));
            }
        }
        if (t == 0)
        {
            for (int32_t i = 1; i < K; ++i)
            {
                for (int32_t j = 0; j < K; ++j)
                {
                    out[i * K + j] = out[j];
                }
            }
        }
    }
}

bool argsOk(void const* candIds, void const* unary, void const* hidden, void const* anchor, void const* predCb,
    void const* succCb, int32_t batch, int32_t L, int32_t K, int32_t r, int32_t V, int32_t elemType)
{
    return candIds != nullptr && unary != nullptr && hidden != nullptr && anchor != nullptr && predCb != nullptr
        && succCb != nullptr && batch >= 0 && L >= 1 && K >= 1 && K <= sel::kMAX_TOP_K && r >= 1 && V >= 1
        && elemType >= 0 && elemType <= 2;
}

template <typename T>
int32_t latticeBatch(int32_t const* candIds, float const* unary, void const* hidden, int32_t const* anchorIds,
    void const* predCb, void const* succCb, int32_t batch, int32_t L, int32_t K, int32_t r, int32_t V, float* lattice)
{
    for (int32_t b = 0; b < batch; ++b)
    {
        int64_t const lk = static_cast<int64_t>(b) * L * K;
        latticeOne(candIds + lk, unary + lk, static_cast<T const*>(hidden) + static_cast<int64_t>(b) * L * r,
            anchorIds[b], static_cast<T const*>(predCb), static_cast<T const*>(succCb), L, K, r, V,
            lattice + lk * K);
    }
    return DFL2_SELECTOR_OK;
}

int32_t latticeAny(int32_t const* candIds, float const* unary, void const* hidden, int32_t const* anchorIds,
    void const* predCb, void const* succCb, int32_t batch, int32_t L, int32_t K, int32_t r, int32_t V,
    int32_t elemType, float* lattice)
{
    switch (static_cast<sel::ElemType>(elemType))
    {
    case sel::ElemType::kFLOAT32:
        return latticeBatch<float>(candIds, unary, hidden, anchorIds, predCb, succCb, batch, L, K, r, V, lattice);
    case sel::ElemType::kFLOAT16:
        return latticeBatch<sel::Fp16Bits>(
            candIds, unary, hidden, anchorIds, predCb, succCb, batch, L, K, r, V, lattice);
    case sel::ElemType::kBFLOAT16:
        return latticeBatch<sel::Bf16Bits>(
            candIds, unary, hidden, anchorIds, predCb, succCb, batch, L, K, r, V, lattice);
    }
    return DFL2_SELECTOR_BAD_ARGUMENT;
}

} // namespace

extern "C" int32_t dfl2SelectorLatticeHost(int32_t const* candIds, float const* unary, void const* hiddenProj,
    int32_t const* anchorIds, void const* predCodebook, void const* succCodebook, int32_t batch, int32_t rows,
    int32_t topK, int32_t rank, int32_t vocab, int32_t elemType, float* lattice)
{
    if (!argsOk(candIds, unary, hiddenProj, anchorIds, predCodebook, succCodebook, batch, rows, topK, rank, vocab,
            elemType)
        || lattice == nullptr)
    {
        return DFL2_SELECTOR_BAD_ARGUMENT;
    }
    return latticeAny(candIds, unary, hiddenProj, anchorIds, predCodebook, succCodebook, batch, rows, topK, rank,
        vocab, elemType, lattice);
}

extern "C" int32_t dfl2SelectPathsHost(int32_t const* candIds, float const* unary, void const* hiddenProj,
    int32_t const* anchorIds, void const* predCodebook, void const* succCodebook, float const* temperature,
    float const* uniforms, int32_t batch, int32_t rows, int32_t topK, int32_t rank, int32_t vocab, int32_t elemType,
    int32_t mode, int32_t* pathIds, float* proposals, int32_t* pathIdx)
{
    if (!argsOk(candIds, unary, hiddenProj, anchorIds, predCodebook, succCodebook, batch, rows, topK, rank, vocab,
            elemType)
        || temperature == nullptr || pathIds == nullptr || proposals == nullptr || (mode != 0 && mode != 1))
    {
        return DFL2_SELECTOR_BAD_ARGUMENT;
    }
    for (int32_t b = 0; b < batch; ++b)
    {
        if (temperature[b] > 0.0f && uniforms == nullptr)
        {
            return DFL2_SELECTOR_BAD_ARGUMENT;
        }
    }
    try
    {
        int32_t const L = rows;
        int32_t const K = topK;
        std::vector<float> lattice(static_cast<size_t>(batch) * L * K * K); // [B, L, K, K]
        int32_t const status = latticeAny(candIds, unary, hiddenProj, anchorIds, predCodebook, succCodebook, batch,
            L, K, rank, vocab, elemType, lattice.data());
        if (status != DFL2_SELECTOR_OK)
        {
            return status;
        }
        std::vector<float> messages(static_cast<size_t>(L) * K); // [L, K]
        std::vector<int32_t> back(static_cast<size_t>(L) * K);   // [L, K]
        std::vector<int32_t> idx(static_cast<size_t>(L));        // [L]
        for (int32_t b = 0; b < batch; ++b)
        {
            int64_t const lk = static_cast<int64_t>(b) * L * K;
            sel::WalkArgs w{};
            w.lattice = lattice.data() + lk * K;
            w.messages = messages.data();
            w.back = back.data();
            w.pathIdx = idx.data();
            w.proposals = proposals + lk;
            w.uniforms = uniforms != nullptr ? uniforms + static_cast<int64_t>(b) * L : nullptr;
            w.temperature = temperature[b];
            w.rows = L;
            w.topK = K;
            sel::WalkScratch scratch{};
            sel::walk(sel::SerialLanes{}, static_cast<sel::Mode>(mode), w, scratch);
            for (int32_t t = 0; t < L; ++t)
            {
                pathIds[static_cast<int64_t>(b) * L + t] = candIds[lk + t * K + idx[t]];
                if (pathIdx != nullptr)
                {
                    pathIdx[static_cast<int64_t>(b) * L + t] = idx[t];
                }
            }
        }
    }
    catch (std::exception const&)
    {
        return DFL2_SELECTOR_BAD_ARGUMENT; // allocation failure; nothing escapes the C ABI
    }
    return DFL2_SELECTOR_OK;
}

extern "C" void dfl2SelectorExpHost(float const* in, float* out, int32_t n)
{
    for (int32_t k = 0; k < n; ++k)
    {
        out[k] = sel::dfl2Exp(in[k]);
    }
}

extern "C" void dfl2SelectorLogHost(float const* in, float* out, int32_t n)
{
    for (int32_t k = 0; k < n; ++k)
    {
        out[k] = sel::dfl2Log(in[k]);
    }
}
