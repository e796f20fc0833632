//! \file decodeAttention.cpp
//! See decodeAttention.h. Loops are written so the compiler vectorizes them (`omp simd` reductions over d).
#include "decodeAttention.h"

#include <algorithm>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdlib>
#include <vector>

namespace dflash2
{
namespace
{

//! Non-interleaved rotary (rotate_half) of one head vector x [d] at position pos -> y [d].
inline void rotate(float const* x, float const* cosRow, float const* sinRow, int64_t d, float* y) noexcept
{
    int64_t const h = d / 2;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i)
    {
        float const a = x[i];
        float const b = x[i + h];
        y[i] = a * cosRow[i] - b * sinRow[i];
        y[i + h] = b * cosRow[i] + a * sinRow[i];
    }
}

//! The planted bug of tests/test_ort_decode_attention.py (DFLASH2_PLANT_ATTENTION_CUT=1): a range of queries that
//! starts inside a head's rows takes its rows as counted from the range's start (their positions and causal lengths
//! shifted), which the op's comparison with its NumPy twin must catch.
bool cutPlanted() noexcept
{
    static bool const planted = [] {
        char const* v = std::getenv("DFLASH2_PLANT_ATTENTION_CUT");
        return v != nullptr && v[0] == '1';
    }();
    return planted;
}

} // namespace

void decodeAttentionWriteKv(DecodeAttentionShape const& s, float const* qkv, float const* cosTable,
    float const* sinTable, float* keyCache, float* valueCache) noexcept
{
    int64_t const d = s.headDim;
    int64_t const rowStride = (s.numHeads + 2 * s.kvHeads) * d;
    for (int64_t r = 0; r < s.rows; ++r)
    {
        int64_t const pos = s.past + r;
        float const* row = qkv + r * rowStride;
        for (int64_t k = 0; k < s.kvHeads; ++k)
        {
            float const* key = row + (s.numHeads + k) * d;
            float const* value = row + (s.numHeads + s.kvHeads + k) * d;
            rotate(key, cosTable + pos * (d / 2), sinTable + pos * (d / 2), d, keyCache + (k * s.capacity + pos) * d);
            std::copy(value, value + d, valueCache + (k * s.capacity + pos) * d);
        }
    }
}

namespace
{

#if defined(__AVX2__) && defined(__FMA__)
//! e^x for 8 lanes (Cephes expf: Cody-Waite range reduction + degree-5 polynomial; relative error ~1e-7);
//! inputs are scores minus their maximum, so x <= 0 (clamped below at -87.3, where e^x underflows).
inline __m256 exp8(__m256 x) noexcept
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3F));
    __m256 const n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341F)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375F), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4F), r);
    __m256 y = _mm256_set1_ps(1.9875691500E-4F);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3F));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3F));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2F));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1F));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1F));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.F)));
    __m256i const e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

//! 8 dot products q . keys[k] (k < 8), keys [8, d] row-major, d % 8 == 0.
inline __m256 dot8(float const* q, float const* keys, int64_t d) noexcept
{
    __m256 a[8];
    for (auto& v : a)
    {
        v = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < d; i += 8)
    {
        __m256 const qv = _mm256_loadu_ps(q + i);
        for (int k = 0; k < 8; ++k)
        {
            a[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + k * d + i), a[k]);
        }
    }
    __m256 const t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 const t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

inline float dot(float const* q, float const* key, int64_t d) noexcept
{
    float acc = 0.F;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; ++i)
    {
        acc += q[i] * key[i];
    }
    return acc;
}

//! out [d] = sum_u scores[u] * inv * values[u] over n value rows of d (the softmax-weighted sum of V).
inline void weightedSum(float const* scores, float inv, float const* values, int64_t n, int64_t d, float* out) noexcept
{
    std::fill(out, out + d, 0.F);
    for (int64_t u = 0; u < n; ++u)
    {
        float const p = scores[u] * inv;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i)
        {
            out[i] += p * values[u * d + i];
        }
    }
}

//! One query row against slots 0..n-1: out [d] = softmax(scale q . K') V. scores: n + 8 floats.
void attendRow(float const* q, float const* keys, float const* values, int64_t n, int64_t capacity, int64_t d,
    float scale, float* scores, float* out) noexcept
{
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0)
    {
        __m256 const vs = _mm256_set1_ps(scale);
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= capacity && j < n; j += 8) // whole blocks of 8 slots (slots >= n are computed, not used)
        {
            __m256 const sc = _mm256_mul_ps(dot8(q, keys + j * d, d), vs);
            _mm256_storeu_ps(scores + j, sc);
            if (j + 8 <= n)
            {
                vmax = _mm256_max_ps(vmax, sc);
            }
        }
        for (int64_t t = j; t < n; ++t)
        {
            scores[t] = dot(q, keys + t * d, d) * scale;
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        float maxScore = -INFINITY;
        for (float v : lanes)
        {
            maxScore = std::max(maxScore, v);
        }
        for (int64_t t = (n / 8) * 8; t < n; ++t)
        {
            maxScore = std::max(maxScore, scores[t]);
        }
        __m256 const vm = _mm256_set1_ps(maxScore);
        __m256 vsum = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8)
        {
            __m256 const e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vm));
            _mm256_storeu_ps(scores + t, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        _mm256_storeu_ps(lanes, vsum);
        float sum = 0.F;
        for (float v : lanes)
        {
            sum += v;
        }
        if (t < n) // tail: the same exp8 on a padded block
        {
            float block[8] = {};
            for (int64_t u = t; u < n; ++u)
            {
                block[u - t] = scores[u] - maxScore;
            }
            _mm256_storeu_ps(block, exp8(_mm256_loadu_ps(block)));
            for (int64_t u = t; u < n; ++u)
            {
                scores[u] = block[u - t];
                sum += block[u - t];
            }
        }
        __m256 acc[16];
        int64_t const chunks = d / 8;
        if (chunks <= 16)
        {
            for (int64_t c = 0; c < chunks; ++c)
            {
                acc[c] = _mm256_setzero_ps();
            }
            for (int64_t u = 0; u < n; ++u)
            {
                __m256 const p = _mm256_set1_ps(scores[u]);
                float const* v = values + u * d;
                for (int64_t c = 0; c < chunks; ++c)
                {
                    acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
                }
            }
            __m256 const inv = _mm256_set1_ps(1.F / sum);
            for (int64_t c = 0; c < chunks; ++c)
            {
                _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
            }
            return;
        }
        j = n; // scores done; fall through to the generic P x V below
        weightedSum(scores, 1.F / sum, values, n, d, out);
        return;
    }
#endif
    (void) capacity;
    float maxScore = -INFINITY;
    for (; j < n; ++j)
    {
        scores[j] = dot(q, keys + j * d, d) * scale;
        maxScore = std::max(maxScore, scores[j]);
    }
    float sum = 0.F;
    for (int64_t u = 0; u < n; ++u)
    {
        scores[u] = std::exp(scores[u] - maxScore);
        sum += scores[u];
    }
    weightedSum(scores, 1.F / sum, values, n, d, out);
}

} // namespace

#if defined(__AVX2__) && defined(__FMA__)
namespace
{

constexpr int64_t kBlock = 32; //!< keys per block: K and V of a block (2 x 8 KB at d = 64) stay in L1 for all rows

//! The planted bug of tests/test_ort_decode_attention.py (DFLASH2_PLANT_ATTENTION_PAIR=1): a pair's second query
//! rescales its accumulator by the first one's factor, which the op's comparison with its NumPy twin must catch.
bool pairPlanted() noexcept
{
    static bool const planted = [] {
        char const* v = std::getenv("DFLASH2_PLANT_ATTENTION_PAIR");
        return v != nullptr && v[0] == '1';
    }();
    return planted;
}

//! A block's scores of one query: sc[0..cnt) = scale q . keys[j0 + u] (lanes past the query's length n hold -inf)
//! -> their 8-lane maximum.
inline __m256 blockScores(float const* q, float const* keys, int64_t j0, int64_t n, int64_t cnt, int64_t d,
    float scale, __m256 vs, float* sc) noexcept
{
    int64_t const blocks8 = (cnt + 7) / 8;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t b = 0; b < blocks8; ++b)
    {
        int64_t const j = j0 + 8 * b;
        __m256 v;
        if (j + 8 <= n)
        {
            v = _mm256_mul_ps(dot8(q, keys + j * d, d), vs);
        }
        else
        {
            alignas(32) float t[8];
            for (int64_t u = 0; u < 8; ++u)
            {
                t[u] = j + u < n ? dot(q, keys + (j + u) * d, d) * scale : -INFINITY;
            }
            v = _mm256_load_ps(t);
        }
        _mm256_store_ps(sc + 8 * b, v);
        vmax = _mm256_max_ps(vmax, v);
    }
    return vmax;
}

//! dot8 of two queries over the same 8 keys, each key read once for both: every lane's products and sums in
//! dot8's order (per key: the 8-lane FMA chain over d, then the same pairwise folds), so each query's scores equal
//! dot8's bit for bit. Keys 0-3 and 4-7 in two passes of 8 accumulators (AVX2's 16 registers).
inline void dot8Pair(float const* qa, float const* qb, float const* keys, int64_t d, __m256& outA, __m256& outB) noexcept
{
    __m256 t[2][2];
    for (int half = 0; half < 2; ++half)
    {
        float const* k = keys + 4 * half * d;
        __m256 a[4];
        __m256 b[4];
        for (int u = 0; u < 4; ++u)
        {
            a[u] = _mm256_setzero_ps();
            b[u] = _mm256_setzero_ps();
        }
        for (int64_t i = 0; i < d; i += 8)
        {
            __m256 const qva = _mm256_loadu_ps(qa + i);
            __m256 const qvb = _mm256_loadu_ps(qb + i);
            for (int u = 0; u < 4; ++u)
            {
                __m256 kv = _mm256_loadu_ps(k + u * d + i);
                asm("" : "+x"(kv)); // one load for both queries (GCC would fold it into each FMA)
                a[u] = _mm256_fmadd_ps(qva, kv, a[u]);
                b[u] = _mm256_fmadd_ps(qvb, kv, b[u]);
            }
        }
        t[0][half] = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        t[1][half] = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
    }
    outA = _mm256_add_ps(_mm256_permute2f128_ps(t[0][0], t[0][1], 0x20), _mm256_permute2f128_ps(t[0][0], t[0][1], 0x31));
    outB = _mm256_add_ps(_mm256_permute2f128_ps(t[1][0], t[1][1], 0x20), _mm256_permute2f128_ps(t[1][0], t[1][1], 0x31));
}

//! The online softmax step of one query over a block's scores sc[0..cnt) (their 8-lane maximum vmax): sc becomes
//! e^(score - new max) (0 past cnt), m and l are updated -> the factor the accumulator is rescaled by.
inline float blockSoftmax(float* sc, int64_t cnt, __m256 vmax, float& m, float& l) noexcept
{
    int64_t const blocks8 = (cnt + 7) / 8;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float bm = lanes[0];
    for (int u = 1; u < 8; ++u)
    {
        bm = std::max(bm, lanes[u]);
    }
    float const mNew = std::max(m, bm);
    float const corr = std::exp(m - mNew); // 0 on the first block (m = -inf)
    m = mNew;
    __m256 const vm = _mm256_set1_ps(mNew);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks8; ++b)
    {
        // lanes past n hold -inf: exp8 clamps them to e^-87.3 ~ 1e-38, so they are zeroed explicitly
        __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(sc + 8 * b), vm));
        int64_t const valid = std::min<int64_t>(8, cnt - 8 * b);
        if (valid < 8)
        {
            alignas(32) float t[8];
            _mm256_store_ps(t, e);
            for (int64_t u = valid; u < 8; ++u)
            {
                t[u] = 0.F;
            }
            e = _mm256_load_ps(t);
        }
        _mm256_store_ps(sc + 8 * b, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_store_ps(lanes, vsum);
    float bs = 0.F;
    for (float v : lanes)
    {
        bs += v;
    }
    l = l * corr + bs;
    return corr;
}

//! The query rows of every query head sharing one key/value head (rows x heads of the group: query i attends
//! to slots 0..lengths[i]-1), blockwise over the keys with an online softmax (running max m, sum l, unnormalised
//! accumulator acc per query): a block of keys and values is read from memory once and from L1 for all the
//! group's queries. Each query's sequence of operations depends only on its own causal length, never on which
//! or how many queries share the pass: two queries whose lengths both cover a whole block take it together
//! (each key and value read once for both: dot8Pair, and P x V four chunks of both at a time) with every
//! operation of each as when it takes the block alone.
//! kChunks: d / 8 known at compile time (the accumulators then stay in registers: with a run-time d they went
//! through the stack, and P x V ran at a third of its speed), or 0 for any d (no pairs).
template <int64_t kChunks>
void attendRowsBlocked(float const* const* q, int64_t const* lengths, int64_t rows, float const* keys,
    float const* values, int64_t dRuntime, float scale, float* state) noexcept
{
    int64_t const chunks = kChunks != 0 ? kChunks : dRuntime / 8;
    int64_t const d = 8 * chunks;
    float* m = state;              // [rows]
    float* l = state + rows;       // [rows]
    float* acc = state + 2 * rows; // [rows, d]
    std::fill(m, m + rows, -INFINITY);
    std::fill(l, l + rows, 0.F);
    std::fill(acc, acc + rows * d, 0.F);
    __m256 const vs = _mm256_set1_ps(scale);
    int64_t const nMax = *std::max_element(lengths, lengths + rows);
    alignas(32) float sc[kBlock];
    alignas(32) float sc2[kBlock];
    bool const planted = pairPlanted();
    for (int64_t j0 = 0; j0 < nMax; j0 += kBlock)
    {
        for (int64_t r = 0; r < rows; ++r)
        {
            int64_t const n = lengths[r];
            if (j0 >= n)
            {
                continue;
            }
            if (kChunks != 0 && kChunks % 4 == 0 && r + 1 < rows && n >= j0 + kBlock && lengths[r + 1] >= j0 + kBlock)
            {
                __m256 vmaxA = _mm256_set1_ps(-INFINITY);
                __m256 vmaxB = vmaxA;
                for (int64_t b = 0; b < kBlock / 8; ++b)
                {
                    __m256 sa;
                    __m256 sb;
                    dot8Pair(q[r], q[r + 1], keys + (j0 + 8 * b) * d, d, sa, sb);
                    sa = _mm256_mul_ps(sa, vs);
                    sb = _mm256_mul_ps(sb, vs);
                    _mm256_store_ps(sc + 8 * b, sa);
                    _mm256_store_ps(sc2 + 8 * b, sb);
                    vmaxA = _mm256_max_ps(vmaxA, sa);
                    vmaxB = _mm256_max_ps(vmaxB, sb);
                }
                __m256 const vcA = _mm256_set1_ps(blockSoftmax(sc, kBlock, vmaxA, m[r], l[r]));
                __m256 vcB = _mm256_set1_ps(blockSoftmax(sc2, kBlock, vmaxB, m[r + 1], l[r + 1]));
                if (planted)
                {
                    vcB = vcA;
                }
                float* aA = acc + r * d;
                float* aB = acc + (r + 1) * d;
                for (int64_t c0 = 0; c0 < chunks; c0 += 4)
                {
                    __m256 avA[4];
                    __m256 avB[4];
                    for (int64_t c = 0; c < 4; ++c)
                    {
                        avA[c] = _mm256_mul_ps(_mm256_loadu_ps(aA + 8 * (c0 + c)), vcA);
                        avB[c] = _mm256_mul_ps(_mm256_loadu_ps(aB + 8 * (c0 + c)), vcB);
                    }
                    for (int64_t u = 0; u < kBlock; ++u)
                    {
                        __m256 const pA = _mm256_set1_ps(sc[u]);
                        __m256 const pB = _mm256_set1_ps(sc2[u]);
                        float const* v = values + (j0 + u) * d + 8 * c0;
                        for (int64_t c = 0; c < 4; ++c)
                        {
                            __m256 vv = _mm256_loadu_ps(v + 8 * c);
                            asm("" : "+x"(vv)); // one load for both queries (GCC would fold it into each FMA)
                            avA[c] = _mm256_fmadd_ps(pA, vv, avA[c]);
                            avB[c] = _mm256_fmadd_ps(pB, vv, avB[c]);
                        }
                    }
                    for (int64_t c = 0; c < 4; ++c)
                    {
                        _mm256_storeu_ps(aA + 8 * (c0 + c), avA[c]);
                        _mm256_storeu_ps(aB + 8 * (c0 + c), avB[c]);
                    }
                }
                ++r;
                continue;
            }
            int64_t const cnt = std::min(kBlock, n - j0);
            __m256 const vmax = blockScores(q[r], keys, j0, n, cnt, d, scale, vs, sc);
            __m256 const vc = _mm256_set1_ps(blockSoftmax(sc, cnt, vmax, m[r], l[r]));
            float* a = acc + r * d;
            __m256 av[16];
            for (int64_t c = 0; c < chunks; ++c)
            {
                av[c] = _mm256_mul_ps(_mm256_loadu_ps(a + 8 * c), vc);
            }
            for (int64_t u = 0; u < cnt; ++u)
            {
                __m256 const pu = _mm256_set1_ps(sc[u]);
                float const* v = values + (j0 + u) * d;
                for (int64_t c = 0; c < chunks; ++c)
                {
                    av[c] = _mm256_fmadd_ps(pu, _mm256_loadu_ps(v + 8 * c), av[c]);
                }
            }
            for (int64_t c = 0; c < chunks; ++c)
            {
                _mm256_storeu_ps(a + 8 * c, av[c]);
            }
        }
    }
}

} // namespace
#endif

void decodeAttentionQueries(DecodeAttentionShape const& s, float const* qkv, float const* cosTable,
    float const* sinTable, float const* keyCache, float const* valueCache, float* out, int64_t queryBegin,
    int64_t queryEnd, float* scores) noexcept
{
    int64_t const d = s.headDim;
    int64_t const rowStride = (s.numHeads + 2 * s.kvHeads) * d;
    int64_t const group = s.numHeads / s.kvHeads;
    float const scale = s.scale != 0.F ? s.scale : 1.F / std::sqrt(static_cast<float>(d));
    int64_t const count = queryEnd - queryBegin;
    std::vector<float> q(static_cast<size_t>(d * count));
    std::vector<float const*> qRows(static_cast<size_t>(count));
    std::vector<int64_t> lengths(static_cast<size_t>(count));
    int64_t const shift = cutPlanted() ? queryBegin % s.rows : 0;
    for (int64_t i = 0; i < count; ++i) // query queryBegin + i = head h, row r
    {
        int64_t const h = (queryBegin + i) / s.rows;
        int64_t const pos = s.past + (queryBegin + i - shift) % s.rows;
        rotate(qkv + (pos - s.past) * rowStride + h * d, cosTable + pos * (d / 2), sinTable + pos * (d / 2), d,
            q.data() + i * d);
        qRows[static_cast<size_t>(i)] = q.data() + i * d;
        lengths[static_cast<size_t>(i)] = pos + 1;
    }
    for (int64_t i0 = queryBegin; i0 < queryEnd;) // runs of queries whose heads share a key/value head
    {
        int64_t const kv = i0 / s.rows / group;
        int64_t const i1 = std::min(queryEnd, (kv + 1) * group * s.rows);
        float const* keys = keyCache + kv * s.capacity * d;     // [C, d]
        float const* values = valueCache + kv * s.capacity * d; // [C, d]
        int64_t const first = i0 - queryBegin;
        int64_t const n = i1 - i0;
#if defined(__AVX2__) && defined(__FMA__)
        if (d % 8 == 0 && d <= 128)
        {
            // scratch: m, l [n] + acc [n, d] (the caller sizes it, see decodeAttentionScratch)
            auto* const attend = d == 64 ? attendRowsBlocked<8> : d == 128 ? attendRowsBlocked<16>
                                                                             : attendRowsBlocked<0>;
            attend(qRows.data() + first, lengths.data() + first, n, keys, values, d, scale, scores);
            float const* l = scores + n;
            float const* acc = scores + 2 * n;
            for (int64_t i = 0; i < n; ++i)
            {
                int64_t const h = (i0 + i) / s.rows;
                int64_t const r = (i0 + i) % s.rows;
                float const inv = 1.F / l[i];
                float* o = out + r * s.numHeads * d + h * d;
                for (int64_t t = 0; t < d; ++t)
                {
                    o[t] = acc[i * d + t] * inv;
                }
            }
            i0 = i1;
            continue;
        }
#endif
        for (int64_t i = 0; i < n; ++i)
        {
            int64_t const h = (i0 + i) / s.rows;
            int64_t const r = (i0 + i) % s.rows;
            attendRow(qRows[static_cast<size_t>(first + i)], keys, values, s.past + r + 1, s.capacity, d, scale,
                scores, out + r * s.numHeads * d + h * d);
        }
        i0 = i1;
    }
}

void decodeAttentionHeads(DecodeAttentionShape const& s, float const* qkv, float const* cosTable,
    float const* sinTable, float const* keyCache, float const* valueCache, float* out, int64_t headBegin,
    int64_t headEnd, float* scratch) noexcept
{
    decodeAttentionQueries(s, qkv, cosTable, sinTable, keyCache, valueCache, out, headBegin * s.rows,
        headEnd * s.rows, scratch);
}

int64_t decodeAttentionPieces(int64_t groups) noexcept
{
    constexpr int64_t kMinItems = 8; // work items the parallel loop should get at least (a few threads' worth)
    constexpr int64_t kPieces = 6;   // else: items in all, of equal cost (equal shares for 2, 3 or 6 threads)
    return groups >= kMinItems ? 1 : (kPieces + groups - 1) / groups;
}

void decodeAttentionCut(DecodeAttentionShape const& s, int64_t pieces, std::vector<QueryRange>& out)
{
    int64_t const group = s.numHeads / s.kvHeads;
    int64_t const rows = s.rows;
    int64_t const past = s.past;
    // a head's rows attend to past + 1 .. past + rows keys: their total, and the cost of the group's first i queries
    int64_t const headCost = rows * past + rows * (rows + 1) / 2;
    auto costBefore = [&](int64_t i) { return (i / rows) * headCost + (i % rows) * past + (i % rows) * (i % rows + 1) / 2; };
    int64_t const n = group * rows; // queries of a group
    // a few rows are cut between heads only: a head's rows in two pieces cost more than they balance (4 rows at
    // 2032 cached positions: +8 % CPU time)
    int64_t const step = rows >= 8 ? 1 : rows;
    int64_t const cut = std::min(pieces, n / step);
    for (int64_t kv = 0; kv < s.kvHeads; ++kv)
    {
        int64_t begin = 0;
        for (int64_t p = 0; p < cut; ++p)
        {
            // piece p ends at the first query (of a multiple of step) where the cost so far reaches (p + 1) / cut of
            // the group's, each piece at least one step
            int64_t end = n;
            if (p + 1 < cut)
            {
                int64_t const goal = (p + 1) * (group * headCost) / cut;
                end = begin + step;
                while (end < n - (cut - p - 1) * step && costBefore(end) < goal)
                {
                    end += step;
                }
            }
            out.push_back({kv * n + begin, kv * n + end, costBefore(end) - costBefore(begin)});
            begin = end;
        }
    }
}

int64_t decodeAttentionScratch(DecodeAttentionShape const& s) noexcept
{
    return std::max(s.past + s.rows + 8, s.rows * (s.numHeads / s.kvHeads) * (s.headDim + 2));
}

} // namespace dflash2
