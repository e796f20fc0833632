/*
 * dflash2_trt — CPU twin of the DFlash2PathSelector kernel (C ABI, callable through ctypes).
 *
 * Built into libdflash2_selector_host.so by the host C++ compiler from the same math header as
 * the kernel (pathSelectorMath.h). Stateless and thread-safe; all buffers belong to the caller
 * and are only read/written during the call.
 */
#ifndef DFLASH2_PATH_SELECTOR_HOST_H
#define DFLASH2_PATH_SELECTOR_HOST_H

#include <stdint.h>

#if defined(_WIN32)
#define DFL2_SELECTOR_API __declspec(dllexport)
#else
#define DFL2_SELECTOR_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

//! Status codes of the host twin.
#define DFL2_SELECTOR_OK 0
#define DFL2_SELECTOR_BAD_ARGUMENT 1

//! Element types of hidden_proj / codebooks (values of dflash2::selector::ElemType).
#define DFL2_ELEM_FLOAT32 0
#define DFL2_ELEM_FLOAT16 1
#define DFL2_ELEM_BFLOAT16 2

//! Modes (values of dflash2::selector::Mode).
#define DFL2_MODE_GREEDY 0
#define DFL2_MODE_VITERBI 1

//! Path selection for a batch, exactly what the kernel computes.
//!
//! \param candIds     [B, L, K] int32 top-k candidate ids (sorted by descending unary)
//! \param unary       [B, L, K] fp32 top-k logits
//! \param hiddenProj  [B, L, r] elemType projected hidden g
//! \param anchorIds   [B] int32
//! \param predCodebook [V, r] elemType (A)
//! \param succCodebook [V, r] elemType (B)
//! \param temperature [B] fp32 (<= 0: argmax for that sequence)
//! \param uniforms    [B, L] fp32 in [0, 1); may be NULL when no temperature is > 0
//! \param pathIds     [B, L] int32 output: chosen candidate ids
//! \param proposals   [B, L, K] fp32 output: proposal probabilities (one-hot at T <= 0)
//! \param pathIdx     [B, L] int32 optional output (NULL to skip): chosen candidate index
//! \return DFL2_SELECTOR_OK, or DFL2_SELECTOR_BAD_ARGUMENT for bad sizes/mode/type/NULL inputs
DFL2_SELECTOR_API int32_t dfl2SelectPathsHost(int32_t const* candIds, float const* unary, void const* hiddenProj,
    int32_t const* anchorIds, void const* predCodebook, void const* succCodebook, float const* temperature,
    float const* uniforms, int32_t batch, int32_t rows, int32_t topK, int32_t rank, int32_t vocab, int32_t elemType,
    int32_t mode, int32_t* pathIds, float* proposals, int32_t* pathIdx);

//! The fp32 lattice of one batch, as the kernel builds it: lattice [B, L, K, K]. Row 0 repeats
//! the anchor row in every i (the kernel computes only i = 0 there). Same arguments as above.
DFL2_SELECTOR_API int32_t dfl2SelectorLatticeHost(int32_t const* candIds, float const* unary, void const* hiddenProj,
    int32_t const* anchorIds, void const* predCodebook, void const* succCodebook, int32_t batch, int32_t rows,
    int32_t topK, int32_t rank, int32_t vocab, int32_t elemType, float* lattice);

//! The shared exp / log (tests pin their accuracy): out[n] = exp(in[n]) or log(in[n]).
DFL2_SELECTOR_API void dfl2SelectorExpHost(float const* in, float* out, int32_t n);
DFL2_SELECTOR_API void dfl2SelectorLogHost(float const* in, float* out, int32_t n);

#ifdef __cplusplus
}
#endif

#endif // DFLASH2_PATH_SELECTOR_HOST_H
