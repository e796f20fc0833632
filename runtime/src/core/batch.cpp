//! \file batch.cpp
//! Continuous batching; see batch.h. Each function names its Python twin in dflash2_trt/runtime/batch.py.
#include "batch.h"

#include "prefixCache.h"
#include "sampling.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>

//! The tests' hook, as they monkeypatch batch.COST_CLOCK (tests/test_capi.py sets it through ctypes to a double it
//! advances as its runners run, and back to null): while not null, the batch loop's cost clock reads that double.
//! Not part of the C API (no header declares it); nothing but the tests sets it.
extern "C"
{
__attribute__((visibility("default"))) double const* dflash2TestCostClock = nullptr;
}

namespace dflash2
{

namespace
{

using Clock = std::chrono::steady_clock;

double secondsBetween(Clock::time_point a, Clock::time_point b)
{
    return std::chrono::duration<double>(b - a).count();
}

// batch.COST_CLOCK: the rule's clock is wall time, what a user waits for (process CPU time overstated a proposal
// while the target's workers spin into it); the tests' deterministic clock where they set one (dflash2TestCostClock)
double costClock()
{
    if (dflash2TestCostClock != nullptr)
    {
        return *dflash2TestCostClock;
    }
    return secondsBetween(Clock::time_point{}, Clock::now());
}

// The tests' planted bugs, each on while its variable is "1" (never set them otherwise):
// - DFLASH2_PLANT_HELD_STEP_WEIGHED: choose leaves mWeighed as the last weighed step set it on a held step
//   (tests/test_capi.py's measured-cost comparison catches it);
// - DFLASH2_PLANT_PREFILL_CHUNK_SHIFT: a prompt chunk after the first takes its ids one position early
//   (tests/test_capi_batch_cache.py's comparison with whole-prompt prefill catches it);
// - DFLASH2_PLANT_PREFILL_SHARE: the prefill budget ignores the measured costs, every chunk takes "prefill_chunk"
//   rows (tests/test_capi.py's twin test catches it).
bool planted(char const* variable)
{
    char const* const v = std::getenv(variable);
    return v != nullptr && std::string(v) == "1";
}

} // namespace

// ---- costs and the rule ------------------------------------------------------------------------------------

// MeasuredCosts._update
void MeasuredCosts::Mean::update(double s)
{
    ++n;
    m += (s - m) / static_cast<double>(std::min<int64_t>(n, 16));
}

void MeasuredCosts::recordPlain(int32_t n, double s)
{
    mPlain[n].update(s);
}

void MeasuredCosts::recordDraft(double s)
{
    mDraft.update(s);
}

void MeasuredCosts::recordVerify(double s)
{
    mVerify.update(s);
}

// StepRate.add / rate
void StepRate::add(int32_t t, double s)
{
    ++steps;
    double const w = 1.0 / static_cast<double>(std::min(steps, kSTEP_RATE_WINDOW));
    tokens += (t - tokens) * w;
    seconds += (s - seconds) * w;
}

double StepRate::rate() const
{
    return tokens / std::max(seconds, 1e-12);
}

void MeasuredCosts::recordStep(int32_t n, bool drafted, int32_t tokens, double s, bool weighed)
{
    mMade[{n, drafted}].add(tokens, s);
    mStep.update(s);
    if (weighed)
    {
        mModelPlain[n] = !drafted;
        mHeld[n] = 0;
    }
}

// MeasuredCosts.holds_plain
bool MeasuredCosts::holdsPlain(int32_t n)
{
    auto const d = mMade.find({n, true});
    auto const p = mMade.find({n, false});
    if (p == mMade.end() || p->second.steps < kSTEP_RATE_MIN_STEPS)
    {
        return true;
    }
    bool const measured = d != mMade.end() && d->second.steps >= kSTEP_RATE_MIN_STEPS;
    if (measured && d->second.rate() >= p->second.rate())
    {
        return false;
    }
    auto const last = mModelPlain.find(n);
    if (!measured && (last == mModelPlain.end() || !last->second))
    {
        return false;
    }
    return ++mHeld[n] % kSTEP_RATE_PROBE != 0;
}

// MeasuredCosts.plain: exact size, else numpy.interp over the measured sizes
std::optional<double> MeasuredCosts::plain(int32_t n) const
{
    if (n <= 0)
    {
        return 0.0;
    }
    auto const hit = mPlain.find(n);
    if (hit != mPlain.end())
    {
        return hit->second.m;
    }
    if (mPlain.empty())
    {
        return std::nullopt;
    }
    auto const hi = mPlain.upper_bound(n);
    if (hi == mPlain.begin())
    {
        return hi->second.m;  // below the smallest measured size: flat
    }
    auto const lo = std::prev(hi);
    if (hi == mPlain.end())
    {
        return lo->second.m;  // above the largest: flat
    }
    double const slope = (hi->second.m - lo->second.m) / static_cast<double>(hi->first - lo->first);
    return slope * static_cast<double>(n - lo->first) + lo->second.m;
}

std::optional<double> MeasuredCosts::draft() const
{
    return mDraft.n ? std::optional<double>(mDraft.m) : std::nullopt;
}

std::optional<double> MeasuredCosts::verify() const
{
    return mVerify.n ? std::optional<double>(mVerify.m) : std::nullopt;
}

// MeasuredCosts.record_prefill / prefill_row / step
void MeasuredCosts::recordPrefill(int64_t rows, double s)
{
    mRow.update(s / static_cast<double>(rows));
}

std::optional<double> MeasuredCosts::prefillRow() const
{
    return mRow.n ? std::optional<double>(mRow.m) : std::nullopt;
}

std::optional<double> MeasuredCosts::step() const
{
    return mStep.n ? std::optional<double>(mStep.m) : std::nullopt;
}

// SpeculationRule.tau: the prior-weighted mean plus z standard errors of the cycles (numpy's std, ddof 1)
double SpeculationRule::tau(std::deque<int32_t> const& committed) const
{
    size_t const n = committed.size();
    double sum = 0.0;  // of small integers: exact in any order
    for (int32_t c : committed)
    {
        sum += c;
    }
    double const mean = (priorTau * priorWeight + sum) / (priorWeight + static_cast<double>(n));
    if (n == 0)
    {
        return mean;
    }
    double sd = 0.0; // one cycle: no spread measured, minSpread stands
    if (n > 1)
    {
        double const m = sum / static_cast<double>(n);
        std::vector<double> sq;
        for (int32_t c : committed)
        {
            double const d = static_cast<double>(c) - m;
            sq.push_back(d * d);
        }
        sd = std::sqrt(pairwiseSum(sq.data(), n) / static_cast<double>(n - 1));
    }
    return mean + z * std::max(sd, minSpread) / std::sqrt(static_cast<double>(n));
}

// SpeculationRule.choose (without a runner's cost plan, B = 1 drafters): candidates in the caller's order, `free`
// keys cost no drafter time (lookups), each fallback weighed once the candidates are chosen, for a key left out
namespace
{

// SpeculationRule.choose's order when drafter and lookup proposals compete: by tokens added per second of cost (a
// free key's proposal costs only its verify), highest first, ties in the given order
template <typename IsFree>
std::vector<std::pair<uint64_t, double>> byGain(
    std::vector<std::pair<uint64_t, double>> order, IsFree const& isFree, double td, double tv)
{
    auto const gain = [&](std::pair<uint64_t, double> const& c) {
        double const cost = (isFree(c.first) ? 0.0 : td) + tv;
        if (cost <= 0)  // a verify measured as free
        {
            return c.second > 1.0 ? INFINITY : 0.0;
        }
        return (c.second - 1.0) / cost;
    };
    std::stable_sort(order.begin(), order.end(), [&](auto const& a, auto const& b) { return -gain(a) < -gain(b); });
    return order;
}

// the fallbacks (key, τ̂) of the keys the rule left out, highest τ̂ first
std::vector<std::pair<uint64_t, double>> leftOutFallbacks(
    std::vector<std::pair<uint64_t, std::pair<uint64_t, double>>> const& fallbacks, std::vector<uint64_t> const& chosen)
{
    std::vector<std::pair<uint64_t, double>> more;
    for (auto const& [key, fb] : fallbacks)
    {
        if (std::find(chosen.begin(), chosen.end(), key) == chosen.end())
        {
            more.push_back(fb);
        }
    }
    std::stable_sort(more.begin(), more.end(), [](auto const& a, auto const& b) { return -a.second < -b.second; });
    return more;
}

} // namespace

std::vector<uint64_t> SpeculationRule::choose(int32_t nActive,
    std::vector<std::pair<uint64_t, double>> const& candidates, std::vector<uint64_t> const& free,
    std::vector<std::pair<uint64_t, std::pair<uint64_t, double>>> const& fallbacks) const
{
    std::vector<uint64_t> all;
    for (auto const& c : candidates)
    {
        all.push_back(c.first);
    }
    if (candidates.empty() || !adaptive)
    {
        return all;
    }
    std::optional<double> const tAll = costs->plain(nActive);
    if (!tAll)
    {
        return {};  // explore: measure a plain step first
    }
    std::vector<std::pair<uint64_t, double>> order = candidates;
    std::stable_sort(order.begin(), order.end(), [](auto const& a, auto const& b) { return -a.second < -b.second; });
    std::vector<uint64_t> freeKeys = free;  // + the fallbacks' keys
    for (auto const& fb : fallbacks)
    {
        freeKeys.push_back(fb.second.first);
    }
    auto const isFree = [&](uint64_t k) { return std::find(freeKeys.begin(), freeKeys.end(), k) != freeKeys.end(); };
    std::optional<double> tD = costs->draft();
    std::optional<double> const tV = costs->verify();
    if (!tV)
    {
        return {order[0].first};  // explore: measure a verify
    }
    auto const firstDrafter = std::find_if(order.begin(), order.end(), [&](auto const& c) { return !isFree(c.first); });
    if (!tD && firstDrafter != order.end())
    {
        return {firstDrafter->first};  // explore: measure one drafting (at high load one is costly enough)
    }
    double const td = tD.value_or(0.0);  // none: no drafter proposal to cost
    double const tv = std::max(*tV, 0.0);
    // time(keys) = t_plain(n) + k_d (t_draft + t_verify) + (k - k_d) t_verify
    auto const timeOf = [&](std::vector<uint64_t> const& keys) {
        int64_t const k = static_cast<int64_t>(keys.size());
        int64_t const kD = std::count_if(keys.begin(), keys.end(), [&](uint64_t i) { return !isFree(i); });
        return *tAll + static_cast<double>(kD) * (td + tv) + static_cast<double>(k - kD) * tv;
    };
    bool const anyFree
        = std::any_of(candidates.begin(), candidates.end(), [&](auto const& c) { return isFree(c.first); });
    if (anyFree)  // drafter and lookup proposals: by tokens added per second of cost
    {
        order = byGain(candidates, isFree, td, tv);
    }
    // the n for which base + adds[:n] makes the most tokens per second (n = 0: base, at rate `best`, making
    // `tokens`): n; `best` and `tokens` become its rate and tokens
    auto const bestPrefix = [&](std::vector<uint64_t> base, std::vector<std::pair<uint64_t, double>> const& adds,
                                double& tokens, double& best) {
        size_t n = 0;
        double sum = tokens;
        for (size_t k = 1; k <= adds.size(); ++k)
        {
            sum += adds[k - 1].second - 1.0;
            base.push_back(adds[k - 1].first);
            double const rate = sum / std::max(timeOf(base), 1e-12);
            if (rate > best)
            {
                n = k;
                best = rate;
                tokens = sum;
            }
        }
        return n;
    };
    double best = nActive / std::max(*tAll, 1e-12);
    double tokens = nActive;
    size_t const bestK = bestPrefix({}, order, tokens, best);
    std::vector<uint64_t> chosen;
    for (size_t k = 0; k < bestK; ++k)
    {
        chosen.push_back(order[k].first);
    }
    std::vector<std::pair<uint64_t, double>> const more = leftOutFallbacks(fallbacks, chosen);
    size_t const bestJ = bestPrefix(chosen, more, tokens, best);
    for (size_t j = 0; j < bestJ; ++j)
    {
        chosen.push_back(more[j].first);
    }
    return chosen;
}

// ---- the decoder -------------------------------------------------------------------------------------------

// batch._Seq
struct BatchDecoder::Seq
{
    uint64_t id{0};
    BatchRequest req;
    int32_t slot{-1};
    Result res;
    int64_t limit{0};
    Clock::time_point t0{};
    int32_t anchor{-1};
    int32_t pos{0};            //!< the anchor's position
    int32_t pendingRows{0};    //!< features queued in the backend, not yet in the draft context
    int32_t pendingStart{0};
    std::deque<int32_t> committed[2];  //!< per proposer (dflash2, ngram): tokens per cycle, last `window` cycles
    int32_t plainRun{0};       //!< steps in a row the rule kept this candidate plain
    ProposerChoice choice;     //!< who proposes (made at admission: the context needs the first token)
    std::optional<Sampler> sampler;  //!< its transforms and logprobs (none: the raw target law)
    int32_t prefilled{0};      //!< prompt positions the target holds while the prompt is prefilling
    std::map<int32_t, std::shared_ptr<TargetSnapshot const>> snapshots;  //!< the target's state after the prefill
    bool prefilling{false};    //!< holds a slot, its prompt not yet all computed: no decode step runs for it
    bool cancelled{false};
    bool done{false};

    //! whether the DFlash 2 drafter proposes for it (its context then follows the committed positions)
    //! batch._uses_drafter: a speculative request whose proposer is not prompt lookup alone (its choice's
    //! usesDrafter, known before the choice is made at its first token)
    bool usesDrafter() const
    {
        return req.config.speculative && req.config.proposer != Proposer::kNGRAM;
    }
    Sampler* transforms()
    {
        return sampler ? &*sampler : nullptr;
    }
    std::deque<int32_t>& committedBy(Proposer who)
    {
        return committed[who == Proposer::kNGRAM ? 1 : 0];
    }
    int64_t made() const
    {
        return static_cast<int64_t>(res.tokens.size());
    }
};

BatchDecoder::BatchDecoder(
    BatchRunners& runners, SpeculationRule rule, int32_t prefillChunk, double prefillShare, SharedPrefixCache* cache)
    : mRunners(runners)
    , mRule(std::move(rule))
    , mPrefillChunk(prefillChunk)
    , mPrefillShare(prefillShare)
    , mCache(cache != nullptr && runners.keepsPrefix() ? cache : nullptr)
    , mSlotUsed(static_cast<size_t>(runners.slots()), false)
    , mCacheLength(static_cast<size_t>(runners.slots()), 0)
{
}

BatchDecoder::~BatchDecoder() = default;

// batch.BatchDecoder.submit's checks (request.GenerationRequest: its fields, validate)
void checkBatchRequest(BatchRequest const& request, int32_t vocabSize, int32_t maxPositions)
{
    GenerateConfig const& cfg = request.config;
    checkPrompt(request.prompt, vocabSize, maxPositions, cfg.maxNewTokens);
    if (!std::isfinite(cfg.temperature) || cfg.temperature < 0)
    {
        throw Error(DFL2_ERR_OPTION_VALUE, "temperature must be a finite number >= 0 (0 = greedy)");
    }
    if (cfg.measureOracle)
    {
        throw Error(DFL2_ERR_OPTION_VALUE, "measure_oracle is not available in batched decoding (use a session)");
    }
    if (!request.uniforms)
    {
        throw Error(DFL2_ERR_INTERNAL, "batched request without a uniform source");
    }
}

// BatchDecoder.submit
void BatchDecoder::submit(uint64_t id, BatchRequest request)
{
    checkBatchRequest(request, mRunners.vocabSize(), mRunners.maxPositions());
    GenerateConfig const& cfg = request.config;
    auto s = std::make_unique<Seq>();
    s->id = id;
    int64_t const room = mRunners.maxPositions() - static_cast<int64_t>(request.prompt.size());
    s->limit = std::min<int64_t>(cfg.maxNewTokens, room);
    s->req = std::move(request);
    s->sampler = samplerOf(s->req.config, s->req.prompt, mRunners.vocabSize());
    mQueue.push_back(std::move(s));
}

// BatchDecoder.cancel
void BatchDecoder::cancel(uint64_t id)
{
    for (auto it = mQueue.begin(); it != mQueue.end(); ++it)
    {
        if ((*it)->id == id)
        {
            (*it)->cancelled = true;
            finish(**it);
            mQueue.erase(it);
            return;
        }
    }
    for (auto& s : mActive)
    {
        if (s->id == id && !s->done)
        {
            s->cancelled = true;
            finish(*s);
        }
    }
    mActive.erase(std::remove_if(mActive.begin(), mActive.end(), [](auto const& s) { return s->done; }), mActive.end());
}

std::vector<BatchFinished> BatchDecoder::takeFinished()
{
    std::vector<BatchFinished> out;
    out.swap(mFinished);
    return out;
}

// BatchDecoder.step
void BatchDecoder::step()
{
    admit();
    std::vector<Seq*> seqs;
    for (auto& s : mActive)
    {
        if (!s->done && !s->prefilling)  // (a request can end at admission)
        {
            seqs.push_back(s.get());
        }
    }
    if (!seqs.empty())
    {
        ++mCounters.steps;
        double const tStep = costClock();
        int64_t made = 0;
        for (Seq const* s : seqs)
        {
            made += s->made();
        }
        std::vector<Plan> const plan = choose(seqs);
        if (!plan.empty())
        {
            ++mCounters.draftingSteps;
        }
        std::map<Seq*, Proposal> const proposals = propose(plan);
        if (forward(seqs, proposals))
        {
            for (Seq const* s : seqs)
            {
                made -= s->made();
            }
            mRule.costs->recordStep(static_cast<int32_t>(seqs.size()), !proposals.empty(), static_cast<int32_t>(-made),
                costClock() - tStep, mWeighed);
        }
        retire(seqs);
    }
    mActive.erase(std::remove_if(mActive.begin(), mActive.end(), [](auto const& s) { return s->done; }), mActive.end());
}

// BatchDecoder._propose: the planned sequences' drafts (a sequence whose drafter fails ends with its error)
std::map<BatchDecoder::Seq*, BatchDecoder::Proposal> BatchDecoder::propose(std::vector<Plan> const& plan)
{
    std::map<Seq*, Proposal> proposals;
    for (Plan const& p : plan)
    {
        try
        {
            proposals.emplace(p.seq, draft(*p.seq, p.who, p.looked));
        }
        catch (...)
        {
            auto const [code, message] = errorOfCurrentException();
            finish(*p.seq, code, message);
        }
    }
    return proposals;
}

// the step's ONE target forward (a plain sequence's anchor, a drafting sequence's [anchor, drafts]), then each
// sequence's accept -> commit or plain step on its rows of the logits; false: the forward failed (its sequences
// ended with the error)
bool BatchDecoder::targetForward(std::vector<Seq*> const& fed, std::vector<SlotRows> const& rows, bool lastLogits,
    std::vector<float>& logits, char const* what)
{
    try
    {
        mRunners.targetForward(rows, lastLogits, logits);
        return true;
    }
    catch (...)
    {
        auto const [code, message] = errorOfCurrentException();
        for (Seq* s : fed)
        {
            finish(*s, code, what + message);
        }
        return false;
    }
}

bool BatchDecoder::forward(std::vector<Seq*> const& seqs, std::map<Seq*, Proposal> const& proposals)
{
    std::vector<Seq*> fed;
    std::vector<SlotRows> rows;
    for (Seq* s : seqs)
    {
        if (s->done)
        {
            continue;
        }
        fed.push_back(s);
        rows.push_back(SlotRows{s->slot, mCacheLength[static_cast<size_t>(s->slot)], {s->anchor}});
        auto const p = proposals.find(s);
        if (p != proposals.end())
        {
            rows.back().ids.insert(rows.back().ids.end(), p->second.drafts.begin(), p->second.drafts.end());
        }
    }
    if (fed.empty())
    {
        return false;
    }
    std::vector<float> logits;  // [Σ rows, V]
    double const t = costClock();
    if (!targetForward(fed, rows, false, logits, "the step's target forward: "))
    {
        return false;
    }
    recordForward(static_cast<int32_t>(seqs.size()), static_cast<int32_t>(proposals.size()), costClock() - t);
    size_t const V = static_cast<size_t>(mRunners.vocabSize());
    size_t row = 0;
    int32_t plainInCall = 0;
    for (size_t i = 0; i < fed.size(); ++i)
    {
        Seq& s = *fed[i];
        int32_t const n = static_cast<int32_t>(rows[i].ids.size());
        mCacheLength[static_cast<size_t>(s.slot)] += n;
        float const* lg = logits.data() + row * V;
        row += static_cast<size_t>(n);
        try
        {
            auto const p = proposals.find(&s);
            if (p != proposals.end())
            {
                accept(s, p->second, lg);
            }
            else
            {
                ++plainInCall;
                plain(s, lg);
            }
        }
        catch (...)
        {
            auto const [code, message] = errorOfCurrentException();
            finish(s, code, message);
        }
    }
    ++mCounters.forwardCalls;
    mCounters.largestForward = std::max(mCounters.largestForward, static_cast<int32_t>(fed.size()));
    mCounters.largestPlain = std::max(mCounters.largestPlain, plainInCall);
    return true;
}

// the step's end: a sequence cancelled, at max tokens / capacity or at its own EOS is finished
void BatchDecoder::retire(std::vector<Seq*> const& seqs)
{
    for (Seq* s : seqs)
    {
        bool const ended
            = !s->res.tokens.empty() && (s->made() >= s->limit || isEos(s->req.config, s->res.tokens.back()));
        if (!s->done && (s->cancelled || ended))
        {
            finish(*s);
        }
    }
}

// BatchDecoder._admit: queued requests into free slots (slots assigned shortest prompt first), each slot reset (then
// every drafter), then one prefill step
void BatchDecoder::admit()
{
    std::vector<Seq*> fresh;
    size_t const freeSlots = static_cast<size_t>(std::count(mSlotUsed.begin(), mSlotUsed.end(), false));
    while (!mQueue.empty() && fresh.size() < freeSlots)
    {
        mActive.push_back(std::move(mQueue.front()));
        mQueue.pop_front();
        fresh.push_back(mActive.back().get());
    }
    auto const t0 = Clock::now();
    std::vector<Seq*> byLength = fresh;
    std::stable_sort(byLength.begin(), byLength.end(),
        [](Seq const* a, Seq const* b) { return a->req.prompt.size() < b->req.prompt.size(); });
    for (Seq* s : byLength)  // like lengths in neighbouring slots (each takes the lowest free slot)
    {
        auto const slot = std::find(mSlotUsed.begin(), mSlotUsed.end(), false);
        s->slot = static_cast<int32_t>(slot - mSlotUsed.begin());
        s->t0 = t0;
        *slot = true;
        mCacheLength[static_cast<size_t>(s->slot)] = 0;
        s->prefilling = true;
        try
        {
            mRunners.targetReset(s->slot);
        }
        catch (...)
        {
            auto const [code, message] = errorOfCurrentException();
            finish(*s, code, message);
        }
    }
    for (Seq* s : byLength)  // then every drafter, and the longest cached prefix into both
    {
        try
        {
            if (!s->done && s->usesDrafter())
            {
                mRunners.drafterReset(s->slot);
            }
            if (!s->done)
            {
                restorePrefix(*s);
            }
        }
        catch (...)
        {
            auto const [code, message] = errorOfCurrentException();
            finish(*s, code, message);
        }
    }
    prefill();
}

// PrefixCache.prefill_from for a slot just reset: the longest usable prefix of the prompt restored (its drafter's
// context too when it drafts) -> the positions the prefill skips
void BatchDecoder::restorePrefix(Seq& s)
{
    if (mCache == nullptr)
    {
        return;
    }
    SharedPrefixCache::Hit const hit = mCache->lookup(s.req.prompt, s.usesDrafter());
    if (hit.length > 0)
    {
        mRunners.prefixRestore(s.slot, *hit.entry->rows, hit.length, hit.state(), s.usesDrafter());
    }
    s.prefilled = hit.length;
    s.pendingStart = hit.length;
    s.res.cachedTokens = hit.length;
    mCacheLength[static_cast<size_t>(s.slot)] = hit.length;
}

// BatchDecoder._prefill_budget: prompt rows this step's prefill may compute while others decode (-1: whole prompts)
int64_t BatchDecoder::prefillBudget() const
{
    int64_t const cap = mPrefillChunk > 0 ? mPrefillChunk : -1;
    if (mPrefillShare <= 0 || planted("DFLASH2_PLANT_PREFILL_SHARE"))
    {
        return cap;
    }
    std::optional<double> const row = mRule.costs->prefillRow();
    std::optional<double> const step = mRule.costs->step();
    int64_t const rows = !row || !step
        ? kPREFILL_PROBE_ROWS
        : std::max<int64_t>(1, static_cast<int64_t>(mPrefillShare * *step / *row));
    return cap < 0 ? rows : std::min(rows, cap);
}

// BatchDecoder._prefill: the prompts still prefilling, in admission order, forward their next rows in one target
// forward — at most prefillBudget() rows over all of them while other sequences decode, else whole prompts; the rows'
// features join the slot's pending context; a prompt now whole draws its first token (start)
void BatchDecoder::prefill()
{
    bool const decoding = std::any_of(
        mActive.begin(), mActive.end(), [](auto const& s) { return !s->done && !s->prefilling; });
    int64_t budget = decoding ? prefillBudget() : -1;  // -1: whole prompts
    std::vector<Seq*> fed;
    std::vector<SlotRows> rows;
    for (auto const& p : mActive)
    {
        Seq* s = p.get();
        if (s->done || !s->prefilling)
        {
            continue;
        }
        int64_t const left = static_cast<int64_t>(s->req.prompt.size()) - s->prefilled;
        int64_t const take = budget < 0 ? left : std::min(budget, left);
        if (take <= 0)
        {
            break;
        }
        bool const shift = s->prefilled > 0 && planted("DFLASH2_PLANT_PREFILL_CHUNK_SHIFT");
        auto const from = s->req.prompt.begin() + s->prefilled - shift;
        fed.push_back(s);
        rows.push_back(SlotRows{s->slot, s->prefilled, std::vector<int32_t>(from, from + take)});
        budget = budget < 0 ? budget : budget - take;
    }
    if (fed.empty())
    {
        return;
    }
    std::vector<float> logits;  // [fed, V]: each sequence's last row
    double const t = costClock();
    if (!targetForward(fed, rows, true, logits, "the prefill's target forward: "))
    {
        return;
    }
    if (decoding)
    {
        int64_t n = 0;
        for (SlotRows const& r : rows)
        {
            n += static_cast<int64_t>(r.ids.size());
        }
        mRule.costs->recordPrefill(n, costClock() - t);
    }
    ++mCounters.prefillCalls;
    size_t const V = static_cast<size_t>(mRunners.vocabSize());
    for (size_t i = 0; i < fed.size(); ++i)
    {
        Seq& s = *fed[i];
        int32_t const n = static_cast<int32_t>(rows[i].ids.size());
        mCounters.prefillRows += n;
        s.prefilled += n;
        mCacheLength[static_cast<size_t>(s.slot)] = s.prefilled;
        try
        {
            if (s.usesDrafter())
            {
                mRunners.drafterQueueContext(s.slot, n);
                s.pendingRows += n;
            }
        }
        catch (...)
        {
            auto const [code, message] = errorOfCurrentException();
            finish(s, code, message);
            continue;
        }
        if (s.prefilled == static_cast<int32_t>(s.req.prompt.size()))
        {
            s.prefilling = false;
            try
            {
                if (mCache != nullptr)  // PrefixCache.snapshot: the state after the prefill
                {
                    if (auto state = mRunners.targetSnapshot(s.slot))
                    {
                        s.snapshots[s.prefilled] = std::move(state);
                    }
                }
            }
            catch (...)
            {
                auto const [code, message] = errorOfCurrentException();
                finish(s, code, message);
                continue;
            }
            start(s, logits.data() + i * V);
        }
    }
}

// the rest of _admit for one prefilled sequence (logits [V] of its last prompt row): its first token, its proposer
// choice (its prompt's features wait in the slot's pending context, queued chunk by chunk by prefill)
void BatchDecoder::start(Seq& s, float const* logits)
{
    int32_t const n = static_cast<int32_t>(s.req.prompt.size());
    try
    {
        s.anchor = nextToken(logits, static_cast<size_t>(mRunners.vocabSize()), s.req.config.temperature,
            *s.req.uniforms, s.transforms());
        s.res.tokens.push_back(s.anchor);
        s.pos = n;
        // a plain request never looks up: its choice keeps no context
        GenerateConfig const& cfg = s.req.config;
        Proposer const mode = cfg.speculative ? cfg.proposer : Proposer::kDFLASH2;
        std::vector<int32_t> context;
        if (mode != Proposer::kDFLASH2)
        {
            context = s.req.prompt;
            context.push_back(s.anchor);
        }
        int32_t const lookupRows = mode == Proposer::kDFLASH2 ? 0
            : cfg.ngramRows > 0                                ? cfg.ngramRows
                                                               : defaultLookupRows(mRunners.blockSize() - 1);
        s.choice = ProposerChoice(mode, std::move(context), lookupRows);
        emit(s, &s.anchor, 1);
        if (s.cancelled || s.made() >= s.limit || isEos(s.req.config, s.anchor))
        {
            finish(s);
        }
    }
    catch (...)
    {
        auto const [code, message] = errorOfCurrentException();
        finish(s, code, message);
    }
}

namespace
{

// the rule's key of a sequence's proposal: (request id, proposer)
uint64_t ruleKey(uint64_t id, Proposer who)
{
    return id * 2 + (who == Proposer::kNGRAM ? 1 : 0);
}

bool holds(std::vector<uint64_t> const& keys, uint64_t key)
{
    return std::find(keys.begin(), keys.end(), key) != keys.end();
}

} // namespace

// BatchDecoder._choose: each candidate's ProposerChoice names its preferred proposal, the rule weighs them (and the
// lookups of those whose drafter proposal it left out), then each choice settles the outcome; a cycle needs >= 1
// draft row left before the limit
std::vector<BatchDecoder::Plan> BatchDecoder::choose(std::vector<Seq*> const& seqs)
{
    std::vector<Seq*> cands;
    for (Seq* s : seqs)
    {
        if (s->req.config.speculative && s->limit - s->made() >= 2)
        {
            if (s->plainRun >= mRule.probeAfter)  // probe: measure this sequence's acceptance again
            {
                s->committed[0].clear();
                s->committed[1].clear();
                s->plainRun = 0;
            }
            cands.push_back(s);
        }
    }
    if (!cands.empty() && mRule.adaptive && mRule.costs->holdsPlain(static_cast<int32_t>(seqs.size())))
    {
        if (!planted("DFLASH2_PLANT_HELD_STEP_WEIGHED"))
        {
            mWeighed = false;  // the realized check: plain, unweighed (no lookups, no estimates)
        }
        for (Seq* s : cands)
        {
            ++s->plainRun;
        }
        return {};
    }
    std::vector<std::vector<int32_t>> looked;  // per candidate: its lookup's drafts (none for dflash2)
    for (Seq* s : cands)
    {
        looked.push_back(s->choice.ngram(s->limit - s->made() - 1));
    }
    std::vector<std::pair<uint64_t, double>> taus;  // the rule's candidates, one per sequence
    std::vector<uint64_t> free;
    std::vector<std::pair<uint64_t, std::pair<uint64_t, double>>> fallbacks;
    for (size_t i = 0; i < cands.size(); ++i)
    {
        Seq& s = *cands[i];
        Proposer const who = s.choice.preferred(looked[i], std::nullopt, s.usesDrafter());
        if (who == Proposer::kNONE)  // ngram without a match: a plain step, not the rule's choice
        {
            continue;
        }
        taus.emplace_back(ruleKey(s.id, who), estimate(s, who, looked[i]).second);
        if (who == Proposer::kNGRAM)
        {
            free.push_back(taus.back().first);
        }
        if (who == Proposer::kDFLASH2 && s.choice.preferred(looked[i], std::nullopt, false) == Proposer::kNGRAM)
        {
            double const tau = estimate(s, Proposer::kNGRAM, looked[i]).second;
            fallbacks.push_back({ruleKey(s.id, Proposer::kDFLASH2), {ruleKey(s.id, Proposer::kNGRAM), tau}});
        }
    }
    mWeighed = !taus.empty();  // lookups without a match offer the rule nothing: no choice of its to remember
    std::vector<uint64_t> const chosen = mRule.choose(static_cast<int32_t>(seqs.size()), taus, free, fallbacks);
    std::vector<Plan> plan;
    for (size_t i = 0; i < cands.size(); ++i)
    {
        Seq& s = *cands[i];
        Proposer const who = holds(chosen, ruleKey(s.id, Proposer::kDFLASH2)) ? Proposer::kDFLASH2
            : holds(chosen, ruleKey(s.id, Proposer::kNGRAM))                  ? Proposer::kNGRAM
                                                                               : Proposer::kNONE;
        s.choice.settle(looked[i], who);
        bool const weighed = std::any_of(taus.begin(), taus.end(),
            [&](auto const& t) { return t.first / 2 == s.id; });
        if (weighed)
        {
            s.plainRun = who != Proposer::kNONE ? 0 : s.plainRun + 1;
        }
        if (who != Proposer::kNONE)
        {
            plan.push_back(Plan{&s, who, looked[i]});
        }
    }
    return plan;
}

// BatchDecoder._estimate: (verify rows, τ̂) of a proposal by `who` for s this step
std::pair<int32_t, double> BatchDecoder::estimate(Seq& s, Proposer who, std::vector<int32_t> const& looked) const
{
    if (who == Proposer::kNGRAM)  // it commits at most its drafts + the bonus token
    {
        int32_t const n = static_cast<int32_t>(looked.size());
        return {n, std::min(mRule.tau(s.committedBy(who)), 1.0 + n)};
    }
    // τ̂ of a final partial block: its share of the rows' expected gain (a full block's τ̂ would overstate it)
    // (batch.py's 1.0 + (tau - 1.0) * rows / full, evaluated in the same order)
    int64_t const full = mRunners.blockSize() - 1;
    int64_t const rows = std::min<int64_t>(full, s.limit - s.made() - 1);
    double const gain = (mRule.tau(s.committedBy(who)) - 1.0) * static_cast<double>(rows);
    return {static_cast<int32_t>(rows), 1.0 + gain / static_cast<double>(full)};
}

// BatchDecoder._record_forward: a step's forward over n sequences, k verifying -> t_plain(n), or t_verify per
// drafting sequence (its share of the time above t_plain(n))
void BatchDecoder::recordForward(int32_t n, int32_t k, double seconds)
{
    StepCosts& c = *mRule.costs;
    if (k == 0)
    {
        c.recordPlain(n, seconds);
        return;
    }
    std::optional<double> const base = c.plain(n);
    if (base)
    {
        c.recordVerify((seconds - *base) / k);
    }
}

// BatchDecoder._plain: the target's next token after the anchor (logits [1, V]): exactly a B = 1 plain step
void BatchDecoder::plain(Seq& s, float const* logits)
{
    size_t const V = static_cast<size_t>(mRunners.vocabSize());
    s.anchor = nextToken(logits, V, s.req.config.temperature, *s.req.uniforms, s.transforms());
    if (s.usesDrafter())
    {
        defer(s, 1);
    }
    ++s.pos;
    s.res.tokens.push_back(s.anchor);
    s.choice.extend(&s.anchor, 1);
    ++s.res.plainSteps;
    emit(s, &s.anchor, 1);
}

// BatchDecoder._defer: features of the committed positions s.pos .. s.pos + rows - 1 (the first rows of the slot's
// latest forward) wait for the drafter's next pass
void BatchDecoder::defer(Seq& s, int32_t rows)
{
    mRunners.drafterQueueContext(s.slot, rows);
    if (s.pendingRows == 0)
    {
        s.pendingStart = s.pos;
    }
    s.pendingRows += rows;
}

// BatchDecoder._draft: a lookup's drafts as they are (no drafter pass, no random draw; pending features keep
// waiting), or pending features join the slot's drafter and the drafter proposes
BatchDecoder::Proposal BatchDecoder::draft(Seq& s, Proposer who, std::vector<int32_t> const& looked)
{
    if (who == Proposer::kNGRAM)
    {
        return Proposal{who, lookupDraft(looked), looked};
    }
    GenerateConfig const& cfg = s.req.config;
    int32_t const L = mRunners.blockSize() - 1;
    double t = costClock();
    if (s.pendingRows > 0)  // features of the prompt / plain steps join the draft context in one pass
    {
        mRunners.drafterAddContext(s.slot, s.pendingStart);
        if (s.pendingStart == 0)  // the prompt's context (a sequence's first proposal) is not a cycle's cost
        {
            t = costClock();
        }
        s.pendingRows = 0;
    }
    // a final partial block verifies fewer rows
    int32_t const nRows = static_cast<int32_t>(std::min<int64_t>(L, s.limit - s.made() - 1));
    std::vector<double> u64(static_cast<size_t>(L));
    std::vector<float> u32;
    if (cfg.temperature > 0)
    {
        drawDraftUniforms(*s.req.uniforms, u64, u32);
    }
    Proposal p;
    mRunners.drafterPropose(s.slot, s.anchor, s.pos, nRows, static_cast<float>(cfg.temperature),
        cfg.temperature > 0 ? u32.data() : nullptr, p.draft);
    mRule.costs->recordDraft(costClock() - t);
    checkDraft(p.draft, nRows, mRunners.topK(), mRunners.vocabSize());
    if (s.sampler && cfg.temperature > 0)
    {
        s.sampler->redraw(p.draft, u32.data(), nRows);  // an independent draft from the transformed law
    }
    p.drafts.assign(p.draft.tokens.begin(), p.draft.tokens.begin() + nRows);
    return p;
}

// BatchDecoder._accept: accept -> commit of one sequence's verify (logits [nRows + 1, V] of [anchor, drafts])
void BatchDecoder::accept(Seq& s, Proposal const& p, float const* logits)
{
    GenerateConfig const& cfg = s.req.config;
    int32_t const nRows = static_cast<int32_t>(p.drafts.size());
    int32_t const K = p.who == Proposer::kNGRAM ? 1 : mRunners.topK();  // a lookup's: one candidate per row
    auto const [acc, bonus]
        = acceptDrafts(p.draft, p.drafts, logits, mRunners.vocabSize(), K, cfg.temperature, *s.req.uniforms,
            s.transforms());
    int32_t const keep = s.pos + acc + 1;
    mRunners.targetCrop(s.slot, keep);
    int32_t& cached = mCacheLength[static_cast<size_t>(s.slot)];
    cached = std::min(cached, keep);
    // the drafter's pass took the pending features, so its verified rows are the next ones; a lookup cycle's rows
    // wait with the others (the draft context stays contiguous)
    if (s.usesDrafter())
    {
        defer(s, acc + 1);
    }
    std::vector<int32_t> const fresh = committedTokens(p.drafts, acc, bonus, cfg);
    // an accepted EOS ends the request: drafts after it are not committed, so they do not count for τ
    s.res.accepted.push_back(std::min(acc, static_cast<int32_t>(fresh.size())));
    s.res.proposed.push_back(nRows);
    s.res.proposers.push_back(static_cast<int32_t>(p.who));
    s.res.tokens.insert(s.res.tokens.end(), fresh.begin(), fresh.end());
    std::deque<int32_t>& committed = s.committedBy(p.who);
    committed.push_back(static_cast<int32_t>(fresh.size()));
    while (static_cast<int32_t>(committed.size()) > mRule.window)
    {
        committed.pop_front();
    }
    s.choice.extend(fresh.data(), fresh.size());
    s.choice.record(p.who, static_cast<int32_t>(fresh.size()));
    s.pos += acc + 1;
    s.anchor = fresh.back();
    ++mCounters.cycles;
    emit(s, fresh.data(), fresh.size());
}

void BatchDecoder::emit(Seq& s, int32_t const* tokens, size_t n)
{
    if (s.sampler)
    {
        s.sampler->commit(tokens, n);
    }
    if (s.req.sink && !s.req.sink(tokens, n))
    {
        s.cancelled = true;
    }
}

// BatchDecoder._finish's store: the sequence (prompt + tokens, as far as the target holds them) joins the prefix cache
// before its slot is freed (its drafter's context with it when it drafts)
void BatchDecoder::storePrefix(Seq& s)
{
    int32_t const length = mCacheLength[static_cast<size_t>(s.slot)];
    if (mCache == nullptr || mCache->budget() == 0 || length == 0)
    {
        return;
    }
    std::vector<int32_t> ids = s.req.prompt;
    ids.insert(ids.end(), s.res.tokens.begin(), s.res.tokens.end());
    ids.resize(std::min(ids.size(), static_cast<size_t>(length)));
    auto rows = mRunners.prefixCopy(s.slot, static_cast<int32_t>(ids.size()), s.usesDrafter());
    mCache->store(std::move(ids), std::move(rows), std::move(s.snapshots), mRunners.targetSnapshot(s.slot), length);
}

// BatchDecoder._finish: the slot is freed (the backend told), the result handed out by takeFinished
void BatchDecoder::finish(Seq& s, dfl2_code error, std::string const& message)
{
    s.done = true;
    if (s.sampler)
    {
        s.res.logprobs = s.sampler->logprobs();
    }
    if (error == DFL2_OK && s.slot >= 0)
    {
        try
        {
            storePrefix(s);  // (a failure to keep it is not the request's)
        }
        catch (...)
        {
        }
    }
    BatchFinished f{s.id, std::move(s.res), error, message};
    if (s.slot >= 0)
    {
        f.result.elapsedS = secondsBetween(s.t0, Clock::now());
        mSlotUsed[static_cast<size_t>(s.slot)] = false;
        mCacheLength[static_cast<size_t>(s.slot)] = 0;
        try
        {
            mRunners.targetRelease(s.slot);
        }
        catch (...)
        {
            auto const [code, why] = errorOfCurrentException();
            if (f.error == DFL2_OK)
            {
                f.error = code;
                f.message = why;
            }
        }
    }
    f.result.finish = f.error != DFL2_OK ? DFL2_FINISH_ERROR : finishReason(f.result, s.req.config, s.cancelled);
    mFinished.push_back(std::move(f));
}

} // namespace dflash2
