"""One request's options: :class:`GenerationRequest`, the one record every entry point builds and every loop reads.

The Python API (:mod:`dflash2_trt.api`), the OpenAI server (:mod:`dflash2_trt.serving.http.protocol`), the Triton model
and the CLI build it; the single loop (:func:`~dflash2_trt.runtime.decoder.speculative_generate`,
:func:`~dflash2_trt.runtime.decoder.target_generate`) and the batched loop
(:meth:`~dflash2_trt.runtime.batch.BatchDecoder.submit`) read it. It is checked in two steps, each written once:

* **fields** — building the record checks every field alone (types and ranges); a record that exists is well formed;
* **limits** — :meth:`GenerationRequest.validate` checks it against one prompt and the limits a backend exposes
  (:class:`Limits`: vocabulary, positions, draft modes) and returns the record the loops run: ``max_new_tokens``
  resolved, stamped as checked for that prompt and those limits. A loop given a stamped record does not check it
  again; given an unstamped one (a direct caller) it validates it itself.

Field names are those of the C library's generation options (``runtime/include/dflash2/dflash2.h``) where it has
the option; ``min_confidence`` exists only here. Defaults are the Python API's (``docs/python-api.md``); the C
library's differ where its header says so (``max_new_tokens`` 64, ``guard`` false).

Adding an option: a field here with its check in ``__post_init__``, the loop that reads it, and its test; the
entry points pass it through (the API's keyword arguments name the fields).

Standard library only: the API, the server and the Triton model import it before any runtime is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.grammar import GrammarSpec
from dflash2_trt.vocabulary import DEFAULT_PROPOSER, DRAFT_MODES, PROPOSERS, check_draft_mode


# the record's scalar sampling transforms as the interfaces without keyword arguments pass them (the Triton model's
# optional inputs, the CLI's flags: --top-p ...): field name -> its Python type (the record checks the values)
SAMPLING_SCALARS: dict[str, type] = {"top_p": float, "top_k": int, "min_p": float, "presence_penalty": float,
                                     "frequency_penalty": float, "repetition_penalty": float}


class _HasLimits(Protocol):
    vocab_size: int
    max_positions: int


@dataclass(frozen=True)
class Limits:
    """What a backend and a loop let a request ask for: token ids in [0, ``vocab_size``), prompt + generated tokens
    within ``max_positions`` (the caches' capacity), a draft mode of ``draft_modes`` (None: not checked here — the
    drafter the caller passes is the mode); ``whole_blocks``: the loop verifies whole blocks (the batched loop), so
    ``min_confidence`` must be 0."""

    vocab_size: int
    max_positions: int
    draft_modes: tuple[str, ...] | None = None
    whole_blocks: bool = False

    @classmethod
    def of(cls, runner: _HasLimits, draft_modes: tuple[str, ...] | None = None, whole_blocks: bool = False
           ) -> Limits:
        """The limits of a target runner (B = 1 or batched: both expose ``vocab_size`` and ``max_positions``)."""
        return cls(int(runner.vocab_size), int(runner.max_positions), draft_modes, whole_blocks)


def _integer(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One request's options (checked when built; :meth:`validate` checks them against a prompt and a backend)."""

    # -- limits
    max_new_tokens: int | None = 128  # tokens to generate at most (>= 1); None: as many as the caches hold
    eos_ids: frozenset[int] | None = None  # stop tokens; None: the target's; empty: never stop early
    # -- sampling
    temperature: float = 0.0  # 0: greedy (the target's argmax); > 0: lossless rejection sampling
    seed: int | None = None  # the request's random stream (>= 0); None: a fresh one, drawn when the record is built
    # the sampling transforms (runtime/sampling.py), applied to the target's logits in this order: logit_bias,
    # repetition / presence / frequency penalties (over the prompt + committed tokens), temperature, top_k, top_p,
    # min_p; their neutral values change nothing
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added logit in [-100, 100]); a mapping is accepted
    repetition_penalty: float = 1.0  # > 0; a seen token's logit divided by it when positive, multiplied otherwise
    presence_penalty: float = 0.0  # in [-2, 2]; subtracted from the logit of every seen token
    frequency_penalty: float = 0.0  # in [-2, 2]; subtracted once per occurrence of a seen token
    top_k: int = 0  # keep the k most likely tokens (>= 0; 0 or -1: all)
    top_p: float = 1.0  # in (0, 1]; keep the smallest most-likely set of probability >= top_p
    min_p: float = 0.0  # in [0, 1]; keep the tokens of probability >= min_p x the largest
    # -- logprobs (the target's, after the transforms)
    logprobs: bool = False  # each generated token's log-probability
    top_logprobs: int = 0  # in [0, 20]: the most likely tokens of each row with theirs (needs logprobs)
    prompt_logprobs: bool = False  # each prompt token's log-probability too (computes every prompt row: no cache)
    # -- speculation
    speculative: bool = True  # False: plain autoregressive decoding of the target (the baseline)
    draft_mode: str = "greedy"  # the drafter head (of vocabulary.DRAFT_MODES); the API's ``selector``
    proposer: str = DEFAULT_PROPOSER  # who drafts: 'dflash2' (the drafter), 'ngram' (prompt lookup) or 'auto'
    ngram_rows: int | None = None  # most prompt-lookup drafts per cycle; None: max(4, the drafter's rows)
    guard: bool = True  # B = 1: plain target steps while measured acceptance does not pay (runtime/guard.py)
    min_confidence: float = 0.0  # B = 1: verify only the leading rows whose cumulative confidence reaches it
    # -- structured output
    grammar: GrammarSpec | None = None  # the output's grammar (runtime/grammar.py: JSON schema, regex, Lark); None: free
    # the (prompt ids, limits) validate() checked this record against; not an option
    _checked: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m = self.max_new_tokens
        if m is not None and not (_integer(m) and m >= 1):
            raise DFlash2Error(f"max_new_tokens must be an integer >= 1, got {m!r}")
        t = self.temperature
        if not (_number(t) and math.isfinite(t) and t >= 0):
            raise DFlash2Error(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        s = self.seed
        if s is not None and not (_integer(s) and s >= 0):
            raise DFlash2Error(f"seed must be an integer >= 0 or None, got {s!r}")
        if self.draft_mode not in DRAFT_MODES:
            raise DFlash2Error(f"draft mode must be one of {', '.join(DRAFT_MODES)}, got {self.draft_mode!r}")
        if self.proposer not in PROPOSERS:
            raise DFlash2Error(f"proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")
        r = self.ngram_rows
        if r is not None and not (_integer(r) and r >= 1):
            raise DFlash2Error(f"ngram_rows must be an integer >= 1 or None, got {r!r}")
        c = self.min_confidence
        if not (_number(c) and 0.0 <= c <= 1.0):  # `not <=` also refuses NaN
            raise DFlash2Error(f"min_confidence must be in [0, 1], got {c!r}")
        sampling = _check_sampling(self)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise DFlash2Error(f"grammar must be a GrammarSpec or None, got {type(self.grammar).__name__}")
        eos = self.eos_ids
        if eos is not None:
            if isinstance(eos, (str, bytes)) or not isinstance(eos, Iterable) or not all(_integer(e) for e in eos):
                raise DFlash2Error(f"eos_ids must be a collection of token ids or None, got {eos!r}")
            eos = frozenset(int(e) for e in eos)
        # normalised in place (the record is frozen): plain Python types, a drawn seed
        put = object.__setattr__
        put(self, "max_new_tokens", None if m is None else int(m))
        put(self, "temperature", float(t))
        put(self, "seed", secrets.randbits(63) if s is None else int(s))
        put(self, "speculative", bool(self.speculative))
        put(self, "guard", bool(self.guard))
        put(self, "ngram_rows", None if r is None else int(r))
        put(self, "min_confidence", float(c))
        put(self, "eos_ids", eos)
        for k, v in sampling.items():
            put(self, k, v)

    def validate(self, prompt: list[int], limits: Limits) -> GenerationRequest:
        """This request against ``prompt`` (token ids) and a backend's ``limits`` -> the record the loops run
        (``max_new_tokens`` resolved: None becomes the room the caches leave); DFlash2Error when the prompt is empty,
        holds an id outside the vocabulary, does not leave room for one generated token, the draft mode is not
        one of ``limits.draft_modes``, or ``min_confidence`` > 0 for a loop of ``whole_blocks``. A record already
        validated for this prompt and these limits is returned as it is (the loops call this at their entry; an
        entry point that validated first is not checked twice)."""
        key = (tuple(prompt), limits.vocab_size, limits.max_positions)
        if (self._checked == key and (limits.draft_modes is None or self.draft_mode in limits.draft_modes)
                and not (limits.whole_blocks and self.min_confidence > 0)):
            return self
        check_limits(self, prompt, limits)
        out = self
        if self.max_new_tokens is None:
            out = dataclasses.replace(self, max_new_tokens=limits.max_positions - len(prompt))
        object.__setattr__(out, "_checked", key)
        return out


def check_limits(request: GenerationRequest, prompt: list[int], limits: Limits) -> None:
    """The limits step of :meth:`GenerationRequest.validate` (a module function: tests count its calls)."""
    if not prompt:
        raise DFlash2Error("empty prompt")
    bad = [t for t in prompt if not 0 <= int(t) < limits.vocab_size]
    if bad:
        raise DFlash2Error(f"prompt token id {bad[0]} out of range [0, {limits.vocab_size})")
    if len(prompt) + 1 > limits.max_positions:
        raise DFlash2Error(f"prompt of {len(prompt)} tokens does not fit the {limits.max_positions} positions "
                           f"available (the target's maximum, or the --max-seq-len of an export)")
    bad = [t for t, _ in request.logit_bias if t >= limits.vocab_size]
    if bad:
        raise DFlash2Error(f"logit_bias token id {bad[0]} out of range [0, {limits.vocab_size})")
    if limits.draft_modes is not None:
        check_draft_mode(request.draft_mode, limits.draft_modes, "this export")
    if limits.whole_blocks and request.min_confidence > 0:
        raise DFlash2Error(f"min_confidence must be 0 for the batched loop (it verifies whole blocks), got "
                           f"{request.min_confidence}")


def _check_sampling(r: GenerationRequest) -> dict[str, Any]:
    """The sampling transforms' and logprobs' fields checked -> their normalised values (plain Python types; the
    logit bias as sorted (id, bias) pairs, its ids checked against the vocabulary by :func:`check_limits`)."""
    def real(name: str, ok: Any, allowed: str) -> float:
        v = getattr(r, name)
        if not (_number(v) and math.isfinite(v) and ok(v)):
            raise DFlash2Error(f"{name} must be {allowed}, got {v!r}")
        return float(v)

    out: dict[str, Any] = {
        "repetition_penalty": real("repetition_penalty", lambda v: v > 0, "a number > 0 (1: off)"),
        "presence_penalty": real("presence_penalty", lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        "frequency_penalty": real("frequency_penalty", lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        "top_p": real("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "min_p": real("min_p", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    }
    k = r.top_k
    if not (_integer(k) and k >= -1):
        raise DFlash2Error(f"top_k must be an integer >= 0 (0 or -1: all tokens), got {k!r}")
    out["top_k"] = max(0, int(k))
    n = r.top_logprobs
    if not (_integer(n) and 0 <= n <= 20):
        raise DFlash2Error(f"top_logprobs must be an integer in [0, 20], got {n!r}")
    if n and not r.logprobs:
        raise DFlash2Error("top_logprobs needs logprobs=True")
    out.update(top_logprobs=int(n), logprobs=bool(r.logprobs), prompt_logprobs=bool(r.prompt_logprobs))
    bias = r.logit_bias
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise DFlash2Error(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    clean: dict[int, float] = {}
    for t, b in pairs:
        if isinstance(t, str) and t.strip().isdigit():  # JSON object keys are strings
            t = int(t)
        if not (_integer(t) and t >= 0):
            raise DFlash2Error(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
        if not (_number(b) and -100 <= b <= 100):  # `not <=` also refuses NaN
            raise DFlash2Error(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        clean[int(t)] = float(b)
    out["logit_bias"] = tuple(sorted(clean.items()))
    return out
