"""The SPEC §4 decoding loop over any backend (NumPy; no torch). The PyTorch reference
(:mod:`~dflash2_trt.runtime.torch.backend`) runs through this same loop, so backends differ only in their
runners.

One request, a flat loop of named steps: prefill → (draft → select → verify → accept → commit)*. Every
random number is drawn from one ``numpy.random.Generator`` in a fixed order (first token, then per cycle:
the drafter's uniforms, then the rejection test), so a backend whose graphs match PyTorch reproduces the
reference's tokens and metrics exactly for a given seed.

``guard``: an :class:`~dflash2_trt.runtime.guard.AcceptanceGuard` that runs plain target steps while measured
acceptance does not pay for a cycle (exact: a plain step is the target's own step); ``min_confidence``: verify
only the leading draft rows whose cumulative drafter confidence reaches it
(:func:`~dflash2_trt.runtime.guard.verify_rows`; exact, the rule looks at the proposal side only).

``oracle``: a per-cycle oracle top-K counter (:func:`dflash2_trt.bench.oracle.oracle_count`); its extra
target passes are excluded from the timing. ``on_tokens`` streams each newly committed chunk of tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dflash2_trt import reference as ref
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.reference import acceptance_stats
from dflash2_trt.runtime.protocol import Draft, DraftRunner, TargetRunner
from dflash2_trt.runtime.guard import AcceptanceGuard, verify_rows
from dflash2_trt.runtime.ngram import DFLASH2, NGRAM, ProposerChoice, default_rows, lookup_draft

OnTokens = Callable[[list[int]], None]
OnCycle = Callable[[int, int], None]  # (accepted drafts, verified rows) of a speculative cycle
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

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def stats(self) -> dict:
        """SPEC §4 metrics: acceptance_stats + oracle_tau (None when not measured)."""
        s = acceptance_stats(self.accepted, self.proposed)
        s["oracle_tau"] = float(np.mean(np.asarray(self.oracle_accepted) + 1)) if self.oracle_accepted else None
        s.update(spec_cycles=len(self.accepted), plain_steps=self.plain_steps, guard_switches=self.guard_switches,
                 guard_probes=self.guard_probes)
        for who in (DFLASH2, NGRAM):  # each proposer's own acceptance
            acc = [a for a, p in zip(self.accepted, self.proposers) if p == who]
            s[f"{who}_cycles"] = len(acc)
            s[f"{who}_tau"] = float(np.mean(acc)) + 1 if acc else None
        return s



def _next_token(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """logits [V] -> argmax at T = 0, else a sample of softmax(logits / T)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    p = ref.softmax_t(logits, temperature)
    return int(rng.choice(p.shape[-1], p=p))


def check_temperature(temperature: float) -> None:
    """T = 0 is greedy, T > 0 samples; a negative or NaN T is a user error, never silently greedy."""
    if not temperature >= 0 or temperature == float("inf"):  # `not >=` catches NaN
        raise DFlash2Error(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")


def check_prompt(prompt_ids: list[int], target: TargetRunner, max_new_tokens: int) -> None:
    if not prompt_ids:
        raise DFlash2Error("empty prompt")
    bad = [t for t in prompt_ids if not 0 <= int(t) < target.vocab_size]
    if bad:
        raise DFlash2Error(f"prompt token id {bad[0]} out of range [0, {target.vocab_size})")
    if len(prompt_ids) + 1 > target.max_positions:
        raise DFlash2Error(f"prompt of {len(prompt_ids)} tokens does not fit the {target.max_positions} positions "
                           f"available (the target's maximum, or the --max-seq-len of an export)")
    if max_new_tokens < 1:
        raise DFlash2Error(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def target_generate(target: TargetRunner, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                    eos_ids: set[int] | None = None, seed: int = 0, on_tokens: OnTokens | None = None
                    ) -> GenerationResult:
    """Plain autoregressive decoding on the same backend (the lossless reference and the speed baseline)."""
    check_prompt(prompt_ids, target, max_new_tokens)
    check_temperature(temperature)
    rng = np.random.default_rng(seed)
    eos = set(target.eos_ids) if eos_ids is None else eos_ids
    res = GenerationResult(prompt_tokens=list(prompt_ids))
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(list(prompt_ids))
    tok = _next_token(logits[-1], temperature, rng)
    res.tokens.append(tok)
    if on_tokens:
        on_tokens([tok])
    limit = min(max_new_tokens, target.max_positions - len(prompt_ids))
    while len(res.tokens) < limit and tok not in eos:
        logits, _ = target.forward([tok])
        tok = _next_token(logits[-1], temperature, rng)
        res.tokens.append(tok)
        if on_tokens:
            on_tokens([tok])
    res.elapsed_s = time.perf_counter() - t0
    return res


def _proposal_in_vocab(draft: Draft, n_rows: int, vocab: int) -> np.ndarray:
    """q over the candidates scattered into the vocabulary: [n_rows, V] float64."""
    if draft.vocab_proposal is not None:
        return draft.vocab_proposal[:n_rows].astype(np.float64)
    q = np.zeros((n_rows, vocab), dtype=np.float32)
    np.put_along_axis(q, draft.cand[:n_rows], draft.proposal[:n_rows].astype(np.float32), axis=-1)
    return q.astype(np.float64)


def _confidence(draft: Draft, temperature: float) -> np.ndarray | None:
    """[L] per-row confidence given the rows before (see :func:`~dflash2_trt.runtime.guard.verify_rows`)."""
    if draft.confidence is not None:
        return draft.confidence
    if temperature <= 0:
        return None  # a one-hot proposal says nothing
    q = draft.vocab_proposal if draft.vocab_proposal is not None else draft.proposal  # [L, V] | [L, K]
    return np.asarray(q.max(-1), dtype=np.float64)  # [L]


def speculative_generate(
    target: TargetRunner,
    drafter: DraftRunner,
    prompt_ids: list[int],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    eos_ids: set[int] | None = None,
    seed: int = 0,
    oracle: OracleFn | None = None,
    on_tokens: OnTokens | None = None,
    guard: AcceptanceGuard | None = None,
    min_confidence: float = 0.0,
    on_cycle: OnCycle | None = None,
    proposer: str = DFLASH2,
    ngram_rows: int | None = None,
) -> GenerationResult:
    """Speculative decoding of one prompt (SPEC §4); ``guard`` holds one request's state (a fresh one per call).
    ``on_cycle(accepted, rows)`` is called for each speculative cycle just before ``on_tokens`` gets its tokens
    (the prefill's first token and the guard's plain steps reach ``on_tokens`` alone).
    ``proposer``: 'dflash2' (the drafter), 'ngram' (prompt lookup only: the drafter never runs; no match = a plain
    step), 'auto' (per cycle, :class:`~dflash2_trt.runtime.ngram.ProposerChoice`); ``ngram_rows``: most lookup
    drafts per cycle (default: ``NGRAM_ROWS`` = 4, or the drafter's draft rows where more)."""
    check_prompt(prompt_ids, target, max_new_tokens)
    check_temperature(temperature)
    rng = np.random.default_rng(seed)
    eos = set(target.eos_ids) if eos_ids is None else eos_ids
    L = drafter.num_draft_rows
    res = GenerationResult(prompt_tokens=list(prompt_ids))
    oracle_s = 0.0
    t0 = time.perf_counter()

    # prefill: target KV cache + context features of every prompt position; the first anchor
    target.reset()
    drafter.reset()
    logits, feats = target.forward(list(prompt_ids))  # [n, V], [n, F]
    anchor = _next_token(logits[-1], temperature, rng)
    res.tokens.append(anchor)
    if on_tokens:
        on_tokens([anchor])
    choice = ProposerChoice(proposer, list(prompt_ids) + [anchor], ngram_rows or default_rows(L))
    if choice.uses_drafter:
        drafter.add_context(feats, 0)
    pos = len(prompt_ids)  # anchor position
    limit = min(max_new_tokens, target.max_positions - len(prompt_ids))
    # features [rows, F] of committed positions not yet in the draft context: plain steps and prompt-lookup cycles
    # add none until the drafter runs again, then all of them in one pass
    pending: list[np.ndarray] = []

    while len(res.tokens) < limit and anchor not in eos:
        t_step = time.perf_counter()
        looked_up = choice.ngram(limit - len(res.tokens) - 1)
        # the guard rules the drafter alone: while it says plain steps, a lookup that pays still runs
        who = choice.pick(looked_up, guard.t_step if guard is not None else None,
                          drafter=guard is None or not guard.plain_next())
        if who is None:
            # plain step: the target's own next token (exactly target_generate's step)
            logits, feats = target.forward([anchor])  # [1, V], [1, F]
            anchor = _next_token(logits[-1], temperature, rng)
            if choice.uses_drafter:
                pending.append(feats)
            pos += 1
            res.tokens.append(anchor)
            choice.extend([anchor])
            res.plain_steps += 1
            if on_tokens:
                on_tokens([anchor])
            if guard is not None:
                guard.record_step(time.perf_counter() - t_step)
            continue
        if pending and who != NGRAM:  # the drafter runs: the pending positions join its context in one pass
            ctx = np.concatenate(pending)
            drafter.add_context(ctx, pos - ctx.shape[0])
            pending = []
        if who == NGRAM:  # prompt lookup: deterministic drafts, a one-hot proposal
            drafts, n_rows = looked_up, len(looked_up)
            draft = lookup_draft(drafts)
        else:
            n_rows = min(L, limit - len(res.tokens) - 1)  # a final partial block verifies fewer rows
            # draft + select (all bs rows always run, as in training)
            uniforms = rng.random((1, L), dtype=np.float32) if temperature > 0 else None
            draft = drafter.propose(anchor, pos, n_rows, temperature, uniforms)
            n_rows = verify_rows(_confidence(draft, temperature), n_rows, min_confidence)
            drafts = [int(t) for t in draft.tokens[:n_rows]]
        # verify [anchor, d_1..d_n] at positions pos..pos+n
        v_logits, v_feats = target.forward([anchor] + drafts)  # [n+1, V], [n+1, F]
        # accept
        if temperature <= 0:
            acc, bonus = ref.accept_greedy(np.asarray(drafts, dtype=np.int64), v_logits)
        else:
            p = ref.softmax_t(v_logits, temperature)  # [n+1, V]
            q = _proposal_in_vocab(draft, n_rows, p.shape[-1])  # [n, V]
            acc, bonus = ref.accept_rejection(np.asarray(drafts, dtype=np.int64), q, p, rng)
        # commit: crop the target cache; committed positions become draft context
        target.crop(pos + acc + 1)
        if who == NGRAM and choice.uses_drafter:
            pending.append(v_feats[: acc + 1])
        elif choice.uses_drafter:
            drafter.add_context(v_feats[: acc + 1], pos)
        new = drafts[:acc] + [bonus]
        for i, t in enumerate(new):
            if t in eos:
                new = new[: i + 1]
                break
        # an accepted EOS ends the request: drafts after it are not committed, so they do not count for τ
        res.accepted.append(min(acc, len(new)))
        res.proposed.append(n_rows)
        res.proposers.append(who)
        choice.extend(new)
        choice.record(who, len(new), time.perf_counter() - t_step)
        cycle_oracle_s = 0.0
        if oracle is not None:
            t_o = time.perf_counter()
            res.oracle_accepted.append(oracle(target, draft.cand, drafts, n_rows, acc, bonus, pos))
            cycle_oracle_s = time.perf_counter() - t_o
            oracle_s += cycle_oracle_s
        res.tokens.extend(new)
        if on_cycle:
            on_cycle(res.accepted[-1], n_rows)
        if on_tokens:
            on_tokens(new)
        pos += acc + 1
        anchor = new[-1]
        if guard is not None and who == DFLASH2:
            guard.record_cycle(len(new), time.perf_counter() - t_step - cycle_oracle_s)

    if guard is not None:
        res.guard_switches, res.guard_probes = guard.switches, guard.probes
    res.elapsed_s = time.perf_counter() - t0 - oracle_s
    return res
