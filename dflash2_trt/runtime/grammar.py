"""Structured outputs under speculation: a request's grammar (:class:`GrammarSpec`, a field of
:class:`~dflash2_trt.runtime.request.GenerationRequest`) and its matcher over one decoding (:class:`Constraint`).

The engine is llguidance (``pip install 'dflash2-trt[grammar]'``): an Earley matcher over the target's tokenizer with
token masks as NumPy bitmasks and rollback, no torch (xgrammar's Python package requires torch, and its masks are
torch tensors); it also has a C ABI the C library can take later. On the demo's 49,152-token vocabulary a mask costs
a median of about 20 us on one CPU core.

What the loops call, in their order (both loops, each in one or two places):

* :func:`start`: the request's matcher; :func:`masked` / :func:`advance`: a prefill's or a plain step's logits masked
  by the matcher's state, its token then consumed;
* :func:`constrain_draft` (after draft, before verify): walks the proposed path with the matcher. Row t's
  candidates ``cand[t]`` are masked by the state after the drafts before it: at T = 0 a refused draft is replaced by
  the selector's best allowed candidate; at T > 0 the row's proposal q_t is renormalised over the allowed
  candidates (q'_t) and a refused draft redrawn from q'_t — the kept-or-redrawn draft is then distributed exactly as
  q'_t, which becomes the proposal rejection sampling is fed. A row with no allowed candidate cuts the path there.
  The walk leaves the matcher advanced by the drafts and returns one mask per verify row (the state before each
  row's token: n + 1 masks for n drafts);
* :func:`mask_rows`: the verify logits [n + 1, V] with refused tokens at -inf (the masked target law the accept step
  reads: greedy argmax or rejection sampling, unchanged);
* :func:`commit`: the matcher rolled back to the accepted length (n - accepted tokens) and advanced by the bonus.

Greedy constrained speculative output is therefore plain constrained output token for token (the accept step
compares with the masked argmax), and at T > 0 the law is the masked target's.

Importing this module needs only the standard library; llguidance is imported when a grammar is checked or a
matcher made (a missing extra is one DFlash2Error line).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash2_trt.errors import DFlash2Error

# JSON as json.dumps writes it: bounded whitespace, so a model cannot fill its budget with blanks (a schema's own
# "x-guidance" options override these)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# the kinds of grammar a request may carry (one vocabulary: the API, the server and the docs read it)
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise DFlash2Error("structured outputs need llguidance: pip install 'dflash2-trt[grammar]'") from None
    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar: ``kind`` of :data:`GRAMMAR_KINDS` and its ``text`` — a JSON schema (JSON text or a
    dict), nothing for ``json_object`` (any JSON object), a regular expression, or a Lark grammar (llguidance's
    EBNF dialect, GBNF-like; ``start`` is its first rule). Checked once, when built: the grammar must compile."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise DFlash2Error(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        t = self.text
        if self.kind == "json_schema" and isinstance(t, dict):
            t = json.dumps(t)
        if not isinstance(t, str):
            raise DFlash2Error(f"a {self.kind} grammar is text, got {type(t).__name__}")
        if self.kind == "json_schema":
            try:
                if not isinstance(json.loads(t), dict):
                    raise ValueError("not an object")
            except ValueError as e:
                raise DFlash2Error(f"json_schema must be a JSON object: {e}") from None
        elif self.kind in ("regex", "lark") and not t:
            raise DFlash2Error(f"a {self.kind} grammar cannot be empty")
        object.__setattr__(self, "text", t)
        try:
            is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(self.engine_grammar())
        except (ValueError, TypeError, RuntimeError) as e:
            is_error, messages = True, [str(e)]
        if is_error:
            raise DFlash2Error(f"{self.kind} grammar refused: {'; '.join(messages)[:300]}")

    def engine_grammar(self) -> str:
        """The grammar as llguidance's top-level grammar text."""
        m = _llguidance().LLMatcher
        try:
            if self.kind == "json_schema":
                return m.grammar_from_json_schema(self.text, defaults=JSON_STYLE)
            if self.kind == "json_object":
                return m.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_STYLE)
            if self.kind == "regex":
                return m.grammar_from_regex(self.text)
            return m.grammar_from_lark(self.text)
        except Exception as e:  # llguidance raises ValueError / its own on a grammar it cannot read
            raise DFlash2Error(f"{self.kind} grammar refused: {str(e)[:300]}") from None


class GrammarTokenizer:
    """The target's tokenizer as the matcher sees it (built once per model, ~0.5 s): ``tokenizer_json`` the
    ``tokenizers`` JSON text, ``vocab_size`` the logits' width V, ``eos_ids`` the tokens that end a finished
    grammar. Thread safety: immutable once built; matchers made from it are per request."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        llg = _llguidance()
        self.vocab_size = int(vocab_size)
        self.eos_ids = sorted(int(e) for e in eos_ids)
        self.lltok = llg.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids or None)

    def matcher(self, spec: GrammarSpec) -> Constraint:
        return Constraint(spec, self)


class Constraint:
    """One request's matcher: its state follows the committed tokens (the anchor included). Not thread safe: one
    decoding loop owns it."""

    def __init__(self, spec: GrammarSpec, tok: GrammarTokenizer) -> None:
        import numpy as np

        llg = _llguidance()
        self.m = llg.LLMatcher(tok.lltok, spec.engine_grammar(), log_level=0)
        if self.m.is_error():
            raise DFlash2Error(f"{spec.kind} grammar refused: {self.m.get_error()[:300]}")
        self.V = tok.vocab_size
        self.words = (self.V + 31) // 32
        self.eos = np.asarray(tok.eos_ids, dtype=np.int64)
        self.ended = 0  # end tokens taken after the matcher stopped (it stops once nothing but an end can follow)

    def mask(self) -> Any:
        """The allowed tokens of the matcher's state: [V] bool (a stopped matcher allows its EOS tokens)."""
        import numpy as np

        bits = np.full(self.words, -1, dtype=np.int32)  # [ceil(V / 32)] int32, bit i of word w = token 32 w + i
        self.m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.V].astype(bool)
        if not allowed.any():  # finished (or in error): only an end is possible
            allowed[self.eos] = True
        return allowed

    def consume(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.m.is_stopped() and t in self.eos:
                self.ended += 1
            elif not self.m.consume_token(int(t)):
                raise DFlash2Error(f"grammar matcher refused token {t}: {self.m.get_error()[:200]}")

    def rollback(self, n: int) -> None:
        k = min(n, self.ended)
        self.ended -= k
        n -= k
        if n > 0 and not self.m.rollback(int(n)):
            raise DFlash2Error(f"grammar matcher cannot roll back {n} tokens: {self.m.get_error()[:200]}")


def constrain_draft(constraint: Constraint, draft: Any, drafts: list[int], temperature: float,
                    rng: Any) -> tuple[Any, list[int], Any]:
    """The draft's path walked by the matcher -> (the draft with its masked proposal, the drafts to verify (cut
    at the first row with no allowed candidate, or after an end token), masks [n + 1, V] bool of the verify rows).
    The matcher is left advanced by the returned drafts (:func:`commit` rolls it back to the accepted length)."""
    import numpy as np

    cand = np.array(draft.cand)  # [L, K] int64 (a forced token may take a refused candidate's place)
    prop = np.array(draft.proposal, dtype=np.float64)  # [L, K]
    vocab_q = None if draft.vocab_proposal is None else np.array(draft.vocab_proposal, dtype=np.float64)  # [L, V]
    out: list[int] = []
    masks = [constraint.mask()]  # masks[t]: the state before draft t (= verify row t)
    for t, d in enumerate(drafts):
        allowed = masks[-1]
        only = np.flatnonzero(allowed)
        if only.size == 1 and vocab_q is None and only[0] not in cand[t]:
            # the grammar forces a token the drafter did not propose: it takes the last (refused) candidate's place
            # with a one-hot proposal; its masked target probability is 1, so it is always accepted
            cand[t, -1] = only[0]
            prop[t] = np.arange(cand.shape[1]) == cand.shape[1] - 1
        if vocab_q is not None:  # a proposal over the whole vocabulary (no selector)
            q = np.where(allowed, vocab_q[t], 0.0)
            tok = _keep_or_redraw(d, allowed, q, np.arange(q.shape[0]), temperature, rng, by_rank=None)
            if tok is not None:
                vocab_q[t] = q / q.sum() if temperature > 0 else (np.arange(q.shape[0]) == tok)
        else:
            ok = allowed[cand[t]]  # [K]
            q = np.where(ok, prop[t], 0.0)
            tok = _keep_or_redraw(d, allowed, q, cand[t], temperature, rng, by_rank=ok)
            if tok is not None:
                prop[t] = q / q.sum() if temperature > 0 else (cand[t] == tok)
        if tok is None:
            break
        out.append(tok)
        constraint.consume([tok])
        if tok in constraint.eos:  # nothing after an end is committed
            break
        masks.append(constraint.mask())
    if len(masks) == len(out):  # cut after an end token: its row's mask is never read past it
        masks.append(np.ones(constraint.V, dtype=bool))
    new = dataclasses.replace(draft, tokens=np.asarray(out + [0] * (len(cand) - len(out)), dtype=np.int64),
                              proposal=prop.astype(np.float32), cand=cand,
                              vocab_proposal=None if vocab_q is None else vocab_q.astype(np.float32))
    return new, out, np.stack(masks)


def _keep_or_redraw(d: int, allowed: Any, q: Any, ids: Any, temperature: float, rng: Any,
                    by_rank: Any) -> int | None:
    """Row's token: the draft when the grammar allows it; else at T = 0 the best-ranked allowed candidate
    (``by_rank`` [K] bool; candidates are sorted by the selector's unary score) or at T > 0 a draw from q
    renormalised; None when no candidate is allowed."""
    import numpy as np

    if allowed[d] and (temperature <= 0 or q[ids == d].sum() > 0 or by_rank is None):
        return int(d)
    if temperature <= 0:
        if by_rank is None:  # a whole-vocabulary proposal: its most probable allowed token
            return int(np.argmax(q)) if q.max() > 0 else None
        ranked = np.flatnonzero(by_rank)
        return int(ids[ranked[0]]) if ranked.size else None
    z = q.sum()
    if not z > 0:
        return None
    return int(ids[rng.choice(q.shape[0], p=q / z)])


def mask_rows(masks: Any, logits: Any) -> Any:
    """verify logits [n + 1, V] -> the same with refused tokens at -inf (masks [n + 1, V] bool)."""
    import numpy as np

    return np.where(masks[: logits.shape[0]], logits, -np.inf).astype(logits.dtype)


def commit(constraint: Constraint, n_drafts: int, accepted: int, bonus: int) -> None:
    """After acceptance: roll back the drafts not accepted, then advance by the bonus token."""
    constraint.rollback(n_drafts - accepted)
    if not constraint.ended:  # an accepted end token ends the output: the bonus after it is not committed
        constraint.consume([bonus])


def start(request: Any, tok: GrammarTokenizer | Callable[[], GrammarTokenizer] | None) -> Constraint | None:
    """The request's matcher (None without a grammar); ``tok``: the target's :class:`GrammarTokenizer`, which the
    entry point that owns the tokenizer hands the loop (or a function making it on first use)."""
    if request.grammar is None:
        return None
    if tok is not None and not isinstance(tok, GrammarTokenizer):
        tok = tok()
    if tok is None:
        raise DFlash2Error("a request with a grammar needs the target's tokenizer (GrammarTokenizer) in the loop")
    return tok.matcher(request.grammar)


def masked(constraint: Constraint | None, logits: Any) -> Any:
    """logits [V] of a prefill or plain step -> the same with the tokens the grammar refuses at -inf."""
    if constraint is None:
        return logits
    import numpy as np

    return np.where(constraint.mask(), logits, -np.inf).astype(logits.dtype)


def advance(constraint: Constraint | None, tokens: list[int]) -> None:
    """The matcher follows committed tokens of a prefill or plain step."""
    if constraint is not None:
        constraint.consume(tokens)
