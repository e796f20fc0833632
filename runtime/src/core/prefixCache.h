//! \file prefixCache.h
//! Prefix reuse: what finished requests leave behind, so that the next request sharing their leading tokens computes
//! only the rest — the twin of dflash2_trt/runtime/prefix_cache.py's PrefixCache. One class, SharedPrefixCache,
//! holds the entries (a batch's slots share one); PrefixCache is a session's front to its own SharedPrefixCache, cut
//! into the Python class's steps: prefillFrom (lookup + restore), snapshot, store.
//!
//! An entry is one finished sequence, matched **by token ids**: the backend's copy of its target attention K/V rows,
//! its drafter's context (K/V rows and the queued features of positions past them) and, for a target whose other
//! layers cannot be cropped (linear layers' convolution and recurrent states, sliding-window rings), snapshots taken
//! after the prompt's prefill and at the end of the request. A hit is the entry sharing the longest common prefix
//! with the new prompt, at most all but the prompt's last token (its logits draw the first token); for a request
//! that drafts, within the drafter context the entry rebuilds; for a stateful target, the longest snapshot at or below
//! that. A hit puts the K/V rows, that snapshot and the drafter's context back into freshly reset caches, so the first
//! cycle after a hit drafts from exactly the context it would have had without it.
//!
//! The budget ("prefix_cache_bytes"): the entries together never hold more (least recently used evicted first; an
//! entry larger than the budget is not kept; 0: nothing is). Backends whose runners do not keep prefixes
//! (keepsPrefix false: the callbacks backend, whose caches are the caller's) start every request empty.
//!
//! Planted bugs for the tests, never set otherwise: $DFLASH2_PLANT_PREFIX_LATER_SNAPSHOT=1 restores a hit's
//! non-croppable state from the first snapshot after the hit (the K/V still cropped at the hit);
//! $DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED=1 (read by the backend's drafterRestore) leaves the restored drafter context
//! as zeros; $DFLASH2_PLANT_PREFIX_EVICTED_MATCHED=1 keeps evicted entries matchable.
#pragma once

#include "decoder.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

namespace dflash2
{

//! prefix_cache.DEFAULT_BUDGET_BYTES: 1 GiB
constexpr int64_t kPREFIX_BUDGET_BYTES = int64_t{1} << 30;

//! $DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED=1 (a backend's drafterRestore reads it)
bool plantedPrefixDrafterZeroed();

//! Runners::drafterRestore's rule over a backend's drafter context of `held` positions and its queue of `pendingRows`
//! feature rows (`pending`, `rowBytes` each): positions < length kept — the context cropped and the queue dropped, or
//! the queue cut to the positions the context lacks and handed to `addContext(held)` in one pass
template <typename AddContext>
void restoreDrafterContext(int32_t length, int32_t& held, std::vector<char>& pending, int32_t& pendingRows,
    size_t rowBytes, AddContext&& addContext)
{
    if (length < 0 || length > held + pendingRows)
    {
        throw Error(DFL2_ERR_INTERNAL, "a drafter context restore to length " + std::to_string(length)
                + " of one that can rebuild " + std::to_string(held + pendingRows));
    }
    if (length <= held)
    {
        held = length;
        pending.clear();
        pendingRows = 0;
        return;
    }
    pending.resize(static_cast<size_t>(length - held) * rowBytes);
    pendingRows = length - held;
    addContext(held);
}

//! prefix_cache.Entry.usable, the one matching rule of both caches: how many leading positions of `ids` a kept
//! sequence (`kept` ids, drafter context of `drafterLength`, snapshots `states` of a `stateful` target) restores —
//! their common prefix, at most all but ids' last token; with `drafter` within its drafter context; for a stateful
//! target the longest snapshot at or below that
int32_t usablePrefix(std::vector<int32_t> const& kept, int32_t drafterLength, bool stateful,
    std::map<int32_t, std::shared_ptr<TargetSnapshot const>> const& states, std::vector<int32_t> const& ids,
    bool drafter);

//! prefix_cache.CacheStats: counters since the cache was made
struct PrefixCacheStats
{
    int64_t lookups{0};
    int64_t hits{0};
    int64_t hitTokens{0};       //!< prompt positions restored instead of computed
    int64_t computedTokens{0};  //!< prompt positions the target computed (after a hit: the rest)
    int64_t stored{0};
    int64_t evictions{0};
    int64_t nbytes{0};  //!< what the entries hold now
    int64_t entries{0};
};

//! The multi-entry prefix cache a batch's slots share: the twin of prefix_cache.PrefixCache (same steps and names:
//! lookup, store, _evict; Entry.usable is usablePrefix). Entries are the backend's copies (PrefixCopy, snapshots) of
//! finished sequences, matched by token ids; a hit restores the longest usable prefix into any slot. An entry whose
//! ids extend another's replaces it (its snapshots kept); one already holding a stored sequence is only made the
//! most recent; the least recently used entries are evicted to stay within the budget (0: nothing kept). An entry
//! counts its ids as 8 bytes each (the Python entry's int64 ids), so both twins weigh a sequence alike.
//!
//! Not thread safe: its owner's loop (one thread at a time) is its only user.
class SharedPrefixCache
{
public:
    struct Entry
    {
        std::vector<int32_t> ids;  //!< [n] the positions the copy holds
        std::shared_ptr<PrefixCopy const> rows;
        std::map<int32_t, std::shared_ptr<TargetSnapshot const>> states;  //!< length -> snapshot (stateful targets)
        bool stateful{false};
        size_t nbytes() const;
        int32_t usable(std::vector<int32_t> const& prompt, bool drafter) const
        {
            return usablePrefix(ids, rows->drafterLength(), stateful, states, prompt, drafter);
        }
    };
    struct Hit
    {
        std::shared_ptr<Entry const> entry;
        int32_t length{0};  //!< positions restored
        //! the snapshot at the hit (nullptr: an attention-only target)
        TargetSnapshot const* state() const;
    };

    explicit SharedPrefixCache(int64_t budgetBytes = kPREFIX_BUDGET_BYTES);

    //! PrefixCache.lookup: the entry restoring the most leading positions of `ids` (ties: the most recently used),
    //! now the most recently used; length 0: none. Counts the lookup and the prompt positions computed.
    Hit lookup(std::vector<int32_t> const& ids, bool drafter);
    //! PrefixCache.store: a finished sequence (`ids`: the tokens of the positions `rows` holds), `states` snapshots
    //! taken earlier, `end` the target's state now (nullptr: attention-only; kept when the target's length is n)
    void store(std::vector<int32_t> ids, std::shared_ptr<PrefixCopy const> rows,
        std::map<int32_t, std::shared_ptr<TargetSnapshot const>> states, std::shared_ptr<TargetSnapshot const> end,
        int32_t targetLength);
    int64_t budget() const
    {
        return mBudget;
    }
    PrefixCacheStats const& stats() const
    {
        return mStats;
    }

private:
    void evict();

    int64_t mBudget;
    std::vector<std::shared_ptr<Entry>> mEntries;  //!< least recently used first
    std::vector<std::shared_ptr<Entry>> mEvicted;  //!< the planted bug's: evicted, still matched
    PrefixCacheStats mStats;
};

//! A session's prefix cache: its own SharedPrefixCache, entered through the single loop's steps (the Python class's
//! prefill_from / snapshot / store over a B = 1 target and drafter).
class PrefixCache
{
public:
    explicit PrefixCache(int64_t budgetBytes = kPREFIX_BUDGET_BYTES)
        : mEntries(budgetBytes)
    {
    }

    //! PrefixCache.prefill_from: the runners reset, then the longest usable prefix of `prompt` restored (the
    //! drafter's context too when `drafter`: the request drafts with the DFlash 2 drafter) -> the positions restored
    int32_t prefillFrom(std::vector<int32_t> const& prompt, Runners& runners, bool drafter);
    //! PrefixCache.snapshot: the target's non-croppable state after the prefill (stateful targets)
    void snapshot(Runners& runners);
    //! PrefixCache.store: the finished sequence, (prompt + tokens)[:the target's length]; `drafter`: its context
    //! followed the committed positions (else none is kept)
    void store(std::vector<int32_t> const& prompt, std::vector<int32_t> const& tokens, Runners& runners, bool drafter);
    //! the running request's snapshots dropped (a request failed: its sequence is not kept; the entries stay)
    void clear()
    {
        mTaken.clear();
    }
    PrefixCacheStats const& stats() const
    {
        return mEntries.stats();
    }

private:
    SharedPrefixCache mEntries;
    std::map<int32_t, std::shared_ptr<TargetSnapshot const>> mTaken;  //!< the running request's snapshots
};

} // namespace dflash2
