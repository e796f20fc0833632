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

} // namespace dflash2
