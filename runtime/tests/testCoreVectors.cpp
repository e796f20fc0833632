// The C++ decoding core against vectors written by the Python reference (tests/test_capi.py): the step
// functions (softmax, choice, greedy and rejection acceptance, statistics), the batched loop's speculation rule
// over measured costs (batch.SpeculationRule / MeasuredCosts), the acceptance guard (guard.AcceptanceGuard: every
// field after every call, bit for bit), and whole loops replayed from recorded runner
// calls — the core must make the same calls with the same arguments, draw the same uniforms, and produce the
// same tokens, per-cycle counts and metrics.
//
// usage: coreVectors VECTORS.json
#include "core/batch.h"
#include "core/decoder.h"
#include "core/guard.h"
#include "core/ngram.h"
#include "core/sampling.h"

#include "dfl2Test.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

using nlohmann::json;
using namespace dflash2;

namespace
{

int gChecks = 0;

void check(bool ok, std::string const& what)
{
    ++gChecks;
    if (!ok)
    {
        ++*dfl2TestCounter();
        std::cerr << "FAIL: " << what << "\n";
    }
}

template <typename T>
std::vector<T> flat(json const& j)
{
    std::vector<T> out;
    if (j.is_array() && !j.empty() && j[0].is_array())
    {
        for (json const& row : j)
        {
            for (json const& v : row)
            {
                out.push_back(v.get<T>());
            }
        }
    }
    else
    {
        for (json const& v : j)
        {
            out.push_back(v.get<T>());
        }
    }
    return out;
}

bool close(double a, double b, double tol)
{
    return std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b));
}

//! runtime/sampling.py's settings as the vectors write them (null: none)
SamplingConfig samplingOf(json const& j)
{
    SamplingConfig c;
    if (j.is_null())
    {
        return c;
    }
    for (json const& b : j.value("logit_bias", json::array()))
    {
        c.logitBias.emplace_back(b[0].get<int32_t>(), b[1].get<double>());
    }
    c.repetitionPenalty = j.value("repetition_penalty", 1.0);
    c.presencePenalty = j.value("presence_penalty", 0.0);
    c.frequencyPenalty = j.value("frequency_penalty", 0.0);
    c.topK = j.value("top_k", 0);
    c.topP = j.value("top_p", 1.0);
    c.minP = j.value("min_p", 0.0);
    c.logprobs = j.value("logprobs", false);
    c.topLogprobs = j.value("top_logprobs", 0);
    return c;
}

double orMinusInf(json const& x)
{
    return x.is_null() ? -INFINITY : x.get<double>();
}

//! logprobs against the vectors' (null: -inf), within tol; the top ids exactly
bool sameLogprobs(std::vector<TokenLogprob> const& got, json const& want, double tol)
{
    if (got.size() != want.size())
    {
        return false;
    }
    for (size_t i = 0; i < got.size(); ++i)
    {
        json const& w = want[i];
        double const lp = orMinusInf(w["logprob"]);
        bool const sameLp = std::isinf(lp) ? std::isinf(got[i].logprob) && got[i].logprob < 0 : close(got[i].logprob, lp, tol);
        if (got[i].token != w["token"].get<int32_t>() || !sameLp || got[i].topIds != flat<int32_t>(w["top_ids"]))
        {
            return false;
        }
        std::vector<double> const top = flat<double>(w["top_logprobs"]);
        for (size_t k = 0; k < top.size(); ++k)
        {
            if (!close(got[i].topLogprobs[k], top[k], tol))
            {
                return false;
            }
        }
    }
    return true;
}

//! float64 values against the vectors' (null: -inf), within tol
bool sameValues(double const* got, json const& want, double tol)
{
    for (size_t i = 0; i < want.size(); ++i)
    {
        double const w = orMinusInf(want[i]);
        if (std::isinf(w) ? got[i] != w : !close(got[i], w, tol))
        {
            return false;
        }
    }
    return true;
}

// Uniforms recorded from numpy, checked for their use and count.
class ReplayUniforms : public UniformSource
{
public:
    explicit ReplayUniforms(json const& draws, std::string name)
        : mDraws(draws)
        , mName(std::move(name))
    {
    }
    void draw(dfl2_uniform_use use, double* out, size_t n) override
    {
        if (mNext >= mDraws.size())
        {
            throw std::runtime_error(mName + ": more uniforms requested than the reference drew");
        }
        json const& d = mDraws[mNext++];
        std::string const want = d["use"].get<std::string>();
        std::vector<double> const values = flat<double>(d["values"]);
        if (want != (use == DFL2_UNIFORM_DRAFT ? "draft" : "accept") || values.size() != n)
        {
            throw std::runtime_error(mName + ": uniform request " + std::to_string(mNext - 1) + " differs (want "
                + want + " x" + std::to_string(values.size()) + ")");
        }
        std::copy(values.begin(), values.end(), out);
    }
    bool allUsed() const
    {
        return mNext == mDraws.size();
    }

private:
    json const& mDraws;
    std::string mName;
    size_t mNext{0};
};

// Runners that replay the reference's recorded calls and check the core makes them in the same order.
class ReplayRunners : public Runners
{
public:
    ReplayRunners(json const& c, std::string name)
        : mCase(c)
        , mCalls(c["calls"])
        , mName(std::move(name))
    {
    }
    int32_t vocabSize() const override
    {
        return mCase["vocab_size"].get<int32_t>();
    }
    int32_t blockSize() const override
    {
        return mCase["block_size"].get<int32_t>();
    }
    int32_t topK() const override
    {
        return mCase["top_k"].get<int32_t>();
    }
    int32_t maxPositions() const override
    {
        return mCase["max_positions"].get<int32_t>();
    }
    void targetReset() override
    {
        next("target_reset");
    }
    void targetForward(int32_t const* ids, int32_t n, std::vector<float>& logits) override
    {
        json const& c = next("forward");
        expect(flat<int32_t>(c["ids"]) == std::vector<int32_t>(ids, ids + n), "forward ids");
        logits = flat<float>(c["logits"]);
        mLastForwardRows = n;
    }
    void targetCrop(int32_t length) override
    {
        expect(next("crop")["length"].get<int32_t>() == length, "crop length");
    }
    void drafterReset() override
    {
        next("drafter_reset");
    }
    void drafterQueueContext(int32_t rows) override
    {
        expect(rows <= mLastForwardRows, "queued context rows (more than the last forward made)");
        mQueued += rows;
    }
    void drafterAddContext(int32_t start) override
    {
        json const& c = next("add_context");
        expect(c["rows"].get<int32_t>() == mQueued && c["start"].get<int32_t>() == start, "add_context rows/start");
        mQueued = 0;
    }
    void drafterPropose(
        int32_t anchor, int32_t pos, int32_t rows, float temperature, float const* uniforms, Draft& out) override
    {
        json const& c = next("propose");
        expect(c["anchor"].get<int32_t>() == anchor && c["pos"].get<int32_t>() == pos && c["rows"].get<int32_t>() == rows,
            "propose anchor/pos/rows");
        expect(static_cast<float>(c["temperature"].get<double>()) == temperature, "propose temperature");
        if (c["uniforms"].is_null())
        {
            expect(uniforms == nullptr, "propose without uniforms at T = 0");
        }
        else
        {
            std::vector<float> const want = flat<float>(c["uniforms"]);
            expect(uniforms != nullptr && std::vector<float>(uniforms, uniforms + want.size()) == want,
                "propose uniforms");
        }
        out.tokens = flat<int32_t>(c["tokens"]);
        out.proposal = flat<float>(c["proposal"]);
        out.cand = flat<int32_t>(c["cand"]);
        out.hasVocabProposal = !c["vocab_proposal"].is_null();
        out.vocabProposal = out.hasVocabProposal ? flat<float>(c["vocab_proposal"]) : std::vector<float>{};
    }
    bool allUsed() const
    {
        return mNext == mCalls.size();
    }

private:
    json const& next(char const* op)
    {
        if (mNext >= mCalls.size())
        {
            throw std::runtime_error(mName + ": call '" + op + "' after the reference's last call");
        }
        json const& c = mCalls[mNext++];
        if (c["op"].get<std::string>() != op)
        {
            throw std::runtime_error(mName + ": call " + std::to_string(mNext - 1) + " is '" + op
                + "', the reference made '" + c["op"].get<std::string>() + "'");
        }
        return c;
    }
    void expect(bool ok, std::string const& what)
    {
        if (!ok)
        {
            throw std::runtime_error(mName + ": call " + std::to_string(mNext - 1) + ": " + what + " differ");
        }
    }

    json const& mCase;
    json const& mCalls;
    std::string mName;
    size_t mNext{0};
    int32_t mLastForwardRows{0};
    int32_t mQueued{0};
};

void checkStats(Stats const& s, json const& want, std::string const& name)
{
    check(close(s.tau, want["tau"].get<double>(), 1e-12), name + ": tau");
    check(s.cycles == want["cycles"].get<int32_t>(), name + ": cycles");
    std::vector<double> const cum = flat<double>(want["per_position_cumulative"]);
    std::vector<double> const cond = flat<double>(want["per_position_conditional"]);
    bool same = cum.size() == s.cumulative.size() && cond.size() == s.conditional.size();
    for (size_t i = 0; same && i < cum.size(); ++i)
    {
        same = close(s.cumulative[i], cum[i], 1e-12) && close(s.conditional[i], cond[i], 1e-12);
    }
    check(same, name + ": per-position acceptance");
    if (want.contains("oracle_tau"))
    {
        double const o = want["oracle_tau"].is_null() ? -1.0 : want["oracle_tau"].get<double>();
        check(close(s.oracleTau, o, 1e-12), name + ": oracle tau");
    }
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 2)
    {
        std::cerr << "usage: coreVectors VECTORS.json\n";
        return 2;
    }
    std::ifstream f(argv[1]);
    if (!f)
    {
        std::cerr << "cannot read " << argv[1] << " (tests/test_capi.py writes it)\n";
        return 2;
    }
    json const v = json::parse(f);

    int i = 0;
    for (json const& c : v["softmax"])
    {
        std::vector<float> const logits = flat<float>(c["logits"]);
        std::vector<double> const want = flat<double>(c["probs"]);
        std::vector<double> got(logits.size());
        softmaxT(logits.data(), logits.size(), c["temperature"].get<double>(), got.data());
        double worst = 0.0;
        for (size_t k = 0; k < want.size(); ++k)
        {
            worst = std::max(worst, std::fabs(got[k] - want[k]));
        }
        // numpy's vectorised exp may differ from libm's by an ulp; sums use numpy's pairwise order
        check(worst <= 1e-15, "softmax " + std::to_string(i++) + " max abs diff " + std::to_string(worst));
    }
    i = 0;
    for (json const& c : v["choice"])
    {
        std::vector<double> const p = flat<double>(c["p"]);
        check(choiceIndex(p.data(), p.size(), c["u"].get<double>()) == c["index"].get<int32_t>(),
            "choice " + std::to_string(i++));
    }
    i = 0;
    for (json const& c : v["accept_greedy"])
    {
        std::vector<int32_t> const d = flat<int32_t>(c["drafts"]);
        std::vector<float> const logits = flat<float>(c["logits"]);
        size_t const V = logits.size() / (d.size() + 1);
        auto const ab = acceptGreedy(d.data(), static_cast<int32_t>(d.size()), logits.data(), V);
        check(ab.first == c["accepted"].get<int32_t>() && ab.second == c["bonus"].get<int32_t>(),
            "accept_greedy " + std::to_string(i++));
    }
    i = 0;
    for (json const& c : v["accept_rejection"])
    {
        std::string const name = "accept_rejection " + std::to_string(i++);
        std::vector<int32_t> const d = flat<int32_t>(c["drafts"]);
        std::vector<double> const q = flat<double>(c["q"]);
        std::vector<double> const p = flat<double>(c["p"]);
        size_t const V = p.size() / (d.size() + 1);
        ReplayUniforms u(c["uniforms"], name);
        auto const ab = acceptRejection(d.data(), static_cast<int32_t>(d.size()), q.data(), p.data(), V, u);
        check(ab.first == c["accepted"].get<int32_t>() && ab.second == c["bonus"].get<int32_t>() && u.allUsed(),
            name);
    }
    i = 0;
    for (json const& c : v["stats"])
    {
        Stats const s = acceptanceStats(flat<int32_t>(c["accepted"]), flat<int32_t>(c["proposed"]));
        checkStats(s, c["want"], "stats " + std::to_string(i++));
    }
    i = 0;
    for (json const& c : v["independent"])
    {
        std::string const name = "independent " + std::to_string(i++);
        std::vector<float> const logits = flat<float>(c["logits"]);
        std::vector<float> const u = flat<float>(c["uniforms"]);
        float const T = c["temperature"].get<float>();
        Draft d;
        independentDraft(logits.data(), c["L"].get<int32_t>(), c["V"].get<int32_t>(), T, T > 0 ? u.data() : nullptr,
            c["top_k"].get<int32_t>(), d);
        check(d.tokens == flat<int32_t>(c["tokens"]), name + ": tokens");
        if (c["cand_unique"].get<bool>())
        {
            check(d.cand == flat<int32_t>(c["cand"]), name + ": candidates");
            std::vector<double> const q = flat<double>(c["proposal"]);
            bool same = q.size() == d.proposal.size();
            for (size_t j = 0; same && j < q.size(); ++j)
            {
                same = close(d.proposal[j], q[j], 1e-6);
            }
            check(same, name + ": proposal");
        }
        check(d.hasVocabProposal == !c["vocab_proposal"].is_null(), name + ": vocabulary proposal given");
        if (d.hasVocabProposal)
        {
            std::vector<double> const q = flat<double>(c["vocab_proposal"]);
            bool same = q.size() == d.vocabProposal.size();
            for (size_t j = 0; same && j < q.size(); ++j)
            {
                same = close(d.vocabProposal[j], q[j], 1e-6);
            }
            check(same, name + ": vocabulary proposal");
        }
    }
    i = 0;
    for (json const& c : v["rule"])
    {
        std::string const name = "rule " + std::to_string(i++);
        auto costs = std::make_unique<MeasuredCosts>();
        bool holdsSame = true;  // the realized check's answers, between the records and after them
        for (json const& r : c["records"])
        {
            std::string const kind = r["kind"].get<std::string>();
            double const sec = r["s"].get<double>();
            if (kind == "plain")
            {
                costs->recordPlain(r["n"].get<int32_t>(), sec);
            }
            else if (kind == "draft")
            {
                costs->recordDraft(sec);
            }
            else if (kind == "verify")
            {
                costs->recordVerify(sec);
            }
            else if (kind == "prefill")
            {
                costs->recordPrefill(r["n"].get<int64_t>(), sec);
            }
            else if (kind == "ask")
            {
                holdsSame = holdsSame && costs->holdsPlain(r["n"].get<int32_t>()) == r["holds"].get<bool>();
            }
            else
            {
                costs->recordStep(r["n"].get<int32_t>(), r["drafted"].get<bool>(), r["tokens"].get<int32_t>(), sec,
                    r["weighed"].get<bool>());
            }
        }
        std::vector<int32_t> const holdsN = flat<int32_t>(c["holds_n"]);
        for (size_t j = 0; j < holdsN.size(); ++j)
        {
            holdsSame = holdsSame && costs->holdsPlain(holdsN[j]) == c["holds"][j].get<bool>();
        }
        check(holdsSame, name + ": holds_plain");
        bool plainSame = true;
        for (int32_t n = 0; n < static_cast<int32_t>(c["plain"].size()); ++n)
        {
            json const& want = c["plain"][static_cast<size_t>(n)];
            std::optional<double> const got = costs->plain(n);
            plainSame = plainSame && (want.is_null() ? !got : (got && close(*got, want.get<double>(), 1e-12)));
        }
        check(plainSame, name + ": t_plain(n)");
        auto const sameAs = [](json const& want, std::optional<double> got) {
            return want.is_null() ? !got : (got && close(*got, want.get<double>(), 1e-12));
        };
        check(sameAs(c["prefill_row"], costs->prefillRow()), name + ": a chunked prompt row's seconds");
        check(sameAs(c["step"], costs->step()), name + ": a whole step's seconds");
        SpeculationRule rule;
        rule.priorTau = c["prior_tau"].get<double>();
        rule.priorWeight = c["prior_weight"].get<double>();
        rule.window = c["window"].get<int32_t>();
        rule.adaptive = c["adaptive"].get<bool>();
        rule.costs = std::move(costs);
        std::vector<std::pair<uint64_t, double>> cands;
        bool tauSame = true;
        for (size_t j = 0; j < c["committed"].size(); ++j)
        {
            std::vector<int32_t> const committed = flat<int32_t>(c["committed"][j]);
            double const tau = rule.tau(std::deque<int32_t>(committed.begin(), committed.end()));
            tauSame = tauSame && close(tau, c["tau"][j].get<double>(), 1e-12);
            cands.emplace_back(10 + j, tau);
        }
        check(tauSame, name + ": tau");
        std::vector<uint64_t> chosen = rule.choose(c["n_active"].get<int32_t>(), cands);
        std::sort(chosen.begin(), chosen.end());
        check(chosen == flat<uint64_t>(c["chosen"]), name + ": chosen");
    }
    i = 0;
    for (json const& c : v["lookup"])
    {
        std::vector<int32_t> const got = lookup(flat<int32_t>(c["tokens"]), c["rows"].get<int32_t>(),
            c["max_n"].get<int32_t>(), c["min_n"].get<int32_t>());
        check(got == flat<int32_t>(c["want"]), "lookup " + std::to_string(i++));
    }
    i = 0;
    for (json const& c : v["proposer_choice"])
    {
        // ngram.ProposerChoice driven through a recorded sequence of calls: every answer and rate equal
        std::string const name = "proposer_choice " + std::to_string(i++);
        ProposerChoice choice(
            proposerOf(c["mode"].get<std::string>()), flat<int32_t>(c["prompt"]), c["rows"].get<int32_t>());
        auto const whoOf = [](json const& j) {
            return j.is_null() ? Proposer::kNONE : proposerOf(j.get<std::string>());
        };
        auto const tOf = [](json const& j) { return j.is_null() ? std::nullopt : std::optional<double>(j.get<double>()); };
        bool same = true;
        for (json const& op : c["ops"])
        {
            std::string const kind = op["op"].get<std::string>();
            if (kind == "ngram")
            {
                same = same && choice.ngram(op["rows"].get<int64_t>()) == flat<int32_t>(op["want"]);
            }
            else if (kind == "pick" || kind == "preferred")
            {
                std::vector<int32_t> const drafts = flat<int32_t>(op["drafts"]);
                std::optional<double> const t = tOf(op["t_plain"]);
                bool const drafter = op["drafter"].get<bool>();
                Proposer const who = kind == "pick" ? choice.pick(drafts, t, drafter) : choice.preferred(drafts, t, drafter);
                same = same && who == whoOf(op["want"]);
            }
            else if (kind == "settle")
            {
                choice.settle(flat<int32_t>(op["drafts"]), whoOf(op["who"]));
            }
            else if (kind == "record")
            {
                choice.record(whoOf(op["who"]), op["committed"].get<int32_t>(), tOf(op["seconds"]));
            }
            else if (kind == "extend")
            {
                std::vector<int32_t> const t = flat<int32_t>(op["tokens"]);
                choice.extend(t.data(), t.size());
            }
            else if (kind == "pays")
            {
                same = same && choice.lookupPays(tOf(op["t_plain"])) == op["want"].get<bool>();
            }
            // the rates after every call, bit for bit
            same = same && choice.rate(Proposer::kDFLASH2) == op["rate"][0].get<double>()
                && choice.rate(Proposer::kNGRAM) == op["rate"][1].get<double>();
            if (!same)
            {
                check(false, name + ": op " + op.dump());
                break;
            }
        }
        check(same, name);
    }
    i = 0;
    for (json const& c : v["rule_lookup"])
    {
        // SpeculationRule.choose with lookups: free keys and fallbacks, over fixed costs
        std::string const name = "rule_lookup " + std::to_string(i++);
        SpeculationRule rule;
        rule.adaptive = c["adaptive"].get<bool>();
        std::vector<double> const k = flat<double>(c["costs"]);
        if (k.empty())  // measured: the recorded costs (some unknown: the exploring branches)
        {
            auto costs = std::make_unique<MeasuredCosts>();
            for (json const& r : c["records"])
            {
                std::string const kind = r["kind"].get<std::string>();
                double const sec = r["s"].get<double>();
                kind == "plain" ? costs->recordPlain(r["n"].get<int32_t>(), sec)
                    : kind == "draft" ? costs->recordDraft(sec)
                                      : costs->recordVerify(sec);
            }
            rule.costs = std::move(costs);
        }
        else
        {
            rule.costs = std::make_unique<FixedCosts>(k[0], k[1], k[2], k[3]);
        }
        std::vector<std::pair<uint64_t, double>> cands;
        for (json const& cd : c["candidates"])
        {
            cands.emplace_back(cd[0].get<uint64_t>(), cd[1].get<double>());
        }
        std::vector<std::pair<uint64_t, std::pair<uint64_t, double>>> fallbacks;
        for (json const& fb : c["fallbacks"])
        {
            fallbacks.push_back({fb[0].get<uint64_t>(), {fb[1].get<uint64_t>(), fb[2].get<double>()}});
        }
        std::vector<uint64_t> chosen
            = rule.choose(c["n_active"].get<int32_t>(), cands, flat<uint64_t>(c["free"]), fallbacks);
        std::sort(chosen.begin(), chosen.end());
        check(chosen == flat<uint64_t>(c["chosen"]), name + ": chosen");
    }
    i = 0;
    for (json const& c : v["guard"])
    {
        // guard.AcceptanceGuard driven through a recorded sequence of steps and cycles: every field after every call
        std::string const name = "guard " + std::to_string(i++);
        json const& k = c["config"];
        GuardConfig cfg;
        cfg.window = k["window"].get<int32_t>();
        cfg.minCycles = k["min_cycles"].get<int32_t>();
        cfg.probeWindow = k["probe_window"].get<int32_t>();
        cfg.z = k["z"].get<double>();
        cfg.minSpread = k["min_spread"].get<double>();
        cfg.backoff = k["backoff"].get<int32_t>();
        cfg.maxBackoff = k["max_backoff"].get<int32_t>();
        if (!k["cost_ratio"].is_null())
        {
            cfg.costRatio = k["cost_ratio"].get<double>();
        }
        AcceptanceGuard g(cfg);
        auto const same = [](std::optional<double> got, json const& want) {
            return want.is_null() ? !got : (got && *got == want.get<double>());  // float64 bits
        };
        size_t n = 0;
        for (json const& op : c["ops"])
        {
            if (op["op"].get<std::string>() == "step")
            {
                g.recordStep(op["seconds"].get<double>());
            }
            else
            {
                g.recordCycle(op["tokens"].get<int32_t>(), op["seconds"].get<double>());
            }
            json const& w = op["want"];
            bool const ok = same(g.tStep(), w["t_step"]) && same(g.breakEven(), w["break_even"])
                && g.plainNext() == w["plain_next"].get<bool>() && g.plainLeft() == w["plain_left"].get<int64_t>()
                && g.backoff() == w["backoff"].get<int64_t>() && g.need() == w["need"].get<int64_t>()
                && g.calibrating() == w["calibrating"].get<bool>() && g.switches() == w["switches"].get<int32_t>()
                && g.probes() == w["probes"].get<int32_t>();
            if (!ok)
            {
                check(false, name + ": state after call " + std::to_string(n) + " (" + op.dump().substr(0, 300) + ")");
                break;
            }
            ++n;
        }
        check(n == c["ops"].size(), name);
    }
    i = 0;
    for (json const& bad : v["guard_bad_configs"])
    {
        // GuardConfig.__post_init__'s refusals
        GuardConfig cfg;
        cfg.window = bad.value("window", cfg.window);
        cfg.minCycles = bad.value("min_cycles", cfg.minCycles);
        cfg.probeWindow = bad.value("probe_window", cfg.probeWindow);
        cfg.z = bad.value("z", cfg.z);
        cfg.minSpread = bad.value("min_spread", cfg.minSpread);
        cfg.backoff = bad.value("backoff", cfg.backoff);
        cfg.maxBackoff = bad.value("max_backoff", cfg.maxBackoff);
        if (bad.contains("cost_ratio"))
        {
            cfg.costRatio = bad["cost_ratio"].get<double>();
        }
        bool refused = false;
        try
        {
            AcceptanceGuard const g(cfg);
        }
        catch (Error const& e)
        {
            refused = e.code() == DFL2_ERR_OPTION_VALUE;
        }
        check(refused, "guard config refused: " + bad.dump());
        ++i;
    }
    i = 0;
    for (json const& c : v["sampling"])  // runtime/sampling.py's Sampler on the same logits
    {
        std::string const name = "sampling " + std::to_string(i++);
        int32_t const V = c["V"].get<int32_t>();
        int32_t const m = c["m"].get<int32_t>();
        double const T = c["temperature"].get<double>();
        std::vector<float> const rows = flat<float>(c["rows"]);
        std::vector<int32_t> const drafts = flat<int32_t>(c["drafts"]);
        std::vector<int32_t> const tokens = flat<int32_t>(c["tokens"]);
        Sampler sampler(samplingOf(c["sampling"]), flat<int32_t>(c["prompt"]), V, T);
        double const* x = sampler.logits(rows.data(), m, drafts.data());
        check(sameValues(x, c["logits"], 1e-12), name + ": transformed logits");
        if (T > 0)
        {
            std::vector<double> law(static_cast<size_t>(m) * static_cast<size_t>(V));
            sampler.law(x, m, T, law.data());
            check(sameValues(law.data(), c["law"], 1e-12), name + ": law");
        }
        sampler.commit(tokens.data(), tokens.size());
        check(sameLogprobs(sampler.logprobs(), c["logprobs"], 1e-9), name + ": logprobs");
        if (c.contains("redraw"))
        {
            json const& r = c["redraw"];
            Draft d;
            d.tokens = flat<int32_t>(r["tokens"]);
            d.proposal = flat<float>(r["proposal"]);
            d.cand = flat<int32_t>(r["cand"]);
            d.vocabProposal = flat<float>(r["vocab_proposal"]);
            d.hasVocabProposal = true;
            std::vector<float> const u = flat<float>(r["uniforms"]);
            sampler.redraw(d, u.data(), r["n_rows"].get<int32_t>());
            check(d.tokens == flat<int32_t>(r["want_tokens"]), name + ": redrawn tokens");
            std::vector<double> const q = flat<double>(r["want_proposal"]);
            std::vector<double> const vq = flat<double>(r["want_vocab_proposal"]);
            bool same = q.size() == d.proposal.size() && vq.size() == d.vocabProposal.size();
            for (size_t j = 0; same && j < q.size(); ++j)
            {
                same = close(d.proposal[j], q[j], 1e-6);
            }
            for (size_t j = 0; same && j < vq.size(); ++j)
            {
                same = close(d.vocabProposal[j], vq[j], 1e-6);
            }
            check(same, name + ": redrawn proposals");
        }
    }
    int loops = 0;
    for (json const& c : v["loops"])
    {
        std::string const name = "loop " + c["name"].get<std::string>();
        try
        {
            ReplayRunners runners(c, name);
            ReplayUniforms uniforms(c["uniforms"], name);
            GenerateConfig cfg;
            cfg.maxNewTokens = c["max_new_tokens"].get<int64_t>();
            cfg.temperature = c["temperature"].get<double>();
            cfg.speculative = c["speculative"].get<bool>();
            cfg.measureOracle = c["measure_oracle"].get<bool>();
            cfg.eosIds = flat<int32_t>(c["eos_ids"]);
            cfg.proposer = proposerOf(c.value("proposer", std::string("dflash2")));
            cfg.ngramRows = c.value("ngram_rows", 0);
            cfg.sampling = samplingOf(c.value("sampling", json()));
            std::vector<int32_t> const prompt = flat<int32_t>(c["prompt"]);
            std::vector<int32_t> streamed;
            TokenSink sink = [&](int32_t const* t, size_t n) {
                streamed.insert(streamed.end(), t, t + n);
                return true;
            };
            Result const r = cfg.speculative ? speculativeGenerate(runners, prompt, cfg, uniforms, sink)
                                             : targetGenerate(runners, prompt, cfg, uniforms, sink);
            check(r.tokens == flat<int32_t>(c["tokens"]), name + ": tokens");
            check(streamed == r.tokens, name + ": streamed tokens");
            check(r.accepted == flat<int32_t>(c["accepted"]), name + ": accepted");
            check(r.proposed == flat<int32_t>(c["proposed"]), name + ": proposed");
            check(r.oracleAccepted == flat<int32_t>(c["oracle_accepted"]), name + ": oracle accepted");
            if (c.contains("proposers"))
            {
                check(r.proposers == flat<int32_t>(c["proposers"]), name + ": proposer per cycle");
                check(r.plainSteps == c["plain_steps"].get<int32_t>(), name + ": plain steps");
            }
            if (c.contains("logprobs"))
            {
                check(sameLogprobs(r.logprobs, c["logprobs"], 1e-9), name + ": logprobs");
            }
            check(runners.allUsed(), name + ": the core made fewer runner calls than the reference");
            check(uniforms.allUsed(), name + ": the core drew fewer uniforms than the reference");
            checkStats(resultStats(r), c["stats"], name);
            ++loops;
        }
        catch (std::exception const& e)
        {
            check(false, e.what());
        }
    }
    std::printf("coreVectors: %d checks, %d loops, %d failures\n", gChecks, loops, dfl2TestFailures());
    return dfl2TestFailures() == 0 && loops > 0 ? 0 : 1;
}
