/*
 * dflash2_trt — DFlash 2 path selector: the one implementation of the selector math.
 *
 * Everything here is compiled twice: by the host C++ compiler for the CPU twin
 * (libdflash2_selector_host.so, pathSelectorHost.cpp) and by nvcc for the kernel
 * (pathSelectorKernel.cu). The two cannot drift because they call the same functions:
 *
 *  - the pair score (a partitioned fp32 dot product with a fixed summation order),
 *  - exp/log built only from IEEE-exact operations (fmaf, +, *, /, floorf, bit casts), so the
 *    host libm and the CUDA math library never enter the result,
 *  - both walks (greedy, Viterbi) for T <= 0 and T > 0, written against a tiny "lanes"
 *    executor: SerialLanes runs a lane loop on the host, WarpLanes runs one lane per thread.
 *
 * Bit-for-bit equality of host and device additionally needs: no floating-point contraction
 * (-ffp-contract=off on the host, --fmad=false in nvcc; every intended FMA is an explicit fmaf),
 * IEEE division (nvcc default -prec-div=true) and no -use_fast_math. plugins/CMakeLists.txt sets
 * these flags for both sides.
 *
 * Semantics: dflash2_trt/reference.py (module docstring) — the NumPy executable spec.
 * No TensorRT headers here: the kernel side knows nothing about TensorRT.
 */
#ifndef DFLASH2_PATH_SELECTOR_MATH_H
#define DFLASH2_PATH_SELECTOR_MATH_H

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define DFL2_HD __host__ __device__ __forceinline__
#else
#define DFL2_HD inline
#endif

namespace dflash2
{
namespace selector
{

//! Largest supported top-k (lanes of the walk; the ONNX/TensorRT attribute `top_k` is 1..16).
constexpr int32_t kMAX_TOP_K = 16;
//! The dot product over the rank r is split into kDOT_PARTS partial sums (one per lane of an
//! 8-lane group in the kernel); element e belongs to part (e / kDOT_CHUNK) % kDOT_PARTS.
constexpr int32_t kDOT_PARTS = 8;
//! Contiguous elements per part per stride (one 16-byte fp32 / 8-byte fp16 vector load).
constexpr int32_t kDOT_CHUNK = 4;
//! Elements between two chunks of the same part.
constexpr int32_t kDOT_STRIDE = kDOT_PARTS * kDOT_CHUNK;

//! Walk mode; the integer values are only internal (the contract carries the strings).
enum class Mode : int32_t
{
    kGREEDY = 0,
    kVITERBI = 1,
};

//! Element type of hidden_proj and both codebooks (they always share one type).
enum class ElemType : int32_t
{
    kFLOAT32 = 0,
    kFLOAT16 = 1,
    kBFLOAT16 = 2,
};

//! fp16 storage (IEEE binary16 bits); same size/layout as __half.
struct Fp16Bits
{
    uint16_t v;
};

//! bf16 storage (upper 16 bits of an fp32); same size/layout as __nv_bfloat16.
struct Bf16Bits
{
    uint16_t v;
};

// ---------------------------------------------------------------------------------------------
// Bit casts and element conversion (all exact)
// ---------------------------------------------------------------------------------------------

DFL2_HD float bitsToFloat(uint32_t bits)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(bits);
#else
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
#endif
}

DFL2_HD uint32_t floatToBits(float f)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    return bits;
#endif
}

DFL2_HD float toFloat(float x)
{
    return x;
}

//! binary16 -> binary32 is exact, so the hardware conversion and this bit recipe agree.
DFL2_HD float toFloat(Fp16Bits h)
{
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h.v));
#else
    uint32_t const sign = static_cast<uint32_t>(h.v & 0x8000u) << 16;
    uint32_t const expo = (h.v >> 10) & 0x1fu;
    uint32_t const mant = h.v & 0x3ffu;
    if (expo == 0u)
    {
        // zero or subnormal: value = mant * 2^-24, exact in fp32
        float const mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
        return sign != 0u ? -mag : mag;
    }
    if (expo == 31u)
    {
        return bitsToFloat(sign | 0x7f800000u | (mant << 13)); // inf / nan
    }
    return bitsToFloat(sign | ((expo + 112u) << 23) | (mant << 13));
#endif
}

DFL2_HD float toFloat(Bf16Bits h)
{
    return bitsToFloat(static_cast<uint32_t>(h.v) << 16);
}

// ---------------------------------------------------------------------------------------------
// exp / log from exact operations only (|error| ~ 1-2 ulp; identical bits on host and device)
// ---------------------------------------------------------------------------------------------

//! 2^k for k in [-126, 127].
DFL2_HD float pow2i(int32_t k)
{
    return bitsToFloat(static_cast<uint32_t>(k + 127) << 23);
}

//! e^x. Range reduction x = n ln2 + r (|r| <= ln2/2, Cody-Waite split of ln2), degree-7 Taylor
//! polynomial (truncation < 0.1 ulp), then scaling by 2^n in two exact halves so that results
//! down to the subnormal range are reached without an out-of-range exponent.
DFL2_HD float dfl2Exp(float x)
{
    if (!(x == x))
    {
        return x; // nan
    }
    if (x > 88.72283935546875f)
    {
        return bitsToFloat(0x7f800000u); // +inf
    }
    if (x < -103.97208f)
    {
        return 0.0f; // below half the smallest subnormal
    }
    float const n = floorf(fmaf(x, 1.44269502162933349609375f, 0.5f)); // round(x / ln2)
    float r = fmaf(n, -0.693145751953125f, x);                          // ln2_hi has 16 trailing zero bits
    r = fmaf(n, -1.428606765330187045e-06f, r);                         // ln2_lo
    float p = 1.98412698412698412e-04f;                                 // 1/7!
    p = fmaf(p, r, 1.38888888888888889e-03f);                           // 1/6!
    p = fmaf(p, r, 8.33333333333333333e-03f);                           // 1/5!
    p = fmaf(p, r, 4.16666666666666667e-02f);                           // 1/4!
    p = fmaf(p, r, 1.66666666666666667e-01f);                           // 1/3!
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int32_t const ni = static_cast<int32_t>(n);
    int32_t const half = ni / 2;
    return (p * pow2i(half)) * pow2i(ni - half);
}

//! Natural log for y > 0 (0 -> -inf, negative/nan -> nan, inf -> inf). y = m 2^e with
//! m in [sqrt(1/2), sqrt(2)); log m = 2 atanh(s), s = (m-1)/(m+1), odd series to s^9.
DFL2_HD float dfl2Log(float y)
{
    if (!(y > 0.0f))
    {
        return y == 0.0f ? bitsToFloat(0xff800000u) : bitsToFloat(0x7fc00000u);
    }
    if (y == bitsToFloat(0x7f800000u))
    {
        return y;
    }
    int32_t eAdjust = 0;
    if (y < 1.17549435e-38f)
    {
        y *= 8388608.0f; // subnormal: scale by 2^23 (exact)
        eAdjust = -23;
    }
    uint32_t const bits = floatToBits(y);
    int32_t e = static_cast<int32_t>(bits >> 23) - 127 + eAdjust;
    float m = bitsToFloat((bits & 0x007fffffu) | 0x3f800000u); // [1, 2)
    if (m > 1.41421356237309515f)
    {
        m *= 0.5f;
        e += 1;
    }
    float const f = m - 1.0f; // exact (Sterbenz)
    float const s = f / (2.0f + f);
    float const s2 = s * s;
    float p = 1.11111111111111111e-01f;       // 1/9
    p = fmaf(p, s2, 1.42857142857142857e-01f); // 1/7
    p = fmaf(p, s2, 2.0e-01f);                 // 1/5
    p = fmaf(p, s2, 3.33333333333333333e-01f); // 1/3
    float const twoS = 2.0f * s;
    float const logM = fmaf(twoS, p * s2, twoS);
    float const ef = static_cast<float>(e);
    return fmaf(ef, 0.693145751953125f, fmaf(ef, 1.428606765330187045e-06f, logM));
}

// ---------------------------------------------------------------------------------------------
// Scoring
// ---------------------------------------------------------------------------------------------

//! Defensive id clamp: ids index the codebooks, an out-of-range id must never read outside them.
DFL2_HD int32_t clampId(int32_t id, int32_t vocab)
{
    return id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
}

//! g[e] * b[e]: the successor side of one term (reference.py multiplies B by g first).
DFL2_HD float gbProduct(float g, float b)
{
    return g * b;
}

//! Accumulate one term a[e] * (g[e] * b[e]) with a single rounding of the product-sum.
DFL2_HD float dotTermGb(float acc, float a, float gb)
{
    return fmaf(a, gb, acc);
}

DFL2_HD float dotTerm(float acc, float a, float g, float b)
{
    return dotTermGb(acc, a, gbProduct(g, b));
}

//! Partial sum `part` of sum_e a[e] g[e] b[e] over e in [0, r): elements of that part in
//! increasing order. a, g, b: [r] rows (predecessor codebook row, projected hidden, successor row).
template <typename T>
DFL2_HD float partialDot(T const* a, T const* g, T const* b, int32_t r, int32_t part)
{
    float acc = 0.0f;
    for (int32_t base = part * kDOT_CHUNK; base < r; base += kDOT_STRIDE)
    {
        for (int32_t k = 0; k < kDOT_CHUNK && base + k < r; ++k)
        {
            acc = dotTerm(acc, toFloat(a[base + k]), toFloat(g[base + k]), toFloat(b[base + k]));
        }
    }
    return acc;
}

//! Fixed pairwise tree over the kDOT_PARTS partials. The kernel's xor-shuffle butterfly over
//! 8 lanes (offsets 1, 2, 4) computes exactly this tree (float + is commutative).
DFL2_HD float combineParts(float const* p)
{
    float const q0 = p[0] + p[1];
    float const q1 = p[2] + p[3];
    float const q2 = p[4] + p[5];
    float const q3 = p[6] + p[7];
    return (q0 + q1) + (q2 + q3);
}

//! Full pair score sum_e a[e] g[e] b[e] (host path; the kernel distributes the parts over lanes).
template <typename T>
DFL2_HD float pairDot(T const* a, T const* g, T const* b, int32_t r)
{
    float parts[kDOT_PARTS];
    for (int32_t p = 0; p < kDOT_PARTS; ++p)
    {
        parts[p] = partialDot(a, g, b, r, p);
    }
    return combineParts(parts);
}

//! Lattice entry S[t, i, j] = U[t, j] + pair(t, i, j).
DFL2_HD float latticeEntry(float unary, float pair)
{
    return unary + pair;
}

// ---------------------------------------------------------------------------------------------
// Small sequential helpers (K <= 16)
// ---------------------------------------------------------------------------------------------

//! First index of the maximum (np.argmax semantics: the lowest index wins ties).
DFL2_HD int32_t argmaxLowest(float const* v, int32_t n)
{
    int32_t best = 0;
    for (int32_t j = 1; j < n; ++j)
    {
        if (v[j] > v[best])
        {
            best = j;
        }
    }
    return best;
}

DFL2_HD float maxOf(float const* v, int32_t n)
{
    float m = v[0];
    for (int32_t j = 1; j < n; ++j)
    {
        m = v[j] > m ? v[j] : m;
    }
    return m;
}

//! Inverse-CDF draw: min{j : cdf[j] > u} with cdf the running sum of q, clamped to n - 1.
DFL2_HD int32_t sampleInverseCdf(float const* q, int32_t n, float u)
{
    float cdf = 0.0f;
    for (int32_t j = 0; j < n; ++j)
    {
        cdf += q[j];
        if (cdf > u)
        {
            return j;
        }
    }
    return n - 1;
}

//! log(sum_j exp(S[j] / T + bias[j])) = m + log(sum_j exp(x_j - m)), m = max_j x_j.
DFL2_HD float logSumExpScaled(float const* s, float const* bias, float temperature, int32_t n)
{
    float x[kMAX_TOP_K];
    for (int32_t j = 0; j < n; ++j)
    {
        x[j] = s[j] / temperature + bias[j];
    }
    float const m = maxOf(x, n);
    float sum = 0.0f;
    for (int32_t j = 0; j < n; ++j)
    {
        sum += dfl2Exp(x[j] - m);
    }
    return m + dfl2Log(sum);
}

// ---------------------------------------------------------------------------------------------
// Walks, written once against a lanes executor
// ---------------------------------------------------------------------------------------------
//
// A Lanes type provides
//   forEach(n, f): f(k) for every k in [0, n), then a barrier among the lanes;
//   single(f):     f() once, then a barrier.
// Values produced inside single() and read by other lanes go through WalkScratch / the arrays
// passed in (shared memory on the device), never through locals.

//! Host executor: a plain loop.
struct SerialLanes
{
    template <typename F>
    DFL2_HD void forEach(int32_t n, F&& f) const
    {
        for (int32_t k = 0; k < n; ++k)
        {
            f(k);
        }
    }

    template <typename F>
    DFL2_HD void single(F&& f) const
    {
        f();
    }
};

//! Per-sequence walk state shared by the lanes.
struct WalkScratch
{
    float x[kMAX_TOP_K];        //!< [K] scaled scores of the current row
    float e[kMAX_TOP_K];        //!< [K] exp(x - max)
    float delta[2][kMAX_TOP_K]; //!< [2, K] Viterbi running maxima (double-buffered)
    float rowMax;
    float rowSum;
    int32_t prev; //!< chosen index of the previous row (0 for row 0: every i is the anchor)
};

//! Views of one sequence for the walks. S: [L, K, K] lattice (row 0 only needs i = 0).
struct WalkArgs
{
    float const* lattice;  //!< [L, K, K]
    float* messages;       //!< [L, K] Viterbi-sampling backward log-messages (scratch)
    int32_t* back;         //!< [L, K] Viterbi back-pointers (scratch)
    int32_t* pathIdx;      //!< [L] chosen candidate index per row (output)
    float* proposals;      //!< [L, K] proposal q_t (output)
    float const* uniforms; //!< [L] in [0, 1), read only when temperature > 0
    float temperature;     //!< <= 0 (or nan): argmax decoding
    int32_t rows;          //!< L
    int32_t topK;          //!< K
};

//! One sampled row: q = softmax(S_row / T + bias) over K, u -> index (inverse CDF).
//! Writes proposals[t, :] and pathIdx[t]; sets scratch.prev.
template <typename Lanes>
DFL2_HD void sampleRow(Lanes const& lanes, WalkArgs const& w, WalkScratch& sc, int32_t t, float const* row,
    float const* bias)
{
    int32_t const K = w.topK;
    float const T = w.temperature;
    lanes.forEach(K, [&](int32_t j) {
        float v = row[j] / T;
        if (bias != nullptr)
        {
            v += bias[j];
        }
        sc.x[j] = v;
    });
    lanes.single([&]() { sc.rowMax = maxOf(sc.x, K); });
    lanes.forEach(K, [&](int32_t j) { sc.e[j] = dfl2Exp(sc.x[j] - sc.rowMax); });
    lanes.single([&]() {
        float s = 0.0f;
        for (int32_t j = 0; j < K; ++j)
        {
            s += sc.e[j];
        }
        sc.rowSum = s;
    });
    float* q = w.proposals + t * K; // [K]
    lanes.forEach(K, [&](int32_t j) { q[j] = sc.e[j] / sc.rowSum; });
    lanes.single([&]() {
        int32_t const j = sampleInverseCdf(q, K, w.uniforms[t]);
        w.pathIdx[t] = j;
        sc.prev = j;
    });
}

//! Greedy walk (docs/design.md): row t scores S[t, prev, :]; argmax (T <= 0) or sample (T > 0).
template <typename Lanes>
DFL2_HD void greedyWalk(Lanes const& lanes, WalkArgs const& w, WalkScratch& sc)
{
    int32_t const K = w.topK;
    bool const sampling = w.temperature > 0.0f;
    lanes.single([&]() { sc.prev = 0; });
    for (int32_t t = 0; t < w.rows; ++t)
    {
        float const* row = w.lattice + (t * K + sc.prev) * K; // [K]
        if (sampling)
        {
            sampleRow(lanes, w, sc, t, row, nullptr);
        }
        else
        {
            lanes.single([&]() {
                int32_t const j = argmaxLowest(row, K);
                w.pathIdx[t] = j;
                sc.prev = j;
            });
            float* q = w.proposals + t * K; // [K] one-hot
            lanes.forEach(K, [&](int32_t j) { q[j] = j == sc.prev ? 1.0f : 0.0f; });
        }
    }
}

//! Viterbi walk: T <= 0 exact max-sum with back-pointers (lowest index on ties), T > 0 exact
//! chain sampling with backward log-messages (the recorded proposal is q_t(j | prev)).
template <typename Lanes>
DFL2_HD void viterbiWalk(Lanes const& lanes, WalkArgs const& w, WalkScratch& sc)
{
    int32_t const K = w.topK;
    int32_t const L = w.rows;
    if (w.temperature > 0.0f)
    {
        float const T = w.temperature;
        lanes.forEach(K, [&](int32_t i) { w.messages[(L - 1) * K + i] = 0.0f; });
        for (int32_t t = L - 2; t >= 0; --t)
        {
            lanes.forEach(K, [&](int32_t i) {
                float const* s = w.lattice + ((t + 1) * K + i) * K; // [K] S[t+1, i, :]
                w.messages[t * K + i] = logSumExpScaled(s, w.messages + (t + 1) * K, T, K);
            });
        }
        lanes.single([&]() { sc.prev = 0; });
        for (int32_t t = 0; t < L; ++t)
        {
            float const* row = w.lattice + (t * K + sc.prev) * K; // [K]
            sampleRow(lanes, w, sc, t, row, w.messages + t * K);
        }
        return;
    }

    lanes.forEach(K, [&](int32_t j) { sc.delta[0][j] = w.lattice[j]; }); // S[0, 0, :]
    for (int32_t t = 1; t < L; ++t)
    {
        float const* dPrev = sc.delta[(t - 1) & 1];
        float* dCur = sc.delta[t & 1];
        lanes.forEach(K, [&](int32_t j) {
            float const* col = w.lattice + t * K * K + j; // S[t, :, j], stride K
            float best = dPrev[0] + col[0];
            int32_t bestI = 0;
            for (int32_t i = 1; i < K; ++i)
            {
                float const v = dPrev[i] + col[i * K];
                if (v > best)
                {
                    best = v;
                    bestI = i;
                }
            }
            dCur[j] = best;
            w.back[t * K + j] = bestI;
        });
    }
    lanes.single([&]() {
        int32_t j = argmaxLowest(sc.delta[(L - 1) & 1], K);
        w.pathIdx[L - 1] = j;
        for (int32_t t = L - 1; t > 0; --t)
        {
            j = w.back[t * K + j];
            w.pathIdx[t - 1] = j;
        }
    });
    lanes.forEach(L * K, [&](int32_t e) { w.proposals[e] = w.pathIdx[e / K] == e % K ? 1.0f : 0.0f; });
}

template <typename Lanes>
DFL2_HD void walk(Lanes const& lanes, Mode mode, WalkArgs const& w, WalkScratch& sc)
{
    if (mode == Mode::kVITERBI)
    {
        viterbiWalk(lanes, w, sc);
    }
    else
    {
        greedyWalk(lanes, w, sc);
    }
}

} // namespace selector
} // namespace dflash2

#endif // DFLASH2_PATH_SELECTOR_MATH_H
