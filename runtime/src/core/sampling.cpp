//! \file sampling.cpp
//! The sampling transforms; see sampling.h. Each function names its Python twin.
#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>

namespace dflash2
{

// sampling.truncate
void truncate(double* p, size_t m, size_t V, int32_t topK, double topP, double minP)
{
    std::vector<char> keep(V);
    std::vector<double> q(V);
    std::vector<double> sorted(V);
    std::vector<int32_t> order(V);
    for (size_t r = 0; r < m; ++r)
    {
        double* row = p + r * V;
        std::fill(keep.begin(), keep.end(), 1);
        if (topK > 0 && static_cast<size_t>(topK) < V)
        {
            std::copy(row, row + V, sorted.begin());
            std::nth_element(sorted.begin(), sorted.begin() + (topK - 1), sorted.end(), std::greater<double>());
            double const kth = sorted[static_cast<size_t>(topK - 1)];
            for (size_t v = 0; v < V; ++v)
            {
                keep[v] = keep[v] && row[v] >= kth;
            }
        }
        if (topP < 1.0)
        {
            for (size_t v = 0; v < V; ++v)
            {
                q[v] = keep[v] ? row[v] : 0.0;
            }
            double const s = pairwiseSum(q.data(), V);
            for (size_t v = 0; v < V; ++v)
            {
                q[v] /= s;
            }
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&q](int32_t a, int32_t b) { return q[a] > q[b]; });
            double cum = 0.0;
            for (size_t i = 0; i < V; ++i)
            {
                double const sq = q[static_cast<size_t>(order[i])];
                cum += sq;
                double const before = cum - sq;
                keep[static_cast<size_t>(order[i])] = keep[static_cast<size_t>(order[i])] && before < topP;
            }
        }
        if (minP > 0.0)
        {
            double top = 0.0;
            for (size_t v = 0; v < V; ++v)
            {
                top = std::max(top, keep[v] ? row[v] : 0.0);
            }
            double const floor = minP * top;
            for (size_t v = 0; v < V; ++v)
            {
                keep[v] = keep[v] && row[v] >= floor;
            }
        }
        for (size_t v = 0; v < V; ++v)
        {
            row[v] = keep[v] ? row[v] : 0.0;
        }
        double const s = pairwiseSum(row, V);
        for (size_t v = 0; v < V; ++v)
        {
            row[v] /= s;
        }
    }
}

Sampler::Sampler(SamplingConfig cfg, std::vector<int32_t> const& prompt, int32_t vocabSize, double temperature)
    : mCfg(std::move(cfg))
    , mV(static_cast<size_t>(vocabSize))
    , mTemperature(temperature)
{
    if (!mCfg.logitBias.empty())
    {
        mBias.assign(mV, 0.0);
        for (auto const& [t, b] : mCfg.logitBias)
        {
            if (t < 0 || static_cast<size_t>(t) >= mV)
            {
                throw Error(DFL2_ERR_OUT_OF_RANGE, "logit_bias token id " + std::to_string(t) + " out of range [0, "
                    + std::to_string(mV) + ")");
            }
            mBias[static_cast<size_t>(t)] = b;
        }
    }
    if (mCfg.penalised())
    {
        mCounts.assign(mV, 0);
        for (int32_t t : prompt)
        {
            ++mCounts[static_cast<size_t>(t)];
        }
    }
}

// Sampler._penalise: repetition, frequency, presence over the tokens `counts` has seen
void Sampler::penalise(double* row, std::vector<int64_t> const& counts) const
{
    for (size_t v = 0; v < mV; ++v)
    {
        if (counts[v] == 0)
        {
            continue;
        }
        if (mCfg.repetitionPenalty != 1.0)
        {
            row[v] = row[v] > 0 ? row[v] / mCfg.repetitionPenalty : row[v] * mCfg.repetitionPenalty;
        }
        row[v] -= mCfg.frequencyPenalty * static_cast<double>(counts[v]) + mCfg.presencePenalty;
    }
}

// Sampler.logits
double const* Sampler::logits(float const* rows, int32_t m, int32_t const* drafts)
{
    mRows.resize(static_cast<size_t>(m) * mV);
    for (size_t i = 0; i < mRows.size(); ++i)
    {
        mRows[i] = static_cast<double>(rows[i]);
    }
    mRowCount = m;
    if (!mBias.empty())
    {
        for (int32_t i = 0; i < m; ++i)
        {
            double* row = mRows.data() + static_cast<size_t>(i) * mV;
            for (size_t v = 0; v < mV; ++v)
            {
                row[v] += mBias[v];
            }
        }
    }
    if (!mCounts.empty())
    {
        std::vector<int64_t> c = mCounts;
        for (int32_t i = 0; i < m; ++i)
        {
            if (i > 0)
            {
                ++c[static_cast<size_t>(drafts[i - 1])];
            }
            penalise(mRows.data() + static_cast<size_t>(i) * mV, c);
        }
    }
    return mRows.data();
}

// Sampler.law
void Sampler::law(double const* logits, int32_t m, double temperature, double* out) const
{
    for (int32_t i = 0; i < m; ++i)
    {
        softmaxT(logits + static_cast<size_t>(i) * mV, mV, temperature, out + static_cast<size_t>(i) * mV);
    }
    if (mCfg.truncated())
    {
        truncate(out, static_cast<size_t>(m), mV, mCfg.topK, mCfg.topP, mCfg.minP);
    }
}

bool plantedRedrawRawProposal()
{
    char const* v = std::getenv("DFLASH2_PLANT_REDRAW_RAW_PROPOSAL");
    return v != nullptr && std::strcmp(v, "1") == 0;
}

// Sampler.redraw
void Sampler::redraw(Draft& draft, float const* uniforms, int32_t nRows) const
{
    bool const planted = plantedRedrawRawProposal();
    if (!draft.hasVocabProposal || uniforms == nullptr || mCfg.identity() || nRows <= 0)
    {
        return;
    }
    std::vector<double> factor;  // exp((shift - max shift) / T) [V]: presence / frequency and bias shift the logits
    if (!mBias.empty() || !mCounts.empty())
    {
        std::vector<double> shift = mBias.empty() ? std::vector<double>(mV, 0.0) : mBias;
        if (!mCounts.empty())
        {
            for (size_t v = 0; v < mV; ++v)
            {
                shift[v] -= mCfg.frequencyPenalty * static_cast<double>(mCounts[v])
                    + mCfg.presencePenalty * (mCounts[v] > 0 ? 1.0 : 0.0);
            }
        }
        double const top = *std::max_element(shift.begin(), shift.end());
        factor.resize(mV);
        for (size_t v = 0; v < mV; ++v)
        {
            factor[v] = std::exp((shift[v] - top) / temperatureOrOne());
        }
    }
    std::vector<double> w(static_cast<size_t>(nRows) * mV);
    for (int32_t r = 0; r < nRows; ++r)
    {
        double* row = w.data() + static_cast<size_t>(r) * mV;
        float const* q = draft.vocabProposal.data() + static_cast<size_t>(r) * mV;
        for (size_t v = 0; v < mV; ++v)
        {
            row[v] = static_cast<double>(q[v]) * (factor.empty() ? 1.0 : factor[v]);
        }
        double const s = pairwiseSum(row, mV);
        for (size_t v = 0; v < mV; ++v)
        {
            row[v] /= s;
        }
    }
    if (mCfg.truncated())
    {
        truncate(w.data(), static_cast<size_t>(nRows), mV, mCfg.topK, mCfg.topP, mCfg.minP);
    }
    size_t const K = draft.cand.size() / (draft.tokens.empty() ? 1 : draft.tokens.size());
    for (int32_t r = 0; r < nRows; ++r)
    {
        double const* row = w.data() + static_cast<size_t>(r) * mV;
        double const u = static_cast<double>(uniforms[r]);
        double cdf = 0.0;
        int32_t below = 0;
        float* vq = draft.vocabProposal.data() + static_cast<size_t>(r) * mV;
        for (size_t v = 0; v < mV; ++v)
        {
            cdf += row[v];
            below += cdf <= u ? 1 : 0;
            vq[v] = planted ? vq[v] : static_cast<float>(row[v]);  // (planted: the raw q kept for the acceptance)
        }
        draft.tokens[static_cast<size_t>(r)] = std::min(below, static_cast<int32_t>(mV) - 1);
        for (size_t k = 0; k < K; ++k)
        {
            size_t const i = static_cast<size_t>(r) * K + k;
            draft.proposal[i] = vq[draft.cand[i]];
        }
    }
}

// Sampler.commit (+ token_logprobs)
void Sampler::commit(int32_t const* tokens, size_t n)
{
    if (mCfg.logprobs && n > 0)
    {
        if (static_cast<size_t>(mRowCount) < n)
        {
            throw Error(DFL2_ERR_INTERNAL, "sampler commit of more tokens than the last decision's rows");
        }
        std::vector<double> lp(n * mV);
        law(mRows.data(), static_cast<int32_t>(n), temperatureOrOne(), lp.data());
        std::vector<int32_t> order(mV);
        for (size_t j = 0; j < n; ++j)
        {
            double* row = lp.data() + j * mV;
            for (size_t v = 0; v < mV; ++v)
            {
                row[v] = std::log(row[v]);  // -inf where a transform cut the token
            }
            TokenLogprob t;
            t.token = tokens[j];
            t.logprob = row[static_cast<size_t>(tokens[j])];
            if (mCfg.topLogprobs > 0)
            {
                size_t const k = std::min(static_cast<size_t>(mCfg.topLogprobs), mV);
                std::iota(order.begin(), order.end(), 0);
                std::stable_sort(order.begin(), order.end(), [row](int32_t a, int32_t b) { return row[a] > row[b]; });
                for (size_t i = 0; i < k; ++i)
                {
                    double const x = row[static_cast<size_t>(order[i])];
                    if (std::isfinite(x))
                    {
                        t.topIds.push_back(order[i]);
                        t.topLogprobs.push_back(x);
                    }
                }
            }
            mLogprobs.push_back(std::move(t));
        }
    }
    if (!mCounts.empty())
    {
        for (size_t j = 0; j < n; ++j)
        {
            ++mCounts[static_cast<size_t>(tokens[j])];
        }
    }
    mRowCount = 0;
}

} // namespace dflash2
