"""Prompt lookup (n-gram) proposals beside the DFlash 2 drafter (NumPy only).

:func:`lookup` — the continuation of the context's latest earlier occurrence of its own last n tokens (n from
``max_n`` down to ``min_n``): what onnxruntime-genai's n-gram speculation and vLLM's prompt lookup propose. It
costs microseconds where a drafter pass costs milliseconds, and on code and on answers that quote the prompt its
drafts are often long and right.

:class:`ProposerChoice` — which proposer makes a cycle's drafts (``dflash2`` | ``ngram`` | ``auto``). ``auto``:
prompt lookup when the context has a match and its measured acceptance (tokens committed per cycle, an
exponential mean per proposer, optimistic at the start) is at least the drafter's, else the drafter. A lookup
runs only while it pays: its measured tokens per second (committed tokens ÷ cycle time, exponential means) at
least a plain step's (:meth:`ProposerChoice.lookup_pays`). The acceptance guard (runtime/guard.py) rules the
drafter alone: while it says plain steps, a lookup that pays still runs (its proposals cost nothing; only its
verify does, and that is what its rate is measured against). Lossless either way: every draft is verified by the
target (greedy matching; at T > 0 rejection sampling against the one-hot proposal of a deterministic lookup), and
the choice looks only at the past (tokens committed, times measured). The batch loop (runtime/batch.py) keeps one
choice per sequence, its load-adaptive rule in the guard's place (:meth:`ProposerChoice.preferred`, then
:meth:`ProposerChoice.settle` once the rule decided).
"""

from __future__ import annotations

import numpy as np

from dflash2_trt.runtime.protocol import Draft
from dflash2_trt.vocabulary import PROPOSERS

DFLASH2, NGRAM, AUTO = PROPOSERS
NGRAM_ROWS = 4  # most lookup drafts per cycle by default (onnxruntime-genai's max_draft_tokens in our side-by-side runs)


def lookup(tokens: np.ndarray, rows: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """tokens [T] int64 (prompt + generated, the last one the anchor) -> up to ``rows`` tokens that followed
    the latest earlier occurrence of the longest suffix n-gram (max_n >= n >= min_n); [] when none."""
    T = tokens.shape[0]
    for n in range(min(max_n, T - 1), min_n - 1, -1):
        suffix = tokens[T - n:]
        # starts s < T - n with tokens[s:s+n] == suffix (the suffix itself excluded)
        hit = np.ones(T - n, dtype=bool)
        for i in range(n):
            hit &= tokens[i: T - n + i] == suffix[i]
        starts = np.flatnonzero(hit)
        if starts.size:
            s = int(starts[-1]) + n  # the continuation of the latest match
            return [int(t) for t in tokens[s: s + rows]]
    return []


def lookup_draft(drafts: list[int]) -> Draft:
    """A lookup's drafts as a :class:`~dflash2_trt.runtime.protocol.Draft`: deterministic, so a one-hot proposal
    (at T > 0 rejection sampling accepts draft i with probability p_i(d_i) and resamples from the residual)."""
    d = np.asarray(drafts, dtype=np.int64)  # [n]
    return Draft(tokens=d, proposal=np.ones((d.shape[0], 1), np.float32), cand=d[:, None])


def uses_drafter(proposer: str) -> bool:
    """Whether ``proposer`` runs the DFlash 2 drafter (every one but prompt lookup alone): known from the request,
    before its choice is made at the first token."""
    return proposer != NGRAM


def default_rows(draft_rows: int) -> int:
    """Most lookup drafts per cycle when not given: ``NGRAM_ROWS``, or the drafter's L = block size - 1 where larger
    (``draft_rows`` 0: no drafter)."""
    return max(draft_rows, NGRAM_ROWS)


class ProposerChoice:
    """One request's proposer state: the context so far and each proposer's measured acceptance."""

    def __init__(self, mode: str, prompt: list[int], ngram_rows: int, decay: float = 0.8) -> None:
        self.mode = mode  # of PROPOSERS: the request's, checked when it was built
        self.rows = int(ngram_rows)
        self.tokens = np.asarray(prompt, dtype=np.int64)
        self.decay = decay
        # tokens committed per cycle (accepted + 1), exponential mean; optimistic start so each gets tried
        self.rate = {DFLASH2: 2.0, NGRAM: 2.0}
        self.seconds: dict[str, float | None] = {DFLASH2: None, NGRAM: None}  # cycle time, exponential mean

    def extend(self, new: list[int]) -> None:
        if self.mode != DFLASH2:  # the drafter alone never looks the context up
            self.tokens = np.concatenate([self.tokens, np.asarray(new, dtype=np.int64)])

    @property
    def uses_drafter(self) -> bool:
        return uses_drafter(self.mode)

    def ngram(self, rows: int) -> list[int]:
        """Up to ``rows`` lookup drafts for the next cycle (the last token of the context is the anchor)."""
        return lookup(self.tokens, min(rows, self.rows)) if self.mode != DFLASH2 and rows > 0 else []

    def lookup_pays(self, t_plain: float | None) -> bool:
        """Whether a lookup cycle is expected to beat plain steps of ``t_plain`` seconds (True until both are
        measured)."""
        t = self.seconds[NGRAM]
        return t is None or t_plain is None or self.rate[NGRAM] / t >= 1.0 / t_plain

    def pick(self, drafts: list[int], t_plain: float | None = None, drafter: bool = True) -> str | None:
        """The proposer of the next cycle given the lookup's drafts, a plain step's measured time and whether the
        drafter may run (the acceptance guard's say); None: a plain step. :meth:`preferred`, then :meth:`settle`."""
        who = self.preferred(drafts, t_plain, drafter)
        self.settle(drafts, who)
        return who

    def preferred(self, drafts: list[int], t_plain: float | None = None, drafter: bool = True) -> str | None:
        """What :meth:`pick` would answer, changing nothing (the batch loop asks with and without the drafter
        before its rule decides, then settles the outcome)."""
        if self.mode == DFLASH2:
            return DFLASH2 if drafter else None
        use_drafter = drafter and self.mode == AUTO
        if drafts and self.lookup_pays(t_plain) and (not use_drafter or self.rate[NGRAM] >= self.rate[DFLASH2]):
            return NGRAM
        return DFLASH2 if use_drafter else None

    def settle(self, drafts: list[int], who: str | None) -> None:
        """The step's proposer was decided (None: a plain step): a lookup that had drafts and was not chosen drifts
        back to the prior, so a changed context gets another try."""
        if drafts and who != NGRAM:
            self.rate[NGRAM] += (1 - self.decay) / 4 * (2.0 - self.rate[NGRAM])

    def record(self, proposer: str, committed: int, seconds: float | None = None) -> None:
        self.rate[proposer] = self.decay * self.rate[proposer] + (1 - self.decay) * committed
        if seconds is not None:
            t = self.seconds[proposer]
            self.seconds[proposer] = seconds if t is None else self.decay * t + (1 - self.decay) * seconds
