//! \file prefixCache.h
//! A session's prefix reuse: what its runners hold after a request is kept, so that the next request sharing its
//! leading tokens computes only the rest — the twin of dflash2_trt/runtime/prefix_cache.py's PrefixCache for one
//! sequence, the session's last (llama-server's per-slot reuse: the caches stay where they are, in the backend).
//!
//! The kept sequence is matched **by token ids**: the longest common prefix of the new prompt with the last request's
//! prompt + generated tokens (those the target cache holds), at most all but the prompt's last token (its logits draw
//! the first token); for a request that drafts, within the drafter context the runners can rebuild (its K/V rows and
//! the queued features of positions past them); for a target whose other layers cannot be cropped (linear layers'
//! convolution and recurrent states, sliding-window rings), the longest snapshot at or below that — snapshots are
//! taken after each prefill and at the end of each request, and those at or below a hit live on with the next
//! sequence (a conversation's earlier turns). A hit crops the target's attention K/V to the hit, puts that snapshot's
//! state back, and crops (or completes from the queued features) the drafter's context, so the first cycle after a hit
//! drafts from exactly the context it would have had without it. Same steps and names as the Python class:
//! prefillFrom (lookup + restore), snapshot, store.
//!
//! The budget ("prefix_cache_bytes"): a sequence whose target K/V rows, drafter context, queued features and
//! snapshots exceed it is not kept (0: nothing is, every request starts from empty caches). Backends whose runners do
//! not keep their caches (Runners::keepsPrefix false: the callbacks and TensorRT backends) start every request empty.
//!
//! Planted bugs for the tests, never set otherwise: $DFLASH2_PLANT_PREFIX_LATER_SNAPSHOT=1 restores a hit's
//! non-croppable state from the first snapshot after the hit (the K/V still cropped at the hit);
//! $DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED=1 (read by the backend's drafterRestore) leaves the restored drafter context
//! as zeros.
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

class PrefixCache
{
public:
    explicit PrefixCache(int64_t budgetBytes = kPREFIX_BUDGET_BYTES);

    //! PrefixCache.prefill_from: the runners keep the longest usable prefix of `prompt` (the drafter's context too
    //! when `drafter`: the request drafts with the DFlash 2 drafter), everything else reset -> the positions kept
    int32_t prefillFrom(std::vector<int32_t> const& prompt, Runners& runners, bool drafter);
    //! PrefixCache.snapshot: the target's non-croppable state after the prefill (stateful targets)
    void snapshot(Runners& runners);
    //! PrefixCache.store: the finished sequence, (prompt + tokens)[:the target's length]; `drafter`: its context
    //! followed the committed positions (else none is kept)
    void store(std::vector<int32_t> const& prompt, std::vector<int32_t> const& tokens, Runners& runners, bool drafter);
    //! nothing kept (a request failed: the caches' content is unknown)
    void clear();

    //! Entry.usable: how many leading positions of `ids` the kept sequence can restore
    int32_t usable(std::vector<int32_t> const& ids, bool drafter) const;
    int64_t budget() const
    {
        return mBudget;
    }
    //! what the kept sequence costs against the budget (0: none kept)
    size_t nbytes() const
    {
        return mBytes;
    }

private:
    int64_t mBudget;
    std::vector<int32_t> mIds;  //!< [n] the positions the runners hold for the kept sequence
    int32_t mDrafterLength{0};  //!< drafter context its runners can rebuild (0: none kept)
    bool mStateful{false};
    std::map<int32_t, std::shared_ptr<TargetSnapshot const>> mStates;  //!< length -> the state there
    std::map<int32_t, std::shared_ptr<TargetSnapshot const>> mTaken;   //!< the running request's
    size_t mBytes{0};
};

//! $DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED=1 (a backend's drafterRestore reads it)
bool plantedPrefixDrafterZeroed();

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
//! Not thread safe: the batch's loop (one thread at a time) is its only user.
//!
//! Planted bugs for the tests, never set otherwise: $DFLASH2_PLANT_PREFIX_EVICTED_MATCHED=1 keeps evicted entries
//! matchable (their bytes no longer counted); $DFLASH2_PLANT_PREFIX_LATER_SNAPSHOT=1 and
//! $DFLASH2_PLANT_PREFIX_DRAFTER_ZEROED=1 as for PrefixCache (Hit::state, the backend's restore).
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

} // namespace dflash2
