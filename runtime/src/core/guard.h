//! \file guard.h
//! The acceptance guard: the twin of dflash2_trt/runtime/guard.py's GuardConfig and AcceptanceGuard (its module
//! docstring states the rule and why its sizes). One request's switch between speculative cycles and plain target
//! steps: the tokens committed and the seconds of the last `window` cycles, and the running mean of a plain step's
//! seconds (the mean of the first 16 steps, then an exponential mean weighting the newest 1/16); the break-even is
//! the window's mean cycle time over it. A cycle's evidence switches to plain steps when the window's mean τ_w plus
//! z·max(s, minSpread)/√n is below the break-even; `backoff` plain steps follow, then a probe of `probeWindow`
//! cycles; a failed probe doubles the backoff (at most maxBackoff), a passed judgement resets it.
//!
//! Same arithmetic in the same order as the Python class (numpy's pairwise sums, std with ddof = 1), so every state
//! after every call is the Python one bit for bit (tests/test_capi.py writes the vectors, coreVectors replays them).
//! Lossless by construction: it only chooses which exact procedure makes the next tokens.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <utility>

namespace dflash2
{

//! guard.GuardConfig (the same defaults); check() throws DFL2_ERR_OPTION_VALUE where the Python class raises.
struct GuardConfig
{
    int32_t window{64};       //!< speculative cycles per estimate (rolling, kept across plain stretches)
    int32_t minCycles{3};     //!< cycles before the first judgement
    int32_t probeWindow{2};   //!< cycles a probe runs before it is judged
    double z{1.0};            //!< switch when τ_w + z·s/√n is below the break-even
    double minSpread{0.5};    //!< s is at least this (guard.MIN_SPREAD)
    int32_t backoff{32};      //!< plain steps after the first failed estimate
    int32_t maxBackoff{512};  //!< cap of the doubling backoff
    std::optional<double> costRatio;  //!< fixed break-even τ; none: measured in the run

    void check() const;
};

//! guard.AcceptanceGuard: ask plainNext() before each step, report it with recordCycle / recordStep.
class AcceptanceGuard
{
public:
    explicit AcceptanceGuard(GuardConfig cfg = GuardConfig{});

    bool plainNext() const
    {
        return mPlainLeft > 0;
    }
    //! τ a cycle must reach to beat plain steps (none while not measurable yet)
    std::optional<double> breakEven() const;
    void recordStep(double seconds);
    void recordCycle(int32_t tokens, double seconds);

    GuardConfig const& config() const
    {
        return mCfg;
    }
    std::optional<double> tStep() const
    {
        return mTStep;
    }
    std::deque<std::pair<int32_t, double>> const& window() const
    {
        return mWindow;
    }
    int64_t backoff() const
    {
        return mBackoff;
    }
    int64_t plainLeft() const
    {
        return mPlainLeft;
    }
    int64_t need() const
    {
        return mNeed;
    }
    bool calibrating() const
    {
        return mCalibrating;
    }
    int32_t switches() const
    {
        return mSwitches;
    }
    int32_t probes() const
    {
        return mProbes;
    }

private:
    GuardConfig mCfg;
    std::deque<std::pair<int32_t, double>> mWindow;  //!< (tokens, seconds) per cycle, at most cfg.window
    std::optional<double> mTStep;                    //!< running mean seconds of a plain target step
    int64_t mStepsTimed{0};
    int64_t mBackoff;
    int32_t mSwitches{0};  //!< speculative -> plain transitions
    int32_t mProbes{0};    //!< plain -> speculative transitions
    int64_t mNeed;         //!< cycles before the next judgement
    bool mCalibrating;     //!< a measured cost needs t_step: the first step is a timed plain one
    int64_t mPlainLeft;    //!< plain steps still to run before the next (probe) cycle
};

} // namespace dflash2
