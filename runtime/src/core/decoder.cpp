//! \file decoder.cpp
//! The decoding loop and its steps; see decoder.h. Each function names its Python twin.
#include "decoder.h"

#include "ngram.h"
#include "prefixCache.h"
#include "sampling.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

namespace dflash2
{

std::pair<dfl2_code, std::string> errorOfCurrentException()
{
    try
    {
        throw;
    }
    catch (Error const& e)
    {
        return {e.code(), e.what()};
    }
    catch (std::bad_alloc const&)
    {
        return {DFL2_ERR_OUT_OF_MEMORY, "out of memory"};
    }
    catch (std::exception const& e)
    {
        return {DFL2_ERR_INTERNAL, std::string("internal error: ") + e.what()};
    }
    catch (...)
    {
        return {DFL2_ERR_INTERNAL, "internal error"};
    }
}

void SplitMixUniforms::draw(dfl2_uniform_use use, double* out, size_t n)
{
    for (size_t i = 0; i < n; ++i)
    {
        mState += 0x9E3779B97F4A7C15ULL;
        uint64_t z = mState;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        z ^= z >> 31;
        out[i] = use == DFL2_UNIFORM_DRAFT ? static_cast<double>(z >> 40) * (1.0 / 16777216.0)
                                           : static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
    }
}

namespace
{

// numpy's pairwise summation (umath loops_utils) in the array's own type T (np.sum of a float32 row adds in
// float32): blocks of 8 accumulators up to 128 elements, halves (rounded to multiples of 8) above. Reproducing its
// grouping makes our sums bit-equal to np.sum.
template <typename T>
T pairwiseSumOf(T const* a, size_t n)
{
    if (n < 8)
    {
        T res = 0;
        for (size_t i = 0; i < n; ++i)
        {
            res += a[i];
        }
        return res;
    }
    if (n <= 128)
    {
        T r[8];
        for (size_t j = 0; j < 8; ++j)
        {
            r[j] = a[j];
        }
        size_t i = 8;
        for (; i < n - (n % 8); i += 8)
        {
            for (size_t j = 0; j < 8; ++j)
            {
                r[j] += a[i + j];
            }
        }
        T res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i)
        {
            res += a[i];
        }
        return res;
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwiseSumOf(a, n2) + pairwiseSumOf(a + n2, n - n2);
}

} // namespace

double pairwiseSum(double const* a, size_t n)
{
    return pairwiseSumOf(a, n);
}

float pairwiseSum(float const* a, size_t n)
{
    return pairwiseSumOf(a, n);
}

// acceptance.softmax_t (one row)
template <typename T>
static void softmaxOf(T const* logits, size_t V, double temperature, double* out)
{
    double m = -INFINITY;
    for (size_t v = 0; v < V; ++v)
    {
        out[v] = static_cast<double>(logits[v]) / temperature;
        m = std::max(m, out[v]);
    }
    for (size_t v = 0; v < V; ++v)
    {
        out[v] = std::exp(out[v] - m);
    }
    double const s = pairwiseSum(out, V);
    for (size_t v = 0; v < V; ++v)
    {
        out[v] /= s;
    }
}

void softmaxT(float const* logits, size_t V, double temperature, double* out)
{
    softmaxOf(logits, V, temperature, out);
}

void softmaxT(double const* logits, size_t V, double temperature, double* out)
{
    softmaxOf(logits, V, temperature, out);
}

// numpy Generator.choice(n, p=p): cdf = cumsum(p); cdf /= cdf[-1]; searchsorted(cdf, u, side="right")
int32_t choiceIndex(double const* p, size_t n, double u)
{
    std::vector<double> cdf(n);
    double acc = 0.0;
    for (size_t i = 0; i < n; ++i)
    {
        acc += p[i];
        cdf[i] = acc;
    }
    double const last = cdf[n - 1];
    for (size_t i = 0; i < n; ++i)
    {
        cdf[i] /= last;
    }
    size_t const idx = static_cast<size_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
    return static_cast<int32_t>(std::min(idx, n - 1));  // u < 1 = cdf[-1] keeps idx < n; guard anyway
}

template <typename T>
static int32_t argmaxOf(T const* row, size_t n)
{
    size_t best = 0;
    for (size_t i = 1; i < n; ++i)
    {
        if (row[i] > row[best])
        {
            best = i;
        }
    }
    return static_cast<int32_t>(best);
}

int32_t argmaxRow(float const* row, size_t n)
{
    return argmaxOf(row, n);
}

int32_t argmaxRow(double const* row, size_t n)
{
    return argmaxOf(row, n);
}

// protocol.independent_draft, numpy's float32 arithmetic step by step (z = logits / float32(T), e = exp(z - max z),
// q = e / pairwise sum(e), a sequential cumsum); exp is the C library's expf (see decoder.h)
void independentDraft(
    float const* logits, int32_t L, int32_t V, float temperature, float const* uniforms, int32_t topK, Draft& out)
{
    if (temperature > 0 && uniforms == nullptr)
    {
        throw Error(DFL2_ERR_INTERNAL, "an independent draft at temperature > 0 needs its rows' uniforms");
    }
    size_t const nV = static_cast<size_t>(V);
    size_t const K = static_cast<size_t>(std::max(1, std::min(topK, V)));
    out.tokens.assign(static_cast<size_t>(L), 0);
    out.cand.assign(static_cast<size_t>(L) * K, 0);
    out.proposal.assign(static_cast<size_t>(L) * K, 0.0F);
    out.hasVocabProposal = temperature > 0;
    out.vocabProposal.assign(out.hasVocabProposal ? static_cast<size_t>(L) * nV : 0, 0.0F);
    std::vector<int32_t> order(nV);
    std::vector<float> e(nV);
    for (int32_t r = 0; r < L; ++r)
    {
        float const* row = logits + static_cast<size_t>(r) * nV;
        // the row's top K by value descending, then index ascending
        for (size_t v = 0; v < nV; ++v)
        {
            order[v] = static_cast<int32_t>(v);
        }
        std::partial_sort(order.begin(), order.begin() + static_cast<long>(K), order.end(), [row](int32_t a, int32_t b) {
            return row[a] > row[b] || (row[a] == row[b] && a < b);
        });
        int32_t* cand = out.cand.data() + static_cast<size_t>(r) * K;
        std::copy_n(order.begin(), K, cand);
        float* proposal = out.proposal.data() + static_cast<size_t>(r) * K;
        int32_t& token = out.tokens[static_cast<size_t>(r)];
        if (!(temperature > 0))
        {
            token = argmaxRow(row, nV);
            for (size_t k = 0; k < K; ++k)
            {
                proposal[k] = cand[k] == token ? 1.0F : 0.0F;
            }
            continue;
        }
        float m = -INFINITY;
        for (size_t v = 0; v < nV; ++v)
        {
            e[v] = row[v] / temperature;
            m = std::max(m, e[v]);
        }
        for (size_t v = 0; v < nV; ++v)
        {
            e[v] = std::exp(e[v] - m);
        }
        float const sum = pairwiseSum(e.data(), nV);
        float* q = out.vocabProposal.data() + static_cast<size_t>(r) * nV;
        float const u = uniforms[r];
        float cdf = 0.0F;
        int32_t below = 0;
        for (size_t v = 0; v < nV; ++v)
        {
            q[v] = e[v] / sum;
            cdf += q[v];
            below += cdf <= u ? 1 : 0;
        }
        token = std::min(below, V - 1);
        for (size_t k = 0; k < K; ++k)
        {
            proposal[k] = q[cand[k]];
        }
    }
}

// acceptance.accept_greedy
std::pair<int32_t, int32_t> acceptGreedy(int32_t const* drafts, int32_t n, float const* logits, size_t V)
{
    int32_t acc = 0;
    while (acc < n && drafts[acc] == argmaxRow(logits + static_cast<size_t>(acc) * V, V))
    {
        ++acc;
    }
    return {acc, argmaxRow(logits + static_cast<size_t>(acc) * V, V)};
}

// acceptance.accept_greedy over transformed (float64) rows
static std::pair<int32_t, int32_t> acceptGreedyRows(int32_t const* drafts, int32_t n, double const* logits, size_t V)
{
    int32_t acc = 0;
    while (acc < n && drafts[acc] == argmaxRow(logits + static_cast<size_t>(acc) * V, V))
    {
        ++acc;
    }
    return {acc, argmaxRow(logits + static_cast<size_t>(acc) * V, V)};
}

static double drawOne(UniformSource& uniforms)
{
    double u = 0.0;
    uniforms.draw(DFL2_UNIFORM_ACCEPT, &u, 1);
    return u;
}

// acceptance.accept_rejection: a uniform is drawn only when q > 0 (Python's `and` short-circuits)
std::pair<int32_t, int32_t> acceptRejection(
    int32_t const* drafts, int32_t n, double const* q, double const* p, size_t V, UniformSource& uniforms)
{
    for (int32_t t = 0; t < n; ++t)
    {
        double const* pt = p + static_cast<size_t>(t) * V;
        double const* qt = q + static_cast<size_t>(t) * V;
        int32_t const d = drafts[t];
        double const pd = pt[d];
        double const qd = qt[d];
        if (qd > 0 && drawOne(uniforms) < std::min(1.0, pd / qd))
        {
            continue;
        }
        std::vector<double> resid(V);
        for (size_t v = 0; v < V; ++v)
        {
            resid[v] = std::max(pt[v] - qt[v], 0.0);
        }
        double const s = pairwiseSum(resid.data(), V);
        if (s <= 0)
        {
            std::copy(pt, pt + V, resid.begin());
        }
        else
        {
            for (double& r : resid)
            {
                r /= s;
            }
        }
        return {t, choiceIndex(resid.data(), V, drawOne(uniforms))};
    }
    return {n, choiceIndex(p + static_cast<size_t>(n) * V, V, drawOne(uniforms))};
}

// acceptance.acceptance_stats
Stats acceptanceStats(std::vector<int32_t> const& accepted, std::vector<int32_t> const& proposed)
{
    Stats s;
    if (accepted.empty())
    {
        return s;
    }
    int32_t const lmax = *std::max_element(proposed.begin(), proposed.end());
    for (int32_t i = 1; i <= lmax; ++i)
    {
        size_t eligible = 0;
        size_t hit = 0;
        for (size_t c = 0; c < accepted.size(); ++c)
        {
            if (proposed[c] >= i)
            {
                ++eligible;
                hit += accepted[c] >= i ? 1 : 0;
            }
        }
        double const r = eligible ? static_cast<double>(hit) / static_cast<double>(eligible) : 0.0;
        s.cumulative.push_back(r);
        double const prev = i == 1 ? 1.0 : s.cumulative[s.cumulative.size() - 2];
        s.conditional.push_back(prev > 0 ? r / prev : 0.0);
    }
    double total = 0.0;
    for (int32_t a : accepted)
    {
        total += a + 1;
    }
    s.tau = total / static_cast<double>(accepted.size());
    s.cycles = static_cast<int32_t>(accepted.size());
    return s;
}

Stats resultStats(Result const& r)
{
    Stats s = acceptanceStats(r.accepted, r.proposed);
    if (!r.oracleAccepted.empty())
    {
        double total = 0.0;
        for (int32_t o : r.oracleAccepted)
        {
            total += o + 1;
        }
        s.oracleTau = total / static_cast<double>(r.oracleAccepted.size());
    }
    return s;
}

// request.GenerationRequest.validate (check_limits)
void checkPrompt(std::vector<int32_t> const& prompt, Runners const& runners, int64_t maxNewTokens)
{
    checkPrompt(prompt, runners.vocabSize(), runners.maxPositions(), maxNewTokens);
}

//! The planted bug of the generation fuzz test (DFLASH2_PLANT_PROMPT_ID_PAST_VOCAB=1): the prompt check lets the
//! id V through, so tests/test_capi.py shows runtime/tests/fuzzGenerate finding it. Never set it otherwise.
static bool plantedPromptIdPastVocab()
{
    char const* v = std::getenv("DFLASH2_PLANT_PROMPT_ID_PAST_VOCAB");
    return v != nullptr && std::strcmp(v, "1") == 0;
}

void checkPrompt(std::vector<int32_t> const& prompt, int32_t V, int32_t maxPositions, int64_t maxNewTokens)
{
    if (prompt.empty())
    {
        throw Error(DFL2_ERR_INVALID_ARGUMENT, "empty prompt");
    }
    int32_t const past = plantedPromptIdPastVocab() ? V + 1 : V;
    for (int32_t t : prompt)
    {
        if (t < 0 || t >= past)
        {
            throw Error(DFL2_ERR_OUT_OF_RANGE,
                "prompt token id " + std::to_string(t) + " out of range [0, " + std::to_string(V) + ")");
        }
    }
    if (static_cast<int64_t>(prompt.size()) + 1 > maxPositions)
    {
        throw Error(DFL2_ERR_TOO_LONG,
            "prompt of " + std::to_string(prompt.size()) + " tokens does not fit the "
                + std::to_string(maxPositions)
                + " positions available (the export's --max-seq-len)");
    }
    if (maxNewTokens < 1)
    {
        throw Error(DFL2_ERR_OPTION_VALUE, "max_new_tokens must be >= 1, got " + std::to_string(maxNewTokens));
    }
}

namespace
{

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t0)
{
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

int64_t lengthLimit(Runners const& runners, std::vector<int32_t> const& prompt, GenerateConfig const& cfg)
{
    return std::min<int64_t>(cfg.maxNewTokens, runners.maxPositions() - static_cast<int64_t>(prompt.size()));
}

void finish(Result& res, GenerateConfig const& cfg, bool cancelled)
{
    res.finish = finishReason(res, cfg, cancelled);
}

// bench/oracle.oracle_count: leading rows whose target continuation is among the row's candidates
// (K: the draft's candidates per row, 1 for a lookup's)
int32_t oracleCount(Runners& runners, Draft const& draft, int32_t K, std::vector<int32_t> const& drafts, int32_t nRows,
    int32_t accepted, int32_t bonus, int32_t pos, std::vector<float>& logits)
{
    size_t const V = static_cast<size_t>(runners.vocabSize());
    std::vector<int32_t> known(drafts.begin(), drafts.begin() + accepted);
    known.push_back(bonus);
    int32_t const base = pos + accepted + 1;
    int32_t o = 0;
    while (o < nRows)
    {
        if (o == static_cast<int32_t>(known.size()))
        {
            std::vector<int32_t> fed(known.begin() + accepted, known.end());
            fed.insert(fed.end(), drafts.begin() + static_cast<long>(known.size()), drafts.begin() + nRows);
            runners.targetForward(fed.data(), static_cast<int32_t>(fed.size()), logits);
            runners.targetCrop(base);
            size_t j = known.size() - static_cast<size_t>(accepted) - 1;
            known.push_back(argmaxRow(logits.data() + j * V, V));
            while (static_cast<int32_t>(known.size()) < nRows && j + 1 < fed.size() && fed[j + 1] == known.back())
            {
                ++j;
                known.push_back(argmaxRow(logits.data() + j * V, V));
            }
        }
        int32_t const* row = draft.cand.data() + static_cast<size_t>(o) * static_cast<size_t>(K);
        if (std::find(row, row + K, known[static_cast<size_t>(o)]) == row + K)
        {
            break;
        }
        ++o;
    }
    return o;
}

// accept.proposal_in_vocab: q over the candidates scattered into the vocabulary [nRows, V] float64
// (float32 values, the last duplicate candidate wins, as numpy's put_along_axis)
void proposalInVocab(Draft const& draft, int32_t nRows, size_t V, int32_t K, std::vector<double>& q)
{
    q.assign(static_cast<size_t>(nRows) * V, 0.0);
    for (int32_t t = 0; t < nRows; ++t)
    {
        double* row = q.data() + static_cast<size_t>(t) * V;
        if (draft.hasVocabProposal)
        {
            float const* src = draft.vocabProposal.data() + static_cast<size_t>(t) * V;
            std::copy(src, src + V, row);
            continue;
        }
        for (int32_t k = 0; k < K; ++k)
        {
            size_t const i = static_cast<size_t>(t) * static_cast<size_t>(K) + static_cast<size_t>(k);
            row[static_cast<size_t>(draft.cand[i])] = static_cast<double>(draft.proposal[i]);
        }
    }
}

} // namespace

bool isEos(GenerateConfig const& cfg, int32_t t)
{
    return std::find(cfg.eosIds.begin(), cfg.eosIds.end(), t) != cfg.eosIds.end();
}

// accept.next_token
int32_t nextToken(float const* logits, size_t V, double temperature, UniformSource& uniforms, Sampler* sampler)
{
    if (sampler != nullptr)
    {
        double const* x = sampler->logits(logits, 1, nullptr);  // [1, V]
        if (temperature <= 0)
        {
            return argmaxRow(x, V);
        }
        std::vector<double> p(V);
        sampler->law(x, 1, temperature, p.data());
        return choiceIndex(p.data(), V, drawOne(uniforms));
    }
    if (temperature <= 0)
    {
        return argmaxRow(logits, V);
    }
    std::vector<double> p(V);
    softmaxT(logits, V, temperature, p.data());
    return choiceIndex(p.data(), V, drawOne(uniforms));
}

void drawDraftUniforms(UniformSource& uniforms, std::vector<double>& u64, std::vector<float>& u32)
{
    uniforms.draw(DFL2_UNIFORM_DRAFT, u64.data(), u64.size());
    u32.resize(u64.size());
    for (size_t i = 0; i < u64.size(); ++i)
    {
        u32[i] = static_cast<float>(u64[i]);
    }
}

void checkDraft(Draft const& draft, int32_t nRows, int32_t K, int32_t V)
{
    for (int32_t t = 0; t < nRows; ++t)
    {
        int32_t const d = draft.tokens[static_cast<size_t>(t)];
        if (d < 0 || d >= V)
        {
            throw Error(DFL2_ERR_OUT_OF_RANGE,
                "drafter proposed token id " + std::to_string(d) + " out of range [0, " + std::to_string(V) + ")");
        }
        for (int32_t k = 0; k < K; ++k)
        {
            int32_t const c = draft.cand[static_cast<size_t>(t * K + k)];
            if (c < 0 || c >= V)
            {
                throw Error(DFL2_ERR_OUT_OF_RANGE,
                    "drafter candidate id " + std::to_string(c) + " out of range [0, " + std::to_string(V) + ")");
            }
        }
    }
}

std::pair<int32_t, int32_t> acceptDrafts(Draft const& draft, std::vector<int32_t> const& drafts,
    float const* logits, int32_t V, int32_t K, double temperature, UniformSource& uniforms, Sampler* sampler)
{
    size_t const Vs = static_cast<size_t>(V);
    int32_t const nRows = static_cast<int32_t>(drafts.size());
    double const* x = sampler != nullptr ? sampler->logits(logits, nRows + 1, drafts.data()) : nullptr;  // [n+1, V]
    if (temperature <= 0)
    {
        return x != nullptr ? acceptGreedyRows(drafts.data(), nRows, x, Vs)
                            : acceptGreedy(drafts.data(), nRows, logits, Vs);
    }
    std::vector<double> p(static_cast<size_t>(nRows + 1) * Vs);
    if (x != nullptr)
    {
        sampler->law(x, nRows + 1, temperature, p.data());
    }
    for (int32_t r = 0; x == nullptr && r <= nRows; ++r)
    {
        softmaxT(logits + static_cast<size_t>(r) * Vs, Vs, temperature, p.data() + static_cast<size_t>(r) * Vs);
    }
    std::vector<double> q;
    proposalInVocab(draft, nRows, Vs, K, q);
    return acceptRejection(drafts.data(), nRows, q.data(), p.data(), Vs, uniforms);
}

std::vector<int32_t> committedTokens(
    std::vector<int32_t> const& drafts, int32_t accepted, int32_t bonus, GenerateConfig const& cfg)
{
    std::vector<int32_t> fresh(drafts.begin(), drafts.begin() + accepted);
    fresh.push_back(bonus);
    for (size_t i = 0; i < fresh.size(); ++i)
    {
        if (isEos(cfg, fresh[i]))
        {
            fresh.resize(i + 1);
            break;
        }
    }
    return fresh;
}

dfl2_finish_reason finishReason(Result const& r, GenerateConfig const& cfg, bool cancelled)
{
    return cancelled                                        ? DFL2_FINISH_CANCELLED
        : (!r.tokens.empty() && isEos(cfg, r.tokens.back())) ? DFL2_FINISH_EOS
                                                             : DFL2_FINISH_LENGTH;
}

std::optional<Sampler> samplerOf(GenerateConfig const& cfg, std::vector<int32_t> const& prompt, int32_t V)
{
    if (cfg.sampling.identity() && !cfg.sampling.logprobs)
    {
        return std::nullopt;  // the loops' numbers unchanged to the bit
    }
    return Sampler(cfg.sampling, prompt, V, cfg.temperature);
}

// decoder.target_generate
Result targetGenerate(Runners& runners, std::vector<int32_t> const& prompt, GenerateConfig const& cfg,
    UniformSource& uniforms, TokenSink const& sink, PrefixCache* cache)
{
    checkPrompt(prompt, runners, cfg.maxNewTokens);
    size_t const V = static_cast<size_t>(runners.vocabSize());
    Result res;
    auto const t0 = Clock::now();
    std::vector<float> logits;
    int32_t start = 0;
    if (cache != nullptr)
    {
        start = cache->prefillFrom(prompt, runners, false);  // plain decoding keeps no drafter context
    }
    else
    {
        runners.targetReset();
    }
    int32_t const rest = static_cast<int32_t>(prompt.size()) - start;
    runners.targetForwardLast(prompt.data() + start, rest, logits);  // [1, V]: the last row's
    res.cachedTokens = start;
    if (cache != nullptr)
    {
        cache->snapshot(runners);
    }
    std::optional<Sampler> sampler = samplerOf(cfg, prompt, runners.vocabSize());
    Sampler* const s = sampler ? &*sampler : nullptr;
    int32_t tok = nextToken(logits.data(), V, cfg.temperature, uniforms, s);
    res.tokens.push_back(tok);
    if (s != nullptr)
    {
        s->commit(&tok, 1);
    }
    bool cancelled = sink && !sink(&tok, 1);
    int64_t const limit = lengthLimit(runners, prompt, cfg);
    while (!cancelled && static_cast<int64_t>(res.tokens.size()) < limit && !isEos(cfg, tok))
    {
        runners.targetForward(&tok, 1, logits);
        tok = nextToken(logits.data(), V, cfg.temperature, uniforms, s);
        res.tokens.push_back(tok);
        if (s != nullptr)
        {
            s->commit(&tok, 1);
        }
        cancelled = sink && !sink(&tok, 1);
    }
    if (s != nullptr)
    {
        res.logprobs = s->logprobs();
    }
    res.elapsedS = secondsSince(t0);
    finish(res, cfg, cancelled);
    if (cache != nullptr)
    {
        cache->store(prompt, res.tokens, runners, false);
    }
    return res;
}

namespace
{

//! One cycle's drafts between the steps draft -> verify -> commit (the tuple _SpeculativeLoop.draft returns).
struct Cycle
{
    Proposer who{Proposer::kNONE};
    std::vector<int32_t> drafts;  //!< [nRows] the tokens to verify
    int32_t nRows{0};             //!< rows verified (fewer in a final partial block)
    int32_t draftK{0};            //!< candidates per row of the proposal (1 for a lookup's one-hot)
};

//! decoder._SpeculativeLoop: one request's state through the named steps of speculativeGenerate (prefill, pick,
//! plainStep, draft, verify, commit, finish). Uniforms are drawn in the Python loop's order: the first token, then
//! per cycle the drafter's, then the rejection test's.
class SpeculativeLoop
{
public:
    SpeculativeLoop(Runners& runners, std::vector<int32_t> const& prompt, GenerateConfig const& cfg,
        UniformSource& uniforms, TokenSink const& sink, PrefixCache* cache)
        : mRunners(runners)
        , mPrompt(prompt)
        , mCfg(cfg)
        , mUniforms(uniforms)
        , mSink(sink)
        , mV(runners.vocabSize())
        , mL(runners.blockSize() - 1)
        , mK(runners.topK())
        , mLimit(lengthLimit(runners, prompt, cfg))
        , mT0(Clock::now())
        , mU64(static_cast<size_t>(mL))
        , mU32(static_cast<size_t>(mL))
        , mSampler(samplerOf(cfg, prompt, runners.vocabSize()))
        , mCache(cache)
    {
        if (cfg.guard)
        {
            mGuard.emplace(*cfg.guard);
        }
    }

    bool running() const
    {
        return !mCancelled && static_cast<int64_t>(mRes.tokens.size()) < mLimit && !isEos(mCfg, mAnchor);
    }

    //! target KV cache + context features of every prompt position (those the prefix cache keeps, then the rest
    //! computed); the first anchor
    void prefill()
    {
        int32_t start = 0;
        if (mCache != nullptr)
        {
            start = mCache->prefillFrom(mPrompt, mRunners, usesDrafter(mCfg.proposer));
        }
        else
        {
            mRunners.targetReset();
            mRunners.drafterReset();
        }
        int32_t const n = static_cast<int32_t>(mPrompt.size());
        mRunners.targetForwardLast(mPrompt.data() + start, n - start, mLogits);  // [1, V]: the last row's
        mRes.cachedTokens = start;
        if (mCache != nullptr)
        {
            mCache->snapshot(mRunners);
        }
        mAnchor = nextToken(mLogits.data(), vocab(), mCfg.temperature, mUniforms, sampler());
        mRes.tokens.push_back(mAnchor);
        emit(&mAnchor, 1);
        std::vector<int32_t> context = mPrompt;
        context.push_back(mAnchor);
        int32_t const lookupRows = mCfg.ngramRows > 0 ? mCfg.ngramRows : defaultLookupRows(mL);
        mChoice = ProposerChoice(mCfg.proposer, std::move(context), lookupRows);
        if (mChoice.usesDrafter())
        {
            mRunners.drafterQueueContext(n - start);
            mRunners.drafterAddContext(start);
        }
        mPos = n;
    }

    //! (the lookup's drafts, who proposes: kDFLASH2 | kNGRAM | kNONE for a plain step). The guard rules the drafter
    //! alone: while it says plain steps, a lookup that pays still runs.
    std::pair<std::vector<int32_t>, Proposer> pick()
    {
        std::vector<int32_t> lookedUp = mChoice.ngram(room());
        Proposer const who
            = mChoice.pick(lookedUp, mGuard ? mGuard->tStep() : std::nullopt, !mGuard || !mGuard->plainNext());
        return {std::move(lookedUp), who};
    }

    //! the target's own next token (exactly targetGenerate's step)
    void plainStep(Clock::time_point tStep)
    {
        mRunners.targetForward(&mAnchor, 1, mLogits);  // [1, V]
        mAnchor = nextToken(mLogits.data(), vocab(), mCfg.temperature, mUniforms, sampler());
        if (mChoice.usesDrafter())
        {
            mRunners.drafterQueueContext(1);
            ++mPending;
        }
        ++mPos;
        mRes.tokens.push_back(mAnchor);
        mChoice.extend(&mAnchor, 1);
        ++mRes.plainSteps;
        emit(&mAnchor, 1);
        if (mGuard)
        {
            mGuard->recordStep(secondsSince(tStep));
        }
    }

    //! the drafts to verify: a lookup's as they are (a one-hot proposal), or the drafter's after its pending positions
    //! join its context in one pass; a final partial block verifies fewer rows; all bs rows always run, as in training
    Cycle draft(Proposer who, std::vector<int32_t> lookedUp)
    {
        Cycle c;
        c.who = who;
        if (who == Proposer::kNGRAM)  // prompt lookup: deterministic drafts, a one-hot proposal
        {
            c.drafts = std::move(lookedUp);
            c.nRows = static_cast<int32_t>(c.drafts.size());
            c.draftK = 1;
            mDraft = lookupDraft(c.drafts);
            return c;
        }
        if (mPending > 0)  // the drafter runs: the pending positions join in one pass
        {
            mRunners.drafterAddContext(mPos - mPending);
            mPending = 0;
        }
        c.nRows = static_cast<int32_t>(std::min<int64_t>(mL, room()));
        c.draftK = mK;
        bool const sampling = mCfg.temperature > 0;
        if (sampling)
        {
            drawDraftUniforms(mUniforms, mU64, mU32);
        }
        mRunners.drafterPropose(
            mAnchor, mPos, c.nRows, static_cast<float>(mCfg.temperature), sampling ? mU32.data() : nullptr, mDraft);
        checkDraft(mDraft, c.nRows, mK, mV);  // rows past nRows are never read
        if (mSampler && sampling)
        {
            mSampler->redraw(mDraft, mU32.data(), c.nRows);  // an independent draft from the transformed law
        }
        c.drafts.assign(mDraft.tokens.begin(), mDraft.tokens.begin() + c.nRows);
        return c;
    }

    //! the target on [anchor, d_1..d_n] at positions pos..pos+n, then acceptance -> (accepted, bonus token)
    std::pair<int32_t, int32_t> verify(Cycle const& c)
    {
        mVerifyIds.assign(1, mAnchor);
        mVerifyIds.insert(mVerifyIds.end(), c.drafts.begin(), c.drafts.end());
        mRunners.targetForward(mVerifyIds.data(), c.nRows + 1, mLogits);  // [nRows + 1, V]
        return acceptDrafts(mDraft, c.drafts, mLogits.data(), mV, c.draftK, mCfg.temperature, mUniforms, sampler());
    }

    //! crop the target cache; committed positions become draft context (a lookup's wait for the drafter); the
    //! cycle's tokens (up to an accepted EOS: drafts after it are not committed, so they do not count for τ) and counts
    void commit(Cycle const& c, int32_t acc, int32_t bonus, Clock::time_point tStep)
    {
        mRunners.targetCrop(mPos + acc + 1);
        if (mChoice.usesDrafter())
        {
            mRunners.drafterQueueContext(acc + 1);
            if (c.who == Proposer::kNGRAM)
            {
                mPending += acc + 1;
            }
            else
            {
                mRunners.drafterAddContext(mPos);
            }
        }
        std::vector<int32_t> const fresh = committedTokens(c.drafts, acc, bonus, mCfg);
        mRes.accepted.push_back(std::min(acc, static_cast<int32_t>(fresh.size())));
        mRes.proposed.push_back(c.nRows);
        mRes.proposers.push_back(static_cast<int32_t>(c.who));
        mChoice.extend(fresh.data(), fresh.size());
        mChoice.record(c.who, static_cast<int32_t>(fresh.size()), secondsSince(tStep));
        double cycleOracleS = 0.0;
        if (mCfg.measureOracle)
        {
            auto const tO = Clock::now();
            mRes.oracleAccepted.push_back(
                oracleCount(mRunners, mDraft, c.draftK, c.drafts, c.nRows, acc, bonus, mPos, mLogits));
            cycleOracleS = secondsSince(tO);
            mOracleS += cycleOracleS;
        }
        mRes.tokens.insert(mRes.tokens.end(), fresh.begin(), fresh.end());
        emit(fresh.data(), fresh.size());
        mPos += acc + 1;
        mAnchor = fresh.back();
        if (mGuard && c.who == Proposer::kDFLASH2)
        {
            mGuard->recordCycle(static_cast<int32_t>(fresh.size()), secondsSince(tStep) - cycleOracleS);
        }
    }

    Result finish()
    {
        if (mGuard)
        {
            mRes.guardSwitches = mGuard->switches();
            mRes.guardProbes = mGuard->probes();
        }
        if (mSampler)
        {
            mRes.logprobs = mSampler->logprobs();
        }
        mRes.elapsedS = secondsSince(mT0) - mOracleS;
        dflash2::finish(mRes, mCfg, mCancelled);
        if (mCache != nullptr)  // the finished sequence is kept (its positions, the drafter's context and queue)
        {
            mCache->store(mPrompt, mRes.tokens, mRunners, mChoice.usesDrafter());
        }
        return std::move(mRes);
    }

private:
    size_t vocab() const
    {
        return static_cast<size_t>(mV);
    }
    //! tokens still to make after the next one (a cycle's drafts fit before the limit)
    int64_t room() const
    {
        return mLimit - static_cast<int64_t>(mRes.tokens.size()) - 1;
    }
    Sampler* sampler()
    {
        return mSampler ? &*mSampler : nullptr;
    }
    void emit(int32_t const* tokens, size_t n)
    {
        if (mSampler)
        {
            mSampler->commit(tokens, n);
        }
        mCancelled = mSink && !mSink(tokens, n);
    }

    Runners& mRunners;
    std::vector<int32_t> const& mPrompt;
    GenerateConfig const& mCfg;
    UniformSource& mUniforms;
    TokenSink const& mSink;
    int32_t const mV;
    int32_t const mL;
    int32_t const mK;
    int64_t const mLimit;
    Clock::time_point const mT0;
    Result mRes;
    double mOracleS{0.0};  //!< oracle passes, excluded from the timing
    bool mCancelled{false};
    int32_t mAnchor{-1};
    int32_t mPos{0};  //!< the anchor's position
    //! rows of committed positions queued in the backend, not yet in the draft context: plain steps and
    //! prompt-lookup cycles add none until the drafter runs again, then all of them in one pass
    int32_t mPending{0};
    ProposerChoice mChoice;
    std::optional<AcceptanceGuard> mGuard;
    std::vector<float> mLogits;  //!< [rows, V] of the latest target forward
    Draft mDraft;
    std::vector<double> mU64;
    std::vector<float> mU32;
    std::vector<int32_t> mVerifyIds;
    std::optional<Sampler> mSampler;  //!< the request's transforms and logprobs (none: the raw target law)
    PrefixCache* mCache;  //!< the session's kept prefix (nullptr: none)
};

} // namespace

// decoder.speculative_generate (every drafter row verified; the acceptance guard when cfg.guard is set). The loop, top
// to bottom: prefill, then per step the proposer's pick, a plain step or draft -> verify + accept -> commit.
Result speculativeGenerate(Runners& runners, std::vector<int32_t> const& prompt, GenerateConfig const& cfg,
    UniformSource& uniforms, TokenSink const& sink, PrefixCache* cache)
{
    checkPrompt(prompt, runners, cfg.maxNewTokens);
    SpeculativeLoop loop(runners, prompt, cfg, uniforms, sink, cache);
    loop.prefill();
    while (loop.running())
    {
        auto const tStep = Clock::now();
        auto [lookedUp, who] = loop.pick();
        if (who == Proposer::kNONE)
        {
            loop.plainStep(tStep);
            continue;
        }
        Cycle const c = loop.draft(who, std::move(lookedUp));
        auto const [acc, bonus] = loop.verify(c);
        loop.commit(c, acc, bonus, tStep);
    }
    return loop.finish();
}

} // namespace dflash2
