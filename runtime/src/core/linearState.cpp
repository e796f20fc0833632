//! \file linearState.cpp
#include "linearState.h"

#include "decoder.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace dflash2
{

KeptState keptState(int32_t window, int32_t keep, int32_t inputsPitch, int32_t recurrentRow)
{
    // the last `window` columns of [before (window columns) | inputs[:, :keep]] start at column `keep`
    KeptState k;
    k.inputsPitch = inputsPitch;
    k.recurrentRow = recurrentRow;
    int32_t const fromBefore = std::max(0, window - keep);
    if (fromBefore > 0)
    {
        k.spans[static_cast<size_t>(k.spanCount++)] = ConvSpan{false, window - fromBefore, 0, fromBefore};
    }
    if (window - fromBefore > 0)
    {
        k.spans[static_cast<size_t>(k.spanCount++)]
            = ConvSpan{true, keep - (window - fromBefore), fromBefore, window - fromBefore};
    }
    return k;
}

void HostStateCopy::copy2D(void* dst, size_t dstPitch, void const* src, size_t srcPitch, size_t width, size_t height)
{
    for (size_t r = 0; r < height && width > 0; ++r)
    {
        std::memcpy(static_cast<char*>(dst) + r * dstPitch, static_cast<char const*>(src) + r * srcPitch, width);
    }
}

void saveBefore(LinearLayerState const& layer, LinearStateSpec const& spec, StateCopy& copy)
{
    size_t const windowBytes = spec.windowElements() * layer.convElem;
    size_t const recurrentBytes = spec.recurrentElements() * layer.recurrentElem;
    copy.copy2D(layer.windowBefore, windowBytes, layer.window, windowBytes, windowBytes, 1);
    copy.copy2D(layer.recurrentBefore, recurrentBytes, layer.recurrent, recurrentBytes, recurrentBytes, 1);
}

void applyKept(LinearLayerState const& layer, LinearStateSpec const& spec, KeptState const& kept, StateCopy& copy)
{
    size_t const e = layer.convElem;
    size_t const windowPitch = static_cast<size_t>(spec.window()) * e;
    size_t const inputsPitch = static_cast<size_t>(kept.inputsPitch) * e;
    for (int32_t i = 0; i < kept.spanCount; ++i)
    {
        ConvSpan const& s = kept.spans[static_cast<size_t>(i)];
        char const* src = s.fromInputs ? static_cast<char const*>(layer.inputs) : static_cast<char const*>(layer.windowBefore);
        copy.copy2D(static_cast<char*>(layer.window) + static_cast<size_t>(s.dstCol) * e, windowPitch,
            src + static_cast<size_t>(s.srcCol) * e, s.fromInputs ? inputsPitch : windowPitch,
            static_cast<size_t>(s.cols) * e, static_cast<size_t>(spec.convDim));
    }
    size_t const recurrentBytes = spec.recurrentElements() * layer.recurrentElem;
    void const* src = kept.recurrentRow < 0
        ? layer.recurrentBefore
        : static_cast<char const*>(layer.states) + static_cast<size_t>(kept.recurrentRow) * recurrentBytes;
    copy.copy2D(layer.recurrent, recurrentBytes, src, recurrentBytes, recurrentBytes, 1);
}

LinearStateLog::LinearStateLog(int32_t window, int32_t slots, LinearPlant plant)
    : mWindow(window)
    , mPlant(plant)
    , mCalls(static_cast<size_t>(std::max(1, slots)))
{
}

LinearStateLog::Call& LinearStateLog::at(int32_t slot)
{
    if (slot < 0 || static_cast<size_t>(slot) >= mCalls.size())
    {
        throw Error(DFL2_ERR_INTERNAL, "linear state slot " + std::to_string(slot) + " out of range");
    }
    return mCalls[static_cast<size_t>(slot)];
}

void LinearStateLog::reset(int32_t slot)
{
    at(slot) = Call{};
}

KeptState LinearStateLog::called(int32_t slot, int32_t start, int32_t rows, int32_t pitch, bool everyRow)
{
    if (rows < 1 || rows > pitch)
    {
        throw Error(DFL2_ERR_INTERNAL, "a linear state call of " + std::to_string(rows) + " rows over "
            + std::to_string(pitch) + " columns");
    }
    at(slot) = Call{start, rows, pitch, everyRow};
    return keptState(mWindow, rows, pitch, everyRow ? rows - 1 : 0);
}

std::optional<KeptState> LinearStateLog::crop(int32_t slot, int32_t length)
{
    Call& c = at(slot);
    int32_t const keep = length - c.start;
    if (keep >= c.rows && c.rows > 0)
    {
        return std::nullopt;  // every row of the last call kept: the state after it stands
    }
    if (!c.recorded)
    {
        throw Error(DFL2_ERR_INTERNAL, "the linear layers' state can be rolled back only into the last call, and only "
            "when it recorded every row's state");
    }
    if (keep < 0)
    {
        throw Error(DFL2_ERR_INTERNAL, "cannot keep " + std::to_string(keep) + " rows of a call of "
            + std::to_string(c.rows));
    }
    c.recorded = false;
    if (mPlant == LinearPlant::kSKIP_ROLLBACK)
    {
        return std::nullopt;
    }
    return keptState(mWindow, keep, c.pitch, mPlant == LinearPlant::kKEEP_RECURRENT ? c.rows - 1 : keep - 1);
}

LinearPlant plantedLinearRollback()
{
    auto const on = [](char const* name) {
        char const* v = std::getenv(name);
        return v != nullptr && std::string(v) == "1";
    };
    if (on("DFLASH2_PLANT_SKIP_LINEAR_ROLLBACK"))
    {
        return LinearPlant::kSKIP_ROLLBACK;
    }
    return on("DFLASH2_PLANT_KEEP_SSM_STATE") ? LinearPlant::kKEEP_RECURRENT : LinearPlant::kNONE;
}

} // namespace dflash2
