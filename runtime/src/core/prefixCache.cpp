//! \file prefixCache.cpp
//! A session's prefix reuse; see prefixCache.h. Each function names its Python twin.
#include "prefixCache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace dflash2
{

namespace
{

bool planted(char const* name)
{
    char const* v = std::getenv(name);
    return v != nullptr && std::strcmp(v, "1") == 0;
}

} // namespace

bool plantedPrefixDrafterZeroed()
{
    return planted("DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED");
}

// prefix_cache.Entry.usable
int32_t usablePrefix(std::vector<int32_t> const& kept, int32_t drafterLength, bool stateful,
    std::map<int32_t, std::shared_ptr<TargetSnapshot const>> const& states, std::vector<int32_t> const& ids,
    bool drafter)
{
    int64_t const n = std::min<int64_t>(static_cast<int64_t>(kept.size()), static_cast<int64_t>(ids.size()) - 1);
    if (n <= 0)
    {
        return 0;
    }
    int32_t common = 0;
    while (common < n && kept[static_cast<size_t>(common)] == ids[static_cast<size_t>(common)])
    {
        ++common;
    }
    if (drafter)
    {
        common = std::min(common, drafterLength);
    }
    if (!stateful)
    {
        return common;
    }
    auto const at = states.upper_bound(common);  // the first snapshot past the match
    return at == states.begin() ? 0 : std::prev(at)->first;
}

// ---- a session's front ----------------------------------------------------------------------------------

// PrefixCache.prefill_from (lookup + restore)
int32_t PrefixCache::prefillFrom(std::vector<int32_t> const& prompt, Runners& runners, bool drafter)
{
    mTaken.clear();
    runners.targetReset();
    runners.drafterReset();
    if (mEntries.budget() == 0 || !runners.keepsPrefix())
    {
        return 0;
    }
    SharedPrefixCache::Hit const hit = mEntries.lookup(prompt, drafter);
    if (hit.length > 0)
    {
        runners.prefixRestore(*hit.entry->rows, hit.length, hit.state(), drafter);
    }
    return hit.length;
}

// PrefixCache.snapshot
void PrefixCache::snapshot(Runners& runners)
{
    if (mEntries.budget() == 0 || !runners.keepsPrefix())
    {
        return;
    }
    if (std::shared_ptr<TargetSnapshot const> s = runners.targetSnapshot())
    {
        mTaken[runners.targetLength()] = std::move(s);
    }
}

// PrefixCache.store
void PrefixCache::store(
    std::vector<int32_t> const& prompt, std::vector<int32_t> const& tokens, Runners& runners, bool drafter)
{
    std::map<int32_t, std::shared_ptr<TargetSnapshot const>> taken = std::move(mTaken);
    mTaken.clear();
    int32_t const length = runners.targetLength();
    if (mEntries.budget() == 0 || !runners.keepsPrefix() || length <= 0)
    {
        return;
    }
    std::vector<int32_t> ids = prompt;
    ids.insert(ids.end(), tokens.begin(), tokens.end());
    ids.resize(std::min(ids.size(), static_cast<size_t>(length)));
    auto rows = runners.prefixCopy(static_cast<int32_t>(ids.size()), drafter);
    mEntries.store(std::move(ids), std::move(rows), std::move(taken), runners.targetSnapshot(), length);
}

// ---- the multi-entry cache a batch shares --------------------------------------------------------------

// Entry.nbytes
size_t SharedPrefixCache::Entry::nbytes() const
{
    size_t n = ids.size() * sizeof(int64_t) + rows->nbytes();
    for (auto const& s : states)
    {
        n += s.second->nbytes();
    }
    return n;
}

TargetSnapshot const* SharedPrefixCache::Hit::state() const
{
    if (!entry->stateful)
    {
        return nullptr;
    }
    auto const later = entry->states.upper_bound(length);
    if (planted("DFLASH2_PLANT_PREFIX_LATER_SNAPSHOT") && later != entry->states.end())
    {
        return later->second.get();  // the planted bug: the snapshot after the hit
    }
    return entry->states.at(length).get();
}

SharedPrefixCache::SharedPrefixCache(int64_t budgetBytes)
    : mBudget(budgetBytes)
{
    if (budgetBytes < 0)
    {
        throw Error(DFL2_ERR_OPTION_VALUE,
            "option 'prefix_cache_bytes' must be >= 0 (0: keep nothing), got " + std::to_string(budgetBytes));
    }
}

// PrefixCache.lookup (+ prefill_from's count of computed positions)
SharedPrefixCache::Hit SharedPrefixCache::lookup(std::vector<int32_t> const& ids, bool drafter)
{
    ++mStats.lookups;
    Hit hit;
    size_t best = 0;
    for (auto* list : {&mEvicted, &mEntries})  // (mEvicted: empty but for the planted bug)
    {
        for (size_t i = 0; i < list->size(); ++i)
        {
            int32_t const u = (*list)[i]->usable(ids, drafter);
            if (u > 0 && u >= hit.length)  // ties: the most recently used (the list's later entries)
            {
                hit = Hit{(*list)[i], u};
                best = list == &mEntries ? i + 1 : 0;
            }
        }
    }
    if (best > 0)
    {
        std::rotate(mEntries.begin() + static_cast<long>(best - 1), mEntries.begin() + static_cast<long>(best),
            mEntries.end());
    }
    if (hit.length > 0)
    {
        ++mStats.hits;
        mStats.hitTokens += hit.length;
    }
    mStats.computedTokens += static_cast<int64_t>(ids.size()) - hit.length;
    return hit;
}

// PrefixCache.store
void SharedPrefixCache::store(std::vector<int32_t> ids, std::shared_ptr<PrefixCopy const> rows,
    std::map<int32_t, std::shared_ptr<TargetSnapshot const>> states, std::shared_ptr<TargetSnapshot const> end,
    int32_t targetLength)
{
    int32_t const n = static_cast<int32_t>(ids.size());
    if (mBudget == 0 || n == 0)
    {
        return;
    }
    auto e = std::make_shared<Entry>();
    e->stateful = end != nullptr;
    e->states.insert(states.begin(), states.upper_bound(n));
    if (e->stateful && targetLength == n)  // (a cache past an accepted EOS holds more than the ids)
    {
        e->states[n] = std::move(end);
    }
    e->ids = std::move(ids);
    e->rows = std::move(rows);
    if (e->nbytes() > static_cast<uint64_t>(mBudget))
    {
        return;
    }
    int32_t const dl = e->rows->drafterLength();
    for (auto it = mEntries.begin(); it != mEntries.end();)
    {
        Entry const& old = **it;
        size_t const k = old.ids.size();
        if (k >= e->ids.size() && std::equal(e->ids.begin(), e->ids.end(), old.ids.begin())
            && old.rows->drafterLength() >= dl && (!e->stateful || old.states.count(n) > 0))
        {
            std::rotate(it, it + 1, mEntries.end());  // it already holds this sequence: only its recency changes
            return;
        }
        if (k <= e->ids.size() && std::equal(old.ids.begin(), old.ids.end(), e->ids.begin())
            && old.rows->drafterLength() <= dl)
        {
            e->states.insert(old.states.begin(), old.states.end());  // extended: its snapshots live on here
            it = mEntries.erase(it);
            continue;
        }
        ++it;
    }
    mEntries.push_back(std::move(e));
    ++mStats.stored;
    evict();
}

// PrefixCache._evict: least recently used first while over the budget
void SharedPrefixCache::evict()
{
    size_t total = 0;
    for (auto const& e : mEntries)
    {
        total += e->nbytes();
    }
    while (total > static_cast<uint64_t>(mBudget))
    {
        total -= mEntries.front()->nbytes();
        if (planted("DFLASH2_PLANT_PREFIX_EVICTED_MATCHED"))
        {
            mEvicted.push_back(mEntries.front());
        }
        mEntries.erase(mEntries.begin());
        ++mStats.evictions;
    }
    mStats.nbytes = static_cast<int64_t>(total);
    mStats.entries = static_cast<int64_t>(mEntries.size());
}

} // namespace dflash2
