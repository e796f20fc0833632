"""When speculation does not pay: the acceptance guard and the confidence-adapted verify length (NumPy only).

:class:`AcceptanceGuard` — one request's switch between speculative cycles and plain target steps. It keeps
the tokens committed and the wall time of the last ``window`` speculative cycles and the running time of a
plain target step, both measured in this run on this machine. While the window's throughput
(Σ tokens / Σ seconds) is below a plain step's (1 / t_step) — i.e. the mean tokens per cycle τ_w is below
the measured break-even t_cycle / t_step — the decoder runs ``backoff`` plain steps, then probes with a new
window of cycles; each failed probe doubles ``backoff`` (up to ``max_backoff``), a passed one resets it.
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


@dataclass(frozen=True)
class GuardConfig:
    window: int = 4  # speculative cycles per estimate (a probe runs this many cycles too)
    backoff: int = 16  # plain steps after the first failed estimate
    max_backoff: int = 256  # cap of the doubling backoff
    # fixed break-even τ (t_cycle / t_step); None: measured online in the run (the default)
    cost_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.window < 1:
            raise DFlash2Error(f"guard window must be >= 1, got {self.window}")
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
        self.plain_left = 0  # plain steps still to run before the next probe
        self.switches = 0  # speculative -> plain transitions
        self.probes = 0  # plain -> speculative transitions
        self.calibrating = False  # a single plain step run only to time t_step

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
                self.window.clear()  # the probe is judged on its own cycles
            self.calibrating = False

    def record_cycle(self, tokens: int, seconds: float) -> None:
        self.window.append((tokens, seconds))
        if len(self.window) < self.window.maxlen:
            return
        be = self.break_even()
        if be is None:  # no plain step timed yet: time one (it commits a token like any other step)
            self.plain_left, self.calibrating = 1, True
            return
        tau_w = float(np.mean([t for t, _ in self.window]))
        if tau_w < be:
            self.switches += 1
            self.plain_left = self.backoff
            self.backoff = min(2 * self.backoff, self.cfg.max_backoff)
        else:
            self.backoff = self.cfg.backoff


def verify_rows(confidence: np.ndarray | None, n_rows: int, threshold: float) -> int:
    """Rows to verify: the leading rows of the first ``n_rows`` whose cumulative confidence (running product)
    is >= ``threshold``; all ``n_rows`` when the drafter reports no confidence or the threshold is <= 0.

    ``confidence`` [L] float: row i's confidence computed *before* row i's draft is drawn — the largest
    probability of row i's proposal given the drafts of rows < i (see :class:`~dflash2_trt.runtime.base.Draft`).
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
