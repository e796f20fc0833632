"""The public Python front door: ``dflash2_trt.load(model_dir) -> Generator``.

    import dflash2_trt

    with dflash2_trt.load("my-export") as gen:           # a `dflash2 export` folder; TensorRT, else ONNX Runtime
        r = gen.generate("Write a haiku about GPUs.", max_new_tokens=64)
        print(r.text, r.stats.tau, r.stats.tokens_per_s)
        for chunk in gen.stream("Count to five.", max_new_tokens=32):
            print(chunk.text, end="", flush=True)

A ``str`` prompt is a user message rendered with the target's chat template (``chat=False``, or a tokenizer
without a template: the raw text); a ``list[int]`` prompt is used as it is. The option arguments of
:meth:`Generator.generate`, :meth:`~Generator.stream` and :meth:`~Generator.submit` (their defaults are the
record's) build one :class:`~dflash2_trt.runtime.request.GenerationRequest`, validated once against this model's
limits (vocabulary, positions, draft modes) before anything runs; or pass a record built elsewhere as
``request=`` (the server and the Triton model do) and no option argument. Greedy output (T = 0) is
token for token the target's own; T > 0 samples with lossless rejection sampling. ``seed=None`` draws a
fresh seed; equal seeds give equal tokens with ``guard=False`` (the acceptance guard decides from measured
timings, so with it on a seed fixes the sampling law, not the tokens). The record's other fields — the sampling
transforms (``top_p``, ``top_k``, ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``,
``logit_bias``) and ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` — are keyword arguments of the same names
(:mod:`dflash2_trt.runtime.sampling`); the logprobs come back in ``Result.logprobs`` / ``Chunk.logprobs``.

Many requests at once (servers): :meth:`Generator.submit` queues a request from any thread and returns a
:class:`Handle` at once (a bad request raises :class:`~dflash2_trt.errors.DFlash2Error` there and is never
queued); one background thread per Generator decodes every submitted request in one continuous batch
(:mod:`dflash2_trt.runtime.batch`: sequences join and leave between steps, up to ``max_batch`` at a time, the
rest wait in arrival order). Iterating a handle streams its :class:`Chunk` s as the shared loop commits them;
``handle.cancel()`` frees its slot before it returns (within one batch step); ``handle.result()`` waits for the
:class:`Result`. Each request drafts with its own ``proposer`` (the drafter, prompt lookup or ``auto``, as
:meth:`Generator.generate`). :meth:`Generator.generate_batch` is submit + result for a list of prompts;
:meth:`Generator.set_batching` sets ``max_batch``, whether drafting is load-adaptive and the prefill chunk.
Batching needs a backend whose ``batching`` is on (:class:`~dflash2_trt.runtime.protocol.Backend`; today the fused
ONNX Runtime target, the ``ort`` backend on the CPU); on other backends the same loop serves the submitted requests
one after another.

Thread safety: a :class:`Generator` owns one backend. ``generate`` / ``stream`` decode one request at a time on
their own runners, serialised by a lock (a second call waits for the first, including a stream being
iterated); the batch loop has its own runners and runs beside them. Every method may be called from any
thread. ``close()`` (or the ``with`` block) stops the loop (requests still in it fail with DFlash2Error) and
frees the backend; a closed Generator raises :class:`~dflash2_trt.errors.DFlash2Error`.

The CLI's ``generate`` / ``bench`` / ``demo``, the Triton model and ``benchmarks/`` decode through this
module. Importing it needs only the standard library; the runtime (numpy, onnxruntime or TensorRT) is imported
by :func:`load`, never torch.
"""

from __future__ import annotations

import atexit
import dataclasses
import numbers
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.prefix_cache import DEFAULT_BUDGET_BYTES, PrefixCache, check_budget
from dflash2_trt.runtime.batch import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_SHARE
from dflash2_trt.runtime.request import GenerationRequest, Limits
from dflash2_trt.vocabulary import DEFAULT_PROPOSER

__all__ = ["Chunk", "Generator", "Handle", "Result", "Stats", "Stream", "load"]

Prompt = str | list[int] | list[dict[str, str]]  # a user message, token ids, or chat messages
# EOS, max_new_tokens, the export's cache capacity, Handle.cancel()
FINISH_REASONS = ("stop", "length", "capacity", "cancelled")


@dataclass(frozen=True)
class Stats:
    """One request's decoding figures (docs/design.md)."""

    tau: float  # tokens committed per speculative cycle (accepted drafts + 1), pooled over the cycles; 0: none
    cycles: int  # speculative cycles (draft + verify)
    acceptance: list[float]  # [L] r_i: fraction of cycles (verifying >= i rows) that accepted >= i drafts
    acceptance_conditional: list[float]  # [L] c_i = r_i / r_{i-1}
    plain_steps: int  # plain target steps the acceptance guard ran instead of cycles
    tokens_per_s: float  # generated tokens / decode time (prefill included; oracle passes excluded)
    elapsed_s: float
    accepted: list[int]  # per cycle: drafts accepted
    verified: list[int]  # per cycle: draft rows verified
    oracle_tau: float | None = None  # oracle top-K τ, when an ``oracle`` hook measured it
    oracle_accepted: list[int] = field(default_factory=list)  # per cycle, when measured
    guard_switches: int = 0  # speculative -> plain switches of the acceptance guard
    guard_probes: int = 0  # plain -> speculative probes
    proposers: list[str] = field(default_factory=list)  # per cycle: who proposed (dflash2_trt.vocabulary.PROPOSERS)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of computed

    @classmethod
    def of(cls, res: Any) -> Stats:
        """The figures of a :class:`dflash2_trt.runtime.decoder.GenerationResult`."""
        s = res.stats()
        return cls(tau=s["tau"], cycles=s["cycles"], acceptance=list(s["per_position_cumulative"]),
                   acceptance_conditional=list(s["per_position_conditional"]), plain_steps=res.plain_steps,
                   tokens_per_s=res.tokens_per_s, elapsed_s=res.elapsed_s, accepted=list(res.accepted),
                   verified=list(res.proposed), oracle_tau=s["oracle_tau"], oracle_accepted=list(res.oracle_accepted),
                   guard_switches=res.guard_switches, guard_probes=res.guard_probes,
                   proposers=list(res.proposers), cached_tokens=res.cached_tokens)


@dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]  # generated ids (an EOS that ended the request included)
    prompt_tokens: list[int]
    stats: Stats
    finish_reason: str  # one of FINISH_REASONS
    # one TokenLogprob (runtime/sampling.py: token, logprob, top) per generated token when the request asked for
    # logprobs, per prompt token from the second on when it asked for prompt_logprobs; else empty
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)


@dataclass(frozen=True)
class Chunk:
    """What one step committed: the prefill's first token, a plain step's token, or a cycle's accepted drafts
    plus the target's bonus token."""

    text: str  # the text these tokens add (empty while a UTF-8 character is split; it follows with the next)
    tokens: list[int]
    accepted: int | None  # drafts accepted in the cycle; None for the first token and plain steps
    logprobs: list = field(default_factory=list)  # one TokenLogprob per token, when the request asked for logprobs


class _TextDelta:
    """Incremental detokenisation: the text each chunk adds, never taking back what was sent."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.ids, self.sent = decode, [], ""

    def add(self, new: list[int], final: bool = False) -> str:
        self.ids.extend(new)
        full = self.decode(self.ids)
        if (not final and full.endswith("\ufffd")) or not full.startswith(self.sent):
            return ""
        delta, self.sent = full[len(self.sent):], full
        return delta


class _Cancelled(Exception):
    """Raised from the decode loop's callback when a stream's consumer went away."""


# the record's defaults, which the option arguments below repeat (test_api checks that they agree)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationRequest) if f.init}


class Generator:
    """A loaded export: ``generate``, ``stream``, ``close``. Build it with :func:`load`."""

    def __init__(self, backend: Any, tokenizer: Any, note: str = "",
                 prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        """``backend``: a :class:`~dflash2_trt.runtime.protocol.Backend` (the Generator owns and closes it);
        ``tokenizer``: :class:`~dflash2_trt.runtime.tokenizer.TextTokenizer` or one with its methods;
        ``prefix_cache_bytes``: the prefix cache's budget (0: none; a backend without one has none)."""
        self._backend = backend
        # finished sequences the next requests start from (generate, stream and the batch loop share it)
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if backend.prefix_cache and prefix_cache_bytes else None
        self._tok = tokenizer
        self._note = note  # how the backend was chosen, e.g. "TensorRT not available (...), using ONNX Runtime"
        self._lock = threading.Lock()  # generate / stream: one request at a time on the runners below
        self._init_lock = threading.Lock()  # creating the B = 1 target runner; starting / replacing the loop
        self._target: Any = None
        self._drafters: dict[str, Any] = {}
        self._loop: _BatchLoop | None = None  # submit's background loop, started by the first submit
        self._max_batch, self._adaptive = 8, True  # set_batching's
        self._prefill: tuple[int | None, float | None] = (DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_SHARE)
        self._batch_sizes: dict[int, int] = {}  # sequences decoded in one batch step -> steps (written by the loop)
        self._closed = False

    # -- properties -----------------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """What decodes, e.g. ``ONNX Runtime (CPUExecutionProvider)``."""
        return str(self._backend.description)

    @property
    def note(self) -> str:
        """How the backend was chosen and, for ONNX Runtime, which path runs (:attr:`op_library`), e.g.
        ``TensorRT not available (...), using ONNX Runtime (CPUExecutionProvider); op library
        .../libdflash2_ort_ops.so: 64 nodes (DecodeAttention 30, ...)``."""
        lib = self.op_library
        return f"{self._note}; {lib}" if lib and self._note else self._note or lib

    @property
    def op_library(self) -> str:
        """ONNX Runtime: the custom-op library, where it was loaded from and the nodes it runs (the target graph
        is opened to count them), or its absence and its cost (``op library not found (...): the plain ONNX Runtime
        graph, ~2x slower here; ...``); "" for other backends."""
        return str(self._backend.op_library())

    @property
    def weight_codes(self) -> dict[str, int]:
        """ONNX Runtime with the panels: the loaded graphs' PanelMatMul kernels by the exact code their weights fit
        (``affine4``, ``scaled8``, ``fp16``, ``bf16``; ``none``: fp32 weights; plugins/ortDecodeAttention/README.md);
        empty for other backends."""
        return dict(self._backend.panel_codes())

    @property
    def max_positions(self) -> int:
        """Prompt + generated tokens the export's caches hold."""
        return int(self._runner().max_positions)

    @property
    def selectors(self) -> tuple[str, ...]:
        """Draft modes this model can run (of :data:`dflash2_trt.vocabulary.DRAFT_MODES`)."""
        return tuple(self._backend.draft_modes)

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (:class:`~dflash2_trt.runtime.tokenizer.TextTokenizer`: ``chat_template``,
        ``apply_chat_template(messages, tools=...)``)."""
        return self._tok

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def check_selector(self, selector: str) -> str:
        """``selector`` when this model can draft with it, else :class:`DFlash2Error` naming the choices."""
        return str(self._backend.check_draft_mode(selector))

    # -- text ------------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """A prompt as the ids :meth:`generate` decodes from: a ``str`` is a user message rendered with the chat
        template (the raw text with ``chat=False`` or without a template); a list of ``{"role", "content"}``
        messages is rendered with the template; a list of ints is used as it is."""
        if isinstance(prompt, str):
            if chat and self._tok.chat_template:
                return self._tok.apply_chat_template([{"role": "user", "content": prompt}])
            return self._tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if not self._tok.chat_template:
                raise DFlash2Error("chat messages need a chat template; this tokenizer has none")
            return self._tok.apply_chat_template(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise DFlash2Error(f"prompt must be a str, a list of chat messages or a list of token ids, got "
                               f"{type(prompt).__name__}")
        # an id is an integer (numpy's too), never a float or a bool that int() would silently truncate
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise DFlash2Error(f"prompt token ids must be integers, got {bad[0]!r}")
        return [int(t) for t in prompt]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    # -- decoding --------------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0,
                 seed: int | None = None, selector: str = "greedy", guard: bool = True, *, chat: bool = True,
                 min_confidence: float = 0.0, speculative: bool = True, eos_ids: set[int] | None = None,
                 proposer: str = DEFAULT_PROPOSER, oracle: Any = None,
                 request: GenerationRequest | None = None, **sampling: Any) -> Result:
        """Decode one prompt. ``selector``: a draft mode of :attr:`selectors` (the record's ``draft_mode``);
        ``guard``: run plain target steps while measured acceptance does not pay; ``speculative=False``: plain
        autoregressive decoding on the same backend (the baseline); ``proposer``: who drafts — ``dflash2`` (the
        drafter), ``ngram`` (prompt lookup: continuations of the context's last n-gram where it occurred before; no
        match = a plain step) or ``auto``, the default (per cycle, the one whose measured acceptance is higher);
        ``eos_ids``: stop tokens (default: the target's; an empty set never stops early); ``oracle``: an evaluation
        hook counting oracle top-K acceptance per cycle (:func:`dflash2_trt.bench.oracle.oracle_count`), its passes
        excluded from the timing; ``request``: the options as one record instead of the arguments; ``sampling``: the
        record's other fields by name (``top_p``, ``logit_bias``, ``logprobs``, ...)."""
        ids, req = self._prepare(prompt, chat, request, max_new_tokens=max_new_tokens, temperature=temperature,
                                 seed=seed, draft_mode=selector, guard=guard, min_confidence=min_confidence,
                                 speculative=speculative, eos_ids=eos_ids, proposer=proposer, **sampling)
        with self._lock:
            res = self._run(ids, req, oracle, None)
        return self._result(ids, req, res)

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0,
               seed: int | None = None, selector: str = "greedy", guard: bool = True, *, chat: bool = True,
               min_confidence: float = 0.0, eos_ids: set[int] | None = None, proposer: str = DEFAULT_PROPOSER,
               oracle: Any = None, request: GenerationRequest | None = None, **sampling: Any) -> Stream:
        """Decode one prompt chunk by chunk (same arguments and tokens as :meth:`generate`): iterate the returned
        :class:`Stream` for :class:`Chunk` s; its ``result`` is the :class:`Result` once the iteration ended.
        Leaving the loop early (``break``, or ``close()``) stops the decoding at its next step. A bad request
        raises DFlash2Error here."""
        ids, req = self._prepare(prompt, chat, request, max_new_tokens=max_new_tokens, temperature=temperature,
                                 seed=seed, draft_mode=selector, guard=guard, min_confidence=min_confidence,
                                 eos_ids=eos_ids, proposer=proposer, **sampling)
        return Stream(self, ids, req, oracle)

    def submit(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0, seed: int | None = None,
               selector: str = "greedy", *, chat: bool = True, speculative: bool = True,
               eos_ids: set[int] | None = None, proposer: str = DEFAULT_PROPOSER,
               request: GenerationRequest | None = None, **sampling: Any) -> Handle:
        """Queue one prompt for the background batch loop (see the module docstring) -> its :class:`Handle`;
        returns at once. Arguments as :meth:`generate`; ``speculative``: may draft while the loop's rule says it
        pays (with ``set_batching(adaptive=False)``: every step; on a backend without batching the acceptance guard
        is that rule: the record's ``guard`` is the loop's ``adaptive``); ``proposer``: who drafts for this request,
        as in :meth:`generate` (requests of different proposers share the loop's steps). A bad request raises
        DFlash2Error here and nothing is queued. Each sequence's greedy tokens are its own :meth:`generate` tokens;
        its ``Stats.proposers`` say who proposed each cycle."""
        return self._submit(*self._prepare(prompt, chat, request, batch=True, max_new_tokens=max_new_tokens,
                                           temperature=temperature, seed=seed, draft_mode=selector,
                                           speculative=speculative, eos_ids=eos_ids, proposer=proposer, **sampling))

    def generate_batch(self, prompts: list[Prompt], max_new_tokens: int | list[int] = 128,
                       temperature: float | list[float] = 0.0, seed: int | None | list[int | None] = None,
                       selector: str = "greedy", *, chat: bool = True, speculative: bool = True,
                       eos_ids: set[int] | None = None, max_batch: int | None = None,
                       adaptive: bool | None = None, proposer: str | list[str] = DEFAULT_PROPOSER,
                       **sampling: Any) -> list[Result]:
        """Decode many prompts together: :meth:`submit` each (every prompt checked before any is queued), then
        wait for the results (in prompt order). ``max_new_tokens`` / ``temperature`` / ``seed`` / ``proposer``: one
        value for all, or one per prompt; ``max_batch`` / ``adaptive``: :meth:`set_batching` first (None: keep the
        loop's).
        Each sequence's tokens are its own :meth:`generate` tokens at T = 0 (and, at T > 0 with
        ``speculative=False``, its ``generate(..., speculative=False)`` tokens for the same seed).
        ``Stats.elapsed_s`` is a sequence's time from joining the batch to finishing."""
        n = len(prompts)
        if max_batch is not None or adaptive is not None:
            self.set_batching(self._max_batch if max_batch is None else max_batch,
                              self._adaptive if adaptive is None else adaptive)
        if not n:
            return []

        def per(v: Any, what: str) -> list:
            if isinstance(v, (list, tuple)):
                if len(v) != n:
                    raise DFlash2Error(f"{what}: {len(v)} values for {n} prompts")
                return list(v)
            return [v] * n

        reqs = [self._prepare(p, chat, None, batch=True, max_new_tokens=m, temperature=t, seed=s,
                              draft_mode=selector, speculative=speculative, eos_ids=eos_ids, proposer=w, **sampling)
                for p, m, t, s, w in zip(prompts, per(max_new_tokens, "max_new_tokens"),
                                         per(temperature, "temperature"), per(seed, "seed"), per(proposer, "proposer"))]
        handles: list[Handle] = []
        try:
            for ids, r in reqs:
                handles.append(self._submit(ids, r))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return [h.result() for h in handles]

    def set_batching(self, max_batch: int = 8, adaptive: bool = True,
                     prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                     prefill_share: float | None = DEFAULT_PREFILL_SHARE) -> None:
        """The batch loop's settings: ``max_batch`` sequences decoded together (more wait for a slot);
        ``adaptive``: a sequence drafts only while the load-adaptive rule of :mod:`dflash2_trt.runtime.batch`
        says it pays (False: every speculative sequence drafts every step); ``prefill_chunk``: at most this many prompt
        rows computed in one step over all joining prompts while others decode (running streams wait one chunk, not
        a whole prompt; None: no cap); ``prefill_share``: fewer rows where they are measured dear, those whose
        forward takes about share × the decoding step (None: ``prefill_chunk`` rows; both None: whole prompts).
        Needs no request in flight (DFlash2Error otherwise) when they change; the loop then restarts with fresh
        measured costs."""
        from dflash2_trt.runtime.batch import check_batch_size, check_prefill_chunk, check_prefill_share

        check_batch_size(max_batch)
        prefill = check_prefill_chunk(prefill_chunk), check_prefill_share(prefill_share)
        with self._init_lock:
            if self._closed:
                raise DFlash2Error("this Generator is closed")
            if (max_batch, bool(adaptive), prefill) == (self._max_batch, self._adaptive, self._prefill):
                return  # the loop keeps its runners and measured costs
            if self._loop is not None:
                if not self._loop.idle:
                    raise DFlash2Error("set_batching needs the batch loop idle; requests are in flight")
                self._loop.close()
                self._loop = None
            self._max_batch, self._adaptive, self._prefill = max_batch, bool(adaptive), prefill

    @property
    def batch_sizes(self) -> dict[int, int]:
        """{sequences decoded together in one batch step: steps} of the batch loop, since the Generator opened."""
        return dict(self._batch_sizes)

    def close(self) -> None:
        """Free the backend (sessions, engines, device memory); idempotent."""
        with self._init_lock:
            loop, self._loop = self._loop, None
            closing = not self._closed
            self._closed = True
        if loop is not None:
            loop.close()  # requests still in it fail with DFlash2Error
        if closing:
            with self._lock:
                self._target, self._drafters = None, {}
                self._backend.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------------------
    def _runner(self) -> Any:
        if self._closed:
            raise DFlash2Error("this Generator is closed")
        if self._target is None:
            with self._init_lock:
                if self._target is None:
                    self._target = self._backend.target_runner()
        return self._target

    def _drafter(self, selector: str) -> Any:
        if selector not in self._drafters:
            self._drafters[selector] = self._backend.draft_runner(selector)  # checks the mode against the export
        return self._drafters[selector]

    def _prepare(self, prompt: Prompt, chat: bool, request: GenerationRequest | None, batch: bool = False,
                 **options: Any) -> tuple[list[int], GenerationRequest]:
        """(prompt ids, the request validated against this model's limits): the record built from ``options``
        (argument names = its fields), or ``request`` when given (then every option at its default). ``batch``: for
        the batch loop, whose ``adaptive`` setting is the guard of a request it serves without batching."""
        unknown = sorted(set(options) - set(_DEFAULTS))
        if unknown:
            raise DFlash2Error(f"unknown option {unknown[0]!r} (the GenerationRequest fields are "
                               f"{', '.join(sorted(_DEFAULTS))})")
        if request is None:
            request = GenerationRequest(**options)
        elif not isinstance(request, GenerationRequest):
            raise DFlash2Error(f"request must be a GenerationRequest, got {type(request).__name__}")
        else:
            given = sorted(k for k, v in options.items() if v != _DEFAULTS[k])
            if given:
                raise DFlash2Error(f"give the options as arguments or as request=, not both ({', '.join(given)})")
        if batch and request.guard != self._adaptive:
            request = dataclasses.replace(request, guard=self._adaptive)
        ids = self.encode(prompt, chat)
        whole_blocks = batch and bool(self._backend.batching)  # the batched loop verifies whole blocks
        return ids, request.validate(ids, Limits.of(self._runner(), self.selectors, whole_blocks))

    def _submit(self, prompt: list[int], req: GenerationRequest) -> Handle:
        with self._init_lock:
            if self._closed:
                raise DFlash2Error("this Generator is closed")
            if self._loop is None:
                self._loop = _BatchLoop(self, self._max_batch, self._adaptive)
            h = Handle(self._loop, prompt, req)
            self._loop.put(h)
        return h

    def _run(self, prompt: list[int], req: GenerationRequest, oracle: Any,
             hooks: tuple[Callable, Callable] | None) -> Any:
        """One request (validated for ``prompt``) on this Generator's runners; the caller holds the lock."""
        from dflash2_trt.runtime import decoder as D

        target = self._runner()
        on_tokens, on_cycle, on_logprobs = (*hooks, None)[:3] if hooks else (None, None, None)
        gtok = self.grammar_tokenizer() if req.grammar is not None else None
        if not req.speculative:
            return D.target_generate(target, prompt, req, on_tokens=on_tokens, cache=self.prefix_cache,
                                     on_logprobs=on_logprobs, grammar_tokenizer=gtok)
        hooks_ = D.DecodeHooks(on_tokens, on_cycle, oracle, on_logprobs=on_logprobs, grammar=gtok)
        return D.speculative_generate(target, self._drafter(req.draft_mode), prompt, req, hooks_, self.prefix_cache)

    def grammar_tokenizer(self) -> Any:
        """The target's tokenizer as the grammar matcher sees it (:class:`~dflash2_trt.runtime.grammar.GrammarTokenizer`,
        built on first use and kept)."""
        target = self._runner()
        with self._init_lock:
            if getattr(self, "_gtok", None) is None:
                from dflash2_trt.runtime.grammar import GrammarTokenizer

                self._gtok = GrammarTokenizer(self._tok.tok.to_str(), target.vocab_size, sorted(target.eos_ids))
            return self._gtok

    def _result(self, prompt: list[int], req: GenerationRequest, res: Any) -> Result:
        eos = self._target.eos_ids if req.eos_ids is None else req.eos_ids
        if res.tokens and res.tokens[-1] in eos:
            reason = "stop"
        elif len(res.tokens) >= req.max_new_tokens:
            reason = "length"
        else:
            reason = "capacity"
        return Result(self._tok.decode(res.tokens), list(res.tokens), list(res.prompt_tokens), Stats.of(res), reason,
                      list(res.logprobs), list(res.prompt_logprobs))


_OPEN_STREAMS: weakref.WeakSet = weakref.WeakSet()  # the chunk iterators of streams not yet closed


@atexit.register
def _close_open_streams() -> None:
    """At interpreter exit, stop the decoding of streams still referenced (``s = g.stream(...)`` left early): a
    worker thread inside a native session while the interpreter tears down aborts the process."""
    for it in list(_OPEN_STREAMS):
        try:
            it.close()
        except ValueError:  # being iterated by another thread at exit: nothing to do from here
            pass


class Stream:
    """The chunks of one request being decoded (from :meth:`Generator.stream`): iterate it once; ``result`` is
    the request's :class:`Result` after the last chunk (None before, or when the stream was closed early).
    The decoding runs in a worker thread holding the Generator's lock; ``close()`` (also on leaving a ``for``
    loop early, garbage collection or interpreter exit) stops it at its next step and waits for it.

    The chunk iterator holds no reference to its Stream (the result goes through a one-item list): a ``for``
    loop over ``g.stream(...)`` that breaks drops the last reference at once, which closes the iterator then —
    with a cycle it would wait for the garbage collector, at exit for a worker thread torn down mid-session."""

    def __init__(self, gen: Generator, prompt: list[int], req: GenerationRequest, oracle: Any = None) -> None:
        self._result: list[Result] = []
        self._it = _stream_chunks(gen, prompt, req, oracle, self._result)
        _OPEN_STREAMS.add(self._it)

    @property
    def result(self) -> Result | None:
        return self._result[0] if self._result else None

    def __iter__(self) -> Iterator[Chunk]:
        return self._it

    def __next__(self) -> Chunk:
        return next(self._it)

    def close(self) -> None:
        self._it.close()


def _stream_chunks(gen: Generator, prompt: list[int], req: GenerationRequest, oracle: Any,
                   result: list[Result]) -> Iterator[Chunk]:
    """The chunks of a :class:`Stream`; ``result`` gets its Result after the last one."""
    chunks: queue.Queue = queue.Queue(maxsize=64)
    stop = threading.Event()
    delta = _TextDelta(gen._tok.decode)
    cycle: list[int | None] = [None]
    logprobs: list[list] = [[]]  # the next chunk's
    done: list[Any] = []

    def on_cycle(accepted: int, rows: int) -> None:
        cycle[0] = accepted

    def on_logprobs(lps: list) -> None:
        logprobs[0] = list(lps)

    def on_tokens(new: list[int]) -> None:
        if stop.is_set():
            raise _Cancelled
        chunks.put(Chunk(delta.add(new), list(new), cycle[0], logprobs[0]))
        cycle[0], logprobs[0] = None, []

    def work() -> None:
        try:
            with gen._lock:
                done.append(gen._run(prompt, req, oracle, (on_tokens, on_cycle, on_logprobs)))
            chunks.put(None)
        except _Cancelled:
            chunks.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            chunks.put(e)

    worker = threading.Thread(target=work, name="dflash2-stream", daemon=True)
    worker.start()
    try:
        while True:
            item = chunks.get()
            if item is None:
                tail = delta.add([], final=True)
                if done:
                    result.append(gen._result(prompt, req, done[0]))
                if tail:
                    yield Chunk(tail, [], None)
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # unblock a producer waiting on a full queue, then let it finish
            try:
                chunks.get(timeout=0.05)
            except queue.Empty:
                pass
        worker.join()


_END = object()  # a Handle's last queue item


class Handle:
    """One request of :meth:`Generator.submit`. Iterate it (from any one thread) for its :class:`Chunk` s as the
    batch loop commits them (the prefill's first token, then each plain step's token or cycle's tokens; the
    iteration ends when the request finished and raises its error if it failed); ``result()`` waits for its
    :class:`Result`; ``cancel()`` stops it. Chunks queue without bound until read (a slow reader never stalls
    the batch; they are at most ``max_new_tokens`` tokens)."""

    def __init__(self, loop: _BatchLoop, prompt: list[int], req: GenerationRequest) -> None:
        self._loop, self._prompt, self._req = loop, prompt, req
        self._chunks: queue.Queue = queue.Queue()  # Chunk ..., then _END
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._result: Result | None = None
        self._error: BaseException | None = None
        # the loop's bookkeeping (its thread only)
        self._delta = _TextDelta(loop.gen._tok.decode)
        self._tokens: list[int] = []  # sent so far
        self._cycles = 0  # cycles already reported
        self._stopped = False  # the loop took it out on cancel() (a request that finished first keeps its reason)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def prompt_tokens(self) -> list[int]:
        return list(self._prompt)

    def __iter__(self) -> Iterator[Chunk]:
        return (c for c in self.chunks() if c is not None)

    def chunks(self, poll: float | None = None) -> Iterator[Chunk | None]:
        """The chunks; with ``poll`` seconds it also yields None whenever none came for that long (a server
        checks whether its client is still there)."""
        while True:
            try:
                item = self._chunks.get(timeout=poll)
            except queue.Empty:
                yield None
                continue
            if item is _END:
                self._chunks.put(_END)  # a second iteration ends too
                if self._error is not None:
                    raise self._error
                return
            yield item

    def result(self, timeout: float | None = None) -> Result:
        """The request's Result once it finished (``finish_reason`` 'cancelled' after :meth:`cancel`: the tokens
        made until then); its DFlash2Error if it failed."""
        if not self._done.wait(timeout):
            raise DFlash2Error(f"the request did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def cancel(self, wait: bool = True) -> None:
        """Stop decoding this request and free its slot; returns once that is done (within one batch step), or at
        once with ``wait=False`` (the loop frees the slot after the step under way). No effect on a finished
        request."""
        if not self._done.is_set():
            self._cancel.set()
            self._loop.wake()
            if wait:
                self._done.wait()

    # -- the loop's side ---------------------------------------------------------------------------------
    def _emit(self, tokens: list[int], accepted: int | None, logprobs: list | None = None) -> None:
        self._tokens.extend(tokens)
        self._chunks.put(Chunk(self._delta.add(tokens), list(tokens), accepted, list(logprobs or [])))

    def _finish(self, result: Result | None, error: BaseException | None = None) -> None:
        if result is not None:
            tail = self._delta.add([], final=True)
            if tail:
                self._chunks.put(Chunk(tail, [], None))
            if self._stopped:
                result = dataclasses.replace(result, finish_reason="cancelled")
        self._result, self._error = result, error
        self._chunks.put(_END)
        self._done.set()


class _BatchLoop:
    """The background thread behind :meth:`Generator.submit`: one :class:`~dflash2_trt.runtime.batch.BatchDecoder`
    per draft mode asked for (its own batched target runner and batched drafter of ``max_batch`` slots; requests of
    one mode share steps), stepped in turn while any is busy. Between steps it takes in submitted handles and applies
    cancellations; after each step it hands every sequence's new tokens to its handle. A step that raises fails
    the requests of that decoder (DFlash2Error) and drops it; the others go on. Backends without ``batching``
    serve the queued requests one after another through :meth:`Generator._run` (under the Generator's lock)."""

    def __init__(self, gen: Generator, max_batch: int, adaptive: bool) -> None:
        self.gen, self.max_batch, self.adaptive = gen, max_batch, adaptive
        self.batched = bool(gen._backend.batching)
        self._cond = threading.Condition()
        self._inbox: deque[Handle] = deque()  # submitted, not yet taken in (under _cond)
        self._pending = 0  # handles not finished (under _cond)
        self._closed = False
        self._decoders: dict[str, Any] = {}  # draft mode -> BatchDecoder (loop thread only, as below)
        self._live: dict[str, dict[int, Handle]] = {}  # draft mode -> decoder's request id -> handle
        self._serial: deque[Handle] = deque()  # unbatched backends: taken in, not yet served
        self._thread = threading.Thread(target=self._main, name="dflash2-batch", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._pending == 0

    def put(self, h: Handle) -> None:
        with self._cond:
            if self._closed:
                raise DFlash2Error("this Generator is closed")
            self._inbox.append(h)
            self._pending += 1
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # -- the thread ----------------------------------------------------------------------------------------
    def _main(self) -> None:
        why: BaseException = DFlash2Error("this Generator was closed while the request was in flight")
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._inbox or self._serial
                               or any(d.busy for d in self._decoders.values())):
                        self._cond.wait()
                    if self._closed:
                        break
                self._take_inbox()
                if self.batched:
                    self._cancel_asked()
                    self._step()
                else:
                    self._serve_one()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop: every request gets it, none hangs
            why = DFlash2Error(f"the batch loop failed: {type(e).__name__}: {e}")
        with self._cond:
            self._closed = True
            left = list(self._inbox) + list(self._serial) + [h for live in self._live.values() for h in live.values()]
            self._inbox.clear()
        for h in left:
            self._done(h, None, why)

    def _done(self, h: Handle, res: Any, error: BaseException | None = None) -> None:
        h._finish(None if res is None else self.gen._result(h._prompt, h._req, res), error)
        with self._cond:
            self._pending -= 1

    def _take_inbox(self) -> None:
        with self._cond:
            new = list(self._inbox)
            self._inbox.clear()
        for h in new:
            self._take(h)

    def _take(self, h: Handle) -> None:
        if not self.batched:
            self._serial.append(h)
            return
        from dflash2_trt.runtime import batch as B

        mode = h._req.draft_mode
        try:
            dec = self._decoders.get(mode)
            if dec is None:
                be = self.gen._backend
                dec = B.BatchDecoder(be.batch_target_runner(self.max_batch), None,
                                     B.SpeculationRule(adaptive=self.adaptive),
                                     batched_drafter=lambda n: be.batch_draft_runner(mode, n),
                                     cache=self.gen.prefix_cache, prefill_chunk=self.gen._prefill[0],
                                     prefill_share=self.gen._prefill[1],
                                     grammar_tokenizer=self.gen.grammar_tokenizer)
                self._decoders[mode], self._live[mode] = dec, {}
            i = dec.submit(h._prompt, h._req)
        except DFlash2Error as e:  # checked in submit already; whatever is left fails this request alone
            self._done(h, None, e)
            return
        self._live[mode][i] = h

    def _cancel_asked(self) -> None:
        for mode, live in self._live.items():
            asked = [i for i, h in live.items() if h._cancel.is_set()]
            for i in asked:
                live[i]._stopped = True
                self._decoders[mode].cancel(i)
            if asked:
                self._deliver(mode)

    def _step(self) -> None:
        for mode, dec in list(self._decoders.items()):
            if not dec.busy:
                continue
            try:
                dec.step()
            except Exception as e:  # noqa: BLE001 - fails this decoder's requests, not the loop
                err = DFlash2Error(f"batch step failed: {type(e).__name__}: {e}")
                for h in self._live.pop(mode).values():
                    self._done(h, None, err)
                del self._decoders[mode]
                continue
            self._deliver(mode)

    def _deliver(self, mode: str) -> None:
        """Each sequence's tokens committed since the last delivery -> chunks; finished ones -> results."""
        dec, live = self._decoders[mode], self._live[mode]
        stepped = 0
        for i, h in list(live.items()):
            fin = dec.results.pop(i, None)  # popped: a long-running loop keeps no finished results
            res = fin if fin is not None else dec.in_flight(i)
            if res is None:  # still waiting for a slot
                continue
            new = res.tokens[len(h._tokens):]
            if new:
                stepped += 1
                if not h._tokens:  # the prefill's first token is a chunk of its own
                    h._emit(new[:1], None, res.logprobs[:1])
                    new = new[1:]
            if new:  # one plain step's token or one cycle's tokens (a step runs one or the other)
                cycled = len(res.accepted) > h._cycles
                h._cycles = len(res.accepted)
                n = len(h._tokens)
                h._emit(new, res.accepted[-1] if cycled else None, res.logprobs[n: n + len(new)])
            if fin is not None:
                del live[i]
                self._done(h, fin)
        if stepped:  # a new dict each time: Generator.batch_sizes copies it from other threads
            self.gen._batch_sizes = {**self.gen._batch_sizes, stepped: self.gen._batch_sizes.get(stepped, 0) + 1}

    def _drop_cancelled_serial(self) -> None:
        """Queued requests of an unbatched backend whose cancel() waits: finished now, not after those before."""
        from dflash2_trt.runtime.decoder import GenerationResult

        for h in [h for h in self._serial if h._cancel.is_set()]:
            self._serial.remove(h)
            h._stopped = True
            self._done(h, GenerationResult(prompt_tokens=list(h._prompt)))

    def _serve_one(self) -> None:
        from dflash2_trt.runtime.decoder import GenerationResult

        self._drop_cancelled_serial()
        if not self._serial:
            return
        h = self._serial.popleft()
        cycle: list[int | None] = [None]
        logprobs: list[list] = [[]]  # the next chunk's

        def on_cycle(accepted: int, rows: int) -> None:
            cycle[0] = accepted

        def on_logprobs(lps: list) -> None:
            logprobs[0] = list(lps)

        def on_tokens(new: list[int]) -> None:
            if h._cancel.is_set():
                raise _Cancelled
            h._emit(new, cycle[0], logprobs[0])
            cycle[0], logprobs[0] = None, []
            self._take_inbox()
            self._drop_cancelled_serial()

        try:
            with self.gen._lock:
                res = self.gen._run(h._prompt, h._req, None, (on_tokens, on_cycle, on_logprobs))
        except _Cancelled:
            h._stopped = True
            res = GenerationResult(prompt_tokens=list(h._prompt), tokens=list(h._tokens))
        except Exception as e:  # noqa: BLE001 - fails this request, not the loop
            self._done(h, None, e if isinstance(e, DFlash2Error) else
                       DFlash2Error(f"decoding failed: {type(e).__name__}: {e}"))
            return
        self._done(h, res)


def load(model_dir: str | Path, backend: str = "auto", threads: int | None = None,
         verify_checksums: bool = True, *, spinning: bool | None = None, panels: bool | None = None,
         weight_codes: bool = True, prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES) -> Generator:
    """Open a ``dflash2 export`` folder. ``backend``: ``auto`` (TensorRT when it can run here, else ONNX
    Runtime; :attr:`Generator.note` says which and why), ``trt`` or ``ort``; ``verify_checksums``: check every file
    against the manifest. ONNX Runtime's options (the TensorRT backend has none of them):

    * ``threads``: intra-op threads (default: ONNX Runtime's);
    * ``spinning``: the target session's workers spin between ops (the default; the drafter's never do) — False on
      a CPU shared with other work (several servers or Triton instances on one machine), where spinning workers
      slow everyone; None: ``$DFLASH2_ORT_SPINNING``, else True;
    * ``panels``: swap the fused target's and the drafter's MatMuls for the custom-op library's
      ``dflash2.PanelMatMul`` (True) or keep ONNX Runtime's (False); None: ``$DFLASH2_ORT_PANELS``, else where the
      panel kernels run AVX-512 (docs/onnxruntime.md);
    * ``weight_codes``: the panel kernels read a matrix as its exact weight code where one reproduces every weight
      (4-bit affine, 8-bit, fp16, bf16: :attr:`Generator.weight_codes`; the same numbers, fewer bytes); False: from
      the fp32 weights.

    None of them changes a token: they choose how the same numbers are computed. Nor does ``prefix_cache_bytes``:
    the budget of the prefix cache (default 1 GiB; 0: none) — a request whose prompt begins with a finished
    sequence's tokens restores that prefix instead of computing it (:attr:`Stats.cached_tokens`); ONNX Runtime
    only."""
    from dflash2_trt.manifest import export_folder
    from dflash2_trt.runtime.backends import open_backend
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise DFlash2Error(f"threads must be an integer >= 1 or None, got {threads!r}")
    for key, v in (("spinning", spinning), ("panels", panels)):
        if v is not None and not isinstance(v, bool):
            raise DFlash2Error(f"{key} must be True, False or None, got {v!r}")
    if not isinstance(weight_codes, bool):
        raise DFlash2Error(f"weight_codes must be True or False, got {weight_codes!r}")
    export_folder(model_dir)  # not an export: say so before the tokenizer's files are looked for
    tok = TextTokenizer(model_dir)  # before the backend: a folder without a tokenizer fails cheaply
    check_budget(prefix_cache_bytes)  # a bad budget fails before the backend loads
    be, note = open_backend(model_dir, backend, verify_checksums=verify_checksums, threads=threads, spinning=spinning,
                            panels=panels, weight_codes=weight_codes)
    return Generator(be, tok, note, prefix_cache_bytes)
