"""The sampling transforms of one sequence: the target's logits rows -> the law its tokens are drawn from, and the
log-probabilities it reports.

One fixed order (vLLM's): logit bias, penalties (repetition, then frequency, then
presence, over the prompt + the committed tokens; a verify row also sees the drafts before it as committed),
temperature, top-k, top-p, min-p. :class:`Sampler` holds what the penalties count and is called by the accept step
(:mod:`dflash2_trt.runtime.accept`) for every plain step, prefill and verify row of both loops, so the output is the
transformed target's own at T = 0 (the argmax of the biased and penalised logits; top-k / top-p / min-p keep the
argmax) and in law at T > 0 (rejection sampling against the transformed law ``p``, fed the proposal ``q`` the drafts
were really drawn from).

Drafts: where the draft mode samples each row on its own over the vocabulary (``independent``: the draft carries
its full proposal), :meth:`Sampler.redraw` draws the drafts again from that proposal under the same transforms
(logit bias, presence / frequency penalties over the committed tokens, top-k, top-p, min-p; the repetition
penalty needs the raw logits' signs and is left out) with the drafter's own uniforms, and hands the acceptance
that transformed ``q`` — a draft outside the target's top-p is then never proposed. A selector's path (greedy /
viterbi) is drawn inside its graph; its own ``q`` is what the acceptance gets.

Logprobs are the target's after the transforms: log of the law above, at temperature 1 when the request is greedy
(a token cut by top-k / top-p / min-p has -inf and is never listed among the top ones).

NumPy only. A sampler holds one sequence's counts: one per sequence, not thread safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash2_trt import acceptance
from dflash2_trt.runtime.protocol import Draft
from dflash2_trt.runtime.request import GenerationRequest


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted (or prompt) token's log-probability under the transformed target law, and the ``top`` most
    likely tokens of its row with theirs (``top_logprobs`` of them, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def truncate(p: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """p [m, V] probabilities -> the same rows after top-k, top-p and min-p, renormalised (float64). Ties at the
    top-k boundary are kept; top-p keeps the tokens (by descending probability, index order among ties) whose
    mass before them is < top_p, so the most likely token always stays."""
    p = np.asarray(p, dtype=np.float64)
    keep = np.ones(p.shape, dtype=bool)
    V = p.shape[-1]
    if 0 < top_k < V:
        kth = -np.partition(-p, top_k - 1, axis=-1)[:, top_k - 1: top_k]  # [m, 1]
        keep &= p >= kth
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q = q / q.sum(-1, keepdims=True)
        order = np.argsort(-q, axis=-1, kind="stable")  # [m, V]
        sq = np.take_along_axis(q, order, -1)
        before = np.cumsum(sq, -1) - sq  # [m, V] mass of the tokens ranked above
        kept = np.zeros_like(keep)
        np.put_along_axis(kept, order, before < top_p, -1)
        keep &= kept
    if min_p > 0.0:
        keep &= p >= min_p * np.max(np.where(keep, p, 0.0), -1, keepdims=True)
    out = np.where(keep, p, 0.0)
    return out / out.sum(-1, keepdims=True)


class Sampler:
    """One sequence's transforms: what the penalties count (the prompt and every committed token), the request's
    bias, and the logprobs of the tokens committed so far (``logprobs``: one :class:`TokenLogprob` each, when the
    request asks for them). The accept step calls :meth:`logits` / :meth:`law` on the rows it decides with; the
    loop calls :meth:`commit` with each chunk of tokens those rows emitted (row j -> token j)."""

    def __init__(self, request: GenerationRequest, prompt: list[int], vocab: int) -> None:
        r = self.r = request
        self.vocab = vocab
        self.penalised = r.repetition_penalty != 1.0 or r.presence_penalty != 0.0 or r.frequency_penalty != 0.0
        self.truncated = r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0
        self.bias: np.ndarray | None = None  # [V] float64
        if r.logit_bias:
            self.bias = np.zeros(vocab, dtype=np.float64)
            for t, b in r.logit_bias:
                self.bias[t] = b
        self.counts = np.bincount(np.asarray(prompt, dtype=np.int64), minlength=vocab) if self.penalised else None
        self.logprobs: list[TokenLogprob] = []
        self._rows: np.ndarray | None = None  # [m, V] the transformed logits of the last decision

    @property
    def identity(self) -> bool:
        """No transform: the target's logits as they are (the loops' numbers unchanged to the bit)."""
        return self.bias is None and not self.penalised and not self.truncated

    # -- the transforms ---------------------------------------------------------------------------------------
    def _penalise(self, row: np.ndarray, counts: np.ndarray) -> None:
        """row [V] float64 in place: repetition, frequency, presence over the tokens ``counts`` [V] has seen."""
        r = self.r
        seen = np.flatnonzero(counts)
        if r.repetition_penalty != 1.0:
            x = row[seen]
            row[seen] = np.where(x > 0, x / r.repetition_penalty, x * r.repetition_penalty)
        row[seen] -= r.frequency_penalty * counts[seen] + r.presence_penalty

    def logits(self, rows: np.ndarray, drafts: list[int] | np.ndarray = ()) -> np.ndarray:
        """rows [m, V] of the target -> [m, V] after the logit bias and the penalties; row i sees the committed
        tokens and ``drafts[:i]`` (the verify rows of ``[anchor, d_1..]``). Kept for :meth:`commit`'s logprobs."""
        if self.bias is None and not self.penalised:
            out = rows
        else:
            out = rows.astype(np.float64)
            if self.bias is not None:
                out += self.bias
            if self.penalised:
                assert self.counts is not None
                c = self.counts.copy()
                for i in range(out.shape[0]):
                    if i:
                        c[int(drafts[i - 1])] += 1
                    self._penalise(out[i], c)
        self._rows = out
        return out

    def law(self, logits: np.ndarray, temperature: float) -> np.ndarray:
        """Transformed logits [m, V] (of :meth:`logits`) -> the law [m, V] float64: softmax at ``temperature``,
        then top-k, top-p, min-p."""
        p = acceptance.softmax_t(logits, temperature)
        return truncate(p, self.r.top_k, self.r.top_p, self.r.min_p) if self.truncated else p

    def redraw(self, draft: Draft, uniforms: np.ndarray | None, n_rows: int) -> Draft:
        """A draft whose rows were each sampled on their own over the vocabulary (``vocab_proposal`` [L, V], drawn
        by inverse CDF with ``uniforms`` [1, L]) -> its first ``n_rows`` drawn again, with the same uniforms, from
        that proposal under the transforms; the returned draft carries the law it was drawn from. Any other draft
        (a selector's path, a prompt lookup, greedy) is returned as it is."""
        q = draft.vocab_proposal
        if q is None or uniforms is None or self.identity or n_rows <= 0:
            return draft
        w = np.asarray(q[:n_rows], dtype=np.float64)  # [n, V]
        if self.bias is not None or self.penalised:
            shift = np.zeros(self.vocab) if self.bias is None else self.bias.copy()
            if self.counts is not None:  # presence / frequency: shifts of the logits, so factors of q
                shift -= self.r.frequency_penalty * self.counts + self.r.presence_penalty * (self.counts > 0)
            w = w * np.exp((shift - shift.max()) / self._temperature)
        w = w / w.sum(-1, keepdims=True)
        if self.truncated:
            w = truncate(w, self.r.top_k, self.r.top_p, self.r.min_p)
        u = np.asarray(uniforms, dtype=np.float64).reshape(-1)[:n_rows]
        tok = np.minimum((np.cumsum(w, -1) <= u[:, None]).sum(-1), self.vocab - 1).astype(np.int64)
        vq = np.array(q, dtype=np.float32, copy=True)
        vq[:n_rows] = w
        tokens = np.array(draft.tokens, copy=True)
        tokens[:n_rows] = tok
        return Draft(tokens=tokens, proposal=np.take_along_axis(vq, draft.cand, -1), cand=draft.cand,
                     vocab_proposal=vq, confidence=draft.confidence)

    @property
    def _temperature(self) -> float:
        return self.r.temperature if self.r.temperature > 0 else 1.0

    # -- committing -------------------------------------------------------------------------------------------
    def commit(self, tokens: list[int]) -> None:
        """Tokens emitted by the rows of the last decision (row j -> token j) are committed: the penalties count
        them, and their logprobs join :attr:`logprobs` when the request asks for them."""
        if self.r.logprobs and tokens:
            assert self._rows is not None, "commit before a decision"
            self.logprobs.extend(self.token_logprobs(self._rows[: len(tokens)], tokens))
        if self.counts is not None:
            np.add.at(self.counts, np.asarray(tokens, dtype=np.int64), 1)
        self._rows = None

    def token_logprobs(self, logits: np.ndarray, tokens: list[int]) -> list[TokenLogprob]:
        """Transformed logits [m, V] and the m tokens they emitted -> each token's logprob and its row's top
        ``top_logprobs`` (log of :meth:`law`, at temperature 1 for a greedy request)."""
        with np.errstate(divide="ignore"):
            lp = np.log(self.law(logits, self._temperature))  # [m, V]
        n = self.r.top_logprobs
        out = []
        for row, t in zip(lp, tokens):
            top: tuple[tuple[int, float], ...] = ()
            if n:
                idx = np.argsort(-row, kind="stable")[:n]
                top = tuple((int(i), float(row[i])) for i in idx if np.isfinite(row[i]))
            out.append(TokenLogprob(int(t), float(row[int(t)]), top))
        return out

    def prompt_logprobs(self, prompt: list[int], rows: np.ndarray) -> list[TokenLogprob]:
        """The prompt's tokens 1.. with their logprobs from the prefill's rows [n, V] (row i predicts token i + 1),
        each row seeing the prompt before it (the penalties count from the first token on); token 0 has no row and
        is not listed."""
        if len(prompt) < 2:
            return []
        saved = self.counts
        if self.penalised:
            self.counts = np.bincount(np.asarray(prompt[:1], dtype=np.int64), minlength=self.vocab)
        try:
            logits = self.logits(rows[: len(prompt) - 1], prompt[1:])
            return self.token_logprobs(logits, prompt[1:])
        finally:
            self.counts, self._rows = saved, None
