//! \file sampling.h
//! The sampling transforms of one sequence and the log-probabilities it reports: the twin of
//! dflash2_trt/runtime/sampling.py (same steps, same names, float64 as numpy computes them).
//!
//! One fixed order (vLLM's): logit bias, penalties (repetition, then frequency, then presence, over the prompt + the
//! committed tokens; a verify row also sees the drafts before it as committed), temperature, top-k, top-p, min-p. The
//! loops (core/decoder.cpp, core/batch.cpp) decide every prefill, plain step and verify row on the transformed law
//! (nextToken, acceptDrafts), so the output is the transformed target's own at T = 0 (the argmax of the biased and
//! penalised logits) and in law at T > 0 (rejection sampling against the transformed p, fed the proposal q the drafts
//! were really drawn from). An independent draft (a proposal over the whole vocabulary) is drawn again from that
//! proposal under the transforms (redraw; the repetition penalty, which needs the raw logits' signs, left out), with
//! the drafter's own uniforms. Logprobs are the target's after the transforms: the log of the law, at temperature 1
//! for a greedy request (a token cut by top-k / top-p / min-p has -inf and is never listed among the top ones).
//!
//! A Sampler holds one sequence's counts: one per sequence, not thread safe.
//!
//! Planted bug for the tests, never set otherwise: $DFLASH2_PLANT_REDRAW_RAW_PROPOSAL=1 draws an independent draft from
//! the transformed law but leaves the untransformed proposal for the acceptance ratio (plantedRedrawRawProposal).
#pragma once

#include "decoder.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace dflash2
{

//! sampling.truncate: p [m, V] probabilities in place -> the rows after top-k, top-p and min-p, renormalised. Ties at
//! the top-k boundary are kept; top-p keeps the tokens (by descending probability, index order among ties) whose mass
//! before them is < topP, so the most likely token always stays.
void truncate(double* p, size_t m, size_t V, int32_t topK, double topP, double minP);

//! sampling.Sampler: one sequence's transforms, what the penalties count and the logprobs of its committed tokens.
class Sampler
{
public:
    Sampler(SamplingConfig cfg, std::vector<int32_t> const& prompt, int32_t vocabSize, double temperature);

    //! Sampler.logits: rows [m, V] of the target -> [m, V] float64 after the logit bias and the penalties; row i sees
    //! the committed tokens and drafts[:i] (may be nullptr when m == 1). Kept for commit's logprobs.
    double const* logits(float const* rows, int32_t m, int32_t const* drafts);
    //! Sampler.law: transformed logits [m, V] -> the law out [m, V]: softmax at `temperature`, then top-k, top-p, min-p
    void law(double const* logits, int32_t m, double temperature, double* out) const;
    //! Sampler.redraw: an independent draft's first nRows rows drawn again, with the drafter's uniforms [L], from its
    //! vocabulary proposal under the transforms; the draft then carries the law it was drawn from. Any other draft
    //! (a selector's path, a lookup's, a greedy one) stays as it is.
    void redraw(Draft& draft, float const* uniforms, int32_t nRows) const;
    //! Sampler.commit: the rows of the last decision emitted these tokens (row j -> token j): the penalties count them,
    //! their logprobs join logprobs() when asked for
    void commit(int32_t const* tokens, size_t n);

    std::vector<TokenLogprob> const& logprobs() const
    {
        return mLogprobs;
    }
    SamplingConfig const& config() const
    {
        return mCfg;
    }

private:
    void penalise(double* row, std::vector<int64_t> const& counts) const;
    double temperatureOrOne() const
    {
        return mTemperature > 0 ? mTemperature : 1.0;
    }

    SamplingConfig mCfg;
    size_t mV;
    double mTemperature;
    std::vector<double> mBias;      //!< [V] (empty: no bias)
    std::vector<int64_t> mCounts;   //!< [V] prompt + committed tokens (empty: no penalty)
    std::vector<double> mRows;      //!< [m, V] the transformed logits of the last decision
    int32_t mRowCount{0};
    std::vector<TokenLogprob> mLogprobs;
};

//! $DFLASH2_PLANT_REDRAW_RAW_PROPOSAL=1
bool plantedRedrawRawProposal();

//! The request's Sampler, none when its transforms are the identity and it asks for no logprobs (the loops' numbers
//! then unchanged to the bit).
std::optional<Sampler> samplerOf(GenerateConfig const& cfg, std::vector<int32_t> const& prompt, int32_t vocabSize);

} // namespace dflash2
