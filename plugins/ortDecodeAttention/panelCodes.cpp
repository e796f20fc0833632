//! \file panelCodes.cpp
//! See panelCodes.h. The search runs once per kernel (when the session loads); the kernels, AVX-512 where the CPU
//! has it (panelMatMulWide) else portable C++, rebuild each weight exactly as the search checked it (the same
//! fused multiply-add or product) and run the fp32 kernel's chains.
#include "panelCodes.h"

#include "panelMatMul.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dflash2
{
namespace
{

constexpr int64_t kW = kPanelWidth;
constexpr int64_t kMaxRows = 8;          //!< rows per register block: 8 sums + the rebuilt weights and their code
constexpr int64_t kPrefetchBytes = 1024; //!< bytes ahead in the code stream

uint32_t bitsOf(float v)
{
    uint32_t b = 0;
    std::memcpy(&b, &v, sizeof b);
    return b;
}

//! v (>= 0) rounded to 11 significant bits, fp16's precision (where GGUF keeps its scales), then moved by `step`
//! units of that last bit: the candidates for a block's scale.
float nearHalf(float v, int step)
{
    uint32_t b = ((bitsOf(v) + 0x1000U) & ~0x1FFFU) + static_cast<uint32_t>(step) * 0x2000U;
    float out = 0.F;
    std::memcpy(&out, &b, sizeof out);
    return out;
}

//! w as fp16 bits where fp16 holds it exactly (normal or subnormal; not inf / nan).
bool exactHalf(float v, uint16_t& h)
{
    uint32_t const b = bitsOf(v);
    auto const sign = static_cast<uint16_t>((b >> 16) & 0x8000U);
    int const e = static_cast<int>((b >> 23) & 0xFFU) - 127;
    uint32_t const man = b & 0x7FFFFFU;
    if ((b & 0x7FFFFFFFU) == 0)
    {
        h = sign;
        return true;
    }
    if (e >= -14 && e <= 15 && (man & 0x1FFFU) == 0)
    {
        h = static_cast<uint16_t>(sign | ((e + 15) << 10) | (man >> 13));
        return true;
    }
    int const shift = -(e + 1); // a subnormal fp16 is m 2^-24, m < 1024: m = (1.man 2^23) >> shift
    uint32_t const full = man | 0x800000U;
    if (e >= -24 && e < -14 && (full & ((1U << shift) - 1)) == 0)
    {
        h = static_cast<uint16_t>(sign | (full >> shift));
        return true;
    }
    return false;
}

//! fp16 bits -> the fp32 value (exact; the portable kernel's, as _mm512_cvtph_ps).
float halfToFloat(uint16_t h)
{
    uint32_t const sign = static_cast<uint32_t>(h & 0x8000U) << 16;
    uint32_t const e = (h >> 10) & 0x1FU;
    uint32_t m = h & 0x3FFU;
    uint32_t b = sign;
    if (e == 0x1FU)
    {
        b |= 0x7F800000U | (m << 13);
    }
    else if (e != 0)
    {
        b |= ((e + 112) << 23) | (m << 13);
    }
    else if (m != 0)
    {
        int shift = 0;
        while ((m & 0x400U) == 0)
        {
            m <<= 1;
            ++shift;
        }
        b |= (static_cast<uint32_t>(113 - shift) << 23) | ((m & 0x3FFU) << 13);
    }
    float out = 0.F;
    std::memcpy(&out, &b, sizeof out);
    return out;
}

//! Affine4 for one block of one column (w: its kCodeBlock values, stride kW): w[k] = fma(q[k], s, m) exactly.
bool fitAffine4(float const* w, float& s, float& m, uint8_t* q)
{
    float lo = w[0];
    float hi = w[0];
    for (int64_t k = 1; k < kCodeBlock; ++k)
    {
        lo = std::min(lo, w[k * kW]);
        hi = std::max(hi, w[k * kW]);
    }
    auto fits = [&](float scale) {
        for (int64_t k = 0; k < kCodeBlock; ++k)
        {
            float const t = scale > 0.F ? std::nearbyint((w[k * kW] - lo) / scale) : 0.F;
            if (!(t >= 0.F && t <= 15.F) || bitsOf(std::fma(t, scale, lo)) != bitsOf(w[k * kW]))
            {
                return false;
            }
            q[k] = static_cast<uint8_t>(t);
        }
        s = scale;
        m = lo;
        return true;
    };
    if (hi == lo)
    {
        return fits(0.F);
    }
    for (float const levels : {15.F, 14.F})
    {
        for (int const step : {0, -1, 1})
        {
            float const c = nearHalf((hi - lo) / levels, step);
            if (c > 0.F && std::isfinite(c) && fits(c))
            {
                return true;
            }
        }
    }
    return false;
}

//! Scaled8 for one block of one column: w[k] = q[k] x s exactly.
bool fitScaled8(float const* w, float& s, int8_t* q)
{
    float amax = 0.F;
    for (int64_t k = 0; k < kCodeBlock; ++k)
    {
        amax = std::max(amax, std::fabs(w[k * kW]));
    }
    auto fits = [&](float scale) {
        for (int64_t k = 0; k < kCodeBlock; ++k)
        {
            float const t = scale > 0.F ? std::nearbyint(w[k * kW] / scale) : 0.F;
            if (!(t >= -127.F && t <= 127.F) || bitsOf(t * scale) != bitsOf(w[k * kW]))
            {
                return false;
            }
            q[k] = static_cast<int8_t>(t);
        }
        s = scale;
        return true;
    };
    if (amax == 0.F)
    {
        return fits(0.F);
    }
    for (int const step : {0, -1, 1})
    {
        float const c = nearHalf(amax / 127.F, step);
        if (c > 0.F && std::isfinite(c) && fits(c))
        {
            return true;
        }
    }
    return false;
}

//! Affine4 for the 16 columns of one block (w [kCodeBlock][kW]): codes into q [kCodeBlock][kW]. The first
//! candidate scale for all columns at once (vectorised: this runs over every weight when the session loads), the
//! other candidates for the columns it misses.
bool fitAffine4Block(float const* w, float* s, float* m, uint8_t* q)
{
    float lo[kW];
    float hi[kW];
    float c[kW];
    float t[kCodeBlock][kW];
    bool miss[kW] = {};
    std::copy(w, w + kW, lo);
    std::copy(w, w + kW, hi);
    for (int64_t k = 1; k < kCodeBlock; ++k)
    {
        for (int64_t j = 0; j < kW; ++j)
        {
            lo[j] = std::min(lo[j], w[k * kW + j]);
            hi[j] = std::max(hi[j], w[k * kW + j]);
        }
    }
    for (int64_t j = 0; j < kW; ++j)
    {
        c[j] = nearHalf((hi[j] - lo[j]) / 15.F, 0);
    }
    for (int64_t k = 0; k < kCodeBlock; ++k)
    {
        for (int64_t j = 0; j < kW; ++j)
        {
            float const v = c[j] > 0.F ? std::nearbyint((w[k * kW + j] - lo[j]) / c[j]) : 0.F;
            t[k][j] = std::min(std::max(v, 0.F), 15.F);
            miss[j] |= v != t[k][j] || bitsOf(std::fma(t[k][j], c[j], lo[j])) != bitsOf(w[k * kW + j]);
        }
    }
    for (int64_t j = 0; j < kW; ++j)
    {
        uint8_t col[kCodeBlock];
        if (!miss[j])
        {
            s[j] = c[j];
            m[j] = lo[j];
            for (int64_t k = 0; k < kCodeBlock; ++k)
            {
                q[k * kW + j] = static_cast<uint8_t>(t[k][j]);
            }
        }
        else if (fitAffine4(w + j, s[j], m[j], col))
        {
            for (int64_t k = 0; k < kCodeBlock; ++k)
            {
                q[k * kW + j] = col[k];
            }
        }
        else
        {
            return false;
        }
    }
    return true;
}

//! Scaled8 for the 16 columns of one block, as fitAffine4Block.
bool fitScaled8Block(float const* w, float* s, int8_t* q)
{
    float amax[kW] = {};
    float c[kW];
    float t[kCodeBlock][kW];
    bool miss[kW] = {};
    for (int64_t k = 0; k < kCodeBlock; ++k)
    {
        for (int64_t j = 0; j < kW; ++j)
        {
            amax[j] = std::max(amax[j], std::fabs(w[k * kW + j]));
        }
    }
    for (int64_t j = 0; j < kW; ++j)
    {
        c[j] = nearHalf(amax[j] / 127.F, 0);
    }
    for (int64_t k = 0; k < kCodeBlock; ++k)
    {
        for (int64_t j = 0; j < kW; ++j)
        {
            float const v = c[j] > 0.F ? std::nearbyint(w[k * kW + j] / c[j]) : 0.F;
            t[k][j] = std::min(std::max(v, -127.F), 127.F);
            miss[j] |= v != t[k][j] || bitsOf(t[k][j] * c[j]) != bitsOf(w[k * kW + j]);
        }
    }
    for (int64_t j = 0; j < kW; ++j)
    {
        int8_t col[kCodeBlock];
        if (!miss[j])
        {
            s[j] = c[j];
            for (int64_t k = 0; k < kCodeBlock; ++k)
            {
                q[k * kW + j] = static_cast<int8_t>(t[k][j]);
            }
        }
        else if (fitScaled8(w + j, s[j], col))
        {
            for (int64_t k = 0; k < kCodeBlock; ++k)
            {
                q[k * kW + j] = col[k];
            }
        }
        else
        {
            return false;
        }
    }
    return true;
}

// -- kernels: one per code, R rows of one panel; x [R, K] (row stride K), y [R, .] (row stride N) ---------------

using Block = void (*)(float const* x, int64_t K, void const* codes, float const* scales, float const* offsets,
    float* y, int64_t N);

template <int R>
void store(float const (&acc)[R][kW], float* y, int64_t N)
{
    for (int r = 0; r < R; ++r)
    {
        std::copy(acc[r], acc[r] + kW, y + r * N);
    }
}

template <int R>
void accumulate(float (&acc)[R][kW], float const* x, int64_t K, int64_t k, float const* w)
{
    for (int r = 0; r < R; ++r)
    {
        for (int64_t j = 0; j < kW; ++j)
        {
            acc[r][j] = std::fma(x[r * K + k], w[j], acc[r][j]);
        }
    }
}

template <int R>
void blockAffine4(float const* x, int64_t K, void const* codes, float const* scales, float const* offsets, float* y,
    int64_t N)
{
    float acc[R][kW] = {};
    float w0[kW];
    float w1[kW];
    auto const* c = static_cast<uint8_t const*>(codes);
    for (int64_t k0 = 0; k0 < K; k0 += kCodeBlock, scales += kW, offsets += kW)
    {
        for (int64_t k = k0; k < k0 + kCodeBlock; k += 2, c += kW)
        {
            for (int64_t j = 0; j < kW; ++j)
            {
                w0[j] = std::fma(static_cast<float>(c[j] & 15), scales[j], offsets[j]);
                w1[j] = std::fma(static_cast<float>(c[j] >> 4), scales[j], offsets[j]);
            }
            accumulate<R>(acc, x, K, k, w0);
            accumulate<R>(acc, x, K, k + 1, w1);
        }
    }
    store<R>(acc, y, N);
}

template <int R>
void blockScaled8(float const* x, int64_t K, void const* codes, float const* scales, float const*, float* y,
    int64_t N)
{
    float acc[R][kW] = {};
    float w[kW];
    auto const* c = static_cast<int8_t const*>(codes);
    for (int64_t k0 = 0; k0 < K; k0 += kCodeBlock, scales += kW)
    {
        for (int64_t k = k0; k < k0 + kCodeBlock; ++k, c += kW)
        {
            for (int64_t j = 0; j < kW; ++j)
            {
                w[j] = static_cast<float>(c[j]) * scales[j];
            }
            accumulate<R>(acc, x, K, k, w);
        }
    }
    store<R>(acc, y, N);
}

//! The 16-bit codes: fp16 (F16) or bf16 bits, widened to the exact fp32 weight (as block16W).
template <int R, bool F16>
void block16(float const* x, int64_t K, void const* codes, float const*, float const*, float* y, int64_t N)
{
    float acc[R][kW] = {};
    float w[kW];
    auto const* c = static_cast<uint16_t const*>(codes);
    for (int64_t k = 0; k < K; ++k, c += kW)
    {
        for (int64_t j = 0; j < kW; ++j)
        {
            if constexpr (F16)
            {
                w[j] = halfToFloat(c[j]);
            }
            else
            {
                uint32_t const b = static_cast<uint32_t>(c[j]) << 16;
                std::memcpy(&w[j], &b, sizeof b);
            }
        }
        accumulate<R>(acc, x, K, k, w);
    }
    store<R>(acc, y, N);
}

template <int R>
void blockF16(float const* x, int64_t K, void const* codes, float const* s, float const* o, float* y, int64_t N)
{
    block16<R, true>(x, K, codes, s, o, y, N);
}

template <int R>
void blockBf16(float const* x, int64_t K, void const* codes, float const* s, float const* o, float* y, int64_t N)
{
    block16<R, false>(x, K, codes, s, o, y, N);
}

#if defined(__x86_64__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized" // the widening intrinsics' undefined merge source (as in Q4)
template <int R>
__attribute__((target("avx512f"))) void blockAffine4W(float const* x, int64_t K, void const* codes,
    float const* scales, float const* offsets, float* y, int64_t N)
{
    __m512 const table = _mm512_setr_ps(0.F, 1.F, 2.F, 3.F, 4.F, 5.F, 6.F, 7.F, 8.F, 9.F, 10.F, 11.F, 12.F, 13.F,
        14.F, 15.F);
    __m512 acc[R];
    for (int r = 0; r < R; ++r)
    {
        acc[r] = _mm512_setzero_ps();
    }
    auto const* c = static_cast<uint8_t const*>(codes);
    for (int64_t k0 = 0; k0 < K; k0 += kCodeBlock, scales += kW, offsets += kW)
    {
        __m512 const s = _mm512_loadu_ps(scales);
        __m512 const m = _mm512_loadu_ps(offsets);
        for (int64_t k = k0; k < k0 + kCodeBlock; k += 2, c += kW)
        {
            _mm_prefetch(reinterpret_cast<char const*>(c + kPrefetchBytes), _MM_HINT_T0);
            __m512i const q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(c)));
            __m512 const w0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, table), s, m);
            __m512 const w1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), s, m);
            for (int r = 0; r < R; ++r)
            {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w0, acc[r]);
            }
            for (int r = 0; r < R; ++r)
            {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k + 1]), w1, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
    {
        _mm512_storeu_ps(y + r * N, acc[r]);
    }
}

template <int R>
__attribute__((target("avx512f"))) void blockScaled8W(float const* x, int64_t K, void const* codes,
    float const* scales, float const*, float* y, int64_t N)
{
    __m512 acc[R];
    for (int r = 0; r < R; ++r)
    {
        acc[r] = _mm512_setzero_ps();
    }
    auto const* c = static_cast<int8_t const*>(codes);
    for (int64_t k0 = 0; k0 < K; k0 += kCodeBlock, scales += kW)
    {
        __m512 const s = _mm512_loadu_ps(scales);
        for (int64_t k = k0; k < k0 + kCodeBlock; ++k, c += kW)
        {
            _mm_prefetch(reinterpret_cast<char const*>(c + kPrefetchBytes), _MM_HINT_T0);
            __m512 const w = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(c)))), s);
            for (int r = 0; r < R; ++r)
            {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
    {
        _mm512_storeu_ps(y + r * N, acc[r]);
    }
}

//! The 16-bit codes: bf16 (F16 false) or fp16 bits, widened to the exact fp32 weight.
template <int R, bool F16>
__attribute__((target("avx512f"))) void block16W(float const* x, int64_t K, void const* codes, float const*,
    float const*, float* y, int64_t N)
{
    __m512 acc[R];
    for (int r = 0; r < R; ++r)
    {
        acc[r] = _mm512_setzero_ps();
    }
    auto const* c = static_cast<uint16_t const*>(codes);
    for (int64_t k = 0; k < K; ++k, c += kW)
    {
        _mm_prefetch(reinterpret_cast<char const*>(c) + kPrefetchBytes, _MM_HINT_T0);
        __m256i const h = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(c));
        __m512 const w
            = F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        for (int r = 0; r < R; ++r)
        {
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r)
    {
        _mm512_storeu_ps(y + r * N, acc[r]);
    }
}

template <int R>
void blockBf16W(float const* x, int64_t K, void const* codes, float const* s, float const* o, float* y, int64_t N)
{
    block16W<R, false>(x, K, codes, s, o, y, N);
}

template <int R>
void blockF16W(float const* x, int64_t K, void const* codes, float const* s, float const* o, float* y, int64_t N)
{
    block16W<R, true>(x, K, codes, s, o, y, N);
}
#pragma GCC diagnostic pop
#endif

#if defined(__x86_64__)
// -- AVX2 + FMA + F16C kernels (the library's x86-64 baseline): a panel's 16 columns in two halves of 8 (one ymm a
// row), each half a pass over K, so R <= 8 rows keep their sums in registers; the panel's codes (K/2 x 16 bytes
// for affine4) stay in L1 between the halves, so memory is read once. Each weight is rebuilt exactly as the portable
// kernel rebuilds it and enters the same fused multiply-add chain: the fp32 kernel's numbers, bit for bit.

//! Broadcast-multiply-add of one k into R row sums.
template <int R>
__attribute__((target("avx2,fma"))) inline void accumulateA(__m256 (&acc)[R], float const* x, int64_t K, int64_t k,
    __m256 w)
{
    for (int r = 0; r < R; ++r)
    {
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + k), w, acc[r]);
    }
}

template <int R>
__attribute__((target("avx2,fma"))) inline void storeA(__m256 const (&acc)[R], float* y, int64_t N)
{
    for (int r = 0; r < R; ++r)
    {
        _mm256_storeu_ps(y + r * N, acc[r]);
    }
}

//! Affine4, R <= 4 rows: both halves in one pass (2 R sums in registers): half the loop and unpacking overhead
//! per multiply-add of the two-pass kernel, which a 1-row step is bound by.
template <int R>
__attribute__((target("avx2,fma"))) void blockAffine4A1(float const* x, int64_t K, void const* codes,
    float const* scales, float const* offsets, float* y, int64_t N)
{
    __m256i const low = _mm256_set1_epi32(15);
    __m256 acc[2][R];
    for (int r = 0; r < R; ++r)
    {
        acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    }
    auto const* c = static_cast<uint8_t const*>(codes);
    for (int64_t k0 = 0; k0 < K; k0 += kCodeBlock, scales += kW, offsets += kW)
    {
        __m256 const s[2] = {_mm256_loadu_ps(scales), _mm256_loadu_ps(scales + 8)};
        __m256 const m[2] = {_mm256_loadu_ps(offsets), _mm256_loadu_ps(offsets + 8)};
        for (int64_t k = k0; k < k0 + kCodeBlock; k += 2, c += kW)
        {
            _mm_prefetch(reinterpret_cast<char const*>(c + kPrefetchBytes), _MM_HINT_T0);
            for (int h = 0; h < 2; ++h)
            {
                __m256i const q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(c + 8 * h)));
                accumulateA<R>(acc[h], x, K, k,
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low)), s[h], m[h]));
                accumulateA<R>(acc[h], x, K, k + 1,
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), s[h], m[h]));
            }
        }
    }
    storeA<R>(acc[0], y, N);
    storeA<R>(acc[1], y + 8, N);
}

template <int R>
__attribute__((target("avx2,fma"))) void blockAffine4A(float const* x, int64_t K, void const* codes,
    float const* scales, float const* offsets, float* y, int64_t N)
{
    if constexpr (R <= 4)
    {
        blockAffine4A1<R>(x, K, codes, scales, offsets, y, N);
        return;
    }
    __m256i const low = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; ++h)
    {
        __m256 acc[R];
        for (int r = 0; r < R; ++r)
        {
            acc[r] = _mm256_setzero_ps();
        }
        auto const* c = static_cast<uint8_t const*>(codes) + 8 * h;
        float const* sc = scales + 8 * h;
        float const* of = offsets + 8 * h;
        for (int64_t k0 = 0; k0 < K; k0 += kCodeBlock, sc += kW, of += kW)
        {
            __m256 const s = _mm256_loadu_ps(sc);
            __m256 const m = _mm256_loadu_ps(of);
            for (int64_t k = k0; k < k0 + kCodeBlock; k += 2, c += kW)
            {
                if (h == 0)
                {
                    _mm_prefetch(reinterpret_cast<char const*>(c + kPrefetchBytes), _MM_HINT_T0);
                }
                __m256i const q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(c)));
                accumulateA<R>(acc, x, K, k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low)), s, m));
                accumulateA<R>(acc, x, K, k + 1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), s, m));
            }
        }
        storeA<R>(acc, y + 8 * h, N);
    }
}

template <int R>
__attribute__((target("avx2,fma"))) void blockScaled8A(float const* x, int64_t K, void const* codes,
    float const* scales, float const*, float* y, int64_t N)
{
    for (int h = 0; h < 2; ++h)
    {
        __m256 acc[R];
        for (int r = 0; r < R; ++r)
        {
            acc[r] = _mm256_setzero_ps();
        }
        auto const* c = static_cast<int8_t const*>(codes) + 8 * h;
        float const* sc = scales + 8 * h;
        for (int64_t k0 = 0; k0 < K; k0 += kCodeBlock, sc += kW)
        {
            __m256 const s = _mm256_loadu_ps(sc);
            for (int64_t k = k0; k < k0 + kCodeBlock; ++k, c += kW)
            {
                if (h == 0)
                {
                    _mm_prefetch(reinterpret_cast<char const*>(c + kPrefetchBytes), _MM_HINT_T0);
                }
                __m256i const q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(c)));
                accumulateA<R>(acc, x, K, k, _mm256_mul_ps(_mm256_cvtepi32_ps(q), s));
            }
        }
        storeA<R>(acc, y + 8 * h, N);
    }
}

//! The 16-bit codes: fp16 (F16: F16C's exact widening) or bf16 bits shifted into the upper half.
template <int R, bool F16>
__attribute__((target("avx2,fma,f16c"))) void block16A(float const* x, int64_t K, void const* codes, float const*,
    float const*, float* y, int64_t N)
{
    for (int h = 0; h < 2; ++h)
    {
        __m256 acc[R];
        for (int r = 0; r < R; ++r)
        {
            acc[r] = _mm256_setzero_ps();
        }
        auto const* c = static_cast<uint16_t const*>(codes) + 8 * h;
        for (int64_t k = 0; k < K; ++k, c += kW)
        {
            if (h == 0)
            {
                _mm_prefetch(reinterpret_cast<char const*>(c) + kPrefetchBytes, _MM_HINT_T0);
            }
            __m128i const b = _mm_loadu_si128(reinterpret_cast<__m128i const*>(c));
            __m256 const w
                = F16 ? _mm256_cvtph_ps(b) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
            accumulateA<R>(acc, x, K, k, w);
        }
        storeA<R>(acc, y + 8 * h, N);
    }
}

template <int R>
void blockBf16A(float const* x, int64_t K, void const* codes, float const* s, float const* o, float* y, int64_t N)
{
    block16A<R, false>(x, K, codes, s, o, y, N);
}

template <int R>
void blockF16A(float const* x, int64_t K, void const* codes, float const* s, float const* o, float* y, int64_t N)
{
    block16A<R, true>(x, K, codes, s, o, y, N);
}
#endif

//! A 16-bit code: every weight through `encode(w, bits)` (false where it does not fit) into c.codes.
template <class Encode>
bool code16(float const* packed, int64_t total, CodedPanels& c, Encode encode)
{
    uint16_t h = 0;
    if (!std::all_of(packed, packed + total, [&](float v) { return encode(v, h); }))
    {
        return false;
    }
    c.codes.resize(static_cast<size_t>(total) * 2);
    c.scales.clear();
    c.offsets.clear();
    auto* out = reinterpret_cast<uint16_t*>(c.codes.data());
    for (int64_t i = 0; i < total; ++i)
    {
        encode(packed[i], out[i]);
    }
    return true;
}

// one kernel's register blocks of 1 .. kMaxRows rows, indexed by rows - 1
#define DFLASH2_BLOCKS(f) {f<1>, f<2>, f<3>, f<4>, f<5>, f<6>, f<7>, f<8>}

} // namespace

CodedPanels codePanels(float const* packed, int64_t K, int64_t N)
{
    CodedPanels c;
    c.K = K;
    c.N = N;
    if (K <= 0 || N <= 0 || N % kW != 0)
    {
        return c;
    }
    int64_t const P = N / kW;
    int64_t const B = K / kCodeBlock;
    if (K % kCodeBlock == 0)
    {
        float s[kW];
        float m[kW];
        uint8_t q4[kCodeBlock * kW];
        if (fitAffine4Block(packed, s, m, q4)) // the first block decides whether the rest is worth a buffer
        {
            c.codes.assign(static_cast<size_t>(P * K / 2 * kW), 0);
            c.scales.resize(static_cast<size_t>(P * B * kW));
            c.offsets.resize(c.scales.size());
            bool fits = true;
            for (int64_t pb = 0; fits && pb < P * B; ++pb) // block b of panel p: pb = p B + b
            {
                fits = fitAffine4Block(packed + pb * kCodeBlock * kW, c.scales.data() + pb * kW,
                    c.offsets.data() + pb * kW, q4);
                uint8_t* out = c.codes.data() + pb * kCodeBlock / 2 * kW;
                for (int64_t i = 0; fits && i < kCodeBlock / 2; ++i)
                {
                    for (int64_t j = 0; j < kW; ++j)
                    {
                        out[i * kW + j] = static_cast<uint8_t>(q4[2 * i * kW + j] | (q4[(2 * i + 1) * kW + j] << 4));
                    }
                }
            }
            if (fits)
            {
                c.code = PanelCode::Affine4;
                return c;
            }
        }
        int8_t q8[kCodeBlock * kW];
        if (fitScaled8Block(packed, s, q8))
        {
            c.codes.assign(static_cast<size_t>(P * K * kW), 0);
            c.scales.resize(static_cast<size_t>(P * B * kW));
            c.offsets.clear();
            bool fits = true;
            for (int64_t pb = 0; fits && pb < P * B; ++pb)
            {
                fits = fitScaled8Block(packed + pb * kCodeBlock * kW, c.scales.data() + pb * kW,
                    reinterpret_cast<int8_t*>(c.codes.data()) + pb * kCodeBlock * kW);
            }
            if (fits)
            {
                c.code = PanelCode::Scaled8;
                return c;
            }
        }
    }
    int64_t const total = P * K * kW;
    auto const bf16 = [](float v, uint16_t& h) {
        h = static_cast<uint16_t>(bitsOf(v) >> 16);
        return (bitsOf(v) & 0xFFFFU) == 0;
    };
    if (code16(packed, total, c, exactHalf))
    {
        c.code = PanelCode::F16;
        return c;
    }
    if (code16(packed, total, c, bf16))
    {
        c.code = PanelCode::Bf16;
        return c;
    }
    return CodedPanels{PanelCode::None, K, N, {}, {}, {}};
}

void panelMatMulCoded(float const* x, int64_t rows, CodedPanels const& coded, float* y, int64_t panelBegin,
    int64_t panelEnd)
{
    static constexpr Block kAffine4[] = DFLASH2_BLOCKS(blockAffine4);
    static constexpr Block kScaled8[] = DFLASH2_BLOCKS(blockScaled8);
    static constexpr Block kF16[] = DFLASH2_BLOCKS(blockF16);
    static constexpr Block kBf16[] = DFLASH2_BLOCKS(blockBf16);
    Block const* const tables[] = {nullptr, kAffine4, kScaled8, kBf16, kF16}; // by PanelCode
    Block const* blocks = tables[static_cast<int>(coded.code)];
#if defined(__x86_64__)
    static constexpr Block kAffine4W[] = DFLASH2_BLOCKS(blockAffine4W);
    static constexpr Block kScaled8W[] = DFLASH2_BLOCKS(blockScaled8W);
    static constexpr Block kBf16W[] = DFLASH2_BLOCKS(blockBf16W);
    static constexpr Block kF16W[] = DFLASH2_BLOCKS(blockF16W);
    Block const* const tablesW[] = {nullptr, kAffine4W, kScaled8W, kBf16W, kF16W};
    static constexpr Block kAffine4A[] = DFLASH2_BLOCKS(blockAffine4A);
    static constexpr Block kScaled8A[] = DFLASH2_BLOCKS(blockScaled8A);
    static constexpr Block kBf16A[] = DFLASH2_BLOCKS(blockBf16A);
    static constexpr Block kF16A[] = DFLASH2_BLOCKS(blockF16A);
    Block const* const tablesA[] = {nullptr, kAffine4A, kScaled8A, kBf16A, kF16A};
    // AVX-512 where the CPU has it; else the AVX2 kernels (every x86-64 CPU this library is built for: x86-64-v3)
    blocks = (panelMatMulWide() ? tablesW : tablesA)[static_cast<int>(coded.code)];
#endif
    int64_t const K = coded.K;
    int64_t const N = coded.N;
    int64_t const B = K / kCodeBlock;
    // bytes of one panel's codes; its scales and offsets: B x kW each (none for the 16-bit codes)
    int64_t const panelBytes = coded.code == PanelCode::Affine4 ? K / 2 * kW
        : coded.code == PanelCode::Scaled8                       ? K * kW
                                                                 : K * kW * 2;
    for (int64_t p = panelBegin; p < panelEnd; ++p)
    {
        void const* codes = coded.codes.data() + p * panelBytes;
        float const* scales = coded.scales.empty() ? nullptr : coded.scales.data() + p * B * kW;
        float const* offsets = coded.offsets.empty() ? nullptr : coded.offsets.data() + p * B * kW;
        for (int64_t m = 0; m < rows; m += kMaxRows)
        {
            blocks[std::min(kMaxRows, rows - m) - 1](x + m * K, K, codes, scales, offsets, y + m * N + p * kW, N);
        }
    }
}

namespace
{
std::atomic<int64_t> gCodeCounts[kPanelCodes];
} // namespace

void countPanelCode(PanelCode code)
{
    gCodeCounts[static_cast<int32_t>(code)] += 1;
}

int64_t panelCodeCount(int32_t code)
{
    return code >= 0 && code < kPanelCodes ? gCodeCounts[code].load() : -1;
}

} // namespace dflash2
