"""When speculation does not pay: the acceptance guard and the confidence-adapted verify length (NumPy only).

:class:`AcceptanceGuard` — one request's switch between speculative cycles and plain target steps. It keeps
the tokens committed and the wall time of the last ``window`` speculative cycles (kept across plain
stretches) and the running time of a plain target step, both measured in this run on this machine (the first
decode step is a plain one, timed). The break-even is the measured t_cycle / t_step: a cycle pays when it
commits more tokens than that. Tokens per cycle vary a lot (a τ 1.5 drafter commits 1 token in ~2 of 3
cycles), so the window's mean τ_w alone switches a drafter that pays off after any unlucky stretch; the guard
switches only when the evidence says it does not pay — when the upper bound τ_w + z·s/√n (s the sample
standard deviation of the n cycles in the window, at least ``min_spread``) is below the break-even. It then runs
``backoff`` plain steps and probes with ``probe_window`` cycles, judged with the window's earlier cycles; each
failed probe doubles ``backoff`` (up to ``max_backoff``), a passed one resets it. Why these sizes: the first
judgement comes after ``min_cycles`` = 3 cycles; ``min_spread`` = 0.5 because a few equal cycles prove nothing
(a τ 1.4 drafter at block size 3 commits 1 token in ~70 % of its cycles, so three 1-token cycles in a row come
one time in three; with s = 0 they switched it off at once, and a 128-token answer then ran mostly plain: on
the packaged drafter's per-position acceptance of 20 MT-Bench answers, replayed through the guard at a break-even
of 1.15 / 1.25 (benchmarks/guard_replay.py), the floor gives 1.22 / 1.10x against 1.15 / 1.08x without it and
1.23 / 1.13x drafting always; a useless drafter is still switched off, after 5 one-token cycles at a break-even of
1.25, 12 at 1.15); a failed probe wastes about ``probe_window`` × (break-even − 1) plain steps, so 2 probe cycles
per 32 plain steps bound the loss of a useless drafter to ~6 % (less as the backoff doubles); a 64-cycle window
with z = 1 keeps a drafter that pays ~10 % on average switched on where a 3-cycle mean kept switching it off
(the README's CPU options table measures both).
TensorRT-LLM's ``acceptance_rate_threshold`` is the model: a rolling acceptance average over the last N
speculative iterations; there the threshold is a fixed rate and speculation stops for good, here the
threshold is the measured cost ratio and speculation is probed again (acceptance changes along a request:
code vs prose, boilerplate vs content).

Lossless: the guard only chooses *which* exact procedure makes the next tokens — a plain step samples the
target's own law (argmax at T = 0), a cycle is verified by greedy matching / rejection sampling. The choice
depends only on the past (tokens committed, times measured), never on the random numbers of the step it
chooses, so every token still has the target's conditional law. Randomness: one generator in a fixed order
per step kind (plain step: one target draw; cycle: the drafter's uniforms, then the rejection test). With a
measured cost the step kinds depend on timing, so a seed fixes the law but not the sample; a fixed
``cost_ratio`` (or ``--no-guard``) makes a seed reproduce the tokens exactly.

:func:`verify_rows` — how many draft rows to verify: the leading rows whose cumulative drafter confidence
stays at or above a threshold (fewer rows = a cheaper verify pass on CPU).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from dflash2_trt.errors import DFlash2Error


# the least spread of tokens per cycle an estimate assumes (the module docstring); the batch loop's rule shares it
MIN_SPREAD = 0.5


@dataclass(frozen=True)
class GuardConfig:
    window: int = 64  # speculative cycles per estimate (rolling, kept across plain stretches)
    min_cycles: int = 3  # cycles before the first judgement
    probe_window: int = 2  # cycles a probe runs before it is judged
    z: float = 1.0  # switch when τ_w + z·s/√n is below the break-even (0: when the mean τ_w is)
    min_spread: float = MIN_SPREAD  # s is at least this: a few equal cycles are no proof
    backoff: int = 32  # plain steps after the first failed estimate
    max_backoff: int = 512  # cap of the doubling backoff
    # fixed break-even τ (t_cycle / t_step); None: measured online in the run (the default)
    cost_ratio: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.probe_window <= self.window or not 1 <= self.min_cycles <= self.window:
            raise DFlash2Error(f"guard window must be >= probe_window, min_cycles >= 1, got {self.window}, "
                               f"{self.probe_window}, {self.min_cycles}")
        if not 0 <= self.z < float("inf"):
            raise DFlash2Error(f"guard z must be a finite number >= 0, got {self.z}")
        if not 0 <= self.min_spread < float("inf"):
            raise DFlash2Error(f"guard min_spread must be a finite number >= 0, got {self.min_spread}")
        if not 1 <= self.backoff <= self.max_backoff:
            raise DFlash2Error(f"guard backoff must be in [1, max_backoff={self.max_backoff}], got {self.backoff}")
        if self.cost_ratio is not None and not self.cost_ratio > 0:
            raise DFlash2Error(f"guard cost_ratio must be > 0, got {self.cost_ratio}")


class AcceptanceGuard:
    """One request's guard state (see the module docstring). The decoder asks :meth:`plain_next` before each
    step and reports it with :meth:`record_cycle` / :meth:`record_step`."""

    def __init__(self, cfg: GuardConfig | None = None) -> None:
        self.cfg = cfg or GuardConfig()
        self.window: deque[tuple[int, float]] = deque(maxlen=self.cfg.window)  # (tokens, seconds) per cycle
        self.t_step: float | None = None  # running mean seconds of a plain target step
        self.n_steps_timed = 0
        self.backoff = self.cfg.backoff
        self.switches = 0  # speculative -> plain transitions
        self.probes = 0  # plain -> speculative transitions
        self.need = self.cfg.min_cycles  # cycles before the next judgement
        # a measured cost needs t_step: the first step is a plain one, timed (it commits a token like any other)
        self.calibrating = self.cfg.cost_ratio is None
        self.plain_left = 1 if self.calibrating else 0  # plain steps still to run before the next (probe) cycle

    def plain_next(self) -> bool:
        return self.plain_left > 0

    def break_even(self) -> float | None:
        """τ a cycle must reach to beat plain steps (None while not measurable yet)."""
        if self.cfg.cost_ratio is not None:
            return self.cfg.cost_ratio
        if self.t_step is None or not self.window:
            return None
        return float(np.mean([s for _, s in self.window])) / self.t_step

    def record_step(self, seconds: float) -> None:
        self.n_steps_timed += 1
        self.t_step = seconds if self.t_step is None else self.t_step + (seconds - self.t_step) / min(
            self.n_steps_timed, 16)  # running mean, then an exponential one (context grows slowly)
        self.plain_left -= 1
        if self.plain_left == 0:
            if not self.calibrating:
                self.probes += 1
                self.need = self.cfg.probe_window  # judged with the window's earlier cycles
            self.calibrating = False

    def record_cycle(self, tokens: int, seconds: float) -> None:
        self.window.append((tokens, seconds))
        self.need -= 1
        if self.need > 0:
            return
        self.need = 1  # from now on judged after every cycle, on the rolling window
        be = self.break_even()
        assert be is not None  # t_step is timed by the first step
        per_cycle = np.array([t for t, _ in self.window], dtype=np.float64)
        s = float(per_cycle.std(ddof=1)) if per_cycle.size > 1 else 0.0
        spread = max(s, self.cfg.min_spread) / np.sqrt(per_cycle.size)
        if float(per_cycle.mean()) + self.cfg.z * spread < be:
            self.switches += 1
            self.plain_left = self.backoff
            self.backoff = min(2 * self.backoff, self.cfg.max_backoff)
        else:
            self.backoff = self.cfg.backoff


def verify_rows(confidence: np.ndarray | None, n_rows: int, threshold: float) -> int:
    """Rows to verify: the leading rows of the first ``n_rows`` whose cumulative confidence (running product)
    is >= ``threshold``; all ``n_rows`` when the drafter reports no confidence or the threshold is <= 0.

    ``confidence`` [L] float: row i's confidence computed *before* row i's draft is drawn — the largest
    probability of row i's proposal given the drafts of rows < i (see :class:`~dflash2_trt.runtime.protocol.Draft`).
    Why not the probability of the drawn draft itself: at T > 0 a row's inclusion must not depend on the value
    verified in it, or rejection sampling is biased (proposal q = (0.9, 0.1), target p = (0.5, 0.5), verify
    only when the draft is token 0: P(token 0) = 0.9 · 0.5/0.9 + 0.1 · 0.5 = 0.55). A rule that decides row i
    from rows < i and the drafter alone is a stopping rule on the proposal side, and speculative sampling is
    exact for every such rule; at T = 0 any rule is lossless (fewer drafts proposed, same greedy check).
    """
    if confidence is None or threshold <= 0:
        return n_rows
    cum = np.cumprod(np.asarray(confidence[:n_rows], dtype=np.float64))  # [n_rows]
    below = np.flatnonzero(cum < threshold)
    return int(below[0]) if below.size else n_rows
