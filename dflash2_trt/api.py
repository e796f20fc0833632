"""The public Python front door: ``dflash2_trt.load(model_dir) -> Generator``.

    import dflash2_trt

    with dflash2_trt.load("my-export") as gen:           # a `dflash2 export` folder; TensorRT, else ONNX Runtime
        r = gen.generate("Write a haiku about GPUs.", max_new_tokens=64)
        print(r.text, r.stats.tau, r.stats.tokens_per_s)
        for chunk in gen.stream("Count to five.", max_new_tokens=32):
            print(chunk.text, end="", flush=True)

A ``str`` prompt is a user message rendered with the target's chat template (``chat=False``, or a tokenizer
without a template: the raw text); a ``list[int]`` prompt is used as it is. Greedy output (T = 0) is
token for token the target's own; T > 0 samples with lossless rejection sampling. ``seed=None`` draws a
fresh seed; equal seeds give equal tokens with ``guard=False`` (the acceptance guard decides from measured
timings, so with it on a seed fixes the sampling law, not the tokens).

Thread safety: a :class:`Generator` owns one backend and one request's caches; its methods may be called from
any thread and are serialised by a lock (a second call waits for the first, including a stream being
iterated). For requests in parallel open one Generator per worker. ``close()`` (or the ``with`` block) frees
the backend; a closed Generator raises :class:`~dflash2_trt.errors.DFlash2Error`.

The CLI's ``generate`` / ``bench`` / ``demo``, the Triton model and ``benchmarks/`` decode through this
module. Importing it needs only the standard library; the runtime (numpy, onnxruntime or TensorRT) is imported
by :func:`load`, never torch.
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.vocabulary import DEFAULT_PROPOSER, PROPOSERS

__all__ = ["Chunk", "Generator", "Result", "Stats", "Stream", "load"]

Prompt = str | list[int] | list[dict[str, str]]  # a user message, token ids, or chat messages
FINISH_REASONS = ("stop", "length", "capacity")  # EOS, max_new_tokens, the export's cache capacity


@dataclass(frozen=True)
class Stats:
    """One request's decoding figures (SPEC §4)."""

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

    @classmethod
    def of(cls, res: Any) -> Stats:
        """The figures of a :class:`dflash2_trt.runtime.decoder.GenerationResult`."""
        s = res.stats()
        return cls(tau=s["tau"], cycles=s["cycles"], acceptance=list(s["per_position_cumulative"]),
                   acceptance_conditional=list(s["per_position_conditional"]), plain_steps=res.plain_steps,
                   tokens_per_s=res.tokens_per_s, elapsed_s=res.elapsed_s, accepted=list(res.accepted),
                   verified=list(res.proposed), oracle_tau=s["oracle_tau"], oracle_accepted=list(res.oracle_accepted),
                   guard_switches=res.guard_switches, guard_probes=res.guard_probes,
                   proposers=list(res.proposers))


@dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]  # generated ids (an EOS that ended the request included)
    prompt_tokens: list[int]
    stats: Stats
    finish_reason: str  # one of FINISH_REASONS


@dataclass(frozen=True)
class Chunk:
    """What one step committed: the prefill's first token, a plain step's token, or a cycle's accepted drafts
    plus the target's bonus token."""

    text: str  # the text these tokens add (empty while a UTF-8 character is split; it follows with the next)
    tokens: list[int]
    accepted: int | None  # drafts accepted in the cycle; None for the first token and plain steps


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


@dataclass
class _Request:
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    seed: int
    selector: str
    guard: bool
    min_confidence: float
    speculative: bool
    eos_ids: set[int] | None
    oracle: Any = None
    proposer: str = DEFAULT_PROPOSER


class Generator:
    """A loaded export: ``generate``, ``stream``, ``close``. Build it with :func:`load`."""

    def __init__(self, backend: Any, tokenizer: Any, note: str = "") -> None:
        """``backend``: a :class:`~dflash2_trt.runtime.protocol.Backend` (the Generator owns and closes it);
        ``tokenizer``: :class:`~dflash2_trt.runtime.tokenizer.TextTokenizer` or one with its methods."""
        self._backend = backend
        self._tok = tokenizer
        self.note = note  # how the backend was chosen, e.g. "TensorRT not available (...), using ONNX Runtime"
        self._lock = threading.Lock()
        self._target: Any = None
        self._drafters: dict[str, Any] = {}
        self._batched: dict[int, Any] = {}  # slots -> the batched target runner of generate_batch (at most one)
        self._closed = False

    # -- properties -----------------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """What decodes, e.g. ``ONNX Runtime (CPUExecutionProvider)``."""
        return str(self._backend.description)

    @property
    def max_positions(self) -> int:
        """Prompt + generated tokens the export's caches hold."""
        return int(self._runner().max_positions)

    @property
    def selectors(self) -> tuple[str, ...]:
        """Draft modes this model can run (of :data:`dflash2_trt.vocabulary.DRAFT_MODES`)."""
        return tuple(self._backend.draft_modes)

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
        try:
            return [int(t) for t in prompt]  # type: ignore[union-attr]
        except (TypeError, ValueError):
            raise DFlash2Error("prompt must be a str, a list of chat messages or a list of token ids") from None

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    # -- decoding --------------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0,
                 seed: int | None = None, selector: str = "greedy", guard: bool = True, *, chat: bool = True,
                 min_confidence: float = 0.0, speculative: bool = True, eos_ids: set[int] | None = None,
                 proposer: str = DEFAULT_PROPOSER, oracle: Any = None) -> Result:
        """Decode one prompt. ``selector``: a draft mode of :attr:`selectors`; ``guard``: run plain target steps
        while measured acceptance does not pay; ``speculative=False``: plain autoregressive decoding on the same
        backend (the baseline); ``proposer``: who drafts — ``dflash2`` (the drafter), ``ngram`` (prompt lookup:
        continuations of the context's last n-gram where it occurred before; no match = a plain step) or
        ``auto``, the default (per cycle, the one whose measured acceptance is higher); ``eos_ids``: stop tokens (default: the target's; an empty set never stops
        early); ``oracle``: an evaluation hook counting oracle top-K acceptance per cycle
        (:func:`dflash2_trt.bench.oracle.oracle_count`), its passes excluded from the timing."""
        req = self._request(prompt, max_new_tokens, temperature, seed, selector, guard, chat, min_confidence,
                            speculative, eos_ids, oracle, proposer)
        with self._lock:
            res = self._run(req, None)
        return self._result(req, res)

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0,
               seed: int | None = None, selector: str = "greedy", guard: bool = True, *, chat: bool = True,
               min_confidence: float = 0.0, eos_ids: set[int] | None = None, proposer: str = DEFAULT_PROPOSER,
               oracle: Any = None) -> Stream:
        """Decode one prompt chunk by chunk (same arguments and tokens as :meth:`generate`): iterate the returned
        :class:`Stream` for :class:`Chunk` s; its ``result`` is the :class:`Result` once the iteration ended.
        Leaving the loop early (``break``, or ``close()``) stops the decoding at its next step."""
        req = self._request(prompt, max_new_tokens, temperature, seed, selector, guard, chat, min_confidence,
                            True, eos_ids, oracle, proposer)
        return Stream(self, req)

    def generate_batch(self, prompts: list[Prompt], max_new_tokens: int | list[int] = 128,
                       temperature: float | list[float] = 0.0, seed: int | None | list[int | None] = None,
                       selector: str = "greedy", *, chat: bool = True, speculative: bool = True,
                       eos_ids: set[int] | None = None, max_batch: int = 8, adaptive: bool = True) -> list[Result]:
        """Decode many prompts together (continuous batching, :mod:`dflash2_trt.runtime.batch`): up to
        ``max_batch`` sequences share each batched target call; as one finishes the next prompt takes its slot.
        ``max_new_tokens`` / ``temperature`` / ``seed``: one value for all, or one per prompt. Each sequence's
        tokens are its own :meth:`generate` tokens at T = 0 (and, at T > 0 with ``speculative=False``, its
        ``generate(..., speculative=False)`` tokens for the same seed); ``speculative``: let sequences draft while
        the load-adaptive rule says it pays (``adaptive=False``: draft every step). Results in prompt order;
        ``Stats.elapsed_s`` is a sequence's time from joining the batch to finishing. Needs the fused ONNX Runtime
        target (``ort`` backend on the CPU); other backends decode the prompts one after another."""
        from dflash2_trt.runtime import batch as B

        n = len(prompts)
        if not n:
            return []
        B.check_batch_size(max_batch)

        def per(v: Any, what: str) -> list:
            if isinstance(v, (list, tuple)):
                if len(v) != n:
                    raise DFlash2Error(f"{what}: {len(v)} values for {n} prompts")
                return list(v)
            return [v] * n

        reqs = [self._request(p, m, t, s, selector, False, chat, 0.0, speculative, eos_ids, None)
                for p, m, t, s in zip(prompts, per(max_new_tokens, "max_new_tokens"), per(temperature, "temperature"),
                                      per(seed, "seed"))]
        with self._lock:
            self._runner()  # the Result's default EOS set; raises when closed
            if not getattr(self._backend, "fused", False):
                return [self._result(r, self._run(r, None)) for r in reqs]
            from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

            slots = min(max_batch, n)
            if slots not in self._batched:  # one kept (its KV buffers are slots x capacity): the last size used
                self._batched = {slots: OrtBatchedTargetRunner.from_backend(self._backend, slots)}
            target = self._batched[slots]
            make = (lambda: self._backend.draft_runner(selector)) if speculative else None
            dec = B.BatchDecoder(target, make, B.SpeculationRule(adaptive=adaptive))
            out = dec.run([B.BatchRequest(r.prompt, r.max_new_tokens, r.temperature, r.seed, r.eos_ids,
                                          r.speculative) for r in reqs])
        return [self._result(r, o) for r, o in zip(reqs, out)]

    def close(self) -> None:
        """Free the backend (sessions, engines, device memory); idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._target, self._drafters, self._batched = None, {}, {}
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
            self._target = self._backend.target_runner()
        return self._target

    def _drafter(self, selector: str) -> Any:
        if selector not in self._drafters:
            self._drafters[selector] = self._backend.draft_runner(selector)  # checks the mode against the export
        return self._drafters[selector]

    def _request(self, prompt: Prompt, max_new_tokens: int, temperature: float, seed: int | None,
                 selector: str, guard: bool, chat: bool, min_confidence: float, speculative: bool,
                 eos_ids: set[int] | None, oracle: Any, proposer: str = DEFAULT_PROPOSER) -> _Request:
        from dflash2_trt.runtime.decoder import check_temperature

        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise DFlash2Error(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        check_temperature(float(temperature))
        if seed is None:
            seed = secrets.randbits(63)
        elif isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DFlash2Error(f"seed must be an integer >= 0 or None, got {seed!r}")
        if not 0.0 <= float(min_confidence) <= 1.0:  # `not <=` also refuses NaN
            raise DFlash2Error(f"min_confidence must be in [0, 1], got {min_confidence!r}")
        self.check_selector(selector)
        if proposer not in PROPOSERS:
            raise DFlash2Error(f"proposer must be one of {', '.join(PROPOSERS)}, got {proposer!r}")
        return _Request(self.encode(prompt, chat), max_new_tokens, float(temperature), seed, selector, bool(guard),
                        float(min_confidence), bool(speculative), None if eos_ids is None else set(eos_ids), oracle,
                        proposer)

    def _run(self, req: _Request, hooks: tuple[Callable, Callable] | None) -> Any:
        """One request on this Generator's runners; the caller holds the lock."""
        from dflash2_trt.runtime import decoder as D
        from dflash2_trt.runtime.guard import AcceptanceGuard, GuardConfig

        target = self._runner()
        on_tokens, on_cycle = hooks if hooks else (None, None)
        if not req.speculative:
            return D.target_generate(target, req.prompt, req.max_new_tokens, req.temperature, req.eos_ids, req.seed,
                                     on_tokens=on_tokens)
        return D.speculative_generate(target, self._drafter(req.selector), req.prompt, req.max_new_tokens,
                                      req.temperature, req.eos_ids, req.seed, oracle=req.oracle, on_tokens=on_tokens,
                                      guard=AcceptanceGuard(GuardConfig()) if req.guard else None,
                                      min_confidence=req.min_confidence, on_cycle=on_cycle, proposer=req.proposer)

    def _result(self, req: _Request, res: Any) -> Result:
        eos = self._target.eos_ids if req.eos_ids is None else req.eos_ids
        if res.tokens and res.tokens[-1] in eos:
            reason = "stop"
        elif len(res.tokens) >= req.max_new_tokens:
            reason = "length"
        else:
            reason = "capacity"
        return Result(self._tok.decode(res.tokens), list(res.tokens), list(res.prompt_tokens), Stats.of(res), reason)


class Stream:
    """The chunks of one request being decoded (from :meth:`Generator.stream`): iterate it once; ``result`` is
    the request's :class:`Result` after the last chunk (None before, or when the stream was closed early).
    The decoding runs in a worker thread holding the Generator's lock; ``close()`` (also on leaving a ``for``
    loop early, or garbage collection) stops it at its next step and waits for it."""

    def __init__(self, gen: Generator, req: _Request) -> None:
        self.result: Result | None = None
        self._it = self._run(gen, req)

    def __iter__(self) -> Iterator[Chunk]:
        return self._it

    def __next__(self) -> Chunk:
        return next(self._it)

    def close(self) -> None:
        self._it.close()

    def _run(self, gen: Generator, req: _Request) -> Iterator[Chunk]:
        chunks: queue.Queue = queue.Queue(maxsize=64)
        stop = threading.Event()
        delta = _TextDelta(gen._tok.decode)
        cycle: list[int | None] = [None]
        done: list[Any] = []

        def on_cycle(accepted: int, rows: int) -> None:
            cycle[0] = accepted

        def on_tokens(new: list[int]) -> None:
            if stop.is_set():
                raise _Cancelled
            chunks.put(Chunk(delta.add(new), list(new), cycle[0]))
            cycle[0] = None

        def work() -> None:
            try:
                with gen._lock:
                    done.append(gen._run(req, (on_tokens, on_cycle)))
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
                        self.result = gen._result(req, done[0])
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


def load(model_dir: str | Path, backend: str = "auto", threads: int | None = None,
         verify_checksums: bool = True) -> Generator:
    """Open a ``dflash2 export`` folder. ``backend``: ``auto`` (TensorRT when it can run here, else ONNX
    Runtime; :attr:`Generator.note` says which and why), ``trt`` or ``ort``; ``threads``: ONNX Runtime intra-op
    threads (default: ONNX Runtime's); ``verify_checksums``: check every file against the manifest."""
    from dflash2_trt.runtime.backends import open_backend
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise DFlash2Error(f"threads must be an integer >= 1 or None, got {threads!r}")
    tok = TextTokenizer(model_dir)  # before the backend: a folder without a tokenizer fails cheaply
    be, note = open_backend(model_dir, backend, verify_checksums=verify_checksums, threads=threads)
    return Generator(be, tok, note)
