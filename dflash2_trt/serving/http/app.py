"""The ASGI application of ``dflash2 serve``: Starlette routes over one :class:`~dflash2_trt.api.Generator` whose
background loop decodes every request in one continuous batch, and its Prometheus metrics (prometheus_client).

Routes::

    POST /v1/completions, /v1/chat/completions   OpenAI's bodies (:mod:`dflash2_trt.serving.http.protocol`); with
                                                 "stream": true server-sent events, one per committed chunk
                                                 (OpenAI's chunk objects), then ``data: [DONE]``
    GET  /v1/models, /v1/models/{model}          the one served model
    GET  /health                                 200 {"status": "ok", "backend": ..., "op_library": ...} (the server
                                                 listens only once loaded; op_library: Generator.op_library)
    GET  /metrics                                Prometheus text (see :class:`Metrics`)

With an API key every ``/v1`` route needs ``Authorization: Bearer KEY`` (the scheme in any case; 401 otherwise);
/health and /metrics stay open (a load balancer and a scraper reach them without it).

Every answer carries an ``x-request-id`` header (the client's own when it sent a short one) and is counted in
``dflash2_http_requests_total{route,status}`` as it starts. An exception that escapes a route is answered by the
last resort (:class:`_LastResort`): one 500 with OpenAI's error object (type ``server_error``, the request id in
its message), one log line naming the request id (with the traceback the first time that place fails), and the
keep-alive connection stays open for the client's next request.

One request's life: the body is checked (a bad one gets a 400 with OpenAI's error object and never reaches the
batch) -> admission: with ``max_batch + max_queue`` requests in flight a 429 with ``Retry-After`` (memory stays
bounded) -> :meth:`Generator.submit <dflash2_trt.api.Generator.submit>` -> a forwarding thread moves the handle's
chunks onto the event loop -> the reply (events as they come, or one JSON body at the end) while a watcher waits
for the client's ``http.disconnect``. A disconnect, or a send that fails, cancels the handle:
:meth:`Handle.cancel <dflash2_trt.api.Handle.cancel>` frees the slot before the loop's next step and returns then
(metric ``dflash2_cancel_steps``: batch steps between the two). A stop string cancels the same way once it
appears. Greedy requests (temperature 0) get the target's own tokens, those of :meth:`Generator.generate`.
:meth:`Server.abort_all` (``dflash2 serve`` at ``--drain-timeout``) cancels what is still decoding: each such
reply ends as it would have, with a last chunk of finish_reason ``"abort"`` (vLLM's) and ``[DONE]``.

Threads: the event loop (uvicorn's) runs the routes; the Generator's loop thread decodes; one forwarding thread
per request in flight blocks on its handle. The in-flight count is under a lock; prometheus_client's metrics are
thread safe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.batch import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_SHARE
from dflash2_trt.runtime.request import GenerationRequest
from dflash2_trt.serving.http import tools
from dflash2_trt.serving.http import protocol as P
from dflash2_trt.vocabulary import DEFAULT_PROPOSER

MAX_BODY = 8 << 20  # bytes of a request body
RETRY_AFTER_S = 1  # a 429's Retry-After: requests take seconds, a slot frees often
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
# Result.finish_reason -> OpenAI's ("capacity": the cache is full, the context's length)
FINISH = {"stop": "stop", "length": "length", "capacity": "length", "cancelled": "stop"}
ABORT = "abort"  # the finish_reason (and finished{reason}) of a request the server cancelled: it is stopping
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")  # metrics' route label
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # an x-request-id we take over from the client
_log = logging.getLogger("dflash2_trt.serving.http")


class _BatchSteps:
    """``dflash2_batch_steps_total{size}``: batch steps that decoded ``size`` sequences together, read from
    :attr:`Generator.batch_sizes <dflash2_trt.api.Generator.batch_sizes>` at each scrape."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen

    def collect(self) -> Any:
        c = CounterMetricFamily("dflash2_batch_steps", "batch steps that decoded `size` sequences together",
                                labels=["size"])
        for size, n in sorted(self.gen.batch_sizes.items()):
            c.add_metric([str(size)], n)
        yield c


class _PrefixCache:
    """The prefix cache's series, read from :attr:`Generator.prefix_cache <dflash2_trt.api.Generator.prefix_cache>`
    at each scrape: ``dflash2_prefix_cache_hit_tokens_total`` (prompt tokens restored),
    ``dflash2_prefix_cache_computed_tokens_total`` (prompt tokens computed), ``dflash2_prefix_cache_evictions_total``,
    ``dflash2_prefix_cache_bytes`` and ``dflash2_prefix_cache_budget_bytes`` (none without a cache)."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen

    def collect(self) -> Any:
        cache = self.gen.prefix_cache
        if cache is None:
            return
        s = cache.stats
        for name, what, v in (("hit_tokens", "prompt tokens restored from the prefix cache", s.hit_tokens),
                              ("computed_tokens", "prompt tokens computed (not restored)", s.computed_tokens),
                              ("evictions", "prefix cache entries evicted", s.evictions)):
            c = CounterMetricFamily(f"dflash2_prefix_cache_{name}", what)
            c.add_metric([], v)
            yield c
        for name, what, v in (("bytes", "bytes the prefix cache holds", s.nbytes),
                              ("budget_bytes", "the prefix cache's budget", cache.budget_bytes)):
            g = GaugeMetricFamily(f"dflash2_prefix_cache_{name}", what)
            g.add_metric([], v)
            yield g


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (two servers in one process never collide).

    Counters: ``dflash2_http_requests_total{route,status}`` (every answer, 500s too; route: one of
    :data:`ROUTES` or "other"), ``dflash2_requests_submitted_total`` (reached the batch),
    ``dflash2_requests_finished_total{reason}`` (stop, length: the finish_reason the client got; cancelled: the
    client went away before its answer ended; abort: the server stopped it; error),
    ``dflash2_prompt_tokens_total``, ``dflash2_generation_tokens_total``, ``dflash2_speculative_cycles_total``,
    ``dflash2_draft_tokens_total`` (drafts verified), ``dflash2_accepted_draft_tokens_total``,
    ``dflash2_plain_steps_total``, ``dflash2_batch_steps_total{size}``, the prefix cache's (``_PrefixCache``). Gauges: ``dflash2_requests_waiting``
    (submitted, no batch slot yet: the queue depth), ``dflash2_requests_running`` (holding a slot),
    ``dflash2_tau`` (tokens per speculative cycle, pooled since start), ``dflash2_acceptance_rate`` (accepted /
    verified drafts). Histograms: ``dflash2_time_to_first_token_seconds``,
    ``dflash2_time_per_output_token_seconds`` (per request: first to last token), ``dflash2_request_duration_seconds``,
    ``dflash2_request_tau`` (requests that ran cycles), ``dflash2_cancel_steps`` (batch steps from a client's
    disconnect to its slot being free)."""

    def __init__(self, gen: Any) -> None:
        r = self.registry = CollectorRegistry()
        self.http = Counter("dflash2_http_requests", "HTTP requests answered, by route and status",
                            ["route", "status"], registry=r)
        self.submitted = Counter("dflash2_requests_submitted", "requests queued for decoding", registry=r)
        self.finished = Counter("dflash2_requests_finished", "requests that left the batch, by reason", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("dflash2_prompt_tokens", "prompt tokens of the decoded requests", registry=r)
        self.generation_tokens = Counter("dflash2_generation_tokens", "tokens generated", registry=r)
        self.cycles = Counter("dflash2_speculative_cycles", "speculative cycles (draft + verify)", registry=r)
        self.draft_tokens = Counter("dflash2_draft_tokens", "draft tokens verified", registry=r)
        self.accepted = Counter("dflash2_accepted_draft_tokens", "draft tokens accepted", registry=r)
        self.plain_steps = Counter("dflash2_plain_steps", "plain target steps (no draft)", registry=r)
        self.waiting = Gauge("dflash2_requests_waiting", "requests submitted, waiting for a batch slot", registry=r)
        self.running = Gauge("dflash2_requests_running", "requests holding a batch slot", registry=r)
        self._lock = threading.Lock()
        self._sums = {"cycles": 0, "accepted": 0, "verified": 0}  # the counters' totals, for the two ratios
        Gauge("dflash2_tau", "tokens per speculative cycle, pooled since start", registry=r).set_function(
            lambda: self._ratio("accepted", "cycles", 1.0))
        Gauge("dflash2_acceptance_rate", "accepted / verified draft tokens since start", registry=r).set_function(
            lambda: self._ratio("accepted", "verified"))
        secs = (.005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30, 60)
        self.ttft = Histogram("dflash2_time_to_first_token_seconds", "from the request to its first token",
                              buckets=secs, registry=r)
        self.tpot = Histogram("dflash2_time_per_output_token_seconds", "per request: (last - first token) / (n - 1)",
                              buckets=(.002, .005, .01, .015, .02, .03, .05, .075, .1, .2, .5, 1), registry=r)
        self.duration = Histogram("dflash2_request_duration_seconds", "from the request to its last token",
                                  buckets=secs + (120, 300), registry=r)
        self.tau = Histogram("dflash2_request_tau", "tokens per speculative cycle of a request",
                             buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8), registry=r)
        self.cancel_steps = Histogram("dflash2_cancel_steps", "batch steps from a client's disconnect to its slot "
                                      "being free", buckets=(0, 1, 2, 3, 5, 10, 20), registry=r)
        r.register(_BatchSteps(gen))
        r.register(_PrefixCache(gen))

    def _ratio(self, num: str, den: str, plus: float = 0.0) -> float:
        with self._lock:
            return self._sums[num] / self._sums[den] + plus if self._sums[den] else 0.0

    def record(self, prompt_len: int, res: Any, reason: str) -> None:
        """A finished request's counts (``res``: its Result)."""
        s = res.stats
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(prompt_len)
        self.generation_tokens.inc(len(res.tokens))
        self.cycles.inc(s.cycles)
        self.draft_tokens.inc(sum(s.verified))
        self.accepted.inc(sum(s.accepted))
        self.plain_steps.inc(s.plain_steps)
        with self._lock:
            self._sums["cycles"] += s.cycles
            self._sums["accepted"] += sum(s.accepted)
            self._sums["verified"] += sum(s.verified)
        if s.cycles:
            self.tau.observe(s.tau)


@dataclass(eq=False)  # compared and hashed by identity: the server's set of jobs in flight
class _Job:
    """One submitted request, shared by its reply (event loop) and its forwarding thread."""

    spec: P.ParsedRequest
    prompt_len: int
    handle: Any  # dflash2_trt.api.Handle
    loop: asyncio.AbstractEventLoop
    t0: float
    rid: str = field(default_factory=str)
    created: int = 0
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk ..., then _End or an exception
    gone: bool = False  # the client went away before its answer ended
    stopped: bool = False  # a stop string ended it
    answered: bool = False  # the answer's last byte is being sent: a disconnect from now on is no cancel
    aborted: bool = False  # Server.abort_all cancelled it
    logprobs: list = field(default_factory=list)  # TokenLogprobs of the chunks taken, not yet sent (streams)
    sent: int = 0  # characters of text sent (completions' text_offset)


def _finish(job: _Job, res: Any) -> str:
    """The finish_reason of a reply whose decoding ended (a stop string's "stop" is the reply's own)."""
    return ABORT if res.finish_reason == "cancelled" and job.aborted else FINISH.get(res.finish_reason, "stop")


def _reason(job: _Job, res: Any, stop_hit: bool) -> str:
    """finished{reason} of a request: "cancelled" when its client went away before the answer ended, else the
    finish_reason its client got — "stop" when a stop string appeared in its text (``stop_hit``: the forwarding
    thread's own cut of the same text, so the count does not depend on which thread gets there first)."""
    if job.gone:
        return "cancelled"
    return "stop" if stop_hit or job.stopped else _finish(job, res)


@dataclass
class _End:
    result: Any  # dflash2_trt.api.Result


def _stats(res: Any) -> dict:
    """The decoding figures of a Result, the ``dflash2`` extension field of an answer."""
    s = res.stats
    return {"tau": s.tau if s.cycles else None,  # None: no speculative cycle ran (0 would read as a measurement)
            "cycles": s.cycles, "accepted_drafts": sum(s.accepted), "verified_drafts": sum(s.verified),
            "plain_steps": s.plain_steps, "proposer_cycles": {p: s.proposers.count(p) for p in sorted(set(s.proposers))},
            "tokens_per_s": s.tokens_per_s}


class Server:
    """The routes over ``gen`` (a loaded Generator; the caller closes it). ``max_batch``: sequences decoded
    together (set on the Generator with ``adaptive``, ``prefill_chunk`` and ``prefill_share``); ``max_queue``: requests that may wait
    beyond them; ``speculative``: requests may draft; ``api_key``: required on /v1 routes when given."""

    def __init__(self, gen: Any, model_name: str, *, max_batch: int = 8, max_queue: int = 32,
                 adaptive: bool = True, speculative: bool = True, proposer: str = DEFAULT_PROPOSER,
                 api_key: str | None = None, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                 prefill_share: float | None = DEFAULT_PREFILL_SHARE,
                 strict_params: bool = False) -> None:
        self.gen, self.model_name, self.api_key = gen, model_name, api_key
        self.strict_params = strict_params  # harmless OpenAI keys refused (P.HARMLESS) instead of ignored
        self.speculative, self.proposer, self.limit = speculative, proposer, max_batch + max_queue
        gen.set_batching(max_batch, adaptive=adaptive, prefill_chunk=prefill_chunk, prefill_share=prefill_share)
        self.positions = gen.max_positions
        self.selector = gen.selectors[0]
        self.created = P.now()
        self.metrics = Metrics(gen)
        self._lock = threading.Lock()
        self.in_flight = 0  # submitted, not finished (under _lock)
        self._jobs: set[_Job] = set()  # those requests (under _lock)
        self._failed: set[tuple] = set()  # where unexpected exceptions were raised: their traceback was logged
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error}, middleware=[Middleware(_LastResort, server=self)])

    def warm_up(self) -> None:
        """One 1-token request through the batch loop: its runners exist before the first client comes."""
        self.gen.submit(self.gen.encode("Hi", chat=False) or [0], chat=False,
                        request=self._served(GenerationRequest(max_new_tokens=1, seed=0))).result()

    def _served(self, request: GenerationRequest, **fields: Any) -> GenerationRequest:
        """A request as this server decodes it: the ``--selector`` / ``--speculation`` / ``--proposer`` choices
        and ``fields`` set in it (its seed kept)."""
        return dataclasses.replace(request, draft_mode=self.selector, speculative=self.speculative,
                                   proposer=self.proposer, **fields)

    def steps(self) -> int:
        return sum(self.gen.batch_sizes.values())

    # -- small routes --------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return self._json(request, {"status": "ok", "backend": self.gen.backend, "op_library": self.gen.op_library})

    async def models(self, request: Request) -> Response:
        denied = self._denied(request)
        if denied:
            return denied
        return self._json(request, {"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        denied = self._denied(request)
        if denied:
            return denied
        if request.path_params["model"] != self.model_name:
            return self._json(request, P.error_body(f"The model '{request.path_params['model']}' does not exist",
                                                    param="model", code="model_not_found"), 404)
        return self._json(request, self._card())

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dflash2"}

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), headers={"content-type": CONTENT_TYPE_LATEST})

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        msg = {404: f"Unknown route {request.url.path}", 405: f"Method {request.method} not allowed on "
               f"{request.url.path}"}.get(status, str(getattr(exc, "detail", exc)))
        return self._json(request, P.error_body(msg, code="not_found" if status == 404 else None), status)

    def _json(self, request: Request, body: dict, status: int = 200, headers: dict | None = None) -> Response:
        return _JSON(body, status, headers)

    def _denied(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # RFC 7235: the scheme is case-insensitive
        if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode("utf-8", "replace"),
                                                                 self.api_key.encode()):
            return None
        return self._json(request, P.error_body("Incorrect API key provided.", code="invalid_api_key"), 401)

    # -- completions ---------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._complete(request, P.COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, P.CHAT)

    async def _complete(self, request: Request, kind: str) -> Response:
        denied = self._denied(request)
        if denied:
            return denied
        try:
            spec = (P.parse_chat if kind == P.CHAT else P.parse_completion)(P.parse_json(await _body(request)),
                                                                              self.strict_params)
            if spec.ignored:
                _log.warning("dflash2 serve: ignored %s (no effect on this server; --strict-params refuses them)",
                             ", ".join(spec.ignored))
            if spec.model != self.model_name:
                raise P.RequestError(f"The model '{spec.model}' does not exist", "model", status=404,
                                     code="model_not_found")
            jobs = self._submit_choices(spec)
        except P.RequestError as e:
            headers = {"retry-after": str(RETRY_AFTER_S)} if e.status == 429 else None
            return self._json(request, e.body(), e.status, headers)
        except DFlash2Error as e:  # the Generator's own checks (token ids, template): the request's fault
            return self._json(request, P.error_body(str(e), param="messages" if kind == P.CHAT else "prompt"), 400)
        return _Reply(self, jobs[0]) if len(jobs) == 1 else _Choices(self, jobs, spec.n)

    def _submit_choices(self, spec: P.ParsedRequest) -> list[_Job]:
        """Every choice of a request submitted (prompt i's j-th: index i x n + j; choice j samples with the
        request's seed + j), or none: RequestError / DFlash2Error when one is refused (those submitted before it are
        cancelled)."""
        prompts = P.prompts_of(spec)
        if len(prompts) == 1 and spec.n == 1:
            return [self._submit(spec)]
        with self._lock:
            if self.in_flight + len(prompts) * spec.n > self.limit:
                raise P.RequestError(f"The server is at capacity ({self.in_flight} requests in flight, "
                                     f"{len(prompts) * spec.n} choices asked); retry after {RETRY_AFTER_S} s",
                                     status=429, type="rate_limit_error", code="rate_limit_exceeded")
        jobs: list[_Job] = []
        try:
            for p in prompts:
                for j in range(spec.n):
                    seed = (spec.request.seed + j) % (P.MAX_SEED + 1)
                    jobs.append(self._submit(dataclasses.replace(
                        spec, prompt=p, more_prompts=[], request=dataclasses.replace(spec.request, seed=seed))))
        except BaseException:
            for job in jobs:
                job.aborted = True
                job.handle.cancel(wait=False)
            raise
        for job in jobs[1:]:  # one answer: one id and creation time for every choice
            job.rid, job.created = jobs[0].rid, jobs[0].created
        return jobs

    def _prompt(self, spec: P.ParsedRequest) -> tuple[list[int], Any]:
        """The prompt's ids and the request record: a chat with tools (or tool calls / results in its history)
        rendered by server/tools, the grammar that forces its calls added."""
        uses_tools = spec.kind == P.CHAT and (spec.tools is not None or any(
            m.get("tool_calls") or m["role"] == "tool" for m in spec.prompt))
        if not uses_tools:
            return self.gen.encode(spec.prompt, chat=spec.kind == P.CHAT), spec.request
        tok = self.gen.tokenizer
        if not tok.chat_template:
            raise P.RequestError("tools need a chat template; this model has none", "tools", code="invalid_value")
        family = tools.family_of(tok.chat_template)
        return tools.render(tok, spec.prompt, spec.tools), tools.with_grammar(
            spec.request, tools.tool_grammar(spec.tools, family, tok))

    def _held(self, spec: P.ParsedRequest) -> bool:
        """Whether the answer's text is split by server/tools (calls or reasoning) before it is sent."""
        t = self.gen.tokenizer.chat_template if spec.kind == P.CHAT else None
        return spec.kind == P.CHAT and ((spec.tools is not None and spec.tools.active) or "<think>" in (t or ""))

    def _submit(self, spec: P.ParsedRequest) -> _Job:
        """Encode, check against the context, admit, submit; the forwarding thread started. RequestError /
        DFlash2Error when refused (nothing queued then)."""
        ids, request = self._prompt(spec)
        max_tokens = P.max_tokens_for(spec, len(ids), self.positions)
        with self._lock:
            if self.in_flight >= self.limit:
                raise P.RequestError(f"The server is at capacity ({self.in_flight} requests in flight); retry "
                                     f"after {RETRY_AFTER_S} s", status=429, type="rate_limit_error",
                                     code="rate_limit_exceeded")
            self.in_flight += 1
        try:
            handle = self.gen.submit(ids, chat=False, request=self._served(request, max_new_tokens=max_tokens))
        except BaseException:
            self._release()
            raise
        self.metrics.submitted.inc()
        self.metrics.waiting.inc()
        job = _Job(spec, len(ids), handle, asyncio.get_running_loop(), time.perf_counter(), P.new_id(spec.kind),
                   P.now())
        with self._lock:
            self._jobs.add(job)
        threading.Thread(target=self._forward, args=(job,), name="dflash2-serve-forward", daemon=True).start()
        return job

    def _release(self, job: _Job | None = None) -> None:
        with self._lock:
            self.in_flight -= 1
            self._jobs.discard(job)  # type: ignore[arg-type]

    def abort_all(self) -> int:
        """Cancel every request still decoding (the server is stopping); their replies end with finish_reason
        "abort" and ``[DONE]``. Returns how many were asked; does not wait."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.aborted = True
            job.handle.cancel(wait=False)
        return len(jobs)

    def log_failure(self, rid: str, scope: dict, e: BaseException) -> None:
        """One log line for an unexpected exception of request ``rid``; its traceback only the first time an
        exception of its type is raised at its place (a client retrying does not flood the log)."""
        where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
        key = (type(e).__name__, *((where[0].filename, where[0].lineno) if where else ()))
        with self._lock:
            first = key not in self._failed
            self._failed.add(key)
        what = (str(e).splitlines() or [""])[0][:200]
        _log.error("dflash2 serve: request %s (%s %s) failed: %s: %s%s", rid, scope.get("method"), scope.get("path"),
                   type(e).__name__, what, "" if first else " (traceback logged before)",
                   exc_info=e if first else None)

    def _forward(self, job: _Job) -> None:
        """The forwarding thread: the handle's chunks onto the event loop; at the end the request's accounting, then
        its end (so a client that has its answer finds it counted)."""
        m = self.metrics

        def put(item: Any) -> None:
            try:
                job.loop.call_soon_threadsafe(job.queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (the server stopped): nobody reads this reply
                pass

        first = last = None
        end: Any = None
        cut = P.StopText(job.spec.stop)  # the reply cuts the same text: whether it will end on a stop string
        try:
            for c in job.handle:
                cut.add(c.text)
                last = time.perf_counter()
                if first is None:
                    first = last
                    m.waiting.dec()
                    m.running.inc()
                    m.ttft.observe(first - job.t0)
                put(c)
            end = _End(job.handle.result())
        except BaseException as e:  # noqa: BLE001 - handed to the reply, which answers with it
            end = e
        if isinstance(end, _End):
            res = end.result
            m.record(job.prompt_len, res, _reason(job, res, cut.hit))
            if first is not None:
                m.duration.observe(last - job.t0)
                if len(res.tokens) > 1:
                    m.tpot.observe((last - first) / (len(res.tokens) - 1))
        else:
            m.finished.labels("error").inc()
        (m.waiting if first is None else m.running).dec()  # after the counts: idle means counted
        self._release(job)
        put(end)

    async def cancel(self, job: _Job) -> None:
        """Stop ``job``'s decoding; returns once its slot is free (at most the step under way finishes first)."""
        before = self.steps()
        job.handle.cancel(wait=False)  # asked now, on this thread: the count starts when the loop can see it
        await anyio.to_thread.run_sync(job.handle.cancel)
        if job.gone:
            self.metrics.cancel_steps.observe(self.steps() - before)


async def _body(request: Request) -> bytes:
    try:
        size = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise P.RequestError("the Content-Length header is not a number") from None
    if size > MAX_BODY:
        raise P.RequestError(f"the request body is {size} bytes, more than the {MAX_BODY} accepted", status=413)
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY:
            raise P.RequestError(f"the request body is more than the {MAX_BODY} bytes accepted", status=413)
    return bytes(raw)


class _Reply(Response):
    """The answer to one submitted request, streamed or whole, with a watcher for the client's disconnect."""

    def __init__(self, server: Server, job: _Job) -> None:
        super().__init__()
        self.server, self.job = server, job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        job = self.job

        async def watch(scope_: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not job.answered:  # a client leaving after its whole answer cancelled nothing
                job.gone = True
                scope_.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                try:
                    await (self._stream(send) if job.spec.stream else self._whole(send))
                except OSError:  # a send to a client that went away (uvicorn's ClientDisconnected)
                    job.gone = True
                tg.cancel_scope.cancel()
        finally:
            if not job.handle.done:  # the client went away, or the server stops: free the slot now
                job.gone = job.gone or not (job.stopped or job.aborted)
                with anyio.CancelScope(shield=True):
                    await self.server.cancel(job)

    async def _items(self) -> AsyncIterator[Any]:
        """The chunks and the end as they come; chunks that queued up while a send was slow merge into one."""
        q = self.job.queue
        while True:
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
            text, tokens = "", []
            for it in items:
                if isinstance(it, (_End, BaseException)):
                    if tokens or text:
                        yield text, tokens
                    yield it
                    return
                text += it.text
                tokens += it.tokens
                self.job.logprobs += it.logprobs
            yield text, tokens

    async def _pieces(self) -> AsyncIterator[Any]:
        """(text to send, None) while decoding; then (the tail, (finish_reason, completion tokens, Result)) or an
        exception. A stop string cancels the decoding and ends the text before it."""
        job, srv = self.job, self.server
        cut = P.StopText(job.spec.stop)
        tokens: list[int] = []
        async for it in self._items():
            if isinstance(it, BaseException):
                yield it
                return
            if isinstance(it, _End):
                yield cut.flush(), (_finish(job, it.result), len(it.result.tokens), it.result)
                return
            text, new = it
            before = len(tokens)
            tokens += new
            out = cut.add(text)
            if cut.hit:
                job.stopped = True
                await srv.cancel(job)
                # the tokens up to the one whose text completed the stop string
                n = next((j for j in range(before + 1, len(tokens) + 1)
                          if len(srv.gen.decode(tokens[:j])) >= cut.end), len(tokens))
                yield out, ("stop", n, job.handle.result())
                return
            if out:
                yield out, None

    def _echo(self) -> str:
        """The prompt's text a completions answer begins with when it asks for ``echo`` (else "")."""
        spec = self.job.spec
        if not spec.echo:
            return ""
        return spec.prompt if isinstance(spec.prompt, str) else self.server.gen.decode(spec.prompt)

    def _logprobs(self, res: Any, n: int) -> dict | None:
        """The logprobs object of a whole answer of ``n`` completion tokens (OpenAI's chat or completions shape;
        with echo the prompt's tokens first), None when not asked."""
        spec, decode = self.job.spec, self.server.gen.decode
        if not spec.request.logprobs:
            return None
        if spec.kind == P.CHAT:
            return P.chat_logprobs(res.logprobs[:n], decode)
        if not spec.echo:
            return P.completion_logprobs(res.logprobs[:n], decode)
        from dflash2_trt.runtime.sampling import TokenLogprob

        first = [TokenLogprob(res.prompt_tokens[0], 0.0)]
        return P.completion_logprobs(first + res.prompt_logprobs + res.logprobs[:n], decode, first_null=True)

    def _sent_logprobs(self, text: str) -> dict | None:
        """The logprobs of the tokens taken since the last text sent (a stream's chunk of ``text``)."""
        job = self.job
        if not job.spec.request.logprobs:
            return None
        lps, job.logprobs = job.logprobs, []
        offset, job.sent = job.sent, job.sent + len(text)
        decode = self.server.gen.decode
        return P.chat_logprobs(lps, decode) if job.spec.kind == P.CHAT else P.completion_logprobs(lps, decode, offset)

    async def _whole(self, send: Any) -> None:
        job = self.job
        parts: list[str] = []
        async for it in self._pieces():
            if isinstance(it, BaseException):
                job.answered = True
                await _send_json(send, 500, P.error_body(f"decoding failed: {it}", type="server_error"))
                return
            text, end = it
            parts.append(text)
            if end is not None:
                finish, n, res = end
                text = self._echo() + "".join(parts)
                body = P.answer(job.spec.kind, job.rid, job.created, self.server.model_name, text, finish,
                                P.usage(job.prompt_len, n, res.stats.cached_tokens), _stats(res),
                                self._logprobs(res, n))
                if self.server._held(job.spec):  # calls and reasoning apart from the content
                    tok = self.server.gen.tokenizer
                    p = tools.split_answer(tools.answer_text(tok, res.tokens[:n], "".join(parts)), job.spec.tools,
                                           tok.chat_template)
                    msg, body["choices"][0]["finish_reason"] = tools.message(p, finish)
                    body["choices"][0]["message"] = msg
                job.answered = True
                await _send_json(send, 200, body)
                return

    async def _stream(self, send: Any) -> None:
        job, name = self.job, self.server.model_name
        kind, rid, created = job.spec.kind, job.rid, job.created
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        async def event(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        if kind == P.CHAT:
            await event(P.sse(P.chunk(kind, rid, created, name, first=True)))
        elif job.spec.echo:  # the prompt's text first (its logprobs come with whole answers only)
            job.sent = len(self._echo())
            await event(P.sse(P.chunk(kind, rid, created, name, self._echo())))
        held = self.server._held(job.spec)  # sent once whole: a call is never sent half parsed
        parts: list[str] = []
        async for it in self._pieces():
            if isinstance(it, BaseException):
                await event(P.sse(P.error_body(f"decoding failed: {it}", type="server_error")))
                break
            text, end = it
            if text and held:
                parts.append(text)
            elif text:
                await event(P.sse(P.chunk(kind, rid, created, name, text, logprobs=self._sent_logprobs(text))))
            if end is not None:
                finish, n, res = end
                if held:
                    tok = self.server.gen.tokenizer
                    p = tools.split_answer(tools.answer_text(tok, res.tokens[:n], "".join(parts)), job.spec.tools,
                                           tok.chat_template)
                    finish = tools.message(p, finish)[1]
                    for delta in tools.deltas(p):
                        c = P.chunk(kind, rid, created, name, "")
                        c["choices"][0]["delta"] = delta
                        await event(P.sse(c))
                await event(P.sse(P.chunk(kind, rid, created, name, None, finish, dflash2=_stats(res))))
                if job.spec.include_usage:
                    await event(P.sse(P.usage_chunk(kind, rid, created, name,
                                                    P.usage(job.prompt_len, n, res.stats.cached_tokens))))
        job.answered = True
        await send({"type": "http.response.body", "body": P.SSE_DONE, "more_body": False})


class _Choices(Response):
    """The answer to a request of several choices (n > 1, several prompts): one :class:`_Reply` per choice, their
    bodies merged into one (choices indexed, usage summed: :func:`~dflash2_trt.serving.http.protocol.merge_answers`) or
    their streams interleaved with each chunk's choice index (one usage chunk, one ``[DONE]``); a client going
    away cancels them all."""

    def __init__(self, server: Server, jobs: list[_Job], n: int) -> None:
        super().__init__()
        self.server, self.replies, self.n = server, [_Reply(server, j) for j in jobs], n

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        jobs = [r.job for r in self.replies]

        async def watch(scope_: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            for job in jobs:
                job.gone = job.gone or not job.answered
            scope_.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                try:
                    await (self._stream(send) if jobs[0].spec.stream else self._whole(send))
                except OSError:
                    for job in jobs:
                        job.gone = True
                tg.cancel_scope.cancel()
        finally:
            for job in jobs:
                if not job.handle.done:
                    job.gone = job.gone or not (job.stopped or job.aborted)
                    with anyio.CancelScope(shield=True):
                        await self.server.cancel(job)

    async def _whole(self, send: Any) -> None:
        bodies = []
        for r in self.replies:
            got: list[dict] = []

            async def keep(message: Any, got: list = got) -> None:
                got.append(message)

            await r._whole(keep)
            body = json.loads(b"".join(m.get("body", b"") for m in got[1:]))
            if got[0]["status"] != 200:
                await _send_json(send, got[0]["status"], body)
                return
            bodies.append(body)
        await _send_json(send, 200, P.merge_answers(bodies, self.n))

    async def _stream(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        lock, uses = anyio.Lock(), {}

        async def one(k: int, r: _Reply) -> None:
            async def relay(message: Any) -> None:
                data = message.get("body", b"") if message["type"] == "http.response.body" else b""
                if not data or data == P.SSE_DONE:
                    return
                obj = json.loads(data[len(b"data: "):])
                if obj.get("choices"):
                    obj["choices"][0]["index"] = k
                elif "usage" in obj:
                    uses[k] = obj
                    return
                async with lock:
                    await send({"type": "http.response.body", "body": P.sse(obj), "more_body": True})

            await r._stream(relay)

        async with anyio.create_task_group() as tg:
            for k, r in enumerate(self.replies):
                tg.start_soon(one, k, r)
        if len(uses) == len(self.replies):
            last = uses[0]
            last["usage"] = P.merge_usage([uses[k]["usage"] for k in range(len(uses))], self.n)
            await send({"type": "http.response.body", "body": P.sse(last), "more_body": True})
        for r in self.replies:
            r.job.answered = True
        await send({"type": "http.response.body", "body": P.SSE_DONE, "more_body": False})


class _JSON(JSONResponse):
    """A JSON answer that renders whatever strings it holds (a lone surrogate echoed from a URL or a header is
    written as its JSON escape instead of failing the UTF-8 encoding)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


class _LastResort:
    """The app's middleware (inside Starlette's own error middleware, which then never sees an exception): it
    names each request (``x-request-id``), counts each answer by route and status as it starts, and turns an
    exception that escapes a route into one 500 with OpenAI's error object — a raise would reach uvicorn, which
    answers a plain-text 500, logs the traceback each time and drops the keep-alive connection."""

    def __init__(self, app: Any, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.fullmatch(given) else "req-" + secrets.token_hex(8)
        path = scope.get("path", "")
        route = path if path in ROUTES else "/v1/models" if path.startswith("/v1/models/") else "other"
        started: list[int] = []

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                started.append(message["status"])
                self.server.metrics.http.labels(route, str(message["status"])).inc()
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as e:  # noqa: BLE001 - the last resort: anything a route did not expect
            self.server.log_failure(rid, scope, e)
            try:
                if not started:
                    await _send_json(counted, 500, P.error_body(
                        f"The server had an error while processing your request (request id {rid}).",
                        type="server_error"))
                else:  # an answer under way (a stream): end its body, the client sees it cut
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # noqa: BLE001, S110 - the connection itself is gone; the failure is logged
                pass


async def _send_json(send: Any, status: int, body: dict) -> None:
    data = _JSON(body).body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})
