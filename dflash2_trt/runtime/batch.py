"""Continuous batching (NumPy; no torch): many requests decoded together over one batched target runner
(:class:`~dflash2_trt.runtime.ort.batched_target.OrtBatchedTargetRunner`), speculating only while it pays.

Requests join and leave between steps (in-flight batching): :meth:`BatchDecoder.submit` queues a request, each
:meth:`~BatchDecoder.step` first admits queued requests into free slots (their prompts prefilled together in one
target forward, each its first token drawn), then runs one step for every active sequence, then retires the
finished ones (their own EOS set, max tokens, the cache's capacity, or :meth:`~BatchDecoder.cancel`), freeing
their slots for the next step.

One step, flat (the names of :mod:`dflash2_trt.runtime.decoder`):

    choose  which sequences draft this step (the rule below)
    draft   per drafting sequence: its pending context features join its drafter's cache, the drafter proposes
            (the drafter runner is B = 1: one per slot, called per sequence)
    target  ONE target forward for every sequence: a plain sequence's anchor (one row), a drafting sequence's
            [anchor, drafts] (its verify); ragged rows share graph calls where the runner can (with
            dflash2.DecodeAttention: the verifies and the plain steps in one call; with GroupQueryAttention the
            verifies run one by one, see the runner)
    accept  per sequence its own accepted length (ragged acceptance): greedy matching at T = 0, rejection
            sampling at T > 0; plain sequences draw the target's own next token
    commit  crop each verified slot to its accepted length; committed positions' features become draft context

Randomness: each sequence has its own ``numpy.random.Generator(seed)`` drawn in the order of
:func:`~dflash2_trt.runtime.decoder.speculative_generate` (first token; a plain step: one draw; a cycle: the
drafter's uniforms, then the rejection test), so a sequence's tokens never depend on the others in the batch:
at T = 0 each sequence's output is its own B = 1 greedy output, and a T > 0 sequence that never drafts gives
:func:`~dflash2_trt.runtime.decoder.target_generate`'s tokens for its seed.

The load-adaptive rule (:class:`SpeculationRule`). Per step, with n active sequences and the speculative ones
sorted by their estimated tokens per cycle τ̂_1 >= τ̂_2 >= ..., draft for the k that maximise the step's
estimated throughput

    tokens(k) / time(k),  tokens(k) = (n - k) + Σ_{i<=k} τ̂_i,
                          time(k)   = t_plain(n) + k · (t_draft + t_verify)

where t_plain(m) is the measured time (:data:`COST_CLOCK`: process CPU time) of the target forward of a step
with m sequences and no drafting, t_draft one drafter proposal (context update included, except a prompt's) and
t_verify what one drafting sequence adds to a step's target forward, all measured in this run (running means;
t_plain interpolated linearly in m between measured batch sizes). With the ORT batched runner the rule takes
t_plain(n) + k · t_verify from the runner's plan instead: t_plain(n) x units(k drafting) / units(none), units =
calls x ``call_rows`` + padded rows (``OrtBatchedTargetRunner.cost_units``): a verify that pads every plain row of
the call to its 3 rows costs what it costs, not a noisy difference of two timings. τ̂ of a sequence is
the mean tokens committed over its last ``window`` cycles with a prior of ``prior_tau`` worth ``prior_weight``
cycles, plus ``z`` standard errors (tokens per cycle vary a lot: like the B = 1 guard, a sequence stops drafting
on evidence, not after an unlucky stretch). At one sequence this is the B = 1 guard's break-even (τ̂ / (t_plain(1) + t_draft + t_verify) >
1 / t_plain(1)); as n grows, the n - k plain tokens come almost free with the call while each drafting sequence
still pays its drafter and its verify rows, so k falls to 0: batched plain decoding, never worse than it by the
cost model. Until t_plain and the draft costs are measured the rule explores: the first step of a batch is plain,
the next ones draft for the speculative sequence of the best τ̂ (one: at 8 sequences a step where all draft costs
about what 4 plain steps gain) until a proposal's cost is measured. A sequence the rule kept plain for
``probe_after`` steps in a row forgets its cycles (τ̂ back to the prior), so acceptance that changed along a
request (code vs prose) is measured again when the cost model lets the prior draft. Lossless either way: the rule
picks which exact procedure makes a sequence's next tokens, from past timings and counts only.

Ownership: a :class:`BatchDecoder` owns its target runner's slots and one drafter runner per slot; not thread
safe (one thread drives it: the Generator's batch loop thread behind :meth:`dflash2_trt.api.Generator.submit`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash2_trt import reference as ref
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.decoder import (GenerationResult, _next_token, _proposal_in_vocab, check_prompt,
                                         check_temperature)
from dflash2_trt.runtime.protocol import DraftRunner


# The rule's clock: process CPU time, the work a step costs, blind to other processes' load (on a shared machine
# wall-time costs of a step measured minutes apart differ by more than drafting changes them: measured verify
# costs came out below zero); on a machine of its own the batch loop's CPU time tracks its wall time.
COST_CLOCK = time.process_time


@dataclass
class BatchRequest:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    eos_ids: set[int] | None = None  # None: the target's
    speculative: bool = True  # may draft (when the decoder has a drafter and the rule says it pays)


class MeasuredCosts:
    """The rule's step costs, measured in this run (seconds; running means, then exponential over 16): t_plain(n)
    per batch size, t_draft per proposal, t_verify per drafting sequence (its share of a step's extra forward
    time; may be measured below 0 by noise, used as >= 0)."""

    verify_from_plan = True  # with the runner's plan, t_plain(n) + k t_verify comes from it (SpeculationRule.choose)

    def __init__(self) -> None:
        self._plain: dict[int, tuple[float, int]] = {}  # sequences in the call -> (mean s, count)
        self._draft: tuple[float, int] = (0.0, 0)
        self._verify: tuple[float, int] = (0.0, 0)

    @staticmethod
    def _update(old: tuple[float, int], s: float) -> tuple[float, int]:
        m, n = old
        n += 1
        return m + (s - m) / min(n, 16), n

    def record_plain(self, n: int, s: float) -> None:
        self._plain[n] = self._update(self._plain.get(n, (0.0, 0)), s)

    def record_draft(self, s: float) -> None:
        self._draft = self._update(self._draft, s)

    def record_verify(self, s: float) -> None:
        self._verify = self._update(self._verify, s)

    def plain(self, n: int) -> float | None:
        """t_plain(n): measured, else linear between the nearest measured sizes (flat beyond them); None: none."""
        if n <= 0:
            return 0.0
        if n in self._plain:
            return self._plain[n][0]
        if not self._plain:
            return None
        ks = sorted(self._plain)
        return float(np.interp(n, ks, [self._plain[k][0] for k in ks]))

    def draft(self) -> float | None:
        return self._draft[0] if self._draft[1] else None

    def verify(self) -> float | None:
        return self._verify[0] if self._verify[1] else None


@dataclass
class FixedCosts:
    """Costs given, not measured (tests; a deployment that calibrated them): t_plain(n), t_draft, t_verify (what
    one drafting sequence adds to a step's target forward)."""

    plain_fn: Callable[[int], float]
    draft_s: float
    verify_s: float
    verify_from_plan = False  # t_verify is given (a class attribute, not a field)

    def record_plain(self, n: int, s: float) -> None: ...

    def record_draft(self, s: float) -> None: ...

    def record_verify(self, s: float) -> None: ...

    def plain(self, n: int) -> float:
        return 0.0 if n <= 0 else float(self.plain_fn(n))

    def draft(self) -> float:
        return self.draft_s

    def verify(self) -> float:
        return self.verify_s


@dataclass
class SpeculationRule:
    """Which sequences draft this step (the module docstring's rule)."""

    prior_tau: float = 2.0  # τ̂ of a sequence before its first cycles
    prior_weight: float = 2.0  # cycles the prior counts for
    window: int = 32  # cycles per sequence in τ̂
    adaptive: bool = True  # False: every speculative sequence drafts every step
    probe_after: int = 64  # plain steps in a row after which a candidate's τ̂ returns to the prior
    costs: Any = field(default_factory=MeasuredCosts)  # MeasuredCosts | FixedCosts
    z: float = 1.0  # τ̂ is the mean + z s/√n (s: the cycles' standard deviation): off only on evidence, as the guard

    def tau(self, committed: deque) -> float:
        n = len(committed)
        mean = (self.prior_tau * self.prior_weight + float(sum(committed))) / (self.prior_weight + n)
        return mean + (self.z * float(np.std(committed, ddof=1)) / np.sqrt(n) if n >= 2 else 0.0)

    def choose(self, n_active: int, candidates: dict[int, float],
               units: Callable[[list[int]], float] | None = None) -> set[int]:
        """candidates: sequence id -> τ̂ (the speculative sequences that can draft) -> the ids that draft.
        ``units``: the target forward's cost in the runner's units (calls and padded rows,
        :meth:`~dflash2_trt.runtime.ort.batched_target.OrtBatchedTargetRunner.cost_units`) when the given ids draft;
        with it time(k) = t_plain(n) x units(top k) / units(none) + k t_draft (t_verify unused: a difference of two
        noisy timings, where the runner's plan knows what k verifies add)."""
        if not candidates:
            return set()
        if not self.adaptive:
            return set(candidates)
        c = self.costs
        t_all = c.plain(n_active)
        if t_all is None:
            return set()  # explore: measure a plain step first
        order = sorted(candidates, key=lambda i: -candidates[i])
        t_d, t_v = c.draft(), c.verify()
        if not getattr(c, "verify_from_plan", False):
            units = None
        if t_d is None or (units is None and t_v is None):
            return set(order[:1])  # explore: measure one sequence's drafting (at high load one is costly enough)
        best_k, best = 0, n_active / max(t_all, 1e-12)
        tokens = float(n_active)
        per_unit = t_all / units([]) if units is not None else 0.0
        for k, i in enumerate(order, start=1):
            tokens += candidates[i] - 1.0
            if units is not None:
                t = per_unit * units(order[:k]) + k * t_d
            else:
                t = t_all + k * (t_d + max(t_v, 0.0))
            rate = tokens / max(t, 1e-12)
            if rate > best:
                best_k, best = k, rate
        return set(order[:best_k])


@dataclass
class _Seq:
    id: int
    req: BatchRequest
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
    committed: deque = field(default_factory=deque)  # tokens per cycle, last `window` cycles
    plain_run: int = 0  # steps in a row the rule kept this candidate plain
    done: bool = False


class BatchDecoder:
    """Continuous batching over ``target`` (a batched target runner) with optional drafting (``drafter_factory``
    makes one B = 1 drafter per slot). ``submit`` / ``step`` / ``cancel`` / ``results``; or :meth:`run`."""

    def __init__(self, target: Any, drafter_factory: Callable[[], DraftRunner] | None = None,
                 rule: SpeculationRule | None = None) -> None:
        self.target = target  # OrtBatchedTargetRunner (join/leave/crop/forward over slots)
        self.rule = rule or SpeculationRule()
        self._make_drafter = drafter_factory
        self._drafters: dict[int, DraftRunner] = {}  # slot -> its drafter
        self._queue: deque[_Seq] = deque()
        self._active: dict[int, _Seq] = {}  # id -> sequence
        self.results: dict[int, GenerationResult] = {}  # id -> result, once finished
        self._next_id = 0
        self.steps = 0  # batch steps run
        self.drafting_steps = 0  # steps where at least one sequence drafted

    # -- requests -----------------------------------------------------------------------------------------------
    def submit(self, req: BatchRequest) -> int:
        """Queue a request (it joins at the next step with a free slot) -> its id."""
        check_prompt(req.prompt, self.target, req.max_new_tokens)
        check_temperature(req.temperature)
        i = self._next_id
        self._next_id += 1
        eos = set(self.target.eos_ids) if req.eos_ids is None else set(req.eos_ids)
        limit = min(req.max_new_tokens, self.target.max_positions - len(req.prompt))
        self._queue.append(_Seq(i, req, -1, np.random.default_rng(req.seed),
                                GenerationResult(prompt_tokens=list(req.prompt)), eos, limit, 0.0,
                                committed=deque(maxlen=self.rule.window)))
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

    def run(self, reqs: list[BatchRequest]) -> list[GenerationResult]:
        ids = [self.submit(r) for r in reqs]
        while self.busy:
            self.step()
        return [self.results[i] for i in ids]

    # -- the step -------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit, then one plain step or speculative cycle per active sequence, then retire the finished."""
        self._admit()
        seqs = list(self._active.values())
        if not seqs:
            return
        self.steps += 1
        drafting = self._choose(seqs)
        if drafting:
            self.drafting_steps += 1
        proposals = {s.id: self._draft(s) for s in seqs if s.id in drafting}  # id -> (proposal, drafts)
        rows = {s.slot: [s.anchor] + (proposals[s.id][1] if s.id in proposals else []) for s in seqs}
        t = COST_CLOCK()
        out = self.target.forward(rows)  # slot -> (logits [m, V], features [m, F])
        self._record_forward(len(seqs), len(proposals), COST_CLOCK() - t)
        for s in seqs:
            logits, feats = out[s.slot]
            if s.id in proposals:
                self._accept(s, *proposals[s.id], logits, feats)
            else:
                self._plain(s, logits, feats)
        for s in seqs:
            if s.res.tokens and (len(s.res.tokens) >= s.limit or s.res.tokens[-1] in s.eos):
                self._finish(s)

    def _admit(self) -> None:
        """Queued requests into free slots, their prompts prefilled in one target forward (the runner shares
        graph calls between them where that pays), each its first token drawn."""
        new: list[_Seq] = []
        while self._queue and len(new) < self.target.free_slots:
            new.append(self._queue.popleft())
        if not new:
            return
        t0 = time.perf_counter()
        # prompts of like lengths in neighbouring slots: a graph call binds a slot range, padded to its longest
        for s in sorted(new, key=lambda s: len(s.req.prompt)):
            s.slot, s.t0 = self.target.join(), t0
        # slot -> (logits [1, V] of the last prompt row, features [n, F])
        out = self.target.forward({s.slot: list(s.req.prompt) for s in new}, last_logits=True)
        for s in new:
            logits, feats = out[s.slot]
            s.anchor = _next_token(logits[-1], s.req.temperature, s.rng)
            s.res.tokens.append(s.anchor)
            s.pos = len(s.req.prompt)
            if self._can_draft(s):
                s.pending, s.pending_start = [feats], 0
                self._drafter(s.slot).reset()
            self._active[s.id] = s
            if len(s.res.tokens) >= s.limit or s.anchor in s.eos:
                self._finish(s)

    def _can_draft(self, s: _Seq) -> bool:
        return s.req.speculative and self._make_drafter is not None

    def _drafter(self, slot: int) -> DraftRunner:
        if slot not in self._drafters:
            assert self._make_drafter is not None
            self._drafters[slot] = self._make_drafter()
        return self._drafters[slot]

    def _choose(self, seqs: list[_Seq]) -> set[int]:
        # a cycle needs >= 1 draft row left before the limit
        cands = [s for s in seqs if self._can_draft(s) and s.limit - len(s.res.tokens) >= 2]
        for s in cands:
            if s.plain_run >= self.rule.probe_after:  # probe: measure this sequence's acceptance again
                s.committed.clear()
                s.plain_run = 0
        full = {s.id: self._drafter(s.slot).block_size - 1 for s in cands}  # draft rows of a full block
        drafts = {s.id: min(full[s.id], s.limit - len(s.res.tokens) - 1) for s in cands}  # this cycle's
        # τ̂ of a final partial block: its share of the rows' expected gain (a full block's τ̂ would overstate it)
        taus = {s.id: 1.0 + (self.rule.tau(s.committed) - 1.0) * drafts[s.id] / full[s.id] for s in cands}
        units = None
        if cands and hasattr(self.target, "cost_units"):

            def units(ids: list[int]) -> float:  # the step's forward when ``ids`` draft (their verify rows)
                return self.target.cost_units({s.slot: 1 + (drafts[s.id] if s.id in ids else 0) for s in seqs})

        chosen = self.rule.choose(len(seqs), taus, units)
        for s in cands:
            s.plain_run = 0 if s.id in chosen else s.plain_run + 1
        return chosen

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
        s.anchor = _next_token(logits[-1], s.req.temperature, s.rng)
        if self._can_draft(s):
            s.pending.append(feats)
        s.pos += 1
        s.res.tokens.append(s.anchor)
        s.res.plain_steps += 1

    def _draft(self, s: _Seq) -> tuple[Any, list[int]]:
        """draft (decoder.speculative_generate's cycle, first half): pending features join the drafter's context,
        the drafter proposes -> (its proposal, the drafts to verify)."""
        T = s.req.temperature
        drafter = self._drafter(s.slot)
        L = drafter.block_size - 1
        t = COST_CLOCK()
        if s.pending:  # features of the prompt / plain steps join the draft context in one pass
            drafter.add_context(np.concatenate(s.pending), s.pending_start)
            if s.pending_start == 0:  # the prompt's context (a sequence's first proposal) is not a cycle's cost
                t = COST_CLOCK()
            s.pending = []
        n_rows = min(L, s.limit - len(s.res.tokens) - 1)  # a final partial block verifies fewer rows
        uniforms = s.rng.random((1, L), dtype=np.float32) if T > 0 else None
        draft = drafter.propose(s.anchor, s.pos, n_rows, T, uniforms)
        self.rule.costs.record_draft(COST_CLOCK() - t)
        return draft, [int(x) for x in draft.tokens[:n_rows]]

    def _accept(self, s: _Seq, draft: Any, drafts: list[int], v_logits: np.ndarray, v_feats: np.ndarray) -> None:
        """accept → commit of one sequence's verify (v_logits [n+1, V], v_feats [n+1, F] of [anchor, drafts])."""
        T = s.req.temperature
        n_rows = len(drafts)
        if T <= 0:
            acc, bonus = ref.accept_greedy(np.asarray(drafts, dtype=np.int64), v_logits)
        else:
            p = ref.softmax_t(v_logits, T)  # [n+1, V]
            q = _proposal_in_vocab(draft, n_rows, p.shape[-1])  # [n, V]
            acc, bonus = ref.accept_rejection(np.asarray(drafts, dtype=np.int64), q, p, s.rng)
        self.target.crop(s.slot, s.pos + acc + 1)
        s.pending, s.pending_start = [v_feats[: acc + 1]], s.pos
        new = drafts[:acc] + [bonus]
        for i, tok in enumerate(new):
            if tok in s.eos:
                new = new[: i + 1]
                break
        s.res.accepted.append(min(acc, len(new)))
        s.res.proposed.append(n_rows)
        s.res.tokens.extend(new)
        s.committed.append(len(new))
        s.pos += acc + 1
        s.anchor = new[-1]

    def _finish(self, s: _Seq) -> None:
        s.done = True
        s.res.elapsed_s = time.perf_counter() - s.t0
        self.target.leave(s.slot)
        self._active.pop(s.id, None)
        self.results[s.id] = s.res


def check_batch_size(max_batch: Any) -> int:
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise DFlash2Error(f"max_batch must be an integer >= 1, got {max_batch!r}")
    return max_batch
