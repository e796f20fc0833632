/*
 * dflash2_trt — DFlash2PathSelector CUDA kernel: launcher interface (no TensorRT headers).
 *
 * Ownership: every pointer is a device buffer owned by the caller; the launcher only enqueues
 * work on `stream` (no allocation, no synchronisation, no host<->device copy), so it may be
 * captured into a CUDA graph. A captured graph keeps these addresses: the buffers must outlive
 * it and must never be reallocated while it exists.
 */
#ifndef DFLASH2_PATH_SELECTOR_KERNEL_CUH
#define DFLASH2_PATH_SELECTOR_KERNEL_CUH

#include "pathSelectorMath.h"

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace dflash2
{
namespace selector
{

//! Threads per block (one block per sequence). 16 warps: the lattice uses all of them, the walk
//! runs in warp 0.
constexpr int32_t kTHREADS = 512;

//! Default dynamic shared memory a block may use without an opt-in (all architectures).
constexpr size_t kDEFAULT_SMEM_LIMIT = 48 * 1024;

//! Arguments of one launch. Shapes: B = batch, L = rows, K = topK, r = rank, V = vocab.
struct SelectorLaunchParams
{
    int32_t const* candIds;   //!< [B, L, K] int32
    float const* unary;       //!< [B, L, K] fp32, sorted descending per row
    void const* hiddenProj;   //!< [B, L, r] elemType
    int32_t const* anchorIds; //!< [B] int32
    void const* predCodebook; //!< [V, r] elemType (A)
    void const* succCodebook; //!< [V, r] elemType (B)
    float const* temperature; //!< [B] fp32, <= 0 means argmax for that sequence
    float const* uniforms;    //!< [B, L] fp32 in [0, 1)
    int32_t* pathIds;         //!< [B, L] int32 output
    float* proposals;         //!< [B, L, K] fp32 output
    int32_t batch;
    int32_t rows;
    int32_t topK;
    int32_t rank;
    int32_t vocab;
    ElemType elemType;
    Mode mode;
};

//! Dynamic shared memory one block needs for L rows and K candidates (lattice + walk scratch).
size_t pathSelectorSharedBytes(int32_t rows, int32_t topK) noexcept;

//! Enqueue the selector on `stream`. Returns cudaErrorInvalidValue for sizes outside the
//! supported range (K in 1..16, smem within kDEFAULT_SMEM_LIMIT) and otherwise the launch status
//! (cudaGetLastError). batch == 0 is a no-op.
cudaError_t launchPathSelector(SelectorLaunchParams const& params, cudaStream_t stream) noexcept;

} // namespace selector
} // namespace dflash2

#endif // DFLASH2_PATH_SELECTOR_KERNEL_CUH
