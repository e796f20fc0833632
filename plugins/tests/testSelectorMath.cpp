/*
 * dflash2_trt — host unit test of the shared selector math (pathSelectorMath.h):
 * exact fp16/bf16 conversion (all 65536 patterns), exp/log accuracy against double precision,
 * the fixed partial-sum order of the pair score, and the sequential helpers' tie rules.
 */
#include "pathSelectorMath.h"

#include "dfl2Test.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace sel = dflash2::selector;

namespace
{

//! binary16 decoded with double arithmetic (independent of the bit recipe under test).
double halfReference(uint16_t h)
{
    int const sign = (h & 0x8000) ? -1 : 1;
    int const expo = (h >> 10) & 0x1f;
    int const mant = h & 0x3ff;
    if (expo == 0)
    {
        return sign * std::ldexp(static_cast<double>(mant), -24);
    }
    if (expo == 31)
    {
        return mant == 0 ? sign * INFINITY : NAN;
    }
    return sign * std::ldexp(1.0 + mant / 1024.0, expo - 15);
}

//! Error in units of the fp32 spacing at the exact value.
double ulpError(float got, double exact)
{
    if (exact == 0.0)
    {
        return got == 0.0f ? 0.0 : INFINITY;
    }
    int e = 0;
    std::frexp(exact, &e);
    double const ulp = std::ldexp(1.0, (e - 24) < -149 ? -149 : e - 24);
    return std::fabs(static_cast<double>(got) - exact) / ulp;
}

void testConversions()
{
    for (uint32_t h = 0; h < 65536; ++h)
    {
        float const f = sel::toFloat(sel::Fp16Bits{static_cast<uint16_t>(h)});
        double const ref = halfReference(static_cast<uint16_t>(h));
        if (std::isnan(ref))
        {
            CHECK(std::isnan(f));
        }
        else
        {
            CHECK(static_cast<double>(f) == ref);
        }
        float const b = sel::toFloat(sel::Bf16Bits{static_cast<uint16_t>(h)});
        uint32_t bits = 0;
        std::memcpy(&bits, &b, sizeof(bits));
        CHECK(bits == (h << 16));
    }
}

void testExpLog()
{
    double worstExp = 0.0;
    for (float x = -103.0f; x <= 88.0f; x += 0.0137f)
    {
        worstExp = std::fmax(worstExp, ulpError(sel::dfl2Exp(x), std::exp(static_cast<double>(x))));
    }
    for (float x = -1.0f; x <= 1.0f; x += 1.0e-4f)
    {
        worstExp = std::fmax(worstExp, ulpError(sel::dfl2Exp(x), std::exp(static_cast<double>(x))));
    }
    std::printf("dfl2Exp: max error %.3f ulp\n", worstExp);
    CHECK(worstExp <= 2.0);
    CHECK(sel::dfl2Exp(0.0f) == 1.0f);
    CHECK(sel::dfl2Exp(-200.0f) == 0.0f);
    CHECK(std::isinf(sel::dfl2Exp(100.0f)));
    CHECK(std::isnan(sel::dfl2Exp(NAN)));
    CHECK(sel::dfl2Exp(-INFINITY) == 0.0f);

    double worstLog = 0.0;
    for (float y = 1.0e-30f; y < 1.0e30f; y *= 1.0137f)
    {
        worstLog = std::fmax(worstLog, ulpError(sel::dfl2Log(y), std::log(static_cast<double>(y))));
    }
    for (float y = 0.5f; y <= 20.0f; y += 1.0e-4f)
    {
        double const exact = std::log(static_cast<double>(y));
        // near y = 1 the result is tiny; measure against the spacing of 1 instead
        double const err = std::fabs(exact) < 1.0e-3
            ? std::fabs(static_cast<double>(sel::dfl2Log(y)) - exact) / std::ldexp(1.0, -24)
            : ulpError(sel::dfl2Log(y), exact);
        worstLog = std::fmax(worstLog, err);
    }
    std::printf("dfl2Log: max error %.3f ulp\n", worstLog);
    CHECK(worstLog <= 2.0);
    CHECK(sel::dfl2Log(1.0f) == 0.0f);
    CHECK(std::isinf(sel::dfl2Log(0.0f)) && sel::dfl2Log(0.0f) < 0.0f);
    CHECK(std::isnan(sel::dfl2Log(-1.0f)));
    CHECK(std::fabs(sel::dfl2Log(1.0e-40f) - std::log(1.0e-40)) < 1.0e-4);
}

void testPairDotOrder()
{
    // the partial sums and their tree are the definition; pairDot must equal them exactly
    for (int32_t r = 1; r <= 70; ++r)
    {
        float a[70];
        float g[70];
        float b[70];
        for (int32_t e = 0; e < r; ++e)
        {
            a[e] = std::sin(0.7f * static_cast<float>(e) + 0.1f);
            g[e] = std::cos(1.3f * static_cast<float>(e));
            b[e] = 0.01f * static_cast<float>((e * 37) % 11) - 0.05f;
        }
        float parts[sel::kDOT_PARTS];
        for (int32_t p = 0; p < sel::kDOT_PARTS; ++p)
        {
            float acc = 0.0f;
            for (int32_t e = 0; e < r; ++e)
            {
                if ((e / sel::kDOT_CHUNK) % sel::kDOT_PARTS == p)
                {
                    acc = std::fma(a[e], g[e] * b[e], acc);
                }
            }
            parts[p] = acc;
        }
        float const tree = ((parts[0] + parts[1]) + (parts[2] + parts[3])) + ((parts[4] + parts[5]) + (parts[6] + parts[7]));
        CHECK(sel::pairDot(a, g, b, r) == tree);
        double exact = 0.0;
        for (int32_t e = 0; e < r; ++e)
        {
            exact += static_cast<double>(a[e]) * static_cast<double>(g[e]) * static_cast<double>(b[e]);
        }
        CHECK(std::fabs(sel::pairDot(a, g, b, r) - exact) < 1.0e-5);
    }
}

void testHelpers()
{
    float const v[5] = {1.0f, 3.0f, 3.0f, -2.0f, 3.0f};
    CHECK(sel::argmaxLowest(v, 5) == 1);
    CHECK(sel::maxOf(v, 5) == 3.0f);
    float const q[4] = {0.25f, 0.25f, 0.25f, 0.25f};
    CHECK(sel::sampleInverseCdf(q, 4, 0.0f) == 0);
    CHECK(sel::sampleInverseCdf(q, 4, 0.25f) == 1); // cdf[0] = 0.25 is not > 0.25
    CHECK(sel::sampleInverseCdf(q, 4, 0.999f) == 3);
    float const low[3] = {0.2f, 0.2f, 0.2f}; // cdf ends below u: clamped to the last index
    CHECK(sel::sampleInverseCdf(low, 3, 0.9f) == 2);
    CHECK(sel::clampId(-5, 10) == 0 && sel::clampId(10, 10) == 9 && sel::clampId(3, 10) == 3);
}

} // namespace

int main()
{
    testConversions();
    testExpLog();
    testPairDotOrder();
    testHelpers();
    return dfl2TestReport("testSelectorMath");
}
