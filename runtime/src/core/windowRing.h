//! \file windowRing.h
//! Where the sliding-window layers' K/V go in their ring buffers, and what a rollback keeps, over any memory: the
//! twin of dflash2_trt/runtime/kv.py WindowRing without its arrays. Backends own the rings (host vectors, device
//! allocations; per sliding layer a key and a value ring [heads, ringSlots, dim] per sequence) and copy a call's
//! new rows by the runs place() returns; this module keeps each slot's window_positions (the position each ring
//! slot holds, -1 none: the target graph's input) and the lowest length a crop can return to.
//!
//! Position p lives in ring slot p % ringSlots. A call's new rows overwrite the oldest slots; the ring holds
//! ringSlots - window slots more than the window, so a crop back into a call of at most ringSlots - window + 1 rows
//! finds every key its next row needs (the overwritten ones are older than any window after the crop) and only
//! drops the cut rows' slots. A crop deeper than that is refused (DFL2_ERR_INTERNAL), never decoded with keys lost.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace dflash2
{

//! manifest target.sliding_window: each row attends to the last `window` positions; rings of `ringSlots` slots.
struct SlidingWindowSpec
{
    int32_t window{0};
    int32_t ringSlots{0};
};

//! A call's rows [first, first + count) go to ring slots [slot, slot + count).
struct RingRun
{
    int32_t first;
    int32_t slot;
    int32_t count;
};

//! The window positions of `sequences` sequences' rings (one row of ringSlots each) and their crop floors.
class WindowRingLog
{
public:
    //! plantedKeepCut: the tests' planted bug ($DFLASH2_PLANT_RING_KEEP_CUT=1), a crop leaves the cut rows' slots valid
    WindowRingLog(SlidingWindowSpec spec, int32_t sequences, bool plantedKeepCut = false);

    //! an empty ring: a new sequence
    void reset(int32_t seq);
    //! sequence `seq`'s `rows` new rows at positions start.. go into its ring -> where (at most two runs: the last
    //! ringSlots of the rows, each at its position % ringSlots)
    std::vector<RingRun> place(int32_t seq, int32_t start, int32_t rows);
    //! sequence `seq` keeps positions < length (DFL2_ERR_INTERNAL when its ring no longer holds the keys the row at
    //! `length` needs)
    void crop(int32_t seq, int32_t length);
    //! kv.WindowRing.snapshot without the arrays: sequence `seq`'s window positions [ringSlots] and crop floor
    std::pair<std::vector<int64_t>, int64_t> snapshot(int32_t seq) const;
    //! kv.WindowRing.restore without the arrays: snapshot()'s positions and floor back into sequence `seq`
    void restore(int32_t seq, std::vector<int64_t> const& positions, int64_t floor);
    //! [ringSlots] the window_positions of sequence `seq` (valid until the next call that changes it)
    int64_t const* positions(int32_t seq) const
    {
        return mPositions.data() + static_cast<size_t>(seq) * static_cast<size_t>(mSpec.ringSlots);
    }
    SlidingWindowSpec const& spec() const
    {
        return mSpec;
    }

private:
    int64_t* row(int32_t seq);

    SlidingWindowSpec mSpec;
    int32_t mSequences;
    bool mPlantedKeepCut;
    std::vector<int64_t> mPositions;  //!< [sequences, ringSlots]
    std::vector<int64_t> mFloor;      //!< [sequences] the lowest length a crop can return to
};

//! $DFLASH2_PLANT_RING_KEEP_CUT=1 (the tests' planted ring bug)
bool plantedRingKeepCut();

} // namespace dflash2
