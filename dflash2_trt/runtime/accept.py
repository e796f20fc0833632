"""The accept step, one function for both loops: the single loop (:mod:`dflash2_trt.runtime.decoder`) and the
batched loop (:mod:`dflash2_trt.runtime.batch`) call :func:`accept_drafts`, as the C core's loops call
``acceptDrafts`` (``runtime/src/core/decoder.cpp``); :func:`next_token` is the target's own token of a plain step
or a prefill (the C core's ``nextToken``). The rules themselves are the NumPy references
(:func:`dflash2_trt.acceptance.accept_greedy`, :func:`~dflash2_trt.acceptance.accept_rejection`), looked up at call
time so a test can plant a faulty rule. Given the sequence's :class:`~dflash2_trt.runtime.sampling.Sampler`, both
decide on the request's transformed target law (runtime/sampling.py) instead of the raw logits.
"""

from __future__ import annotations

import numpy as np

from dflash2_trt import acceptance
from dflash2_trt.runtime.protocol import Draft
from dflash2_trt.runtime.sampling import Sampler


def next_token(logits: np.ndarray, temperature: float, rng: np.random.Generator, sampler: Sampler | None = None
               ) -> int:
    """logits [V] -> argmax at T = 0, else a sample of softmax(logits / T) (one draw of ``rng``); with ``sampler``,
    of the transformed logits / law."""
    if sampler is not None:
        logits = sampler.logits(logits[None])[0]
    if temperature <= 0:
        return int(np.argmax(logits))
    p = acceptance.softmax_t(logits, temperature) if sampler is None else sampler.law(logits[None], temperature)[0]
    return int(rng.choice(p.shape[-1], p=p))


def proposal_in_vocab(draft: Draft, n_rows: int, vocab: int) -> np.ndarray:
    """q over the candidates scattered into the vocabulary: [n_rows, V] float64."""
    if draft.vocab_proposal is not None:
        return draft.vocab_proposal[:n_rows].astype(np.float64)
    q = np.zeros((n_rows, vocab), dtype=np.float32)
    np.put_along_axis(q, draft.cand[:n_rows], draft.proposal[:n_rows].astype(np.float32), axis=-1)
    return q.astype(np.float64)


def accept_drafts(draft: Draft, drafts: list[int], v_logits: np.ndarray, temperature: float,
                  rng: np.random.Generator, sampler: Sampler | None = None) -> tuple[int, int]:
    """accept: the drafts [n] against the verify logits [n + 1, V] of ``[anchor, d_1..d_n]`` -> (accepted, bonus
    token): greedy matching at T <= 0 (no draw), rejection sampling at T > 0 against the draft's proposal scattered
    into the vocabulary (its draws from ``rng``; a prompt lookup's draft is a one-hot proposal). With ``sampler``
    the target side is the transformed law, row i seeing the drafts before it; the proposal stays the one the
    drafts were drawn from (the draft's own)."""
    d = np.asarray(drafts, dtype=np.int64)  # [n]
    if sampler is not None:
        v_logits = sampler.logits(v_logits, d)  # [n+1, V]
    if temperature <= 0:
        return acceptance.accept_greedy(d, v_logits)
    p = (acceptance.softmax_t(v_logits, temperature) if sampler is None
         else sampler.law(v_logits, temperature))  # [n+1, V]
    q = proposal_in_vocab(draft, d.shape[0], p.shape[-1])  # [n, V]
    return acceptance.accept_rejection(d, q, p, rng)
