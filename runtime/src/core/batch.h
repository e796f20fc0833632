//! \file batch.h
//! Continuous batching in plain C++: the twin of dflash2_trt/runtime/batch.py's BatchDecoder and
//! SpeculationRule (the Python reference defines the behaviour; tests/test_capi.py runs both on the same
//! callbacks and compares them request by request).
//!
//! Requests join and leave between steps: submit() queues one, each step() first admits queued requests into
//! free slots (slots given shortest prompt first), then runs one prefill step (below), then one step for every
//! active sequence whose prompt is whole, then retires the finished ones (their own EOS set, max tokens, the
//! capacity, a cancel), freeing their slots.
//!
//! Prefix reuse (batch._admit / _finish with a cache): a request admitted to a slot first restores the longest usable
//! prefix of its prompt from the batch's SharedPrefixCache (target K/V, the snapshot at or below the match, the
//! drafter's context), then prefills the rest; the state after its prefill is snapshotted, and a finished request's
//! sequence (its prompt + tokens the target holds) joins the cache before its slot is freed. Result::cachedTokens
//! counts the positions restored.
//!
//! Chunked prefill (batch._prefill): the prompts still prefilling, in admission order, compute their next rows in ONE
//! target forward per step — at most `prefillChunk` rows over all of them while other sequences decode (a long prompt
//! joining running streams delays their next token by one chunk's time, not by the whole prompt's); with nobody
//! decoding, or prefillChunk 0, whole prompts. A prompt whose last row is computed draws its first token (start);
//! the chunks' features wait in the slot's pending context until its drafter first proposes.
//!
//! One step, flat (the names of batch.py):
//!   choose  which sequences draft this step and who proposes for each (SpeculationRule, below)
//!   draft   per drafting sequence, by its proposer: the drafter (its pending context features join its slot's
//!           drafter, the drafter proposes) or prompt lookup (core/ngram.h: the context's own continuation, no model;
//!           the features of its verified rows wait with the plain steps' until the drafter runs again, then join its
//!           context in one pass)
//!   target  ONE target forward for every sequence (ragged rows, each slot its own cache length): a plain
//!           sequence's anchor (one row), a drafting sequence's [anchor, drafts] (its verify)
//!   accept  per sequence its own accepted length (ragged acceptance): greedy matching at T = 0, rejection
//!           sampling at T > 0 (a lookup's deterministic drafts: a one-hot proposal); plain sequences draw the target's
//!           own next token
//!
//! Proposers: each request names its own (GenerateConfig::proposer: dflash2 | ngram | auto, default auto); one
//! ProposerChoice per sequence makes the choice as batch.py does, the rule below in the acceptance guard's place: the
//! choice names the sequence's preferred proposal; when the rule leaves a preferred drafter proposal out, a lookup of
//! the same sequence may still verify. Result::proposers records each cycle's proposer.
//!   commit  crop each verified slot to its accepted length; committed positions' features become draft context
//!
//! Randomness: each request has its own UniformSource, asked in the order of speculativeGenerate (first token; a
//! plain step: one ACCEPT draw; a drafter cycle: the drafter's DRAFT uniforms, then the rejection test; a lookup
//! cycle: the rejection test): greedy, a sequence's tokens are its own B = 1 output whatever the batch; at T > 0
//! they depend on the others only through the rule's choice of plain step or cycle.
//!
//! The load-adaptive rule (SpeculationRule::choose). Per step, with n active sequences and the speculative ones
//! sorted by their estimated tokens per cycle τ̂_1 >= τ̂_2 >= ..., draft for the k that maximise
//!     tokens(k) / time(k),  tokens(k) = (n - k) + Σ_{i<=k} τ̂_i,
//!                           time(k)   = t_plain(n) + k · (t_draft + max(t_verify, 0))
//! with t_plain(m) the time of a step's target forward over m sequences none of which drafts, t_draft one drafter
//! proposal (context update included, except a prompt's) and t_verify what one drafting sequence adds to the
//! step's forward ((forward time - t_plain(n)) / k over drafting steps): measured in this run in wall time
//! (batch.COST_CLOCK; MeasuredCosts: running means, then
//! exponential over 16; t_plain linear between measured sizes, flat beyond them) or given (FixedCosts). τ̂ of a
//! sequence = (prior_tau · prior_weight + Σ committed over its last `window` cycles) / (prior_weight + cycles)
//! + z · max(s, min_spread) / √cycles (s: the cycles' standard deviation, 0 for one cycle), for a final partial block of r < L rows
//! only its share of the gain: 1 + (τ̂ - 1) · r / L; τ̂ is kept per proposer, a lookup's at most its drafts + 1.
//! With lookups among the proposals (t_draft 0 for them: time(k) = t_plain(n) + Σ (t_draft(c) + max(t_verify, 0)))
//! the order is by (τ̂_c - 1) / (t_draft(c) + max(t_verify, 0)) instead; then, with those k fixed, the lookups of the
//! sequences whose drafter proposal was left out are weighed the same way.
//! Until the costs are measured the rule explores: plain first, then a step where the candidate of the best τ̂
//! drafts (one: at high load a step where all draft costs more than it teaches). A candidate kept plain for
//! probe_after steps in a row forgets its cycles (τ̂ back to the prior).
//!
//! Not here: batch.py's cost plan from its ORT runner (OrtBatchedTargetRunner.cost_units replaces the measured
//! t_verify when the costs are measured); a callbacks engine has no such plan, so this rule is batch.py's over a
//! runner without cost_units (the twin test's fixed costs and the rule vectors take that path on both sides).
//!
//! Errors: the Python loop raises out of step(); here a failure is the request's own (this is the one place the
//! twins differ, on purpose: a server must not lose every request to one engine error). A failing per-sequence
//! call (its slot's reset, its draft, its acceptance, its uniform source) ends that request with
//! DFL2_FINISH_ERROR and its message; a failing target forward ends every request in that forward. The others
//! go on.
//!
//! Not thread safe: one thread at a time calls submit / cancel / step (capi.cpp's dfl2_batch adds the locking).
#pragma once

#include "decoder.h"
#include "ngram.h"

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dflash2
{

class SharedPrefixCache;  // core/prefixCache.h

//! One sequence's rows in a batched target call.
struct SlotRows
{
    int32_t slot;
    int32_t cacheLength;          //!< the slot's cached positions: the rows land at cacheLength..cacheLength+n-1
    std::vector<int32_t> ids;     //!< [n] n >= 1
};

//! The batched backend: `slots` sequences' target caches (ragged: each slot its own length) and one B = 1
//! drafter per slot. Context features stay in the backend: targetForward keeps each slot's latest features, and
//! drafterQueueContext / drafterAddContext move rows of them into the slot's drafter.
class BatchRunners : public RunnerShape
{
public:
    virtual int32_t slots() const = 0;

    //! a new sequence takes `slot`: its target cache starts empty
    virtual void targetReset(int32_t slot) = 0;
    //! the slot's sequence ended (the engine may free it until the next targetReset of the slot)
    virtual void targetRelease(int32_t slot) = 0;
    //! one call over distinct slots -> logits in the order of `seqs` (resized by the callee): [Σ n, V], or with
    //! lastLogits each sequence's last row only, [seqs, V] (a prefill's)
    virtual void targetForward(std::vector<SlotRows> const& seqs, bool lastLogits, std::vector<float>& logits) = 0;
    virtual void targetCrop(int32_t slot, int32_t length) = 0;
    virtual void drafterReset(int32_t slot) = 0;
    //! the first `rows` rows of the slot's latest targetForward features join its pending context
    virtual void drafterQueueContext(int32_t slot, int32_t rows) = 0;
    //! the slot's pending context (positions start..) joins its drafter in one call; pending emptied
    virtual void drafterAddContext(int32_t slot, int32_t start) = 0;
    //! Runners::drafterPropose for the slot's drafter
    virtual void drafterPropose(int32_t slot, int32_t anchor, int32_t pos, int32_t rows, float temperature,
        float const* uniforms, Draft& out)
        = 0;

    // ---- prefix reuse across slots (core/prefixCache.h SharedPrefixCache; prefix_cache.py's runner side) ------
    //! whether the members below are implemented (false: the batch keeps no prefixes)
    virtual bool keepsPrefix() const
    {
        return false;
    }
    //! a copy of the slot's target non-croppable state at its length (nullptr: an attention-only target)
    virtual std::shared_ptr<TargetSnapshot const> targetSnapshot(int32_t slot)
    {
        (void) slot;
        return nullptr;
    }
    //! a copy of the slot's first n positions (n <= its length): target K/V rows; with `drafter`, the drafter's
    //! context and its queued features (prefix_rows, context_rows and the pending features)
    virtual std::shared_ptr<PrefixCopy const> prefixCopy(int32_t slot, int32_t n, bool drafter)
    {
        (void) slot;
        (void) n;
        (void) drafter;
        throw Error(DFL2_ERR_INTERNAL, "this backend keeps no prefix");
    }
    //! the slot (just reset, its drafter too) holds `rows`' positions < length: K/V rows copied, the non-croppable
    //! state put back from `state` (taken at `length`; nullptr for an attention-only target); with `drafter`, the
    //! drafter's context holds positions < length (<= rows.drafterLength()) with nothing queued (restore_prefix,
    //! restore_context + add_context)
    virtual void prefixRestore(
        int32_t slot, PrefixCopy const& rows, int32_t length, TargetSnapshot const* state, bool drafter)
    {
        (void) slot;
        (void) rows;
        (void) length;
        (void) state;
        (void) drafter;
        throw Error(DFL2_ERR_INTERNAL, "this backend keeps no prefix");
    }
};

//! The rule's step costs (seconds). plain(n) / draft() / verify(): nullopt while not known.
class StepCosts
{
public:
    virtual ~StepCosts() = default;
    virtual void recordPlain(int32_t n, double s) = 0;
    virtual void recordDraft(double s) = 0;
    virtual void recordVerify(double s) = 0;
    //! a prefill chunk of `rows` prompt rows forwarded in s seconds while other sequences decode
    virtual void recordPrefill(int64_t rows, double s) = 0;
    virtual std::optional<double> plain(int32_t n) const = 0;
    virtual std::optional<double> draft() const = 0;
    virtual std::optional<double> verify() const = 0;
    //! seconds one prompt row of a chunk costs
    virtual std::optional<double> prefillRow() const = 0;
    //! seconds a whole step takes (the decoding sequences' gap between tokens)
    virtual std::optional<double> step() const = 0;
    //! a whole step over n sequences (choose to accept): the tokens it committed in s seconds, whether any sequence
    //! drafted, whether the rule weighed it (false: held plain by holdsPlain)
    virtual void recordStep(int32_t n, bool drafted, int32_t tokens, double s, bool weighed) = 0;
    //! the realized check, asked before the rule weighs a step of n sequences: true = the step is plain, unweighed
    virtual bool holdsPlain(int32_t n) = 0;
};

//! batch.StepRate: exponential means over kSTEP_RATE_WINDOW steps of a kind's tokens and seconds
struct StepRate
{
    double tokens{0.0};
    double seconds{0.0};
    int64_t steps{0};
    void add(int32_t t, double s);
    double rate() const;
};
constexpr int64_t kSTEP_RATE_WINDOW = 8;
constexpr int64_t kSTEP_RATE_MIN_STEPS = 4;
constexpr int32_t kSTEP_RATE_PROBE = 16;

//! batch.MeasuredCosts: running means, then exponential over 16 samples.
class MeasuredCosts : public StepCosts
{
public:
    void recordPlain(int32_t n, double s) override;
    void recordDraft(double s) override;
    void recordVerify(double s) override;
    void recordPrefill(int64_t rows, double s) override;
    //! measured, else linear between the nearest measured sizes (flat beyond them), as numpy.interp
    std::optional<double> plain(int32_t n) const override;
    std::optional<double> draft() const override;
    std::optional<double> verify() const override;
    std::optional<double> prefillRow() const override;
    std::optional<double> step() const override;
    void recordStep(int32_t n, bool drafted, int32_t tokens, double s, bool weighed) override;
    //! batch.MeasuredCosts.holds_plain: plain steps at n measured first; then false (weigh) while drafting steps at n
    //! made at least the plain ones' tokens per second, or are unmeasured and the rule's last choice at n drafted;
    //! else true, every kSTEP_RATE_PROBE-th step excepted
    bool holdsPlain(int32_t n) override;

private:
    struct Mean
    {
        double m{0.0};
        int64_t n{0};
        void update(double s);
    };
    std::map<int32_t, Mean> mPlain;
    Mean mDraft;
    Mean mVerify;
    Mean mStep;  //!< a whole step, any size
    Mean mRow;   //!< one prompt row of a prefill chunk computed while others decode
    std::map<std::pair<int32_t, bool>, StepRate> mMade;  //!< (sequences, drafted) -> what whole steps made
    std::map<int32_t, bool> mModelPlain;  //!< sequences -> the rule's last choice there was plain
    std::map<int32_t, int32_t> mHeld;  //!< sequences -> steps held plain since the rule last weighed one
};

//! batch.FixedCosts with t_plain(n) = plainBase + plainPerSeq · n, t_verify = what one drafting sequence adds to a
//! step's forward; for the prefill budget a whole step's seconds and one chunked prompt row's (nullopt: not given)
//! (costs a deployment calibrated; tests).
class FixedCosts : public StepCosts
{
public:
    FixedCosts(double plainBase, double plainPerSeq, double draftS, double verifyS,
        std::optional<double> stepS = std::nullopt, std::optional<double> prefillRowS = std::nullopt)
        : mBase(plainBase)
        , mPerSeq(plainPerSeq)
        , mDraft(draftS)
        , mVerify(verifyS)
        , mStep(stepS)
        , mRow(prefillRowS)
    {
    }
    void recordPlain(int32_t, double) override {}
    void recordDraft(double) override {}
    void recordVerify(double) override {}
    void recordPrefill(int64_t, double) override {}
    std::optional<double> plain(int32_t n) const override
    {
        return n <= 0 ? 0.0 : mBase + mPerSeq * n;
    }
    std::optional<double> draft() const override
    {
        return mDraft;
    }
    std::optional<double> verify() const override
    {
        return mVerify;
    }
    std::optional<double> prefillRow() const override
    {
        return mRow;
    }
    std::optional<double> step() const override
    {
        return mStep;
    }
    void recordStep(int32_t, bool, int32_t, double, bool) override {}
    bool holdsPlain(int32_t) override  // the given costs decide every step
    {
        return false;
    }

private:
    double mBase, mPerSeq, mDraft, mVerify;
    std::optional<double> mStep, mRow;
};

//! batch.SpeculationRule (the file comment states the rule).
struct SpeculationRule
{
    double priorTau{1.5};
    double priorWeight{2.0};
    int32_t window{32};
    bool adaptive{true};
    int32_t probeAfter{64};
    double z{1.0};  //!< τ̂ adds z standard errors of the cycles: a sequence stops drafting on evidence
    double minSpread{0.5};  //!< the cycles' spread is taken as at least this: a few equal cycles prove nothing
    std::unique_ptr<StepCosts> costs{std::make_unique<MeasuredCosts>()};

    double tau(std::deque<int32_t> const& committed) const;
    //! candidates: (key, τ̂) in the active order -> the keys that draft this step. `free`: keys whose proposal costs
    //! no drafter time (prompt lookups: only their verify counts); `fallbacks`: key -> (another key, its τ̂), weighed
    //! once the candidates are chosen, for each key left out (fallback keys are free)
    std::vector<uint64_t> choose(int32_t nActive, std::vector<std::pair<uint64_t, double>> const& candidates,
        std::vector<uint64_t> const& free = {},
        std::vector<std::pair<uint64_t, std::pair<uint64_t, double>>> const& fallbacks = {}) const;
};

//! One request (a prompt and its request.GenerationRequest + where its uniforms come from and where its tokens go).
struct BatchRequest
{
    std::vector<int32_t> prompt;
    GenerateConfig config;                     //!< maxNewTokens, temperature, speculative, eosIds (no oracle)
    std::unique_ptr<UniformSource> uniforms;   //!< never null
    TokenSink sink;                            //!< may be empty; returning false cancels the request
};

//! What submit checks: the prompt (ids, length), max tokens, temperature, no oracle asked, a uniform source.
void checkBatchRequest(BatchRequest const& request, int32_t vocabSize, int32_t maxPositions);

//! A request that ended: its result, and for DFL2_FINISH_ERROR the error.
struct BatchFinished
{
    uint64_t id{0};
    Result result;
    dfl2_code error{DFL2_OK};
    std::string message;
};

struct BatchCounters
{
    int64_t steps{0};           //!< steps that ran at least one sequence
    int64_t draftingSteps{0};   //!< steps where at least one sequence drafted
    int64_t forwardCalls{0};    //!< the steps' target forwards (prefills not counted)
    int32_t largestForward{0};  //!< most sequences in one step's target forward
    int32_t largestPlain{0};    //!< most plain steps (one row each) in one step's target forward
    int64_t cycles{0};          //!< speculative cycles over all sequences
    int64_t prefillCalls{0};    //!< target forwards of prompt rows (a chunked prompt: one per chunk)
    int64_t prefillRows{0};     //!< prompt rows those forwards computed
};

//! batch.DEFAULT_PREFILL_CHUNK / DEFAULT_PREFILL_SHARE / PREFILL_PROBE_ROWS (chunked prefill; the Generator's, the
//! server's and options "prefill_chunk" / "prefill_share"'s defaults): while other sequences decode, the prompts
//! joining compute at most kPREFILL_CHUNK rows a step, fewer where a row is measured dear: rows whose forward takes
//! about kPREFILL_SHARE times the decoding step; kPREFILL_PROBE_ROWS while either time is unmeasured
constexpr int32_t kPREFILL_CHUNK = 512;
constexpr double kPREFILL_SHARE = 1.5;
constexpr int64_t kPREFILL_PROBE_ROWS = 8;

class BatchDecoder
{
public:
    //! prefillChunk: most prompt rows per step while others decode (batch.BatchDecoder's prefill_chunk; 0: no cap,
    //! its None); prefillShare: fewer by the measured times (its prefill_share; 0: none, its None; both 0: whole
    //! prompts); cache: the prefix cache prompts start from and finished sequences join (nullptr: none; used only
    //! where the runners keep prefixes), owned by the caller, outliving the decoder
    BatchDecoder(BatchRunners& runners, SpeculationRule rule, int32_t prefillChunk, double prefillShare,
        SharedPrefixCache* cache = nullptr);
    ~BatchDecoder();  //!< (Seq is complete in batch.cpp only)

    //! Queue a request under the caller's id (checks the prompt, max tokens, and that no oracle is asked).
    void submit(uint64_t id, BatchRequest request);
    //! Stop a queued or active request now: it keeps its tokens, finishes DFL2_FINISH_CANCELLED, its slot is
    //! freed. Unknown or finished ids are ignored.
    void cancel(uint64_t id);
    //! Admit, then one plain step or speculative cycle per active sequence, then retire the finished.
    void step();
    bool busy() const
    {
        return !mQueue.empty() || !mActive.empty();
    }
    int32_t activeCount() const
    {
        return static_cast<int32_t>(mActive.size());
    }
    int32_t queuedCount() const
    {
        return static_cast<int32_t>(mQueue.size());
    }
    //! The requests that ended since the last call, in the order they ended.
    std::vector<BatchFinished> takeFinished();
    BatchCounters const& counters() const
    {
        return mCounters;
    }

private:
    struct Seq;
    struct Proposal
    {
        Proposer who{Proposer::kDFLASH2};
        Draft draft;
        std::vector<int32_t> drafts;  //!< [nRows] to verify
    };
    //! a drafting sequence's plan: who proposes, and the lookup's drafts
    struct Plan
    {
        Seq* seq;
        Proposer who;
        std::vector<int32_t> looked;
    };
    void admit();
    void restorePrefix(Seq& s);
    void prefill();
    int64_t prefillBudget() const;
    void storePrefix(Seq& s);
    void start(Seq& s, float const* logits);
    std::vector<Plan> choose(std::vector<Seq*> const& seqs);
    std::map<Seq*, Proposal> propose(std::vector<Plan> const& plan);
    //! mRunners.targetForward over `rows` (one per sequence of `fed`); a throw finishes every one of `fed` with the
    //! error, `what` + its message, and returns false
    bool targetForward(std::vector<Seq*> const& fed, std::vector<SlotRows> const& rows, bool lastLogits,
        std::vector<float>& logits, char const* what);
    bool forward(std::vector<Seq*> const& seqs, std::map<Seq*, Proposal> const& proposals);
    void retire(std::vector<Seq*> const& seqs);
    std::pair<int32_t, double> estimate(Seq& s, Proposer who, std::vector<int32_t> const& looked) const;
    void recordForward(int32_t n, int32_t k, double seconds);
    void plain(Seq& s, float const* logits);
    void defer(Seq& s, int32_t rows);
    Proposal draft(Seq& s, Proposer who, std::vector<int32_t> const& looked);
    void accept(Seq& s, Proposal const& p, float const* logits);
    void emit(Seq& s, int32_t const* tokens, size_t n);
    void finish(Seq& s, dfl2_code error = DFL2_OK, std::string const& message = {});

    BatchRunners& mRunners;
    SpeculationRule mRule;
    int32_t mPrefillChunk;  //!< 0: no cap
    double mPrefillShare;   //!< 0: no time budget
    SharedPrefixCache* mCache;  //!< nullptr: no prefix reuse
    std::deque<std::unique_ptr<Seq>> mQueue;
    std::vector<std::unique_ptr<Seq>> mActive;  //!< in admission order (batch.py's dict order)
    std::vector<bool> mSlotUsed;
    std::vector<int32_t> mCacheLength;  //!< per slot
    std::vector<BatchFinished> mFinished;
    BatchCounters mCounters;
    bool mWeighed{true};  //!< the rule weighed this step's proposals (false: held plain by the realized check)
};

} // namespace dflash2
