//! \file drafterLayer.cpp
//! See drafterLayer.h. Every step follows DrafterLayer.forward's order of operations in fp32; sums (norms, dot
//! products, softmax) are the kernel's own order, so the result is the PyTorch layer's within fp32 rounding.
#include "drafterLayer.h"

#include "panelMatMul.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace dflash2
{

void PanelWeight::set(float const* w, int64_t k, int64_t n)
{
    K = k;
    N = n;
    panels.assign(static_cast<size_t>(K * N), 0.F);
    for (int64_t p = 0; p < N / kPanelWidth; ++p)
    {
        for (int64_t i = 0; i < K; ++i)
        {
            for (int64_t j = 0; j < kPanelWidth; ++j)
            {
                panels[static_cast<size_t>((p * K + i) * kPanelWidth + j)] = w[i * N + p * kPanelWidth + j];
            }
        }
    }
    coded = codePanels(panels.data(), K, N);
    countPanelCode(coded.code);
    if (coded.code != PanelCode::None)
    {
        std::vector<float>().swap(panels); // the code reproduces every weight: the fp32 panels are not read again
    }
}

void PanelWeight::apply(float const* x, int64_t rows, float* y, int64_t panelBegin, int64_t panelEnd) const
{
    if (coded.code != PanelCode::None)
    {
        panelMatMulCoded(x, rows, coded, y, panelBegin, panelEnd);
    }
    else
    {
        panelMatMul(x, rows, K, panels.data(), N, y, panelBegin, panelEnd);
    }
}

namespace
{

struct MatMulJob
{
    PanelWeight const* w;
    float const* x;
    int64_t rows;
    float* y;
    int64_t perItem;
};

void matMulItem(void* user, size_t i)
{
    auto const* j = static_cast<MatMulJob const*>(user);
    int64_t const begin = static_cast<int64_t>(i) * j->perItem;
    j->w->apply(j->x, j->rows, j->y, begin, std::min(j->w->N / kPanelWidth, begin + j->perItem));
}

//! y [rows, N] = x [rows, K] @ w, the panels split over the caller's parallel loop
void matMul(PanelWeight const& w, float const* x, int64_t rows, float* y, ParallelFn parallel, void* ctx)
{
    int64_t const panels = w.N / kPanelWidth;
    int64_t const perItem = std::max<int64_t>(4, (panels + 7) / 8);
    MatMulJob job{&w, x, rows, y, perItem};
    size_t const items = static_cast<size_t>((panels + perItem - 1) / perItem);
    if (parallel != nullptr && items > 1)
    {
        parallel(ctx, matMulItem, items, &job);
        return;
    }
    for (size_t i = 0; i < items; ++i)
    {
        matMulItem(&job, i);
    }
}

//! RMSNorm over the last n of rows vectors (torch: x * rsqrt(mean(x^2) + eps), then weight * x)
void rmsNorm(float const* x, float const* weight, int64_t rows, int64_t n, float eps, float* y)
{
    for (int64_t r = 0; r < rows; ++r)
    {
        float const* xr = x + r * n;
        float ss = 0.F;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < n; ++c)
        {
            ss += xr[c] * xr[c];
        }
        float const inv = 1.F / std::sqrt(ss / static_cast<float>(n) + eps);
        for (int64_t c = 0; c < n; ++c)
        {
            y[r * n + c] = weight[c] * (xr[c] * inv);
        }
    }
}

//! The two-tap mix of one side: out[t][c] = sum_o (base[side, o, c] + dyn[t][(side kc + o) G + c / group]) y[t-o][c]
void convMix(DrafterLayerWeights const& w, std::vector<float> const& base, float const* dyn, float const* y,
    int64_t S, int side, float* out)
{
    int64_t const H = w.hidden;
    int64_t const kc = w.convTaps;
    int64_t const G = H / w.convGroup;
    for (int64_t t = 0; t < S; ++t)
    {
        float const* dt = dyn + t * 2 * kc * G;
        for (int64_t c = 0; c < H; ++c)
        {
            float acc = 0.F;
            for (int64_t o = 0; o < kc; ++o)
            {
                int64_t const tap = side * kc + o;
                float const coef = base[static_cast<size_t>(tap * H + c)] + dt[tap * G + c / w.convGroup];
                float const v = t >= o ? y[(t - o) * H + c] : 0.F;
                acc = o == 0 ? coef * v : acc + coef * v;
            }
            out[t * H + c] = acc;
        }
    }
}

//! x [rows, heads d]: per head RMSNorm with weight [d], then RoPE (rotate_half) with cos / sin [rows, d]
void normRope(float* x, int64_t rows, int64_t heads, int64_t d, float const* weight, float eps, float const* cos,
    float const* sin)
{
    float tmp[512];
    for (int64_t r = 0; r < rows; ++r)
    {
        for (int64_t hh = 0; hh < heads; ++hh)
        {
            float* v = x + (r * heads + hh) * d;
            rmsNorm(v, weight, 1, d, eps, v);
            int64_t const half = d / 2;
            for (int64_t e = 0; e < d; ++e)
            {
                float const rot = e < half ? -v[e + half] : v[e - half];
                tmp[e] = v[e] * cos[r * d + e] + rot * sin[r * d + e];
            }
            std::copy(tmp, tmp + d, v);
        }
    }
}

struct AttentionJob
{
    DrafterLayerWeights const* w;
    int64_t S, C;
    float const *q, *kb, *vb, *ctxK, *ctxV, *ctxBias, *blkBias;
    float* att;     //!< [S, nh d]
    float* scratch; //!< per head: C + S scores
};

//! query head hh (kv head g = hh / rep, fold r = hh % rep), every row
void attentionHead(void* user, size_t item)
{
    auto const* j = static_cast<AttentionJob const*>(user);
    DrafterLayerWeights const& w = *j->w;
    int64_t const hh = static_cast<int64_t>(item);
    int64_t const d = w.headDim, S = j->S, C = j->C;
    int64_t const rep = w.heads / w.kvHeads;
    int64_t const g = hh / rep, r = hh % rep;
    float const scale = 1.F / std::sqrt(static_cast<float>(d));
    float* sc = j->scratch + hh * (C + S);
    float const* K = j->ctxK + g * C * d;
    float const* V = j->ctxV + g * C * d;
    float const ninf = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < S; ++t)
    {
        float const* q = j->q + (t * w.heads + hh) * d;
        float const* cb = j->ctxBias + (r * S + t) * C;
        float const* bb = j->blkBias + (r * S + t) * S;
        float mx = ninf;
        for (int64_t c = 0; c < C; ++c)
        {
            if (cb[c] == ninf)
            {
                sc[c] = ninf;
                continue;
            }
            float dot = 0.F;
#pragma omp simd reduction(+ : dot)
            for (int64_t e = 0; e < d; ++e)
            {
                dot += q[e] * K[c * d + e];
            }
            sc[c] = dot * scale + cb[c];
            mx = std::max(mx, sc[c]);
        }
        for (int64_t s = 0; s < S; ++s)
        {
            float const* k = j->kb + (s * w.kvHeads + g) * d;
            float dot = 0.F;
#pragma omp simd reduction(+ : dot)
            for (int64_t e = 0; e < d; ++e)
            {
                dot += q[e] * k[e];
            }
            sc[C + s] = dot * scale + bb[s];
            mx = std::max(mx, sc[C + s]);
        }
        float sum = 0.F;
        for (int64_t c = 0; c < C + S; ++c) // exp: not vectorised by the compiler, C + S calls
        {
            sc[c] = sc[c] == ninf ? 0.F : std::exp(sc[c] - mx);
            sum += sc[c];
        }
        float* o = j->att + (t * w.heads + hh) * d;
        float ctxOut[512] = {};
        for (int64_t c = 0; c < C; ++c)
        {
            if (sc[c] == 0.F)
            {
                continue;
            }
            float const p = sc[c] / sum;
            for (int64_t e = 0; e < d; ++e)
            {
                ctxOut[e] += p * V[c * d + e];
            }
        }
        float blkOut[512] = {};
        for (int64_t s = 0; s < S; ++s)
        {
            float const p = sc[C + s] / sum;
            float const* v = j->vb + (s * w.kvHeads + g) * d;
            for (int64_t e = 0; e < d; ++e)
            {
                blkOut[e] += p * v[e];
            }
        }
        for (int64_t e = 0; e < d; ++e)
        {
            o[e] = ctxOut[e] + blkOut[e];
        }
    }
}

float activate(Activation a, float x)
{
    switch (a)
    {
    case Activation::Silu: return x / (1.F + std::exp(-x));
    case Activation::Gelu: return 0.5F * x * (1.F + std::erf(x * 0.70710678118654752F));
    case Activation::GeluTanh:
        return 0.5F * x * (1.F + std::tanh(0.79788456080286536F * (x + 0.044715F * x * x * x)));
    case Activation::Relu: return x > 0.F ? x : 0.F;
    }
    return x;
}

} // namespace

int64_t drafterLayerScratch(DrafterLayerWeights const& w, int64_t S, int64_t C)
{
    int64_t const H = w.hidden;
    int64_t const dyn = w.convGroup > 0 ? 2 * w.convTaps * (H / w.convGroup) : 0;
    return 4 * S * H + S * dyn + 2 * S * w.heads * w.headDim + 2 * S * w.kvHeads * w.headDim
        + w.heads * (C + S) + 2 * S * w.inter;
}

void drafterLayer(DrafterLayerWeights const& w, int64_t S, float const* h, float const* cos, float const* sin,
    float const* ctxK, float const* ctxV, int64_t C, float const* ctxBias, float const* blkBias, float* out,
    float* scratch, ParallelFn parallel, void* parallelCtx)
{
    int64_t const H = w.hidden;
    int64_t const nd = w.heads * w.headDim, kvd = w.kvHeads * w.headDim;
    bool const conv = w.convGroup > 0;
    float* x = scratch;
    float* a = x + S * H;
    float* h1 = a + S * H;
    float* tmp = h1 + S * H;
    float* dyn = tmp + S * H;
    float* q = dyn + (conv ? S * 2 * w.convTaps * (H / w.convGroup) : 0);
    float* att = q + S * nd;
    float* kb = att + S * nd;
    float* vb = kb + S * kvd;
    float* scores = vb + S * kvd;
    float* gate = scores + w.heads * (C + S);
    float* up = gate + S * w.inter;

    // attention half: h1 = h + post_conv(attention(pre_conv(norm(h))))
    rmsNorm(h, w.inputNorm.data(), S, H, w.eps, x);
    if (conv)
    {
        matMul(w.attnKernel, x, S, dyn, parallel, parallelCtx);
        convMix(w, w.attnBase, dyn, x, S, 0, tmp);
        std::swap(x, tmp);
    }
    matMul(w.q, x, S, q, parallel, parallelCtx);
    matMul(w.k, x, S, kb, parallel, parallelCtx);
    matMul(w.v, x, S, vb, parallel, parallelCtx);
    normRope(q, S, w.heads, w.headDim, w.qNorm.data(), w.eps, cos, sin);
    normRope(kb, S, w.kvHeads, w.headDim, w.kNorm.data(), w.eps, cos, sin);
    AttentionJob job{&w, S, C, q, kb, vb, ctxK, ctxV, ctxBias, blkBias, att, scores};
    if (parallel != nullptr)
    {
        parallel(parallelCtx, attentionHead, static_cast<size_t>(w.heads), &job);
    }
    else
    {
        for (int64_t hh = 0; hh < w.heads; ++hh)
        {
            attentionHead(&job, static_cast<size_t>(hh));
        }
    }
    matMul(w.o, att, S, a, parallel, parallelCtx);
    if (conv)
    {
        convMix(w, w.attnBase, dyn, a, S, 1, tmp);
        std::swap(a, tmp);
    }
    for (int64_t i = 0; i < S * H; ++i)
    {
        h1[i] = h[i] + a[i];
    }
    // MLP half: out = h1 + post_conv(mlp(pre_conv(norm(h1))))
    rmsNorm(h1, w.postNorm.data(), S, H, w.eps, x);
    if (conv)
    {
        matMul(w.mlpKernel, x, S, dyn, parallel, parallelCtx);
        convMix(w, w.mlpBase, dyn, x, S, 0, tmp);
        std::swap(x, tmp);
    }
    matMul(w.gate, x, S, gate, parallel, parallelCtx);
    matMul(w.up, x, S, up, parallel, parallelCtx);
    for (int64_t i = 0; i < S * w.inter; ++i)
    {
        gate[i] = activate(w.act, gate[i]) * up[i];
    }
    matMul(w.down, gate, S, a, parallel, parallelCtx);
    if (conv)
    {
        convMix(w, w.mlpBase, dyn, a, S, 1, tmp);
        std::swap(a, tmp);
    }
    for (int64_t i = 0; i < S * H; ++i)
    {
        out[i] = h1[i] + a[i];
    }
}

} // namespace dflash2
