"""The docs/design.md decoding loop over any backend (NumPy; no torch). The PyTorch reference
(:mod:`~dflash2_trt.runtime.torch.backend`) runs through this same loop, so backends differ only in their
runners.

One request, a flat loop of named steps: prefill → (draft → select → verify → accept → commit)*. Every
random number is drawn from one ``numpy.random.Generator`` in a fixed order (first token, then per cycle:
the drafter's uniforms, then the rejection test), so a backend whose graphs match PyTorch reproduces the
reference's tokens and metrics exactly for a given seed.

:func:`speculative_generate` and :func:`target_generate` read what the request asks for from one
:class:`~dflash2_trt.runtime.request.GenerationRequest` (validated at their entry against the target's limits,
unless the caller validated it for this prompt) and take what the loop calls as one :class:`DecodeHooks`. The
request's ``min_confidence``: verify only the leading draft rows whose cumulative drafter confidence reaches it
(:func:`~dflash2_trt.runtime.guard.verify_rows`; exact, the rule looks at the proposal side only); its ``guard``:
an :class:`~dflash2_trt.runtime.guard.AcceptanceGuard` runs plain target steps while measured acceptance does not
pay for a cycle (exact: a plain step is the target's own step). Among the hooks, ``oracle``: a per-cycle oracle
top-K counter (:func:`dflash2_trt.bench.oracle.oracle_count`), its extra target passes excluded from the timing;
``on_tokens`` streams each newly committed chunk of tokens. The accept step is
:func:`dflash2_trt.runtime.accept.accept_drafts`, shared with the batched loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dflash2_trt.acceptance import acceptance_stats
from dflash2_trt.runtime import grammar
from dflash2_trt.runtime.accept import accept_drafts, next_token
from dflash2_trt.runtime.guard import AcceptanceGuard, GuardConfig, verify_rows
from dflash2_trt.runtime.ngram import DFLASH2, NGRAM, ProposerChoice, default_rows, lookup_draft, uses_drafter
from dflash2_trt.runtime.prefix_cache import PrefixCache
from dflash2_trt.runtime.protocol import Draft, DraftRunner, TargetRunner
from dflash2_trt.runtime.request import GenerationRequest, Limits
from dflash2_trt.runtime.sampling import Sampler, TokenLogprob

OnTokens = Callable[[list[int]], None]
OnCycle = Callable[[int, int], None]  # (accepted drafts, verified rows) of a speculative cycle
OnLogprobs = Callable[[list[TokenLogprob]], None]  # the logprobs of the chunk on_tokens gets next
# (target, cand [L, K], drafts, n_rows, accepted, bonus, anchor position) -> oracle top-K count of the cycle
OracleFn = Callable[[TargetRunner, np.ndarray, list[int], int, int, int, int], int]


@dataclass
class GenerationResult:
    """One request's output and per-cycle counts (every backend, PyTorch included, runs this one loop)."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated (EOS included when hit)
    accepted: list[int] = field(default_factory=list)  # per cycle: accepted drafts
    proposed: list[int] = field(default_factory=list)  # per cycle: drafts verified
    oracle_accepted: list[int] = field(default_factory=list)  # per cycle: oracle top-K count
    elapsed_s: float = 0.0  # wall time excluding oracle measurement passes
    plain_steps: int = 0  # plain target steps run by the guard (each commits one token)
    guard_switches: int = 0  # speculative -> plain switches
    guard_probes: int = 0  # plain -> speculative probes
    proposers: list[str] = field(default_factory=list)  # per cycle: who proposed ('dflash2' | 'ngram')
    cached_tokens: int = 0  # prompt positions restored from the prefix cache (not computed)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when the request asks (runtime/sampling)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., when the request asks

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def stats(self) -> dict:
        """docs/design.md metrics: acceptance_stats + oracle_tau (None when not measured)."""
        s = acceptance_stats(self.accepted, self.proposed)
        s["oracle_tau"] = float(np.mean(np.asarray(self.oracle_accepted) + 1)) if self.oracle_accepted else None
        s.update(spec_cycles=len(self.accepted), plain_steps=self.plain_steps, guard_switches=self.guard_switches,
                 guard_probes=self.guard_probes)
        for who in (DFLASH2, NGRAM):  # each proposer's own acceptance
            acc = [a for a, p in zip(self.accepted, self.proposers) if p == who]
            s[f"{who}_cycles"] = len(acc)
            s[f"{who}_tau"] = float(np.mean(acc)) + 1 if acc else None
        return s



def target_generate(target: TargetRunner, prompt_ids: list[int], request: GenerationRequest,
                    on_tokens: OnTokens | None = None, cache: PrefixCache | None = None,
                    on_logprobs: OnLogprobs | None = None,
                    grammar_tokenizer: grammar.GrammarTokenizer | None = None) -> GenerationResult:
    """Plain autoregressive decoding on the same backend (the lossless reference and the speed baseline); reads
    the request's ``max_new_tokens``, ``temperature``, ``seed`` and ``eos_ids``. ``cache``: the prefix cache the
    prompt starts from and the finished sequence joins (no drafter context: plain decoding keeps none). The
    request's sampling transforms and logprobs: :mod:`dflash2_trt.runtime.sampling` (``on_logprobs`` gets each
    token's just before ``on_tokens`` gets the token). The request's grammar (:mod:`dflash2_trt.runtime.grammar`)
    masks each step's logits; ``grammar_tokenizer``: the target's tokenizer for it."""
    r = request.validate(prompt_ids, Limits.of(target))
    constraint = grammar.start(r, grammar_tokenizer)
    rng = np.random.default_rng(r.seed)
    eos = set(target.eos_ids) if r.eos_ids is None else r.eos_ids
    res = GenerationResult(prompt_tokens=list(prompt_ids))
    sampler = Sampler(r, prompt_ids, target.vocab_size)
    sampler.logprobs = res.logprobs
    t0 = time.perf_counter()
    target.reset()
    start = cache.prefill_from(prompt_ids, target, None) if cache is not None and not r.prompt_logprobs else 0
    # the prompt's last row's logits alone, unless its prompt logprobs read every row's
    logits, _ = target.forward(list(prompt_ids[start:]), last_logits=not r.prompt_logprobs)
    res.cached_tokens = start
    if r.prompt_logprobs:
        res.prompt_logprobs = sampler.prompt_logprobs(prompt_ids, logits)
    snaps = PrefixCache.snapshot(target) if cache is not None else {}
    tok = next_token(grammar.masked(constraint, logits[-1]), r.temperature, rng, sampler)
    limit = min(r.max_new_tokens, target.max_positions - len(prompt_ids))
    while True:
        res.tokens.append(tok)
        grammar.advance(constraint, [tok])
        sampler.commit([tok])
        if on_logprobs and r.logprobs:
            on_logprobs(res.logprobs[-1:])
        if on_tokens:
            on_tokens([tok])
        if len(res.tokens) >= limit or tok in eos:
            break
        logits, _ = target.forward([tok])
        tok = next_token(grammar.masked(constraint, logits[-1]), r.temperature, rng, sampler)
    res.elapsed_s = time.perf_counter() - t0
    if cache is not None:
        cache.store((list(prompt_ids) + res.tokens)[: target.cache_length], target, None, None, snaps)
    return res


def _confidence(draft: Draft, temperature: float) -> np.ndarray | None:
    """[L] per-row confidence given the rows before (see :func:`~dflash2_trt.runtime.guard.verify_rows`)."""
    if draft.confidence is not None:
        return draft.confidence
    if temperature <= 0:
        return None  # a one-hot proposal says nothing
    q = draft.vocab_proposal if draft.vocab_proposal is not None else draft.proposal  # [L, V] | [L, K]
    return np.asarray(q.max(-1), dtype=np.float64)  # [L]


@dataclass(frozen=True)
class DecodeHooks:
    """What the loop calls during one request: ``on_tokens(new)`` gets each committed chunk (the prefill's first
    token, a plain step's token, a cycle's tokens); ``on_cycle(accepted, rows)`` runs for each speculative cycle
    just before ``on_tokens`` gets its tokens; ``oracle``: the per-cycle oracle top-K count, excluded from the
    timing; ``guard``: the acceptance guard to run (a test's own clock or config), asked before each step whether
    to run a plain one and told each step's time — it holds one request's state, so a fresh one per call; None:
    a fresh ``AcceptanceGuard(GuardConfig())`` when the request's ``guard`` is on."""

    on_tokens: OnTokens | None = None
    on_cycle: OnCycle | None = None
    oracle: OracleFn | None = None
    guard: AcceptanceGuard | None = None
    on_logprobs: OnLogprobs | None = None  # each chunk's logprobs, just before on_tokens (when the request asks)
    grammar: grammar.GrammarTokenizer | None = None  # the target's tokenizer for a request's grammar


class _SpeculativeLoop:
    """One request's state through the named steps of :func:`speculative_generate` (prefill, pick, plain step, draft,
    verify + accept, commit). Every random number comes from ``rng`` in a fixed order: the first token, then per
    cycle the drafter's uniforms, then the rejection test."""

    def __init__(self, target: TargetRunner, drafter: DraftRunner, prompt_ids: list[int], request: GenerationRequest,
                 hooks: DecodeHooks, cache: PrefixCache | None = None) -> None:
        o = request.validate(prompt_ids, Limits.of(target))
        guard = hooks.guard if hooks.guard is not None else AcceptanceGuard(GuardConfig()) if o.guard else None
        self.target, self.drafter, self.o, self.guard, self.hooks = target, drafter, o, guard, hooks
        self.prompt = list(prompt_ids)
        self.rng = np.random.default_rng(o.seed)
        self.eos = set(target.eos_ids) if o.eos_ids is None else o.eos_ids
        self.L = drafter.num_draft_rows
        self.res = GenerationResult(prompt_tokens=list(prompt_ids))
        self.sampler = Sampler(o, prompt_ids, target.vocab_size)  # the request's transforms, its logprobs
        self.sampler.logprobs = self.res.logprobs
        self.constraint = grammar.start(o, hooks.grammar)  # the request's grammar matcher, None without one
        self.masks: np.ndarray | None = None  # [n + 1, V] bool: the verify rows' grammar masks of this cycle
        self.oracle_s = 0.0
        self.t0 = time.perf_counter()
        self.limit = min(o.max_new_tokens, target.max_positions - len(prompt_ids))
        self.pos = len(prompt_ids)  # the anchor's position
        self.anchor = -1
        # features [rows, F] of committed positions not yet in the draft context: plain steps and prompt-lookup
        # cycles add none until the drafter runs again, then all of them in one pass
        self.pending: list[np.ndarray] = []
        self.choice: ProposerChoice | None = None
        self.cache = cache
        self.snapshots: dict = {}  # the target's state after the prefill, for the prefix cache (stateful targets)

    @property
    def running(self) -> bool:
        return len(self.res.tokens) < self.limit and self.anchor not in self.eos

    def _emit(self, new: list[int]) -> None:
        self.sampler.commit(new)
        if self.hooks.on_logprobs and self.o.logprobs:
            self.hooks.on_logprobs(self.res.logprobs[-len(new):])
        if self.hooks.on_tokens:
            self.hooks.on_tokens(new)

    def prefill(self) -> None:
        """Target KV cache + context features of every prompt position (those the prefix cache restores, then the
        rest computed); the first anchor."""
        self.target.reset()
        self.drafter.reset()
        drafts = uses_drafter(self.o.proposer)  # (the choice needs the first token)
        start = 0 if self.cache is None or self.o.prompt_logprobs else \
            self.cache.prefill_from(self.prompt, self.target, self.drafter if drafts else None)
        # logits [1, V] (the first token's), or [n - start, V] when the prompt logprobs read every row; feats
        # [n - start, F]
        logits, feats = self.target.forward(self.prompt[start:], last_logits=not self.o.prompt_logprobs)
        self.res.cached_tokens = start
        if self.o.prompt_logprobs:
            self.res.prompt_logprobs = self.sampler.prompt_logprobs(self.prompt, logits)
        if self.cache is not None:
            self.snapshots = PrefixCache.snapshot(self.target)
        self.anchor = next_token(grammar.masked(self.constraint, logits[-1]), self.o.temperature, self.rng,
                                 self.sampler)
        grammar.advance(self.constraint, [self.anchor])
        self.res.tokens.append(self.anchor)
        self._emit([self.anchor])
        self.choice = ProposerChoice(self.o.proposer, self.prompt + [self.anchor],
                                     self.o.ngram_rows or default_rows(self.L))
        if self.choice.uses_drafter:
            self.drafter.add_context(feats, start)

    def pick(self) -> tuple[list[int], str | None]:
        """(the lookup's drafts, who proposes: 'dflash2' | 'ngram' | None for a plain step). The guard rules the
        drafter alone: while it says plain steps, a lookup that pays still runs."""
        assert self.choice is not None
        looked_up = self.choice.ngram(self.limit - len(self.res.tokens) - 1)
        g = self.guard
        return looked_up, self.choice.pick(looked_up, g.t_step if g is not None else None,
                                           drafter=g is None or not g.plain_next())

    def plain_step(self, t_step: float) -> None:
        """The target's own next token (exactly target_generate's step)."""
        assert self.choice is not None
        logits, feats = self.target.forward([self.anchor])  # [1, V], [1, F]
        self.anchor = next_token(grammar.masked(self.constraint, logits[-1]), self.o.temperature, self.rng,
                                 self.sampler)
        grammar.advance(self.constraint, [self.anchor])
        if self.choice.uses_drafter:
            self.pending.append(feats)
        self.pos += 1
        self.res.tokens.append(self.anchor)
        self.choice.extend([self.anchor])
        self.res.plain_steps += 1
        self._emit([self.anchor])
        if self.guard is not None:
            self.guard.record_step(time.perf_counter() - t_step)

    def draft(self, who: str, looked_up: list[int]) -> tuple[Draft, list[int], int]:
        """-> (the draft, its tokens to verify, rows verified). The drafter's pending positions join its context
        in one pass first; a final partial block verifies fewer rows; all bs rows always run, as in training."""
        if who == NGRAM:  # prompt lookup: deterministic drafts, a one-hot proposal
            return self._constrain(lookup_draft(looked_up), looked_up)
        if self.pending:
            ctx = np.concatenate(self.pending)
            self.drafter.add_context(ctx, self.pos - ctx.shape[0])
            self.pending = []
        n_rows = min(self.L, self.limit - len(self.res.tokens) - 1)
        T = self.o.temperature
        uniforms = self.rng.random((1, self.L), dtype=np.float32) if T > 0 else None
        draft = self.sampler.redraw(self.drafter.propose(self.anchor, self.pos, n_rows, T, uniforms), uniforms, n_rows)
        n_rows = verify_rows(_confidence(draft, T), n_rows, self.o.min_confidence)
        return self._constrain(draft, [int(t) for t in draft.tokens[:n_rows]])

    def _constrain(self, draft: Draft, drafts: list[int]) -> tuple[Draft, list[int], int]:
        """The request's grammar along the draft (:func:`~dflash2_trt.runtime.grammar.constrain_draft`): refused
        candidates masked, the path cut at a row with none allowed, the verify rows' masks kept."""
        if self.constraint is not None:
            draft, drafts, self.masks = grammar.constrain_draft(self.constraint, draft, drafts, self.o.temperature,
                                                                self.rng)
        return draft, drafts, len(drafts)

    def verify(self, draft: Draft, drafts: list[int], n_rows: int) -> tuple[int, int, np.ndarray]:
        """The target on [anchor, d_1..d_n] at positions pos..pos+n, then acceptance -> (accepted, bonus token,
        features [n+1, F])."""
        v_logits, v_feats = self.target.forward([self.anchor] + drafts)  # [n+1, V], [n+1, F]
        if self.constraint is not None:  # the masked target law; the matcher back to the accepted length + bonus
            v_logits = grammar.mask_rows(self.masks, v_logits)
        acc, bonus = accept_drafts(draft, drafts, v_logits, self.o.temperature, self.rng, sampler=self.sampler)
        if self.constraint is not None:
            grammar.commit(self.constraint, len(drafts), acc, bonus)
        return acc, bonus, v_feats

    def commit(self, who: str, draft: Draft, drafts: list[int], n_rows: int, acc: int, bonus: int,
               v_feats: np.ndarray, t_step: float) -> None:
        """Crop the target cache; committed positions become draft context; the cycle's tokens (up to an accepted
        EOS: drafts after it are not committed, so they do not count for τ) and counts."""
        assert self.choice is not None
        res = self.res
        self.target.crop(self.pos + acc + 1)
        if who == NGRAM and self.choice.uses_drafter:
            self.pending.append(v_feats[: acc + 1])
        elif self.choice.uses_drafter:
            self.drafter.add_context(v_feats[: acc + 1], self.pos)
        new = drafts[:acc] + [bonus]
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[: i + 1]
                break
        res.accepted.append(min(acc, len(new)))
        res.proposed.append(n_rows)
        res.proposers.append(who)
        self.choice.extend(new)
        self.choice.record(who, len(new), time.perf_counter() - t_step)
        cycle_oracle_s = 0.0
        if self.hooks.oracle is not None:
            t_o = time.perf_counter()
            res.oracle_accepted.append(self.hooks.oracle(self.target, draft.cand, drafts, n_rows, acc, bonus,
                                                         self.pos))
            cycle_oracle_s = time.perf_counter() - t_o
            self.oracle_s += cycle_oracle_s
        res.tokens.extend(new)
        if self.hooks.on_cycle:
            self.hooks.on_cycle(res.accepted[-1], n_rows)
        self._emit(new)
        self.pos += acc + 1
        self.anchor = new[-1]
        if self.guard is not None and who == DFLASH2:
            self.guard.record_cycle(len(new), time.perf_counter() - t_step - cycle_oracle_s)

    def finish(self) -> GenerationResult:
        """The result; the finished sequence joins the prefix cache (its cached positions, the drafter's context
        and the features it has not taken in yet)."""
        if self.guard is not None:
            self.res.guard_switches, self.res.guard_probes = self.guard.switches, self.guard.probes
        self.res.elapsed_s = time.perf_counter() - self.t0 - self.oracle_s
        if self.cache is not None:
            assert self.choice is not None
            drafts = self.choice.uses_drafter
            self.cache.store((self.prompt + self.res.tokens)[: self.target.cache_length], self.target,
                             self.drafter if drafts else None,
                             np.concatenate(self.pending) if drafts and self.pending else None, self.snapshots)
        return self.res


def speculative_generate(target: TargetRunner, drafter: DraftRunner, prompt_ids: list[int],
                         request: GenerationRequest, hooks: DecodeHooks = DecodeHooks(),
                         cache: PrefixCache | None = None) -> GenerationResult:
    """Speculative decoding of one prompt (docs/design.md, the decoding loop; the C core's
    ``dflash2::speculativeGenerate``, the twin of :func:`target_generate`). The loop, top to bottom: prefill, then
    per step the proposer's pick, a plain step or draft -> verify + accept -> commit. ``cache``: the prefix cache
    (:mod:`dflash2_trt.runtime.prefix_cache`) the prefill starts from and the finished sequence joins."""
    loop = _SpeculativeLoop(target, drafter, prompt_ids, request, hooks, cache)
    loop.prefill()
    while loop.running:
        t_step = time.perf_counter()
        looked_up, who = loop.pick()
        if who is None:
            loop.plain_step(t_step)
            continue
        draft, drafts, n_rows = loop.draft(who, looked_up)
        acc, bonus, v_feats = loop.verify(draft, drafts, n_rows)
        loop.commit(who, draft, drafts, n_rows, acc, bonus, v_feats, t_step)
    return loop.finish()
