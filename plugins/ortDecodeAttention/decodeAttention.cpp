//! \file decodeAttention.cpp
//! See decodeAttention.h. Loops are written so the compiler vectorizes them (`omp simd` reductions over d). The
//! blocked kernel (decodeAttentionBlocks.h) is built twice, for the baseline and for AVX-512 CPUs, and chosen per
//! process as the panel kernels are (panelMatMulWide: DFLASH2_ORT_PANELS_AVX512=0 keeps the baseline).
#include "decodeAttention.h"
#include "panelMatMul.h"

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

//! Whether a planted bug's variable is "1" (read once by each bug's function below).
bool plantSet(char const* variable) noexcept
{
    char const* v = std::getenv(variable);
    return v != nullptr && v[0] == '1';
}

//! The planted bug of tests/test_ort_decode_attention.py (DFLASH2_PLANT_ATTENTION_CUT=1): a range of queries that
//! starts inside a head's rows takes its rows as counted from the range's start (their positions and causal lengths
//! shifted), which the op's comparison with its NumPy twin must catch.
bool cutPlanted() noexcept
{
    static bool const planted = plantSet("DFLASH2_PLANT_ATTENTION_CUT");
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

#if defined(__AVX2__) && defined(__FMA__)
namespace
{

constexpr int64_t kBlock = 32; //!< keys per block: K and V of a block (2 x 8 KB at d = 64) stay in L1 for all rows

//! The planted bug of tests/test_ort_decode_attention.py (DFLASH2_PLANT_ATTENTION_PAIR=1): a pair's second query
//! rescales its accumulator by the first one's factor, which the op's comparison with its NumPy twin must catch.
bool pairPlanted() noexcept
{
    static bool const planted = plantSet("DFLASH2_PLANT_ATTENTION_PAIR");
    return planted;
}

//! The planted bug of tests/test_ort_decode_attention.py (DFLASH2_PLANT_ATTENTION_WIDE=1): the AVX-512 build is
//! called with a softmax scale one ulp off, a difference in the last bits that only the comparison of the two builds'
//! outputs bit for bit catches (the NumPy twin's tolerance does not).
bool widePlanted() noexcept
{
    static bool const planted = plantSet("DFLASH2_PLANT_ATTENTION_WIDE");
    return planted;
}

} // namespace
#endif

namespace base
{
namespace
{
#include "decodeAttentionBlocks.h"
} // namespace
} // namespace base

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#define DFLASH2_ATTENTION_WIDE 1
// the same kernel built for x86-64-v4 (the target pragma applies to the functions defined up to pop_options; the
// standard library's templates, defined above, stay baseline code)
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,prefer-vector-width=256")
namespace wide
{
namespace
{
#include "decodeAttentionBlocks.h"
} // namespace
} // namespace wide
#pragma GCC pop_options
#endif

namespace
{

using namespace base;

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
            auto* attend = d == 64 ? base::attendRowsBlocked<8> : d == 128 ? base::attendRowsBlocked<16>
                                                                             : base::attendRowsBlocked<0>;
            float scaleUsed = scale;
#if defined(DFLASH2_ATTENTION_WIDE)
            if (panelMatMulWide())
            {
                attend = d == 64 ? wide::attendRowsBlocked<8> : d == 128 ? wide::attendRowsBlocked<16>
                                                                         : wide::attendRowsBlocked<0>;
                scaleUsed = widePlanted() ? std::nextafter(scale, 1.F) : scale;
            }
#endif
            attend(qRows.data() + first, lengths.data() + first, n, keys, values, d, scaleUsed, scores);
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
