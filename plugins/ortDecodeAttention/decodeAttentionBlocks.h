//! \file decodeAttentionBlocks.h
//! The blocked kernel of decodeAttention.cpp (its dot products, exp and the pass over key blocks), included there
//! twice: once for the library's baseline (x86-64-v3: AVX2 + FMA) and once for x86-64-v4 (AVX-512: 32 vector
//! registers; 256-bit vectors preferred, so every loop keeps its 8-lane shape and every operation its order), which
//! decodeAttentionQueries takes where the panel kernels run AVX-512 (panelMatMulWide). The two give the same numbers
//! bit for bit (tests/test_ort_decode_attention.py compares them). Not a header of its own (no include guard: it is
//! meant to be included twice), included inside an unnamed namespace; kBlock and pairPlanted come from the including
//! file.

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


#if defined(__AVX2__) && defined(__FMA__)

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
                asm("" : "+v"(kv)); // one load for both queries (GCC would fold it into each FMA)
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
                            asm("" : "+v"(vv)); // one load for both queries (GCC would fold it into each FMA)
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

#endif
