//! \file windowRing.cpp
#include "windowRing.h"

#include "decoder.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace dflash2
{

bool plantedRingKeepCut()
{
    char const* v = std::getenv("DFLASH2_PLANT_RING_KEEP_CUT");
    return v != nullptr && std::strcmp(v, "1") == 0;
}

WindowRingLog::WindowRingLog(SlidingWindowSpec spec, int32_t sequences, bool plantedKeepCut)
    : mSpec(spec)
    , mSequences(sequences)
    , mPlantedKeepCut(plantedKeepCut)
    , mPositions(static_cast<size_t>(sequences) * static_cast<size_t>(spec.ringSlots), -1)
    , mFloor(static_cast<size_t>(sequences), 0)
{
    if (spec.window < 1 || spec.ringSlots < spec.window)
    {
        throw Error(DFL2_ERR_INTERNAL, "a sliding window needs 1 <= window <= ring slots");
    }
}

int64_t* WindowRingLog::row(int32_t seq)
{
    if (seq < 0 || seq >= mSequences)
    {
        throw Error(DFL2_ERR_INTERNAL, "window ring sequence " + std::to_string(seq) + " out of range");
    }
    return mPositions.data() + static_cast<size_t>(seq) * static_cast<size_t>(mSpec.ringSlots);
}

void WindowRingLog::reset(int32_t seq)
{
    std::fill_n(row(seq), mSpec.ringSlots, -1);
    mFloor[static_cast<size_t>(seq)] = 0;
}

std::pair<std::vector<int64_t>, int64_t> WindowRingLog::snapshot(int32_t seq) const
{
    if (seq < 0 || seq >= mSequences)
    {
        throw Error(DFL2_ERR_INTERNAL, "window ring sequence " + std::to_string(seq) + " out of range");
    }
    int64_t const* p = positions(seq);
    return {std::vector<int64_t>(p, p + mSpec.ringSlots), mFloor[static_cast<size_t>(seq)]};
}

void WindowRingLog::restore(int32_t seq, std::vector<int64_t> const& positions, int64_t floor)
{
    if (positions.size() != static_cast<size_t>(mSpec.ringSlots))
    {
        throw Error(DFL2_ERR_INTERNAL, "a window ring snapshot of another ring size");
    }
    std::copy(positions.begin(), positions.end(), row(seq));
    mFloor[static_cast<size_t>(seq)] = floor;
}

std::vector<RingRun> WindowRingLog::place(int32_t seq, int32_t start, int32_t rows)
{
    int64_t* p = row(seq);
    int32_t const R = mSpec.ringSlots;
    std::vector<RingRun> runs;
    for (int32_t first = std::max(0, rows - R); first < rows;)
    {
        int32_t const dst = (start + first) % R;
        int32_t const count = std::min(rows - first, R - dst);
        runs.push_back(RingRun{first, dst, count});
        for (int32_t i = 0; i < count; ++i)
        {
            p[dst + i] = static_cast<int64_t>(start) + first + i;
        }
        first += count;
    }
    // the lowest key the ring holds only rises within a sequence (a cut row's slot stays lost to its older position),
    // so neither does the floor: a short call after a crop must not lower it below the lost keys
    int64_t& floor = mFloor[static_cast<size_t>(seq)];
    floor = std::max<int64_t>(floor, static_cast<int64_t>(start) + rows - (R - mSpec.window) - 1);
    return runs;
}

void WindowRingLog::crop(int32_t seq, int32_t length)
{
    int64_t* p = row(seq);
    int64_t const floor = mFloor[static_cast<size_t>(seq)];
    if (length < floor)
    {
        throw Error(DFL2_ERR_INTERNAL, "the sliding-window ring of " + std::to_string(mSpec.ringSlots)
                + " slots cannot return to length " + std::to_string(length) + ": it holds the keys of lengths >= "
                + std::to_string(floor) + " only");
    }
    if (mPlantedKeepCut)
    {
        return;
    }
    for (int32_t i = 0; i < mSpec.ringSlots; ++i)
    {
        p[i] = p[i] >= length ? -1 : p[i];
    }
}

} // namespace dflash2
