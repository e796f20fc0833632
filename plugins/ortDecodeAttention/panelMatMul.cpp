//! \file panelMatMul.cpp
//! See panelMatMul.h. AVX-512 where the CPU has it (chosen at run time: register blocks of up to 12 rows, one
//! 16-float register per row), else AVX2 + FMA where the build targets it (the default x86-64-v3; blocks of up to 6
//! rows, two 8-float registers each), else portable C++. All three compute the same fused multiply-add chain per
//! output element, so they give the same numbers. The int4 kernels: AVX-512, else portable C++ (the same chains).
#include "panelMatMul.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dflash2
{
namespace
{

constexpr int64_t kMaxRows = 6;        //!< rows per register block: 6 x 2 accumulators + 2 weights + 1 broadcast
constexpr int64_t kPrefetch = 64 * 16; //!< floats ahead in the panel stream (4 KiB: 64 of its K steps)

#if defined(__AVX2__) && defined(__FMA__)
template <int R>
void block(float const* x, int64_t K, float const* panel, float* y, int64_t N)
{
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r)
    {
        acc[r][0] = _mm256_setzero_ps();
        acc[r][1] = _mm256_setzero_ps();
    }
    float const* w = panel;
    for (int64_t k = 0; k < K; ++k, w += kPanelWidth)
    {
        _mm_prefetch(reinterpret_cast<char const*>(w + kPrefetch), _MM_HINT_T0);
        __m256 const w0 = _mm256_loadu_ps(w);
        __m256 const w1 = _mm256_loadu_ps(w + 8);
        for (int r = 0; r < R; ++r)
        {
            __m256 const v = _mm256_broadcast_ss(x + r * K + k);
            acc[r][0] = _mm256_fmadd_ps(v, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(v, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; ++r)
    {
        _mm256_storeu_ps(y + r * N, acc[r][0]);
        _mm256_storeu_ps(y + r * N + 8, acc[r][1]);
    }
}
#else
template <int R>
void block(float const* x, int64_t K, float const* panel, float* y, int64_t N)
{
    float acc[R][kPanelWidth] = {};
    float const* w = panel;
    for (int64_t k = 0; k < K; ++k, w += kPanelWidth)
    {
        for (int r = 0; r < R; ++r)
        {
            for (int64_t j = 0; j < kPanelWidth; ++j)
            {
                acc[r][j] = std::fma(x[r * K + k], w[j], acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
    {
        std::copy(acc[r], acc[r] + kPanelWidth, y + r * N);
    }
}
#endif

#if defined(__x86_64__)
constexpr int64_t kMaxRows512 = 12; //!< 12 accumulators + 1 weight register of 32: more rows per weight read

template <int R>
__attribute__((target("avx512f"))) void block512(float const* x, int64_t K, float const* panel, float* y, int64_t N)
{
    __m512 acc[R];
    for (int r = 0; r < R; ++r)
    {
        acc[r] = _mm512_setzero_ps();
    }
    float const* w = panel;
    for (int64_t k = 0; k < K; ++k, w += kPanelWidth)
    {
        _mm_prefetch(reinterpret_cast<char const*>(w + kPrefetch), _MM_HINT_T0);
        __m512 const w0 = _mm512_loadu_ps(w);
        for (int r = 0; r < R; ++r)
        {
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w0, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r)
    {
        _mm512_storeu_ps(y + r * N, acc[r]);
    }
}
#endif

//! int4: the portable kernel (any CPU), the same chains as block512Q4: the same numbers.
template <int R>
void blockQ4(float const* x, int64_t K, uint8_t const* panel, float const* scales, int64_t blockSize, float* y,
    int64_t N)
{
    float acc[R][kPanelWidth] = {};
    float even[R][kPanelWidth];
    float odd[R][kPanelWidth];
    uint8_t const* w = panel;
    for (int64_t k0 = 0; k0 < K; k0 += blockSize, scales += kPanelWidth)
    {
        std::fill(&even[0][0], &even[0][0] + R * kPanelWidth, 0.F);
        std::fill(&odd[0][0], &odd[0][0] + R * kPanelWidth, 0.F);
        for (int64_t k = k0; k < k0 + blockSize; k += 2, w += kPanelWidth)
        {
            for (int r = 0; r < R; ++r)
            {
                for (int64_t j = 0; j < kPanelWidth; ++j)
                {
                    even[r][j] = std::fma(x[r * K + k], static_cast<float>((w[j] & 15) - 8), even[r][j]);
                    odd[r][j] = std::fma(x[r * K + k + 1], static_cast<float>((w[j] >> 4) - 8), odd[r][j]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
        {
            for (int64_t j = 0; j < kPanelWidth; ++j)
            {
                acc[r][j] = std::fma(even[r][j] + odd[r][j], scales[j], acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
    {
        std::copy(acc[r], acc[r] + kPanelWidth, y + r * N);
    }
}

#if defined(__x86_64__)
// GCC 12 warns that the unmasked widen / permute intrinsics read an uninitialised register (their unused merge
// source, left undefined on purpose by the intrinsic headers)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
//! int4, AVX-512: a pair of k steps of the panel is 16 bytes, widened to 16 int32 lanes; each nibble picks its
//! value (q - 8, exact) from a 16-entry table with one permute (which reads the index's low 4 bits: no mask).
template <int R>
__attribute__((target("avx512f"))) void block512Q4(float const* x, int64_t K, uint8_t const* panel,
    float const* scales, int64_t blockSize, float* y, int64_t N)
{
    __m512 const table = _mm512_setr_ps(-8.F, -7.F, -6.F, -5.F, -4.F, -3.F, -2.F, -1.F, 0.F, 1.F, 2.F, 3.F, 4.F,
        5.F, 6.F, 7.F);
    __m512 acc[R];
    __m512 even[R];
    __m512 odd[R];
    for (int r = 0; r < R; ++r)
    {
        acc[r] = _mm512_setzero_ps();
    }
    uint8_t const* w = panel;
    for (int64_t k0 = 0; k0 < K; k0 += blockSize, scales += kPanelWidth)
    {
        for (int r = 0; r < R; ++r)
        {
            even[r] = _mm512_setzero_ps();
            odd[r] = _mm512_setzero_ps();
        }
        for (int64_t k = k0; k < k0 + blockSize; k += 2, w += kPanelWidth)
        {
            _mm_prefetch(reinterpret_cast<char const*>(w + kPrefetch), _MM_HINT_T0);
            __m512i const q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(w)));
            __m512 const w0 = _mm512_permutexvar_ps(q, table);
            __m512 const w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
            for (int r = 0; r < R; ++r)
            {
                even[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w0, even[r]);
                odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k + 1]), w1, odd[r]);
            }
        }
        __m512 const s = _mm512_loadu_ps(scales);
        for (int r = 0; r < R; ++r)
        {
            acc[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), s, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r)
    {
        _mm512_storeu_ps(y + r * N, acc[r]);
    }
}
#pragma GCC diagnostic pop
#endif

} // namespace

bool panelMatMulWide()
{
#if defined(__x86_64__)
    // decided once per process (this runs per work item of every call); DFLASH2_ORT_PANELS_AVX512=0: the AVX2 /
    // portable kernels even on an AVX-512 CPU (the tests compare the two)
    static bool const wide = [] {
        char const* const env = std::getenv("DFLASH2_ORT_PANELS_AVX512");
        return __builtin_cpu_supports("avx512f") && !(env != nullptr && std::string(env) == "0");
    }();
    return wide;
#else
    return false;
#endif
}

void panelMatMul(float const* x, int64_t rows, int64_t K, float const* packed, int64_t N, float* y,
    int64_t panelBegin, int64_t panelEnd)
{
    // blocks[r - 1] computes r rows; the widest is taken for every full block
    using Block = void (*)(float const*, int64_t, float const*, float*, int64_t);
    static constexpr Block kBlocks[] = {block<1>, block<2>, block<3>, block<4>, block<5>, block<6>};
    Block const* blocks = kBlocks;
    int64_t maxRows = kMaxRows;
#if defined(__x86_64__)
    static constexpr Block kBlocks512[] = {block512<1>, block512<2>, block512<3>, block512<4>, block512<5>,
        block512<6>, block512<7>, block512<8>, block512<9>, block512<10>, block512<11>, block512<12>};
    if (panelMatMulWide())
    {
        blocks = kBlocks512;
        maxRows = kMaxRows512;
    }
#endif
    for (int64_t p = panelBegin; p < panelEnd; ++p)
    {
        float const* panel = packed + p * K * kPanelWidth;
        for (int64_t m = 0; m < rows; m += maxRows)
        {
            blocks[std::min(maxRows, rows - m) - 1](x + m * K, K, panel, y + m * N + p * kPanelWidth, N);
        }
    }
}

void panelMatMulQ4(float const* x, int64_t rows, int64_t K, uint8_t const* packed, float const* scales,
    int64_t blockSize, int64_t N, float* y, int64_t panelBegin, int64_t panelEnd)
{
    using Block = void (*)(float const*, int64_t, uint8_t const*, float const*, int64_t, float*, int64_t);
    static constexpr Block kBlocks[] = {blockQ4<1>, blockQ4<2>, blockQ4<3>, blockQ4<4>, blockQ4<5>, blockQ4<6>};
    Block const* blocks = kBlocks;
    int64_t maxRows = kMaxRows;
#if defined(__x86_64__)
    // 8 sums + 2 x 8 block sums + 2 weights + the table + the bytes: 28 of 32 registers
    static constexpr Block kBlocks512[] = {block512Q4<1>, block512Q4<2>, block512Q4<3>, block512Q4<4>,
        block512Q4<5>, block512Q4<6>, block512Q4<7>, block512Q4<8>};
    if (panelMatMulWide())
    {
        blocks = kBlocks512;
        maxRows = 8;
    }
#endif
    int64_t const blocksK = K / blockSize;
    for (int64_t p = panelBegin; p < panelEnd; ++p)
    {
        uint8_t const* panel = packed + p * (K / 2) * kPanelWidth;
        float const* s = scales + p * blocksK * kPanelWidth;
        for (int64_t m = 0; m < rows; m += maxRows)
        {
            blocks[std::min(maxRows, rows - m) - 1](x + m * K, K, panel, s, blockSize, y + m * N + p * kPanelWidth, N);
        }
    }
}

} // namespace dflash2
