"""Continuous batching (NumPy; no torch): many requests decoded together over one batched target runner
(:class:`~dflash2_trt.runtime.ort.batched_target.OrtBatchedTargetRunner`), speculating only while it pays.

Requests join and leave between steps (in-flight batching): :meth:`BatchDecoder.submit` queues a request, each
:meth:`~BatchDecoder.step` first admits queued requests into free slots (their prompts prefilled together in one
target forward, each its first token drawn), then runs one step for every active sequence, then retires the
finished ones (their own EOS set, max tokens, the cache's capacity, or :meth:`~BatchDecoder.cancel`), freeing
their slots for the next step.

One step, flat (the names of :mod:`dflash2_trt.runtime.decoder`):

    choose  which sequences draft this step and who proposes for each (the rule below)
    draft   per drafting sequence, by its proposer: the DFlash 2 drafter (its pending context features join its
            drafter's cache, the drafter proposes: with a batched drafter (``batched_drafter``,
            :class:`~dflash2_trt.runtime.ort.batched_drafter.OrtBatchedDraftRunner`) every drafter proposal of the
            step shares one context call and one block + head call; else one B = 1 drafter per slot, called per
            sequence)
            or prompt lookup (:mod:`dflash2_trt.runtime.ngram`: the context's own continuation, no model; the
            features of its verified rows wait with the plain steps' until the drafter runs again, then join its
            context in one pass, so the draft context stays contiguous as in the B = 1 loop)
    target  ONE target forward for every sequence: a plain sequence's anchor (one row), a drafting sequence's
            [anchor, drafts] (its verify); ragged rows share graph calls where the runner can (with
            dflash2.DecodeAttention: the verifies and the plain steps in one call; with GroupQueryAttention the
            verifies run one by one, see the runner)
    accept  per sequence its own accepted length (ragged acceptance): greedy matching at T = 0, rejection
            sampling at T > 0 (a lookup's deterministic drafts: a one-hot proposal); plain sequences draw the
            target's own next token
    commit  crop each verified slot to its accepted length; committed positions' features become draft context

Requests: each one's options are a :class:`~dflash2_trt.runtime.request.GenerationRequest`, validated by
:meth:`BatchDecoder.submit` against the target's limits (unless the caller validated it for that prompt), read as
the B = 1 loop reads them; ``guard`` and ``min_confidence`` are the B = 1 loop's (here the rule below decides, and
every verify takes the whole block: ``Limits.whole_blocks`` refuses a request with ``min_confidence`` > 0).

Proposers: each request names its own (``GenerationRequest.proposer``, of :data:`dflash2_trt.vocabulary.PROPOSERS`;
default ``auto``, as the B = 1 loop): ``dflash2`` the drafter, ``ngram`` prompt lookup only (the drafter never runs
for it; no match = a plain step; needs no drafter in the decoder), ``auto`` per cycle whichever its measured
acceptance favours. One :class:`~dflash2_trt.runtime.ngram.ProposerChoice` per sequence makes that choice exactly
as in :func:`~dflash2_trt.runtime.decoder.speculative_generate`, with the rule below in the acceptance guard's
place: the choice names the sequence's preferred proposal; when the rule leaves a preferred drafter proposal out,
a lookup of the same sequence may still verify (as a paying lookup runs through the guard's plain stretches).
``GenerationResult.proposers`` records each cycle's proposer (its ``stats()``: each proposer's cycles and τ).

Randomness: each sequence has its own ``numpy.random.Generator(seed)`` drawn in the order of
:func:`~dflash2_trt.runtime.decoder.speculative_generate` (first token; a plain step: one draw; a drafter cycle: the
drafter's uniforms, then the rejection test; a lookup cycle: the rejection test), so a sequence's tokens never
depend on the others in the batch: at T = 0 each sequence's output is its own B = 1 greedy output, and a T > 0
sequence that never drafts gives :func:`~dflash2_trt.runtime.decoder.target_generate`'s tokens for its seed.

The load-adaptive rule (:class:`SpeculationRule`). Per step, with n active sequences, each speculative one offering
its preferred proposal c (the drafter's or a lookup's) with estimated tokens per cycle τ̂_c, sorted by
τ̂_1 >= τ̂_2 >= ..., draft for the k that maximise the step's estimated throughput

    tokens(k) / time(k),  tokens(k) = (n - k) + Σ_{c<=k} τ̂_c,
                          time(k)   = t_plain(n) + Σ_{c<=k} (t_draft(c) + t_verify),
                          t_draft(c) = t_draft for a drafter proposal, 0 for a lookup (microseconds, no model)

where t_plain(m) is the measured time (:data:`COST_CLOCK`: wall time) of the target forward of a step
with m sequences and no drafting, t_draft one drafter proposal (context update included, except a prompt's) and
t_verify what one drafting sequence adds to a step's target forward, all measured in this run (running means;
t_plain interpolated linearly in m between measured batch sizes). With the ORT batched runner the rule takes
t_plain(n) + Σ t_verify from the runner's plan instead: t_plain(n) x units(the k drafting) / units(none), units =
calls x ``call_rows`` + padded rows (``OrtBatchedTargetRunner.cost_units``, each proposal with its own rows): a
verify that pads every plain row of the call to its 3 rows costs what it costs, not a noisy difference of two
timings. When some proposals are lookups the order is by (τ̂_c - 1) / (t_draft(c) + t_verify(c)) instead: the
tokens a proposal adds per second it costs (a lookup of τ̂ 1.8 may pay where a drafter proposal of τ̂ 2 does not).
Then, with those k fixed, the lookups of the sequences whose drafter proposal was left out (``auto`` sequences with
a match) are weighed the same way, free of t_draft: a lookup that pays still runs beside batched plain steps, as
it runs through the B = 1 guard's plain stretches.

With a batched drafter the step's drafter proposals are ONE call, charged once per step: Σ_{c<=k} t_draft(c)
becomes t_draft(k_d), the measured time of the step's proposal call for its k_d drafter proposals (context update
included, except prompts'; running means per k_d, linear between measured counts, flat beyond them). A call costs
a few fixed milliseconds plus little per sequence (benchmarks/batched_draft_cost.py, demo drafter, CPU time: 2.5 ms
for one, 7.6 ms for 8, where 8 B = 1 proposals cost 21 ms), so drafting keeps paying at loads where k separate
proposals did not.

τ̂ is kept per sequence and proposer: the mean tokens committed over its last ``window`` cycles of that proposer
with a prior of ``prior_tau`` worth ``prior_weight`` cycles, plus ``z`` standard errors (tokens per cycle vary a
lot: like the B = 1 guard, a sequence stops drafting on evidence, not after an unlucky stretch; the cycles' spread
taken as at least ``min_spread`` = 0.5, as the guard's, so one, two or three equal cycles are no proof); a drafter
proposal for a final partial block counts its share of the rows' gain, a lookup at most its drafts + 1. At one
sequence this is the B = 1 guard's break-even (τ̂ / (t_plain(1) + t_draft(c) + t_verify) > 1 / t_plain(1)); as n
grows, the n - k plain tokens come almost free with the call while each drafting sequence still pays its
proposal and its verify rows, so k falls to 0: batched plain decoding, never worse than it by the cost model
(long accepted lookups, which cost only their rows, last longest). Until t_plain and the costs are measured the
rule explores: the first step of a batch is plain, the next ones draft for one proposal (the best τ̂; the best
drafter proposal while t_draft is unknown: at 8 sequences a step where all draft costs about what 4 plain steps
gain) until its cost is measured. A sequence the rule kept plain for ``probe_after`` steps in a row forgets its
cycles (τ̂ back to the prior), so acceptance that changed along a request (code vs prose) is measured again when
the cost model lets the prior draft.

The model's estimates can be wrong at a load (τ̂'s optimism; a verify that costs more than its rows; drafter
context catch-up), and weighing costs time of its own (a lookup and an estimate per sequence, the runner's plan per
prefix: about 3 % of a step at 16 sequences), so what the steps made overrides it: the realized check
(:meth:`MeasuredCosts.holds_plain`). Per batch size n the tokens per second of whole steps (choose to accept) that
drafted and of those that did not are kept (exponential means over 8 steps). The first 4 steps at each n are
plain; then the rule weighs every step while the drafting steps at n made at least the plain ones' tokens per
second, or are not measured yet and the rule's last choice at n drafted. Otherwise (drafting made less, or the
rule's last choice was plain: in plain steps nothing it weighs changes but the count that probes a sequence and
the prompt lookups' matches) steps at n are held plain without weighing, every 16th weighed (a probe: a new
request, acceptance that rose, a lookup that now matches). A step whose candidates offered the rule nothing (prompt
lookups without a match) is not a choice of the rule's.
Against batched plain decoding, adaptive decoding then loses at most its exploration and probes where drafting
does not pay. With given costs (:class:`FixedCosts`) the rule weighs every step. A held step counts as a plain
step for ``probe_after``; it makes no lookup, so a lookup that would pay waits for the next weighed step. Lossless
either way: the rule picks which exact procedure makes a sequence's next tokens, from past timings and counts only.

Ownership: a :class:`BatchDecoder` owns its target runner's slots and one drafter runner per slot (or one batched
drafter over all slots); not thread safe (one thread drives it: the Generator's batch loop thread behind
:meth:`dflash2_trt.api.Generator.submit`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime import grammar
from dflash2_trt.runtime.accept import accept_drafts, next_token
from dflash2_trt.runtime.decoder import GenerationResult
from dflash2_trt.runtime.guard import MIN_SPREAD
from dflash2_trt.runtime.ngram import DFLASH2, NGRAM, ProposerChoice, default_rows, lookup_draft, uses_drafter
from dflash2_trt.runtime.prefix_cache import PrefixCache
from dflash2_trt.runtime.protocol import DraftRunner
from dflash2_trt.runtime.request import GenerationRequest, Limits
from dflash2_trt.runtime.sampling import Sampler


# The rule's clock: wall time, what a user waits for, as the B = 1 guard's. Process CPU time overstated a
# proposal: the target's spinning workers (DFLASH2_ORT_SPINNING) keep spinning into the drafter's call, so a
# 2.7 ms proposal read 6-7 ms against a 12 ms plain step read 24 ms, and one stream stopped drafting where the
# B = 1 loop paid (0.99x against 1.17x). With the ORT runner's plan a verify's cost comes from the plan, so the
# rule uses only direct timings (t_plain(n), t_draft(k)); without a plan t_verify is still the difference of two.
COST_CLOCK = time.perf_counter


STEP_RATE_WINDOW = 8  # steps in StepRate's exponential means
STEP_RATE_MIN_STEPS = 4  # steps of each kind at a batch size before the realized check compares them
STEP_RATE_PROBE = 16  # while the check holds a batch size plain, every 16th step there is weighed (a probe)


@dataclass
class StepRate:
    """Tokens per second that steps of one kind made (exponential means over :data:`STEP_RATE_WINDOW` steps of
    their tokens and their seconds; the rate is their ratio, so a long step weighs by its length)."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, s: float) -> None:
        self.steps += 1
        w = 1.0 / min(self.steps, STEP_RATE_WINDOW)
        self.tokens += (tokens - self.tokens) * w
        self.seconds += (s - self.seconds) * w

    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


class MeasuredCosts:
    """The rule's step costs, measured in this run (seconds; running means, then exponential over 16): t_plain(n)
    per batch size, t_draft per proposal call by the sequences k in the call (B = 1 drafters: k = 1; a batched
    drafter's call for k), t_verify per drafting sequence (its share of a step's extra forward time; may be measured
    below 0 by noise, used as >= 0); and what whole steps made per batch size (:meth:`record_step`), drafting or
    not, for the realized check (:meth:`holds_plain`)."""

    verify_from_plan = True  # with the runner's plan, t_plain(n) + k t_verify comes from it (SpeculationRule.choose)

    def __init__(self) -> None:
        self._plain: dict[int, tuple[float, int]] = {}  # sequences in the call -> (mean s, count)
        self._draft: dict[int, tuple[float, int]] = {}  # sequences in the proposal call -> (mean s, count)
        self._verify: tuple[float, int] = (0.0, 0)
        self._made: dict[tuple[int, bool], StepRate] = {}  # (sequences, drafted) -> what whole steps made
        self._step: tuple[float, int] = (0.0, 0)  # a whole step, any size
        self._row: tuple[float, int] = (0.0, 0)  # one prompt row of a prefill chunk computed while others decode
        self._model_plain: dict[int, bool] = {}  # sequences -> the rule's last choice there was plain
        self._held: dict[int, int] = {}  # sequences -> steps held plain since the rule last weighed one

    @staticmethod
    def _update(old: tuple[float, int], s: float) -> tuple[float, int]:
        m, n = old
        n += 1
        return m + (s - m) / min(n, 16), n

    def record_plain(self, n: int, s: float) -> None:
        self._plain[n] = self._update(self._plain.get(n, (0.0, 0)), s)

    def record_draft(self, s: float, k: int = 1) -> None:
        self._draft[k] = self._update(self._draft.get(k, (0.0, 0)), s)

    def record_verify(self, s: float) -> None:
        self._verify = self._update(self._verify, s)

    def record_prefill(self, rows: int, s: float) -> None:
        """A prefill chunk of ``rows`` prompt rows forwarded in s seconds while other sequences decode."""
        self._row = self._update(self._row, s / rows)

    def prefill_row(self) -> float | None:
        """Seconds one prompt row of a chunk costs; None: no chunk measured yet."""
        return self._row[0] if self._row[1] else None

    def step(self) -> float | None:
        """Seconds a whole step takes (the decoding sequences' gap between tokens); None: none measured yet."""
        return self._step[0] if self._step[1] else None

    def plain(self, n: int) -> float | None:
        """t_plain(n): measured, else linear between the nearest measured sizes (flat beyond them); None: none."""
        if n <= 0:
            return 0.0
        return self._at(self._plain, n)

    def draft(self, k: int = 1) -> float | None:
        """t_draft of a proposal call for k sequences: measured, else linear between the nearest measured counts (flat
        beyond them); None: none."""
        return self._at(self._draft, k)

    @staticmethod
    def _at(table: dict[int, tuple[float, int]], n: int) -> float | None:
        if n in table:
            return table[n][0]
        if not table:
            return None
        ks = sorted(table)
        return float(np.interp(n, ks, [table[k][0] for k in ks]))

    def verify(self) -> float | None:
        return self._verify[0] if self._verify[1] else None

    def record_step(self, n: int, drafted: bool, tokens: int, s: float, weighed: bool) -> None:
        """A whole step over n sequences (choose to accept: drafting, the target forward, acceptance): the tokens
        it committed in s seconds, whether any sequence drafted, and whether the rule weighed it (False: held plain
        by :meth:`holds_plain`, or no candidate offered it a proposal)."""
        self._made.setdefault((n, drafted), StepRate()).add(tokens, s)
        self._step = self._update(self._step, s)
        if weighed:
            self._model_plain[n], self._held[n] = not drafted, 0

    def holds_plain(self, n: int) -> bool:
        """Asked before the rule weighs a step of n sequences -> True: the step is plain, unweighed. Plain steps at n
        are measured first (STEP_RATE_MIN_STEPS of them); then the rule weighs every step while the steps that
        drafted at n made at least the plain ones' tokens per second, or are not measured yet (fewer than
        STEP_RATE_MIN_STEPS) and the rule's last choice at n drafted. Otherwise — drafting made less, or the rule's
        last choice at n was plain (in plain steps nothing it weighs changes but the plain-step count that probes a
        sequence and the lookups' matches) — the steps are held plain, every STEP_RATE_PROBE-th left to the rule so
        that a change (a new request, acceptance that rose, a lookup that now matches) is seen."""
        d, p = self._made.get((n, True)), self._made.get((n, False))
        if p is None or p.steps < STEP_RATE_MIN_STEPS:
            return True
        measured = d is not None and d.steps >= STEP_RATE_MIN_STEPS
        if measured and d.rate() >= p.rate():
            return False
        if not measured and not self._model_plain.get(n, False):
            return False
        self._held[n] = self._held.get(n, 0) + 1
        return self._held[n] % STEP_RATE_PROBE != 0


@dataclass
class FixedCosts:
    """Costs given, not measured (tests; a deployment that calibrated them): t_plain(n), t_draft, t_verify (what
    one drafting sequence adds to a step's target forward); for the prefill budget, a whole step's seconds and one
    chunked prompt row's (None: not given)."""

    plain_fn: Callable[[int], float]
    draft_s: float
    verify_s: float
    step_s: float | None = None
    prefill_row_s: float | None = None
    verify_from_plan = False  # t_verify is given (a class attribute, not a field)

    def record_plain(self, n: int, s: float) -> None: ...

    def record_draft(self, s: float, k: int = 1) -> None: ...

    def record_verify(self, s: float) -> None: ...

    def record_prefill(self, rows: int, s: float) -> None: ...

    def prefill_row(self) -> float | None:
        return self.prefill_row_s

    def step(self) -> float | None:
        return self.step_s

    def plain(self, n: int) -> float:
        return 0.0 if n <= 0 else float(self.plain_fn(n))

    def draft(self, k: int = 1) -> float:  # a batched drafter's call: draft_s whatever k
        return self.draft_s

    def verify(self) -> float:
        return self.verify_s

    def record_step(self, n: int, drafted: bool, tokens: int, s: float, weighed: bool) -> None: ...

    def holds_plain(self, n: int) -> bool:  # the given costs decide every step
        return False


@dataclass
class SpeculationRule:
    """Which sequences draft this step, each with its proposal (the module docstring's rule)."""

    prior_tau: float = 1.5  # τ̂ of a sequence before its first cycles (≈ the packaged drafter's τ at block size 3)
    prior_weight: float = 2.0  # cycles the prior counts for
    window: int = 32  # cycles per sequence in τ̂
    adaptive: bool = True  # False: every speculative sequence drafts every step
    probe_after: int = 64  # plain steps in a row after which a candidate's τ̂ returns to the prior
    costs: Any = field(default_factory=MeasuredCosts)  # MeasuredCosts | FixedCosts
    z: float = 1.0  # τ̂ is the mean + z s/√n (s: the cycles' standard deviation): off only on evidence, as the guard
    min_spread: float = MIN_SPREAD  # s is at least this, as the guard's: a few equal cycles prove nothing

    def tau(self, committed: deque) -> float:
        n = len(committed)
        mean = (self.prior_tau * self.prior_weight + float(sum(committed))) / (self.prior_weight + n)
        if not n:
            return mean
        s = float(np.std(committed, ddof=1)) if n > 1 else 0.0  # one cycle: no spread measured, min_spread stands
        return mean + self.z * max(s, self.min_spread) / np.sqrt(n)

    def choose(self, n_active: int, candidates: dict[Hashable, float],
               units: Callable[[list], float] | None = None, free: Collection = (),
               fallbacks: dict[Hashable, tuple[Hashable, float]] | None = None, batched_draft: bool = False) -> set:
        """candidates: proposal -> τ̂ (one per speculative sequence that can draft; keys are the caller's) -> the
        proposals that run. ``free``: the keys whose proposal costs no drafter time (prompt lookups: t_draft 0,
        only their verify counts). ``fallbacks``: key -> (another key, its τ̂), weighed once the candidates are
        chosen, for each key left out (a sequence whose drafter proposal does not pay verifies its lookup instead
        when that pays); fallback keys are free.
        ``units``: the target forward's cost in the runner's units (calls and padded rows,
        :meth:`~dflash2_trt.runtime.ort.batched_target.OrtBatchedTargetRunner.cost_units`) when the given keys draft;
        with it time = t_plain(n) x units(chosen) / units(none) + (drafter proposals) x t_draft (t_verify unused: a
        difference of two noisy timings, where the runner's plan knows what the verifies add).
        ``batched_draft``: the drafter proposals of a step are one call of a batched drafter, charged once:
        t_draft(k_d) (:meth:`MeasuredCosts.draft`) in place of k_d x t_draft."""
        if not candidates:
            return set()
        if not self.adaptive:
            return set(candidates)
        c = self.costs
        t_all = c.plain(n_active)
        if t_all is None:
            return set()  # explore: measure a plain step first
        order = sorted(candidates, key=lambda i: -candidates[i])
        fallbacks = fallbacks or {}
        free = set(free) | {k for k, _ in fallbacks.values()}
        t_d, t_v = c.draft(), c.verify()
        if not getattr(c, "verify_from_plan", False):
            units = None
        if units is None and t_v is None:
            return set(order[:1])  # explore: measure a verify
        drafter_keys = [i for i in order if i not in free]
        if t_d is None and drafter_keys:
            return set(drafter_keys[:1])  # explore: measure one drafting (at high load one is costly enough)
        t_d = t_d or 0.0  # None: no drafter proposal to cost
        tv = max(t_v, 0.0) if t_v is not None else 0.0
        per_unit = t_all / units([]) if units is not None else 0.0

        def time_of(keys: list) -> float:
            k, k_d = len(keys), sum(1 for i in keys if i not in free)
            if batched_draft:  # the step's k_d drafter proposals: one call
                d = float(c.draft(k_d) or 0.0) if k_d else 0.0
                return (per_unit * units(keys) if units is not None else t_all + k * tv) + d
            if units is not None:
                return per_unit * units(keys) + k_d * t_d
            return t_all + k_d * (t_d + tv) + (k - k_d) * tv

        if free & set(candidates):  # drafter and lookup proposals: by tokens added per second of cost

            def gain(i: Hashable) -> float:
                cost = (0.0 if i in free else t_d) + (per_unit * (units([i]) - units([])) if units is not None else tv)
                if cost <= 0:  # a verify measured as free
                    return float("inf") if candidates[i] > 1.0 else 0.0
                return (candidates[i] - 1.0) / cost

            order = sorted(candidates, key=lambda i: -gain(i))
        def best_prefix(base: list, adds: list, taus: dict, tokens: float, best: float) -> tuple[int, float, float]:
            """The n for which base + adds[:n] makes the most tokens per second (n = 0: base, at rate ``best``,
            making ``tokens``) -> (n, its rate, its tokens)."""
            n, best_tokens = 0, tokens
            for k, i in enumerate(adds, start=1):
                tokens += taus[i] - 1.0
                rate = tokens / max(time_of(base + adds[:k]), 1e-12)
                if rate > best:
                    n, best, best_tokens = k, rate, tokens
            return n, best, best_tokens

        k, best, tokens = best_prefix([], order, candidates, float(n_active), n_active / max(t_all, 1e-12))
        chosen = order[:k]
        extra = dict(fb for key, fb in fallbacks.items() if key not in chosen)  # fallback key -> τ̂
        if extra:
            more = sorted(extra, key=lambda i: -extra[i])
            chosen += more[: best_prefix(chosen, more, extra, tokens, best)[0]]
        return set(chosen)


# Chunked prefill (docs/design.md; measured by benchmarks/prefill_join_gap.py). While other sequences decode, the
# prompts joining compute at most DEFAULT_PREFILL_CHUNK rows a step, and fewer where a row is measured dear: rows whose
# forward takes about DEFAULT_PREFILL_SHARE times the decoding sequences' measured step (their next token then waits
# ~1 + share steps), PREFILL_PROBE_ROWS while either time is unmeasured. The Generator's and the server's defaults
# (Generator.set_batching; the C twin's options); a BatchDecoder made without them prefills whole prompts.
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_PREFILL_SHARE = 1.5
PREFILL_PROBE_ROWS = 8


@dataclass
class _Seq:
    id: int
    prompt: list[int]
    req: GenerationRequest  # validated for prompt
    slot: int
    rng: np.random.Generator
    res: GenerationResult
    eos: set[int]
    limit: int
    t0: float
    anchor: int = -1
    pos: int = 0  # the anchor's position
    pending: list[np.ndarray] = field(default_factory=list)  # [m, F] features not yet in the draft context
    pending_start: int = 0
    committed: dict[str, deque] = field(default_factory=dict)  # proposer -> tokens per cycle, last `window` cycles
    plain_run: int = 0  # steps in a row the rule kept this candidate plain
    choice: ProposerChoice | None = None  # who proposes (made at admission: the context needs the first token)
    done: bool = False
    snapshots: dict = field(default_factory=dict)  # the target's state after the prefill (the prefix cache's)
    prefilled: int = 0  # prompt positions the target holds (restored or computed) while the prompt is prefilling
    prefilling: bool = False  # holds a slot, its prompt not yet all computed: no decode step runs for it
    prompt_rows: list = field(default_factory=list)  # [m, V] logits of its prompt chunks (for prompt logprobs)
    sampler: Sampler | None = None  # the request's sampling transforms and logprobs (runtime/sampling.py)
    constraint: Any = None  # the request's grammar matcher (runtime/grammar.py), None without a grammar
    masks: Any = None  # [n + 1, V] bool: this step's verify rows' grammar masks
    # admitted with an identical prompt (a request's n > 1 choices): waits for that sequence's prefill, then takes a
    # copy of its slot instead of computing the prompt again
    leader: _Seq | None = None


class BatchDecoder:
    """Continuous batching over ``target`` (a batched target runner) with optional drafting (``drafter_factory``
    makes one B = 1 drafter per slot; ``batched_drafter(slots)`` one drafter over all slots, whose calls every
    drafter proposal of a step shares, in its place; without either only prompt lookup drafts). ``submit`` /
    ``step`` / ``cancel`` / ``results``; or :meth:`run`."""

    def __init__(self, target: Any, drafter_factory: Callable[[], DraftRunner] | None = None,
                 rule: SpeculationRule | None = None, batched_drafter: Callable[[int], Any] | None = None,
                 cache: PrefixCache | None = None, prefill_chunk: int | None = None,
                 prefill_share: float | None = None, grammar_tokenizer: Any = None) -> None:
        self.target = target  # OrtBatchedTargetRunner (join/leave/crop/forward over slots)
        self.grammar_tokenizer = grammar_tokenizer  # the target's tokenizer for requests with a grammar
        self.cache = cache  # the prefix cache prompts start from and finished sequences join
        # prompt rows computed in one step while others decode, over all prompts still prefilling: at most
        # prefill_chunk (None: no cap), fewer by the measured times when prefill_share is set (None: no time budget)
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self.prefill_share = check_prefill_share(prefill_share)
        self.rule = rule or SpeculationRule()
        self._make_drafter = drafter_factory
        self._make_batched = batched_drafter  # slots -> an OrtBatchedDraftRunner (made on first use)
        self._batched: Any = None
        self._has_drafter = drafter_factory is not None or batched_drafter is not None
        self._drafters: dict[int, DraftRunner] = {}  # slot -> its drafter
        self._queue: deque[_Seq] = deque()
        self._active: dict[int, _Seq] = {}  # id -> sequence
        self.results: dict[int, GenerationResult] = {}  # id -> result, once finished
        self._next_id = 0
        self.steps = 0  # batch steps run
        self._weighed = True  # the rule weighed this step's proposals (False: held plain by the realized check)
        self.drafting_steps = 0  # steps where at least one sequence drafted

    # -- requests -----------------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], request: GenerationRequest) -> int:
        """Queue a request (it joins at the next step with a free slot) -> its id; ``prompt``: token ids."""
        req = request.validate(prompt, Limits.of(self.target, whole_blocks=True))
        i = self._next_id
        self._next_id += 1
        eos = set(self.target.eos_ids) if req.eos_ids is None else set(req.eos_ids)
        limit = min(req.max_new_tokens, self.target.max_positions - len(prompt))
        res = GenerationResult(prompt_tokens=list(prompt))
        sampler = Sampler(req, list(prompt), int(self.target.vocab_size))
        sampler.logprobs = res.logprobs
        self._queue.append(_Seq(i, list(prompt), req, -1, np.random.default_rng(req.seed), res, eos, limit, 0.0,
                                committed={who: deque(maxlen=self.rule.window) for who in (DFLASH2, NGRAM)},
                                sampler=sampler, constraint=grammar.start(req, self.grammar_tokenizer)))
        return i

    def cancel(self, i: int) -> None:
        """Stop request ``i`` now (queued or active): it keeps the tokens it has, its slot is freed."""
        for s in list(self._queue):
            if s.id == i:
                self._queue.remove(s)
                self.results[i] = s.res
        if i in self._active:
            self._finish(self._active[i])

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._active)

    def in_flight(self, i: int) -> GenerationResult | None:
        """Request ``i``'s result so far while it decodes (None while queued or once finished: see ``results``)."""
        s = self._active.get(i)
        return None if s is None else s.res

    def run(self, reqs: list[tuple[list[int], GenerationRequest]]) -> list[GenerationResult]:
        """Submit each (prompt, request), step until all finished -> their results in that order."""
        ids = [self.submit(p, r) for p, r in reqs]
        while self.busy:
            self.step()
        return [self.results[i] for i in ids]

    # -- the step -------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit, then one plain step or speculative cycle per active sequence, then retire the finished."""
        self._admit()
        seqs = [s for s in self._active.values() if not s.prefilling]
        if not seqs:
            return
        self.steps += 1
        t_step, made = COST_CLOCK(), sum(len(s.res.tokens) for s in seqs)
        plan = self._choose(seqs)  # id -> (proposer, lookup drafts)
        if plan:
            self.drafting_steps += 1
        proposals = self._propose([s for s in seqs if s.id in plan], plan)  # id -> (proposal, drafts)
        proposals = {i: self._constrain(self._active[i], *p) for i, p in proposals.items()}
        rows = {s.slot: [s.anchor] + (proposals[s.id][1] if s.id in proposals else []) for s in seqs}
        t = COST_CLOCK()
        out = self.target.forward(rows)  # slot -> (logits [m, V], features [m, F])
        self._record_forward(len(seqs), len(proposals), COST_CLOCK() - t)
        for s in seqs:
            logits, feats = out[s.slot]
            if s.id in proposals:
                self._accept(s, plan[s.id][0], *proposals[s.id], logits, feats)
            else:
                self._plain(s, logits, feats)
        self.rule.costs.record_step(len(seqs), bool(proposals), sum(len(s.res.tokens) for s in seqs) - made,
                                    COST_CLOCK() - t_step, self._weighed)
        for s in seqs:
            if s.res.tokens and (len(s.res.tokens) >= s.limit or s.res.tokens[-1] in s.eos):
                self._finish(s)

    def _admit(self) -> None:
        """Queued requests into free slots, each from its longest cached prefix; then one prefill step
        (:meth:`_prefill`): the prompts still prefilling compute their next rows, and those now whole draw their
        first token."""
        new: list[_Seq] = []
        while self._queue and len(new) < self.target.free_slots:
            new.append(self._queue.popleft())
        t0 = time.perf_counter()
        # prompts of like lengths in neighbouring slots: a graph call binds a slot range, padded to its longest
        by_length = sorted(new, key=lambda s: len(s.prompt))
        for s in by_length:
            s.slot, s.t0 = self.target.join(), t0
        for s in by_length:  # (the C twin's admit: every slot reset, then every drafter, then the prefill)
            drafter = self._drafter(s.slot) if self._uses_drafter(s) else None
            if drafter is not None:
                drafter.reset()
            s.prefilled = 0 if self.cache is None or s.req.prompt_logprobs else \
                self.cache.prefill_from(s.prompt, self.target, drafter, s.slot)
            s.res.cached_tokens = s.pending_start = s.prefilled
            s.prefilling = True
        first: dict[tuple, _Seq] = {}
        for s in new:  # identical prompts admitted together are computed once (the same cached prefix restored)
            if not s.req.prompt_logprobs and hasattr(self.target, "restore_prefix"):
                s.leader = first.setdefault((tuple(s.prompt), self._uses_drafter(s)), s)
                s.leader = None if s.leader is s else s.leader
        self._active.update((s.id, s) for s in new)  # prefilled in the order they came
        if new:  # the joining requests' whole length at once: no growth (a copy of every slot) chunk after chunk
            n = max(len(s.prompt) + s.limit for s in new)  # (a limit leaves its prompt within max_positions)
            self.target.reserve(n)
            if self._batched is not None:
                self._batched.reserve(n)
        for s, logits in self._prefill():
            if self.cache is not None:
                s.snapshots = PrefixCache.snapshot(self.target, s.slot)
            if s.req.prompt_logprobs:
                s.res.prompt_logprobs = s.sampler.prompt_logprobs(s.prompt, logits)
            s.anchor = next_token(grammar.masked(s.constraint, logits[-1]), s.req.temperature, s.rng, s.sampler)
            grammar.advance(s.constraint, [s.anchor])
            s.res.tokens.append(s.anchor)
            s.sampler.commit([s.anchor])
            s.pos = len(s.prompt)
            # a plain request never looks up: its choice keeps no context
            mode = s.req.proposer if s.req.speculative else DFLASH2
            s.choice = ProposerChoice(mode, list(s.prompt) + [s.anchor],
                                      0 if mode == DFLASH2 else self._lookup_rows(s))
            if len(s.res.tokens) >= s.limit or s.anchor in s.eos:
                self._finish(s)

    def _prefill(self) -> list[tuple[_Seq, np.ndarray]]:
        """One prefill step: the prompts still prefilling, oldest first, forward their next rows in one target
        forward — at most ``prefill_chunk`` rows over all of them while other sequences decode (a long prompt
        joining running streams delays their next token by one chunk's time, not by the whole prompt's; with none
        decoding, whole prompts) -> (sequence, logits) of those whose prompt
        is now whole: the last row's [1, V], every computed row's when the request asks for prompt logprobs. The
        rows' features wait in the sequence's pending context (its drafter takes them at its first proposal)."""
        order = [s for s in self._active.values() if s.prefilling and s.leader is None]
        # nobody decoding: nobody waits, whole prompts (the fewest, largest calls)
        decoding = any(not s.prefilling for s in self._active.values())
        budget = self._prefill_budget() if decoding else None
        rows: dict[int, list[int]] = {}
        for s in order:
            take = len(s.prompt) - s.prefilled if budget is None else min(budget, len(s.prompt) - s.prefilled)
            if take <= 0:
                break
            rows[s.slot] = s.prompt[s.prefilled: s.prefilled + take]
            budget = None if budget is None else budget - take
        if not rows:
            return []
        every_row = any(s.req.prompt_logprobs for s in order if s.slot in rows)
        t = COST_CLOCK()
        out = self.target.forward(rows, last_logits=not every_row)  # slot -> (logits, features [m, F])
        if decoding:
            self.rule.costs.record_prefill(sum(map(len, rows.values())), COST_CLOCK() - t)
        done = []
        for s in order:
            if s.slot not in rows:
                continue
            logits, feats = out[s.slot]
            if self._uses_drafter(s):
                s.pending.append(feats)
            s.prefilled += len(rows[s.slot])
            if s.req.prompt_logprobs:
                s.prompt_rows.append(logits)
            if s.prefilled == len(s.prompt):
                s.prefilling = False
                done.append((s, np.concatenate(s.prompt_rows) if s.req.prompt_logprobs else logits))
        for s, logits in list(done):
            for f in [f for f in self._active.values() if f.leader is s]:
                self._share_prompt(s, f)
                done.append((f, logits))
        return done

    def _prefill_budget(self) -> int | None:
        """Prompt rows this step's prefill may compute while others decode (None: whole prompts): ``prefill_chunk``,
        or with ``prefill_share`` the rows whose forward takes share × a decoding step by the measured costs (at
        least 1; PREFILL_PROBE_ROWS while a row or a step is unmeasured), at most ``prefill_chunk``."""
        if self.prefill_share is None:
            return self.prefill_chunk
        row, step = self.rule.costs.prefill_row(), self.rule.costs.step()
        rows = PREFILL_PROBE_ROWS if row is None or step is None else max(1, int(self.prefill_share * step / row))
        return rows if self.prefill_chunk is None else min(rows, self.prefill_chunk)

    def _share_prompt(self, leader: _Seq, f: _Seq) -> None:
        """f's slot (and drafter context to come) = its leader's, whose prompt is now whole: the target's rows and
        state copied across slots, the leader's pending features (past the same cached prefix) taken."""
        n = len(f.prompt)
        self.target.restore_prefix(self.target.prefix_rows(n, leader.slot), n, self.target.prefix_state(leader.slot),
                                   f.slot)
        if self._uses_drafter(f):
            f.pending = list(leader.pending)
        f.prefilled, f.prefilling, f.leader = n, False, None

    def _uses_drafter(self, s: _Seq) -> bool:
        """Whether the DFlash 2 drafter proposes for s (its context then follows s's committed positions): its
        request speculates with a proposer other than prompt lookup alone (its choice's ``uses_drafter``)."""
        return s.req.speculative and self._has_drafter and uses_drafter(s.req.proposer)

    def _speculates(self, s: _Seq) -> bool:
        """Whether s may draft at all: with the drafter, or by prompt lookup (which needs no drafter)."""
        assert s.choice is not None
        return s.req.speculative and (self._uses_drafter(s) or s.choice.mode != DFLASH2)

    def _lookup_rows(self, s: _Seq) -> int:
        """Most lookup drafts per cycle of s: its request's, else speculative_generate's default (from the block size
        of the drafter, when the decoder has one)."""
        if s.req.ngram_rows is not None:
            return s.req.ngram_rows
        return default_rows(self._drafter(s.slot).num_draft_rows if self._has_drafter else 0)

    def _drafter(self, slot: int) -> DraftRunner:
        if slot not in self._drafters:
            if self._make_batched is not None:  # the slot's view of the batched drafter
                if self._batched is None:
                    self._batched = self._make_batched(self.target.slots)
                self._drafters[slot] = self._batched.slot(slot)
            else:
                assert self._make_drafter is not None
                self._drafters[slot] = self._make_drafter()
        return self._drafters[slot]

    def _choose(self, seqs: list[_Seq]) -> dict[int, tuple[str, list[int]]]:
        """id -> (proposer, lookup drafts) of the sequences that draft this step: each candidate's
        :class:`~dflash2_trt.runtime.ngram.ProposerChoice` names its preferred proposal, the rule weighs them (and the
        lookups of those whose drafter proposal it left out), then each choice settles the outcome."""
        # a cycle needs >= 1 draft row left before the limit
        cands = [s for s in seqs if self._speculates(s) and s.limit - len(s.res.tokens) >= 2]
        for s in cands:
            if s.plain_run >= self.rule.probe_after:  # probe: measure this sequence's acceptance again
                for c in s.committed.values():
                    c.clear()
                s.plain_run = 0
        if cands and self.rule.adaptive and self.rule.costs.holds_plain(len(seqs)):
            self._weighed = False  # the realized check: plain, unweighed (no lookups, no estimates)
            for s in cands:
                s.plain_run += 1
            return {}
        looked = {s.id: s.choice.ngram(s.limit - len(s.res.tokens) - 1) for s in cands}  # [] for dflash2
        taus: dict[tuple[int, str], float] = {}  # (id, proposer) -> τ̂: the rule's candidates, one per sequence
        rows: dict[tuple[int, str], int] = {}  # (id, proposer) -> its verify rows
        fallbacks: dict[tuple[int, str], tuple[tuple[int, str], float]] = {}
        for s in cands:
            who = s.choice.preferred(looked[s.id], drafter=self._uses_drafter(s))
            if who is None:  # ngram without a match: a plain step, not the rule's choice
                continue
            rows[s.id, who], taus[s.id, who] = self._estimate(s, who, looked[s.id])
            if who == DFLASH2 and s.choice.preferred(looked[s.id], drafter=False) == NGRAM:
                rows[s.id, NGRAM], tau = self._estimate(s, NGRAM, looked[s.id])
                fallbacks[s.id, DFLASH2] = ((s.id, NGRAM), tau)
        self._weighed = bool(taus)  # lookups without a match offer the rule nothing: no choice of its to remember

        def units(keys: list[tuple[int, str]]) -> float:  # the step's forward when ``keys`` draft (their rows)
            extra = {i: rows[i, who] for i, who in keys}
            return self.target.cost_units({s.slot: 1 + extra.get(s.id, 0) for s in seqs})

        chosen = self.rule.choose(len(seqs), taus, units if taus and hasattr(self.target, "cost_units") else None,
                                  free={k for k in taus if k[1] == NGRAM}, fallbacks=fallbacks,
                                  batched_draft=self._make_batched is not None)
        plan: dict[int, tuple[str, list[int]]] = {}
        for s in cands:
            who = DFLASH2 if (s.id, DFLASH2) in chosen else NGRAM if (s.id, NGRAM) in chosen else None
            s.choice.settle(looked[s.id], who)
            if (s.id, DFLASH2) in taus or (s.id, NGRAM) in taus:  # the rule weighed it
                s.plain_run = 0 if who else s.plain_run + 1
            if who is not None:
                plan[s.id] = (who, looked[s.id])
        return plan

    def _estimate(self, s: _Seq, who: str, looked: list[int]) -> tuple[int, float]:
        """(verify rows, τ̂) of a proposal by ``who`` for s this step."""
        if who == NGRAM:  # it commits at most its drafts + the bonus token
            return len(looked), min(self.rule.tau(s.committed[NGRAM]), 1.0 + len(looked))
        full = self._drafter(s.slot).num_draft_rows  # draft rows of a full block
        n = min(full, s.limit - len(s.res.tokens) - 1)  # this cycle's
        # τ̂ of a final partial block: its share of the rows' expected gain (a full block's τ̂ would overstate it)
        return n, 1.0 + (self.rule.tau(s.committed[DFLASH2]) - 1.0) * n / full

    def _record_forward(self, n: int, k: int, seconds: float) -> None:
        """A step's target forward over n sequences, k of them verifying -> t_plain(n), or t_verify per drafting
        sequence (its share of the time above t_plain(n))."""
        c = self.rule.costs
        if not k:
            c.record_plain(n, seconds)
            return
        base = c.plain(n)
        if base is not None:
            c.record_verify((seconds - base) / k)

    def _plain(self, s: _Seq, logits: np.ndarray, feats: np.ndarray) -> None:
        """The target's next token after the anchor (logits [1, V], features [1, F]): exactly a B = 1 plain step."""
        s.anchor = next_token(grammar.masked(s.constraint, logits[-1]), s.req.temperature, s.rng, s.sampler)
        grammar.advance(s.constraint, [s.anchor])
        if self._uses_drafter(s):
            self._defer(s, feats)
        s.pos += 1
        s.res.tokens.append(s.anchor)
        s.sampler.commit([s.anchor])
        s.choice.extend([s.anchor])
        s.res.plain_steps += 1

    @staticmethod
    def _defer(s: _Seq, feats: np.ndarray) -> None:
        """Features [m, F] of the committed positions s.pos .. s.pos + m - 1 wait for the drafter's next pass."""
        if not s.pending:
            s.pending_start = s.pos
        s.pending.append(feats)

    def _draft(self, s: _Seq, who: str, looked: list[int]) -> tuple[Any, list[int]]:
        """draft (decoder.speculative_generate's cycle, first half) -> (the proposal, the drafts to verify): a lookup's
        drafts as they are (no drafter pass, no random draw; pending features keep waiting), or pending features join
        the drafter's context and the drafter proposes."""
        if who == NGRAM:
            return lookup_draft(looked), looked
        T = s.req.temperature
        drafter = self._drafter(s.slot)
        L = drafter.num_draft_rows
        t = COST_CLOCK()
        if s.pending:  # features of the prompt / plain steps join the draft context in one pass
            drafter.add_context(np.concatenate(s.pending), s.pending_start)
            if s.pending_start == 0:  # the prompt's context (a sequence's first proposal) is not a cycle's cost
                t = COST_CLOCK()
            s.pending = []
        n_rows = min(L, s.limit - len(s.res.tokens) - 1)  # a final partial block verifies fewer rows
        uniforms = s.rng.random((1, L), dtype=np.float32) if T > 0 else None
        draft = s.sampler.redraw(drafter.propose(s.anchor, s.pos, n_rows, T, uniforms), uniforms, n_rows)
        self.rule.costs.record_draft(COST_CLOCK() - t)
        return draft, [int(x) for x in draft.tokens[:n_rows]]

    def _propose(self, seqs: list[_Seq], plan: dict[int, tuple[str, list[int]]]) -> dict[int, tuple[Any, list[int]]]:
        """draft, for the planned sequences -> id -> (the proposal, the drafts to verify): with a batched drafter its
        proposals in one call (:meth:`_draft_batched`), else each sequence's own :meth:`_draft`."""
        if self._make_batched is None:
            return {s.id: self._draft(s, *plan[s.id]) for s in seqs}
        out = {s.id: self._draft(s, *plan[s.id]) for s in seqs if plan[s.id][0] != DFLASH2}
        out.update(self._draft_batched([s for s in seqs if plan[s.id][0] == DFLASH2]))
        return out

    def _draft_batched(self, seqs: list[_Seq]) -> dict[int, tuple[Any, list[int]]]:
        """:meth:`_draft` of several sequences on the batched drafter: their pending features join their contexts
        (prompts in one call, not a cycle's cost; the cycles' rows in another), then ONE proposal call for all, whose
        time is the rule's t_draft(k), k = len(seqs)."""
        if not seqs:
            return {}
        run = self._batched
        L = run.num_draft_rows
        run.add_contexts({s.slot: (np.concatenate(s.pending), 0) for s in seqs if s.pending and s.pending_start == 0})
        t = COST_CLOCK()
        run.add_contexts({s.slot: (np.concatenate(s.pending), s.pending_start)
                          for s in seqs if s.pending and s.pending_start != 0})
        for s in seqs:
            s.pending = []
        n_rows = [min(L, s.limit - len(s.res.tokens) - 1) for s in seqs]  # a final partial block verifies fewer rows
        uniforms = [s.rng.random((1, L), dtype=np.float32) if s.req.temperature > 0 else None for s in seqs]
        drafts = run.propose_batch([s.slot for s in seqs], [s.anchor for s in seqs], [s.pos for s in seqs], n_rows,
                                   [s.req.temperature for s in seqs], uniforms)
        self.rule.costs.record_draft(COST_CLOCK() - t, len(seqs))
        drafts = [s.sampler.redraw(d, u, n) for s, d, u, n in zip(seqs, drafts, uniforms, n_rows)]
        return {s.id: (d, [int(x) for x in d.tokens[:n]]) for s, d, n in zip(seqs, drafts, n_rows)}

    @staticmethod
    def _constrain(s: _Seq, draft: Any, drafts: list[int]) -> tuple[Any, list[int]]:
        """The request's grammar along s's draft (:func:`~dflash2_trt.runtime.grammar.constrain_draft`, as the
        single loop's): refused candidates masked, the path cut at a row with none allowed, the masks kept."""
        if s.constraint is None:
            return draft, drafts
        draft, drafts, s.masks = grammar.constrain_draft(s.constraint, draft, drafts, s.req.temperature, s.rng)
        return draft, drafts

    def _accept(self, s: _Seq, who: str, draft: Any, drafts: list[int], v_logits: np.ndarray,
                v_feats: np.ndarray) -> None:
        """accept → commit of one sequence's verify (v_logits [n+1, V], v_feats [n+1, F] of [anchor, drafts])."""
        n_rows = len(drafts)
        if s.constraint is not None:  # the masked target law; the matcher back to the accepted length + bonus
            v_logits = grammar.mask_rows(s.masks, v_logits)
        acc, bonus = accept_drafts(draft, drafts, v_logits, s.req.temperature, s.rng, sampler=s.sampler)
        if s.constraint is not None:
            grammar.commit(s.constraint, n_rows, acc, bonus)
        self.target.crop(s.slot, s.pos + acc + 1)
        if who == DFLASH2:  # the drafter's pass took the pending features: the verified rows are the next ones
            s.pending, s.pending_start = [v_feats[: acc + 1]], s.pos
        elif self._uses_drafter(s):  # a lookup cycle: its rows wait with the others (the context stays contiguous)
            self._defer(s, v_feats[: acc + 1])
        new = drafts[:acc] + [bonus]
        for i, tok in enumerate(new):
            if tok in s.eos:
                new = new[: i + 1]
                break
        s.res.accepted.append(min(acc, len(new)))
        s.res.proposed.append(n_rows)
        s.res.proposers.append(who)
        s.res.tokens.extend(new)
        s.sampler.commit(new)
        s.committed[who].append(len(new))
        s.choice.extend(new)
        s.choice.record(who, len(new))
        s.pos += acc + 1
        s.anchor = new[-1]

    def _finish(self, s: _Seq) -> None:
        for f in self._active.values():  # cancelled while prefilling: those waiting for it prefill themselves
            if f.leader is s:
                f.leader = None
        s.done = True
        s.res.elapsed_s = time.perf_counter() - s.t0
        if self.cache is not None:  # the sequence joins the prefix cache before its slot is freed
            drafts = self._uses_drafter(s)
            self.cache.store((s.prompt + s.res.tokens)[: int(self.target.lengths[s.slot])], self.target,
                             self._drafter(s.slot) if drafts else None,
                             np.concatenate(s.pending) if drafts and s.pending else None, s.snapshots, s.slot)
        self.target.leave(s.slot)
        self._active.pop(s.id, None)
        self.results[s.id] = s.res


def check_prefill_chunk(rows: Any) -> int | None:
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise DFlash2Error(f"prefill_chunk must be an integer >= 1 or None, got {rows!r}")
    return rows


def check_prefill_share(share: Any) -> float | None:
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not share > 0
                              or share == float("inf")):
        raise DFlash2Error(f"prefill_share must be a number > 0 or None, got {share!r}")
    return None if share is None else float(share)


def check_batch_size(max_batch: Any) -> int:
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise DFlash2Error(f"max_batch must be an integer >= 1, got {max_batch!r}")
    return max_batch
