"""``dflash2 serve EXPORT_DIR``: the flags (defined here, standard library only) and the run: load the export, warm
the batch loop up, then serve with uvicorn until SIGTERM or Ctrl-C, which drain: the listening socket closes at
once, requests in flight finish (up to ``--drain-timeout`` seconds; then what still decodes is cancelled and each
such reply ends with finish_reason "abort" and ``[DONE]``), the export is closed and the command returns 0.

Output (stderr): one line once the export is loaded, ``dflash2 serve: MODEL on http://HOST:PORT (BACKEND, ...)``,
then uvicorn's log lines (``Uvicorn running on ...`` once it listens; ``--access-log`` adds one per request). A missing ``serve`` extra, a bad export or a port in use is one
line ``dflash2: error: ...`` and exit 1, as every CLI error.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from dflash2_trt import validate as V
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.ort_options import add_ort_options, ort_options
from dflash2_trt.runtime.batch import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_SHARE
from dflash2_trt.runtime.prefix_cache import DEFAULT_BUDGET_BYTES
from dflash2_trt.vocabulary import BACKEND_CHOICES, DEFAULT_PROPOSER, PROPOSERS, SPECULATION_MODES

PORT = V.integer(1, 65535)
ABORT_GRACE_S = 10.0  # after --drain-timeout, the aborted replies' last events: then uvicorn drops what is left


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the batched runtime",
                       description="OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (streaming "
                                   "and not), /v1/models, /health, /metrics. Needs the serve extra.")
    s.add_argument("export_dir", metavar="EXPORT_DIR", help="a dflash2 export folder")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only; 0.0.0.0 for all)")
    s.add_argument("--port", type=PORT, default=8000)
    s.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    s.add_argument("--threads", type=V.THREADS, default=None, help="ONNX Runtime intra-op threads")
    s.add_argument("--max-batch", type=V.COUNT, default=8, help="sequences decoded together in one batch step")
    s.add_argument("--max-queue", type=V.NON_NEGATIVE, default=32,
                   help="requests that may wait for a slot beyond --max-batch; more get 429 + Retry-After")
    s.add_argument("--speculation", choices=SPECULATION_MODES, default=SPECULATION_MODES[0],
                   help="adaptive: draft only while the load-adaptive rule says it pays; always; off: batched plain "
                        "decoding")
    s.add_argument("--proposer", choices=PROPOSERS, default=DEFAULT_PROPOSER, help="who drafts")
    s.add_argument("--api-key", type=V.text, default=None,
                   help="require 'Authorization: Bearer KEY' on the /v1 routes (401 otherwise)")
    s.add_argument("--model-name", type=V.text, default=None,
                   help="the model id clients send (default: the export folder's name)")
    s.add_argument("--drain-timeout", type=V.NON_NEGATIVE_NUMBER, default=60.0,
                   help="seconds SIGTERM waits for requests in flight before cancelling them")
    s.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    s.add_argument("--strict-params", action="store_true",
                   help="refuse harmless OpenAI keys (store, metadata, reasoning_effort, service_tier, ...) as unknown "
                        "instead of ignoring them with a logged warning")
    s.add_argument("--prefill-chunk", type=V.COUNT, default=DEFAULT_PREFILL_CHUNK,
                   help="most prompt rows computed per batch step while other requests decode (default %(default)s)")
    s.add_argument("--prefill-share", type=V.NON_NEGATIVE_NUMBER, default=DEFAULT_PREFILL_SHARE,
                   help="fewer rows where they are measured dear: those whose forward takes about this many decode "
                        "steps (0: always --prefill-chunk rows; default %(default)s)")
    s.add_argument("--prefix-cache-mib", type=V.NON_NEGATIVE, default=DEFAULT_BUDGET_BYTES >> 20,
                   help="host memory for the prefix cache of finished conversations, MiB (0: off; default %(default)s)")
    add_ort_options(s)


def run(a: argparse.Namespace) -> int:
    try:
        import uvicorn

        from dflash2_trt.serving.http.app import Server
    except ImportError as e:
        raise DFlash2Error(f"dflash2 serve needs the serve extra ({e.name} is missing): "
                           f"pip install 'dflash2-trt[serve]'") from None
    import dflash2_trt

    name = a.model_name or Path(a.export_dir).resolve().name
    with dflash2_trt.load(a.export_dir, a.backend, threads=a.threads, prefix_cache_bytes=a.prefix_cache_mib << 20,
                          **ort_options(a)) as gen:
        srv = Server(gen, name, max_batch=a.max_batch, max_queue=a.max_queue,
                     adaptive=a.speculation == "adaptive", speculative=a.speculation != "off",
                     proposer=a.proposer, api_key=a.api_key, prefill_chunk=a.prefill_chunk,
                     prefill_share=a.prefill_share or None,
                     strict_params=a.strict_params)
        srv.warm_up()
        config = uvicorn.Config(srv.app, host=a.host, port=a.port, lifespan="off", access_log=a.access_log,
                                timeout_graceful_shutdown=a.drain_timeout + ABORT_GRACE_S, log_level="info")

        class Draining(uvicorn.Server):
            """uvicorn's drain, with the requests still decoding at --drain-timeout aborted (their replies end
            whole) before uvicorn's own timeout would cut the connections."""

            async def shutdown(self, sockets: Any = None) -> None:
                timer = asyncio.get_running_loop().call_later(a.drain_timeout, srv.abort_all)
                try:
                    await super().shutdown(sockets)
                finally:
                    timer.cancel()

        server = Draining(config)
        # uvicorn re-raises the signal that stopped it once it drained; these handlers take it, so a drained
        # server returns 0 instead of dying of its SIGTERM (or a KeyboardInterrupt)
        old = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            print(f"dflash2 serve: {name} on http://{a.host}:{a.port} ({gen.note or gen.backend}; max batch "
                  f"{a.max_batch}, queue {a.max_queue}, speculation {a.speculation})", file=sys.stderr, flush=True)
            server.run()
        except SystemExit:  # uvicorn's answer to a socket it could not bind, after logging why
            raise DFlash2Error(f"could not serve on {a.host}:{a.port} (see the line above)") from None
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
    return 0
