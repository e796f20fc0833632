//! \file guard.cpp
//! The acceptance guard; see guard.h. Each step names its line in dflash2_trt/runtime/guard.py.
#include "guard.h"

#include "decoder.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace dflash2
{

// GuardConfig.__post_init__
void GuardConfig::check() const
{
    auto fail = [](std::string const& m) { throw Error(DFL2_ERR_OPTION_VALUE, m); };
    if (!(1 <= probeWindow && probeWindow <= window) || !(1 <= minCycles && minCycles <= window))
    {
        fail("guard window must be >= probe_window, min_cycles >= 1, got " + std::to_string(window) + ", "
            + std::to_string(probeWindow) + ", " + std::to_string(minCycles));
    }
    if (!(0 <= z && z < INFINITY))
    {
        fail("guard z must be a finite number >= 0, got " + std::to_string(z));
    }
    if (!(0 <= minSpread && minSpread < INFINITY))
    {
        fail("guard min_spread must be a finite number >= 0, got " + std::to_string(minSpread));
    }
    if (!(1 <= backoff && backoff <= maxBackoff))
    {
        fail("guard backoff must be in [1, max_backoff=" + std::to_string(maxBackoff) + "], got "
            + std::to_string(backoff));
    }
    if (costRatio && !(*costRatio > 0))
    {
        fail("guard cost_ratio must be > 0, got " + std::to_string(*costRatio));
    }
}

AcceptanceGuard::AcceptanceGuard(GuardConfig cfg)
    : mCfg(cfg)
    , mBackoff(cfg.backoff)
    , mNeed(cfg.minCycles)
    , mCalibrating(!cfg.costRatio)
    , mPlainLeft(mCalibrating ? 1 : 0)
{
    mCfg.check();
}

// break_even: cost_ratio, else np.mean(the window's seconds) / t_step
std::optional<double> AcceptanceGuard::breakEven() const
{
    if (mCfg.costRatio)
    {
        return mCfg.costRatio;
    }
    if (!mTStep || mWindow.empty())
    {
        return std::nullopt;
    }
    std::vector<double> s;
    s.reserve(mWindow.size());
    for (auto const& c : mWindow)
    {
        s.push_back(c.second);
    }
    return pairwiseSum(s.data(), s.size()) / static_cast<double>(s.size()) / *mTStep;
}

// record_step: the running mean (the first 16 steps), then an exponential one (context grows slowly)
void AcceptanceGuard::recordStep(double seconds)
{
    ++mStepsTimed;
    mTStep = !mTStep ? seconds : *mTStep + (seconds - *mTStep) / static_cast<double>(std::min<int64_t>(mStepsTimed, 16));
    --mPlainLeft;
    if (mPlainLeft == 0)
    {
        if (!mCalibrating)
        {
            ++mProbes;
            mNeed = mCfg.probeWindow;  // judged with the window's earlier cycles
        }
        mCalibrating = false;
    }
}

// record_cycle: the window's mean tokens per cycle + z * max(s, min_spread) / sqrt(n) against the break-even
void AcceptanceGuard::recordCycle(int32_t tokens, double seconds)
{
    mWindow.emplace_back(tokens, seconds);
    if (static_cast<int64_t>(mWindow.size()) > mCfg.window)
    {
        mWindow.pop_front();  // deque(maxlen=window)
    }
    if (--mNeed > 0)
    {
        return;
    }
    mNeed = 1;  // from now on judged after every cycle, on the rolling window
    std::optional<double> const be = breakEven();
    if (!be)
    {
        throw Error(DFL2_ERR_INTERNAL, "acceptance guard judged a cycle before a plain step was timed");
    }
    std::vector<double> perCycle;
    perCycle.reserve(mWindow.size());
    for (auto const& c : mWindow)
    {
        perCycle.push_back(static_cast<double>(c.first));
    }
    size_t const n = perCycle.size();
    double const mean = pairwiseSum(perCycle.data(), n) / static_cast<double>(n);
    double s = 0.0;
    if (n > 1)  // numpy's std(ddof=1): pairwise sums of the value and of the squared deviations
    {
        std::vector<double> dev(n);
        for (size_t i = 0; i < n; ++i)
        {
            double const d = perCycle[i] - mean;
            dev[i] = d * d;
        }
        s = std::sqrt(pairwiseSum(dev.data(), n) / static_cast<double>(n - 1));
    }
    double const spread = std::max(s, mCfg.minSpread) / std::sqrt(static_cast<double>(n));
    if (mean + mCfg.z * spread < *be)
    {
        ++mSwitches;
        mPlainLeft = mBackoff;
        mBackoff = std::min<int64_t>(2 * mBackoff, mCfg.maxBackoff);
    }
    else
    {
        mBackoff = mCfg.backoff;
    }
}

} // namespace dflash2
