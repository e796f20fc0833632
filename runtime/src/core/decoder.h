//! \file decoder.h
//! The DFlash 2 decoding loop in plain C++ (no CUDA, TensorRT or ONNX Runtime): prefill, then cycles of
//! draft -> verify -> accept -> commit (drafts from the DFlash 2 drafter or from prompt lookup, core/ngram.h), with
//! rejection sampling on given uniforms, commit/crop bookkeeping,
//! partial final blocks, EOS / length stops, τ and per-position statistics, and the oracle top-K count.
//!
//! It is a line-by-line twin of dflash2_trt/runtime/decoder.py (and the acceptance rules of
//! dflash2_trt/acceptance.py): the same steps in the same order, the same uniforms drawn in the same order,
//! the same tie rules (lowest index), float64 probabilities with numpy's pairwise summation. Token-level
//! equality is tested against vectors the Python reference writes (tests/test_capi.py -> coreVectors ctest).
//!
//! Backends implement Runners (one request's target + drafter state); errors are thrown as dflash2::Error
//! and turned into dfl2_status objects at the C boundary (capi.cpp).
#pragma once

#include "dflash2/dflash2.h"
#include "guard.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dflash2
{

//! The one error type inside the library; code is the dfl2_code reported to C callers.
class Error : public std::runtime_error
{
public:
    Error(dfl2_code code, std::string const& message)
        : std::runtime_error(message)
        , mCode(code)
    {
    }
    dfl2_code code() const noexcept
    {
        return mCode;
    }

private:
    dfl2_code mCode;
};

//! The code and message of the exception being handled (call inside a catch block): Error -> its code,
//! bad_alloc -> DFL2_ERR_OUT_OF_MEMORY, anything else -> DFL2_ERR_INTERNAL.
std::pair<dfl2_code, std::string> errorOfCurrentException();

//! One drafted block of L = bs - 1 rows.
struct Draft
{
    std::vector<int32_t> tokens;       //!< [L] chosen drafts
    std::vector<float> proposal;       //!< [L, K] proposal q over the row's candidates (one-hot at T <= 0)
    std::vector<int32_t> cand;         //!< [L, K] top-K candidates of each row
    std::vector<float> vocabProposal;  //!< [L, V] proposal over the vocabulary, when hasVocabProposal
    bool hasVocabProposal{false};
};

//! A target's non-croppable state of one sequence at one length (linear layers' convolution and recurrent states,
//! sliding-window rings: prefix_cache.SlotState), a backend's own copy; immutable once taken.
class TargetSnapshot
{
public:
    virtual ~TargetSnapshot() = default;
    virtual size_t nbytes() const = 0;
};

//! A backend's copy of one sequence's first n positions (prefix_cache.Entry's rows): the target's attention K/V rows,
//! the drafter's context rows (m <= n positions) and the queued features of positions m.. past them; immutable once
//! taken. What a multi-entry prefix cache (core/prefixCache.h, SharedPrefixCache) keeps.
class PrefixCopy
{
public:
    virtual ~PrefixCopy() = default;
    virtual int32_t length() const = 0;         //!< n: the target positions held
    virtual int32_t drafterLength() const = 0;  //!< drafter context a restore can rebuild (its rows + the features)
    virtual size_t nbytes() const = 0;
};

//! A PrefixCopy on the host (the ONNX Runtime and TensorRT backends' copies): the target's K/V rows
//! [count][heads, n, dim], the drafter's context rows [count][heads, m, dim] and the queued features [k, F] of
//! positions m..m+k-1.
struct HostPrefixCopy : PrefixCopy
{
    int32_t n{0};
    int32_t m{0};
    int32_t k{0};
    std::vector<std::vector<char>> target;
    std::vector<std::vector<char>> drafter;
    std::vector<char> features;

    int32_t length() const override
    {
        return n;
    }
    int32_t drafterLength() const override
    {
        return m + k;
    }
    size_t nbytes() const override
    {
        size_t b = features.size();
        for (auto const* rows : {&target, &drafter})
        {
            for (auto const& r : *rows)
            {
                b += r.size();
            }
        }
        return b;
    }
};

//! The sizes every runner interface answers (Runners here, BatchRunners in batch.h): written once, implemented once
//! by model.h's SizedRunners.
class RunnerShape
{
public:
    virtual ~RunnerShape() = default;
    virtual int32_t vocabSize() const = 0;
    virtual int32_t blockSize() const = 0;
    virtual int32_t topK() const = 0;
    virtual int32_t maxPositions() const = 0;
};

//! The backend interface: one request's target and drafter (runtime/protocol.py's TargetRunner + DraftRunner).
//! Context features never leave the backend: drafterQueueContext queues the first `rows` rows of the features that
//! the latest targetForward produced and drafterAddContext hands the queue to the drafter in one call (rows of
//! several forwards join together after prompt-lookup cycles and plain steps), so a backend keeps them where they are
//! made.
class Runners : public RunnerShape
{
public:

    virtual void targetReset() = 0;
    //! ids [n] at positions cacheLength.. -> logits [n, V] (resized by the callee)
    virtual void targetForward(int32_t const* ids, int32_t n, std::vector<float>& logits) = 0;
    //! targetForward -> the last row's logits [1, V] alone (a prefill's first token; the features of all n rows
    //! kept as targetForward's). A backend whose graph takes the rows to compute overrides it; this one keeps the last.
    virtual void targetForwardLast(int32_t const* ids, int32_t n, std::vector<float>& logits)
    {
        targetForward(ids, n, logits);
        size_t const V = logits.size() / static_cast<size_t>(n);
        std::copy(logits.end() - static_cast<std::ptrdiff_t>(V), logits.end(), logits.begin());
        logits.resize(V);
    }
    virtual void targetCrop(int32_t length) = 0;
    virtual void drafterReset() = 0;
    //! the first `rows` rows of the latest targetForward's features [rows, F] join the pending context
    virtual void drafterQueueContext(int32_t rows) = 0;
    //! the pending context (positions start..) joins the drafter in one call; pending emptied
    virtual void drafterAddContext(int32_t start) = 0;
    //! the first `rows` (<= L) rows will be verified (the path is chosen over them alone); uniforms [L] or nullptr
    //! at T <= 0; fills out (tokens [L], proposal/cand [L, K], maybe vocab [L, V])
    virtual void drafterPropose(
        int32_t anchor, int32_t pos, int32_t rows, float temperature, float const* uniforms, Draft& out)
        = 0;

    // ---- prefix reuse (core/prefixCache.h; the runner side of prefix_cache.py) --------------------------------
    //! Whether prefixes may be kept between requests (the members below implemented); false: every request starts
    //! from empty caches (targetReset / drafterReset).
    virtual bool keepsPrefix() const
    {
        return false;
    }
    //! positions the target cache holds
    virtual int32_t targetLength() const
    {
        return 0;
    }
    //! a copy of the target's non-croppable state at targetLength() (nullptr: an attention-only target)
    virtual std::shared_ptr<TargetSnapshot const> targetSnapshot()
    {
        return nullptr;
    }
    //! the target keeps positions < length (<= targetLength()): attention K/V cropped, the non-croppable state put
    //! back from `state` (taken at `length`; nullptr for an attention-only target); nothing left to roll back into
    virtual void targetRestore(int32_t length, TargetSnapshot const* state)
    {
        (void) length;
        (void) state;
        throw Error(DFL2_ERR_INTERNAL, "this backend keeps no prefix");
    }
    //! positions of drafter context drafterRestore can rebuild: its context and the queued features past it
    virtual int32_t drafterLength() const
    {
        return 0;
    }
    //! the drafter's context holds positions < length (<= drafterLength()): cropped, or the queued features of the
    //! positions it lacks added in one pass; nothing queued afterwards
    virtual void drafterRestore(int32_t length)
    {
        (void) length;
        throw Error(DFL2_ERR_INTERNAL, "this backend keeps no prefix");
    }
    //! a copy of the first n positions (n <= targetLength()): target K/V rows; with `drafter`, the drafter's context
    //! and its queued features (an entry of core/prefixCache.h's SharedPrefixCache)
    virtual std::shared_ptr<PrefixCopy const> prefixCopy(int32_t n, bool drafter) const
    {
        (void) n;
        (void) drafter;
        throw Error(DFL2_ERR_INTERNAL, "this backend keeps no prefix");
    }
    //! the caches (just reset) hold `rows`' positions < length: K/V rows copied back, the non-croppable state from
    //! `state` (taken at `length`; nullptr for an attention-only target); with `drafter`, the drafter's context
    //! holds positions < length (<= rows.drafterLength()) with nothing queued
    virtual void prefixRestore(PrefixCopy const& rows, int32_t length, TargetSnapshot const* state, bool drafter)
    {
        (void) rows;
        (void) length;
        (void) state;
        (void) drafter;
        throw Error(DFL2_ERR_INTERNAL, "this backend keeps no prefix");
    }
};

//! Where uniforms come from (the order of requests is the Python runtime's rng order).
class UniformSource
{
public:
    virtual ~UniformSource() = default;
    virtual void draw(dfl2_uniform_use use, double* out, size_t n) = 0;
};

//! The built-in generator: splitmix64, (x >> 11) * 2^-53 for float64 and (x >> 40) * 2^-24 for float32
//! draws — the same stream on every platform (not numpy's).
class SplitMixUniforms : public UniformSource
{
public:
    explicit SplitMixUniforms(uint64_t seed)
        : mState(seed)
    {
    }
    void draw(dfl2_uniform_use use, double* out, size_t n) override;

private:
    uint64_t mState;
};

//! Who proposes a cycle's drafts (dfl2_proposer's values for the two proposers; kAUTO is a mode only, kNONE a plain
//! step). core/ngram.h: prompt lookup and the per-request choice.
enum class Proposer : int32_t
{
    kNONE = -1,
    kDFLASH2 = DFL2_PROPOSER_DFLASH2,
    kNGRAM = DFL2_PROPOSER_NGRAM,
    kAUTO = 2
};

// the sampling transforms' settings and a token's logprobs (core/sampling.h applies and makes them)
//! request.GenerationRequest's sampling and logprobs fields (their neutral values change nothing).
struct SamplingConfig
{
    std::vector<std::pair<int32_t, double>> logitBias;  //!< (token id, added logit); the last of a token's wins
    double repetitionPenalty{1.0};                       //!< > 0: a seen token's logit / it when > 0, x it otherwise
    double presencePenalty{0.0};                         //!< subtracted from every seen token's logit
    double frequencyPenalty{0.0};                        //!< subtracted once per occurrence of a seen token
    int32_t topK{0};                                     //!< 0: all tokens
    double topP{1.0};
    double minP{0.0};
    bool logprobs{false};     //!< each generated token's log-probability
    int32_t topLogprobs{0};   //!< [0, 20] the most likely tokens of each row with theirs

    //! no transform: the target's logits as they are
    bool identity() const
    {
        return logitBias.empty() && !penalised() && !truncated();
    }
    bool penalised() const
    {
        return repetitionPenalty != 1.0 || presencePenalty != 0.0 || frequencyPenalty != 0.0;
    }
    bool truncated() const
    {
        return topK > 0 || topP < 1.0 || minP > 0.0;
    }
};

//! sampling.TokenLogprob: one emitted token's log-probability and its row's most likely tokens (most likely first).
struct TokenLogprob
{
    int32_t token{0};
    double logprob{0.0};
    std::vector<int32_t> topIds;
    std::vector<double> topLogprobs;
};

struct GenerateConfig
{
    int64_t maxNewTokens{64};
    double temperature{0.0};
    bool speculative{true};
    bool measureOracle{false};
    std::vector<int32_t> eosIds;
    Proposer proposer{Proposer::kAUTO};  //!< dflash2 | ngram | auto (request.GenerationRequest.proposer)
    int32_t ngramRows{0};                //!< most lookup drafts per cycle; 0: defaultLookupRows(L)
    //! the acceptance guard (core/guard.h; decoder.DecodeHooks.guard): plain target steps while the
    //! drafter's measured acceptance does not pay for its cycles; none: every step a cycle where a proposer has drafts
    std::optional<GuardConfig> guard;
    SamplingConfig sampling;  //!< the sampling transforms and logprobs (core/sampling.h)
};

struct Result
{
    std::vector<int32_t> tokens;          //!< generated (EOS included when hit)
    std::vector<int32_t> accepted;        //!< per cycle: accepted drafts
    std::vector<int32_t> proposed;        //!< per cycle: drafts verified
    std::vector<int32_t> oracleAccepted;  //!< per cycle: oracle top-K count (when measured)
    double elapsedS{0.0};                 //!< wall time excluding oracle passes
    int32_t plainSteps{0};                //!< plain target steps (each commits one token)
    std::vector<int32_t> proposers;       //!< per cycle: who proposed (dfl2_proposer)
    int32_t guardSwitches{0};             //!< the guard's speculative -> plain switches
    int32_t guardProbes{0};               //!< the guard's plain -> speculative probes
    int32_t cachedTokens{0};              //!< prompt positions restored from the session's prefix (not computed)
    std::vector<TokenLogprob> logprobs;   //!< per generated token, when sampling.logprobs
    dfl2_finish_reason finish{DFL2_FINISH_NONE};
};

struct Stats
{
    double tau{0.0};
    int32_t cycles{0};
    std::vector<double> cumulative;   //!< r_i, i = 1..Lmax
    std::vector<double> conditional;  //!< c_i = r_i / r_{i-1}
    double oracleTau{-1.0};           //!< < 0: not measured
};

//! Streamed chunk of committed tokens; return false to cancel.
using TokenSink = std::function<bool(int32_t const* tokens, size_t n)>;

// ---- the steps (acceptance.py twins), exposed for the vector tests -------------------------------------

//! numpy's pairwise summation of float64 (np.sum / add.reduce over a contiguous row).
double pairwiseSum(double const* a, size_t n);
//! the same over float32, adding in float32 (np.sum of a float32 row)
float pairwiseSum(float const* a, size_t n);
//! softmax(logits / T) in float64: out [V]
void softmaxT(float const* logits, size_t V, double temperature, double* out);
//! the same over float64 logits (a transformed row, core/sampling.h)
void softmaxT(double const* logits, size_t V, double temperature, double* out);
//! numpy Generator.choice(n, p=p) with its one uniform u: cdf = cumsum(p) / cdf[-1], searchsorted right
int32_t choiceIndex(double const* p, size_t n, double u);
//! argmax with the lowest index among ties
int32_t argmaxRow(float const* row, size_t n);
int32_t argmaxRow(double const* row, size_t n);
//! protocol.independent_draft: the drafts of a head without a selector from its rows' logits [L, V]. T <= 0: each
//! row's argmax (lowest index among ties), a one-hot proposal over its candidates. T > 0: each row samples
//! softmax(logits / T), computed in float32 as numpy does (the same divisions, numpy's pairwise sum, a sequential
//! cumsum), by inverse CDF with its uniform (uniforms [L]); the proposal is that softmax (vocabProposal [L, V]) and
//! its values at the candidates. cand [L, K]: each row's top K by value descending, then index ascending (numpy's
//! argpartition may take another of several values tied at the K-th place). One difference from numpy stays: exp
//! is the C library's expf, numpy's float32 exp its own SIMD routine (within a few ulp of it), so q may differ in
//! its last bits and a uniform within that distance of a cumsum step pick the neighbouring token.
void independentDraft(
    float const* logits, int32_t L, int32_t V, float temperature, float const* uniforms, int32_t topK, Draft& out);
//! Greedy verification: drafts [n], logits [n + 1, V] -> (accepted, bonus)
std::pair<int32_t, int32_t> acceptGreedy(int32_t const* drafts, int32_t n, float const* logits, size_t V);
//! Rejection sampling: drafts [n], q [n, V], p [n + 1, V] (float64) -> (accepted, bonus)
std::pair<int32_t, int32_t> acceptRejection(
    int32_t const* drafts, int32_t n, double const* q, double const* p, size_t V, UniformSource& uniforms);
//! docs/design.md metrics from per-cycle counts (acceptance.acceptance_stats)
Stats acceptanceStats(std::vector<int32_t> const& accepted, std::vector<int32_t> const& proposed);
Stats resultStats(Result const& r);

// ---- pieces of a cycle (shared by the loops here and the batched loop, core/batch.cpp) ----------------

bool isEos(GenerateConfig const& cfg, int32_t token);
class Sampler;  // core/sampling.h

//! accept.next_token: argmax at T <= 0, else a sample of softmax(logits / T) (one ACCEPT uniform); with `sampler`
//! (nullptr: none), of the transformed logits / law
int32_t nextToken(float const* logits, size_t V, double temperature, UniformSource& uniforms, Sampler* sampler = nullptr);
//! the drafter's L uniforms of a sampling cycle (one DRAFT request), in float32 as the Python runtime hands them
void drawDraftUniforms(UniformSource& uniforms, std::vector<double>& u64, std::vector<float>& u32);
//! the drafter's tokens and candidates of the first nRows rows are ids in [0, V) (else DFL2_ERR_OUT_OF_RANGE)
void checkDraft(Draft const& draft, int32_t nRows, int32_t K, int32_t V);
//! accept: drafts [n] against the verify logits [n + 1, V] -> (accepted, bonus): greedy matching at T <= 0,
//! rejection sampling at T > 0 (the proposal scattered into the vocabulary); accept.accept_drafts
//! With `sampler` the target side is the transformed law, row i seeing the drafts before it; the proposal stays the
//! one the drafts were drawn from.
std::pair<int32_t, int32_t> acceptDrafts(Draft const& draft, std::vector<int32_t> const& drafts,
    float const* logits, int32_t V, int32_t K, double temperature, UniformSource& uniforms, Sampler* sampler = nullptr);
//! commit: drafts[:accepted] + [bonus], cut after the first EOS
std::vector<int32_t> committedTokens(
    std::vector<int32_t> const& drafts, int32_t accepted, int32_t bonus, GenerateConfig const& cfg);
//! cancelled, else EOS when the last token is one, else LENGTH
dfl2_finish_reason finishReason(Result const& r, GenerateConfig const& cfg, bool cancelled);

// ---- the loops ----------------------------------------------------------------------------------------

class PrefixCache;  // core/prefixCache.h

//! Rejects an empty prompt, out-of-range ids, a prompt that does not fit, max_new_tokens < 1.
void checkPrompt(std::vector<int32_t> const& prompt, int32_t vocabSize, int32_t maxPositions, int64_t maxNewTokens);
void checkPrompt(std::vector<int32_t> const& prompt, Runners const& runners, int64_t maxNewTokens);
//! Plain autoregressive decoding (decoder.target_generate). cache: the prefix the prompt starts from and the finished
//! sequence is kept as (nullptr: empty caches, nothing kept).
Result targetGenerate(
    Runners& runners, std::vector<int32_t> const& prompt, GenerateConfig const& cfg, UniformSource& uniforms,
    TokenSink const& sink, PrefixCache* cache = nullptr);
//! Speculative decoding of one prompt (decoder.speculative_generate); cache as for targetGenerate.
Result speculativeGenerate(
    Runners& runners, std::vector<int32_t> const& prompt, GenerateConfig const& cfg, UniformSource& uniforms,
    TokenSink const& sink, PrefixCache* cache = nullptr);

} // namespace dflash2
