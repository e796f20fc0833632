//! \file linearState.h
//! The linear-attention (Gated DeltaNet) layers' state of a hybrid target and its rollback, over any memory: the
//! twin of dflash2_trt/runtime/linear_state.py (LinearStates). Backends own the buffers (host vectors, device
//! allocations) and a StateCopy over them; this module says what to copy.
//!
//! A linear layer's state is overwritten by every row: the convolution keeps its last K - 1 inputs (the window,
//! [conv_dim, K - 1]) and the delta rule one recurrent matrix per value head ([heads, dk, dv] fp32). The target graph
//! takes both (past_conv.{i}, past_recurrent.{i}) and returns, for a call of S rows, the convolution's S inputs
//! (present_conv.{i} [conv_dim, S]) and the recurrent state after each row the call asked for (state_rows;
//! present_recurrent.{i} [R, heads, dk, dv]). Per layer and sequence a backend keeps
//!
//!   window, recurrent              the state after the last kept row (what the next call is fed)
//!   windowBefore, recurrentBefore  the state before the last call (saved by saveBefore ahead of applying a call)
//!   inputs, states                 the last call's present_conv / present_recurrent outputs
//!
//! and LinearStateLog (per sequence slot) records the last call, so that a rollback to any accepted prefix of it
//! is a slice of those buffers (KeptState), never a recomputation. A call of more rows than the graph takes
//! (max_rows_per_call: a long prompt) runs in chunks that ask for their last row's state only and cannot be rolled
//! back (the decoder never rolls a prompt back).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace dflash2
{

//! manifest target.linear_state: the state of one linear layer and the rows of one graph call.
struct LinearStateSpec
{
    int32_t convDim{0};
    int32_t convKernel{0};
    int32_t numHeads{0};
    int32_t keyDim{0};
    int32_t valueDim{0};
    int32_t maxRowsPerCall{0};

    //! K - 1: the convolution inputs the state keeps
    int32_t window() const
    {
        return convKernel - 1;
    }
    //! conv_dim x (K - 1)
    size_t windowElements() const
    {
        return static_cast<size_t>(convDim) * static_cast<size_t>(window());
    }
    //! heads x dk x dv: one recurrent state
    size_t recurrentElements() const
    {
        return static_cast<size_t>(numHeads) * static_cast<size_t>(keyDim) * static_cast<size_t>(valueDim);
    }
};

//! Columns [srcCol, srcCol + cols) of every channel of a source -> columns [dstCol, dstCol + cols) of the window.
//! Source: the window before the call (pitch K - 1) or the call's convolution inputs (pitch: the call's S).
struct ConvSpan
{
    bool fromInputs{false};
    int32_t srcCol{0};
    int32_t dstCol{0};
    int32_t cols{0};
};

//! The state after `keep` rows of the last call: the window is the last K - 1 columns of
//! [windowBefore | inputs[:, :keep]] (at most two spans), the recurrent state row `recurrentRow` of the call's
//! states (-1: the state before the call).
struct KeptState
{
    std::array<ConvSpan, 2> spans{};
    int32_t spanCount{0};
    int32_t inputsPitch{0};  //!< the call's S (columns of its present_conv)
    int32_t recurrentRow{-1};
};

//! The spans of the window after `keep` of a call's rows (a pure function: linear_state.LinearStates.rollback's
//! concatenate-and-slice).
KeptState keptState(int32_t window, int32_t keep, int32_t inputsPitch, int32_t recurrentRow);

//! Strided copies of `height` rows of `width` bytes (pitches in bytes): memcpy on the host, a device copy in a GPU
//! backend (enqueued on its stream).
class StateCopy
{
public:
    virtual ~StateCopy() = default;
    virtual void copy2D(void* dst, size_t dstPitch, void const* src, size_t srcPitch, size_t width, size_t height) = 0;
};

//! StateCopy over host memory.
class HostStateCopy : public StateCopy
{
public:
    void copy2D(void* dst, size_t dstPitch, void const* src, size_t srcPitch, size_t width, size_t height) override;
};

//! One linear layer's buffers for one sequence (see the file comment); element sizes in bytes.
struct LinearLayerState
{
    void* window{nullptr};
    void* recurrent{nullptr};
    void* windowBefore{nullptr};
    void* recurrentBefore{nullptr};
    void const* inputs{nullptr};  //!< [conv_dim, inputsPitch] of the last call
    void const* states{nullptr};  //!< [R, heads, dk, dv] of the last call
    size_t convElem{4};
    size_t recurrentElem{4};
};

//! windowBefore / recurrentBefore := window / recurrent (ahead of applying a call's outputs)
void saveBefore(LinearLayerState const& layer, LinearStateSpec const& spec, StateCopy& copy);
//! window / recurrent := the kept state (from the *Before buffers and the call's outputs)
void applyKept(LinearLayerState const& layer, LinearStateSpec const& spec, KeptState const& kept, StateCopy& copy);

//! The planted bugs of the tests (plantedLinearRollback): none; a crop keeps the state after all the call's rows
//! (convolution window and recurrent state); a crop rolls the window back but keeps the recurrent (a Mamba-2 layer's
//! SSM) state after all the call's rows.
enum class LinearPlant
{
    kNONE,
    kSKIP_ROLLBACK,
    kKEEP_RECURRENT,
};

//! Per sequence slot, the last call (LinearStates._last): where it started, its rows, whether it recorded each
//! row's state. Not thread safe (one per runner).
class LinearStateLog
{
public:
    //! `plant`: a planted bug for the tests (plantedLinearRollback), kNONE otherwise
    LinearStateLog(int32_t window, int32_t slots, LinearPlant plant);
    void reset(int32_t slot);
    //! A graph call of `rows` rows of the slot from position `start`, over `pitch` columns (the call's S; rows <=
    //! pitch: a batch pads) whose states are every row's (`everyRow`) or the last row's alone -> the state after
    //! its rows (apply after saveBefore).
    KeptState called(int32_t slot, int32_t start, int32_t rows, int32_t pitch, bool everyRow);
    //! The slot keeps positions 0..length-1: none when that keeps every row of its last call, else the state after
    //! the kept rows of that call (DFL2_ERR_INTERNAL when the call did not record every row, or was rolled back
    //! already, or `length` is before it).
    std::optional<KeptState> crop(int32_t slot, int32_t length);

private:
    struct Call
    {
        int32_t start{0};
        int32_t rows{0};
        int32_t pitch{0};
        bool recorded{false};  //!< every row's state is in the outputs (and not rolled back yet)
    };
    Call& at(int32_t slot);

    int32_t mWindow;
    LinearPlant mPlant;
    std::vector<Call> mCalls;
};

//! The planted bug of the tests, so that their lossless checks are shown to catch it:
//! $DFLASH2_PLANT_SKIP_LINEAR_ROLLBACK=1: kSKIP_ROLLBACK (a crop leaves the linear layers' state after all the
//! verified rows); $DFLASH2_PLANT_KEEP_SSM_STATE=1: kKEEP_RECURRENT (a crop rolls the convolution window back but not
//! the recurrent state: a Mamba-2 layer's SSM state). Unset or 0: kNONE.
LinearPlant plantedLinearRollback();

} // namespace dflash2
