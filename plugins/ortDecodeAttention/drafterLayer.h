//! \file drafterLayer.h
//! One DFlash 2 drafter decoder layer over a block's rows, the whole layer in one call: the twin of
//! dflash2_trt.model.drafter.DrafterLayer.forward (RMSNorm, the dynamic two-tap convolutions, KV-injection attention
//! with q/k norms and RoPE over [context keys | block keys] under additive biases, gated MLP) in place of the ≈ 170
//! small nodes of the layer's ONNX graph, whose per-node costs inside a decode loop (after a target step, caches
//! cold) add up to ≈ 0.3 ms a proposal. Projections read their weights in panels through the PanelMatMul kernels
//! (an exact code where one fits: panelCodes.h).
#pragma once

#include "panelCodes.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dflash2
{

//! A [K, N] weight kept in 16-column panels (and its exact code where one fits).
struct PanelWeight
{
    int64_t K{0};
    int64_t N{0};
    std::vector<float> panels; //!< [N/16][K][16]
    CodedPanels coded;
    void set(float const* w, int64_t K, int64_t N); //!< w [K, N] row-major; N a multiple of 16
    //! y[rows, N] = x[rows, K] @ W, panels [panelBegin, panelEnd)
    void apply(float const* x, int64_t rows, float* y, int64_t panelBegin, int64_t panelEnd) const;
};

enum class Activation : int32_t
{
    Silu = 0,
    Gelu = 1,     //!< erf
    GeluTanh = 2, //!< tanh approximation
    Relu = 3,
};

struct DrafterLayerWeights
{
    int64_t hidden{0}, heads{0}, kvHeads{0}, headDim{0}, inter{0};
    int64_t convGroup{0}; //!< 0: no convolutions
    int64_t convTaps{0};
    float eps{1e-6F};
    Activation act{Activation::Silu};
    std::vector<float> inputNorm, postNorm, qNorm, kNorm; //!< [H], [H], [d], [d]
    PanelWeight q, k, v, o, gate, up, down;
    PanelWeight attnKernel, mlpKernel;       //!< [H, 2 kc G]
    std::vector<float> attnBase, mlpBase;    //!< [2, kc, H]
};

//! Runs `fn(item)` for item in [0, items): the caller's parallel loop (ONNX Runtime's pool in the op).
using ParallelFn = void (*)(void* ctx, void (*body)(void*, size_t), size_t items, void* user);

//! One sequence: h [S, H] -> out [S, H]. cos / sin [S, d]; ctxK / ctxV [kvh, C, d]; ctxBias [rep S, C] and blkBias
//! [rep S, S] additive (row r S + t: query row t of head g rep + r). Scratch is the caller's (drafterLayerScratch).
void drafterLayer(DrafterLayerWeights const& w, int64_t S, float const* h, float const* cos, float const* sin,
    float const* ctxK, float const* ctxV, int64_t C, float const* ctxBias, float const* blkBias, float* out,
    float* scratch, ParallelFn parallel, void* parallelCtx);

//! Floats of scratch drafterLayer needs for S rows and C context slots.
int64_t drafterLayerScratch(DrafterLayerWeights const& w, int64_t S, int64_t C);

} // namespace dflash2
