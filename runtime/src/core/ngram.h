//! \file ngram.h
//! Prompt lookup (n-gram proposals) beside the DFlash 2 drafter: the twin of dflash2_trt/runtime/ngram.py.
//!
//! lookup() — the continuation of the context's latest earlier occurrence of its own last n tokens (n from maxN
//! down to minN): no model, microseconds per cycle. ProposerChoice — which proposer makes a cycle's drafts
//! (dflash2 | ngram | auto): auto takes the lookup when the context has a match and its measured acceptance
//! (tokens committed per cycle, an exponential mean per proposer, optimistic at the start) is at least the
//! drafter's; a lookup runs only while it pays (lookupPays: its committed tokens per second at least a plain
//! step's, True until both are measured). Same arithmetic as the Python class, in the same order (tests/test_capi.py
//! checks both on reference vectors). A lookup's drafts are deterministic: verified against a one-hot proposal
//! (lookupDraft), so rejection sampling at T > 0 stays exact.
#pragma once

#include "decoder.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dflash2
{

//! "dflash2" | "ngram" | "auto" (vocabulary.PROPOSERS) -> the mode; anything else: DFL2_ERR_OPTION_VALUE.
Proposer proposerOf(std::string const& name);
//! The choices as the option table spells them: "dflash2|ngram|auto".
char const* proposerChoices();

//! ngram.uses_drafter: whether `mode` runs the DFlash 2 drafter (every one but prompt lookup alone), known from the
//! request before its choice is made at the first token.
inline bool usesDrafter(Proposer mode)
{
    return mode != Proposer::kNGRAM;
}

//! Most lookup drafts per cycle by default (ngram.NGRAM_ROWS).
constexpr int32_t kNGRAM_ROWS = 4;

//! ngram.lookup: tokens [T] (prompt + generated, the last one the anchor) -> up to `rows` tokens that followed the
//! latest earlier occurrence of the longest suffix n-gram (maxN >= n >= minN); empty when none.
std::vector<int32_t> lookup(std::vector<int32_t> const& tokens, int32_t rows, int32_t maxN = 4, int32_t minN = 2);

//! ngram.default_rows: kNGRAM_ROWS, or the drafter's L = block size - 1 where larger (draftRows 0: no drafter).
int32_t defaultLookupRows(int32_t draftRows);

//! ngram.lookup_draft: drafts [n] as a Draft of one candidate per row with probability 1 (K = 1: acceptDrafts
//! with topK 1 scatters it one-hot into the vocabulary).
Draft lookupDraft(std::vector<int32_t> const& drafts);

//! ngram.ProposerChoice: one request's proposer state (its context so far and each proposer's measured rates).
class ProposerChoice
{
public:
    ProposerChoice() = default;
    ProposerChoice(Proposer mode, std::vector<int32_t> prompt, int32_t rows, double decay = 0.8);

    Proposer mode() const
    {
        return mMode;
    }
    //! whether the DFlash 2 drafter proposes for this request (its context then follows the committed positions)
    bool usesDrafter() const
    {
        return dflash2::usesDrafter(mMode);
    }
    //! committed tokens join the context (the drafter alone never looks it up, so keeps none)
    void extend(int32_t const* tokens, size_t n);
    //! up to min(rows, the request's rows) lookup drafts for the next cycle (none for the drafter alone)
    std::vector<int32_t> ngram(int64_t rows) const;
    //! whether a lookup cycle is expected to beat plain steps of tPlain seconds (true until both are measured)
    bool lookupPays(std::optional<double> tPlain) const;
    //! preferred(), then settle()
    Proposer pick(std::vector<int32_t> const& drafts, std::optional<double> tPlain = std::nullopt, bool drafter = true);
    //! the next cycle's proposer given the lookup's drafts (kNONE: a plain step), changing nothing
    Proposer preferred(std::vector<int32_t> const& drafts, std::optional<double> tPlain = std::nullopt,
        bool drafter = true) const;
    //! the step's proposer was decided: a lookup that had drafts and was not chosen drifts back to the prior
    void settle(std::vector<int32_t> const& drafts, Proposer who);
    void record(Proposer who, int32_t committed, std::optional<double> seconds = std::nullopt);

    double rate(Proposer who) const
    {
        return mRate[index(who)];
    }
    std::optional<double> seconds(Proposer who) const
    {
        return mSeconds[index(who)];
    }

private:
    static size_t index(Proposer who)
    {
        return who == Proposer::kNGRAM ? 1 : 0;
    }

    Proposer mMode{Proposer::kDFLASH2};
    int32_t mRows{0};
    std::vector<int32_t> mTokens;
    double mDecay{0.8};
    double mRate[2]{2.0, 2.0};  //!< tokens committed per cycle (accepted + 1), exponential mean; optimistic start
    std::optional<double> mSeconds[2];  //!< cycle time, exponential mean
};

} // namespace dflash2
