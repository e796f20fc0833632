//! \file ngram.cpp
//! Prompt lookup; see ngram.h. Each function names its Python twin in dflash2_trt/runtime/ngram.py.
#include "ngram.h"

#include <algorithm>

namespace dflash2
{

Proposer proposerOf(std::string const& name)
{
    if (name == "dflash2")
    {
        return Proposer::kDFLASH2;
    }
    if (name == "ngram")
    {
        return Proposer::kNGRAM;
    }
    if (name == "auto")
    {
        return Proposer::kAUTO;
    }
    throw Error(DFL2_ERR_OPTION_VALUE,
        std::string("option 'proposer' must be one of ") + proposerChoices() + ", got '" + name + "'");
}

char const* proposerChoices()
{
    return "dflash2|ngram|auto";
}

// ngram.lookup: for n = min(maxN, T - 1) .. minN, the latest start s < T - n with tokens[s:s+n] == the suffix
std::vector<int32_t> lookup(std::vector<int32_t> const& tokens, int32_t rows, int32_t maxN, int32_t minN)
{
    int64_t const T = static_cast<int64_t>(tokens.size());
    for (int64_t n = std::min<int64_t>(maxN, T - 1); n >= minN; --n)
    {
        int32_t const* suffix = tokens.data() + (T - n);
        for (int64_t s = T - n - 1; s >= 0; --s)  // latest first: the first hit is numpy's starts[-1]
        {
            if (std::equal(suffix, suffix + n, tokens.data() + s))
            {
                int64_t const from = s + n;
                int64_t const to = std::min<int64_t>(T, from + std::max(rows, 0));
                return std::vector<int32_t>(tokens.begin() + from, tokens.begin() + to);
            }
        }
    }
    return {};
}

int32_t defaultLookupRows(int32_t draftRows)
{
    return std::max(draftRows, kNGRAM_ROWS);
}

Draft lookupDraft(std::vector<int32_t> const& drafts)
{
    Draft d;
    d.tokens = drafts;
    d.cand = drafts;
    d.proposal.assign(drafts.size(), 1.0F);
    return d;
}

ProposerChoice::ProposerChoice(Proposer mode, std::vector<int32_t> prompt, int32_t rows, double decay)
    : mMode(mode)
    , mRows(rows)
    , mTokens(std::move(prompt))
    , mDecay(decay)
{
}

void ProposerChoice::extend(int32_t const* tokens, size_t n)
{
    if (mMode != Proposer::kDFLASH2)
    {
        mTokens.insert(mTokens.end(), tokens, tokens + n);
    }
}

std::vector<int32_t> ProposerChoice::ngram(int64_t rows) const
{
    if (mMode == Proposer::kDFLASH2 || rows <= 0)
    {
        return {};
    }
    return lookup(mTokens, static_cast<int32_t>(std::min<int64_t>(rows, mRows)));
}

bool ProposerChoice::lookupPays(std::optional<double> tPlain) const
{
    std::optional<double> const t = mSeconds[1];
    return !t || !tPlain || mRate[1] / *t >= 1.0 / *tPlain;
}

Proposer ProposerChoice::pick(std::vector<int32_t> const& drafts, std::optional<double> tPlain, bool drafter)
{
    Proposer const who = preferred(drafts, tPlain, drafter);
    settle(drafts, who);
    return who;
}

Proposer ProposerChoice::preferred(std::vector<int32_t> const& drafts, std::optional<double> tPlain, bool drafter) const
{
    if (mMode == Proposer::kDFLASH2)
    {
        return drafter ? Proposer::kDFLASH2 : Proposer::kNONE;
    }
    bool const useDrafter = drafter && mMode == Proposer::kAUTO;
    if (!drafts.empty() && lookupPays(tPlain) && (!useDrafter || mRate[1] >= mRate[0]))
    {
        return Proposer::kNGRAM;
    }
    return useDrafter ? Proposer::kDFLASH2 : Proposer::kNONE;
}

void ProposerChoice::settle(std::vector<int32_t> const& drafts, Proposer who)
{
    if (!drafts.empty() && who != Proposer::kNGRAM)
    {
        mRate[1] += (1 - mDecay) / 4 * (2.0 - mRate[1]);
    }
}

void ProposerChoice::record(Proposer who, int32_t committed, std::optional<double> seconds)
{
    size_t const i = index(who);
    mRate[i] = mDecay * mRate[i] + (1 - mDecay) * committed;
    if (seconds)
    {
        mSeconds[i] = mSeconds[i] ? mDecay * *mSeconds[i] + (1 - mDecay) * *seconds : *seconds;
    }
}

} // namespace dflash2
