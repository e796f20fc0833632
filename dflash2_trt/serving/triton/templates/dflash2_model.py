"""DFlash 2 speculative decoding served by Triton's python backend (written by ``dflash2_trt.serving.triton.repo``
as ``<repo>/<model>/1/model.py``; the export folder it runs sits beside it in ``1/export/``).

Decoupled: one request streams one response per committed chunk (the prefill's first token, then each
cycle's accepted drafts + bonus token or plain step's token), then a final response flagged FINAL that carries the request's
totals. Inputs (one of ``text_input`` / ``input_ids``; the rest optional)::

    text_input     BYTES [1]   a user message, rendered with the target's chat template (raw text if none)
    input_ids      INT64 [-1]  prompt token ids, used as they are
    max_tokens     INT32 [1]   >= 1; default: parameter default_max_tokens; at most parameter max_tokens_limit
    temperature    FP32  [1]   0 = greedy (default); > 0 samples (lossless rejection sampling)
    seed           INT64 [1]   the request's random stream (default 0; see parameter speculation below)
    selector_mode  BYTES [1]   greedy | viterbi | independent (default: parameter default_selector_mode)
    proposer       BYTES [1]   dflash2 | ngram | auto: who drafts, the drafter, prompt lookup or per cycle
                               whichever pays (default: parameter default_proposer, itself auto by default)
    top_p, min_p   FP32  [1]   the sampling transforms, applied to the target's law at every row (default: none;
    presence_penalty, frequency_penalty, repetition_penalty
                   FP32  [1]   ranges as GenerationRequest's; lossless under speculation)
    top_k          INT32 [1]

Outputs of every response::

    output_ids   INT64 [n]  tokens committed by this response (empty in the final one)
    text_output  BYTES [1]  their text (decoded incrementally; a partial UTF-8 character waits for the next)
    accepted     INT32 [c]  chunk responses: the drafts accepted in the cycle that produced the chunk
                            ([] for the prefill's token and plain steps); final response: every cycle's count
    tau          FP32  [1]  chunk responses: mean (accepted + 1) over the cycles so far; final: the request's τ

An instance decodes through the public API: one :class:`dflash2_trt.api.Generator` whose background loop
(``Generator.submit``) decodes every request the instance holds in one continuous batch — ``execute`` only
submits and returns (decoupled), a thread per request forwards its chunks, so concurrent requests join and
leave the shared steps (up to parameter ``max_batch`` at a time; with that many in flight ``execute`` waits for
one to finish, so Triton gives new requests to another instance or keeps them in its queue). Parameter
``speculation`` (of ``dflash2_trt.vocabulary.SPECULATION_MODES``): ``adaptive`` (default) drafts for a sequence
only while the load-adaptive rule says it pays (at high load: batched plain decoding), ``always`` drafts every
step, ``off`` never drafts. Greedy output is the target's own either way; at T > 0 a seed fixes the tokens with
``always`` / ``off`` and the sampling law with ``adaptive`` (the rule decides from measured timings). Parameter
``ort_spinning`` (``auto`` | ``on`` | ``off``): whether ONNX Runtime's target session spins between ops
(``dflash2_trt.load(spinning=...)``; ``off`` for several instances or servers on one CPU). The inputs become one
:class:`dflash2_trt.runtime.request.GenerationRequest` (the model's default parameters are one too, built at load),
checked by the record and the API alone: a bad
request gets one Triton error (INVALID_ARG) and is never queued; a cancelled request (the client cancelled or
disconnected, checked at least every 0.1 s) leaves the batch at the next step, freeing its slot. Custom
metrics, per instance: ``dflash2_active_requests`` (gauge), ``dflash2_requests`` (counter: requests queued for
decoding), ``dflash2_cancelled_requests`` (counter) and ``dflash2_batch_steps`` (gauge, label ``size``: batch
steps that decoded ``size`` sequences together, updated as requests end).
"""

import os
import site
import sys


def _add_python_path() -> None:
    # The stub embeds CPython in isolated mode, which ignores PYTHONPATH: add its entries ahead of the system
    # paths, with their .pth files processed (editable installs of dflash2-trt live in one)
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in entries if p not in sys.path]
    for p in entries:
        site.addsitedir(p)


_add_python_path()

import dataclasses  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from dflash2_trt.errors import DFlash2Error  # noqa: E402
from dflash2_trt.runtime.request import SAMPLING_SCALARS, GenerationRequest  # noqa: E402
from dflash2_trt.vocabulary import DEFAULT_PROPOSER, ORT_SPINNING, SPECULATION_MODES  # noqa: E402


def _scalar(request, name: str):  # noqa: ANN001, ANN202
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    a = t.as_numpy().reshape(-1)
    if a.size != 1:
        raise DFlash2Error(f"input {name!r} must hold one value, got {a.size}")
    v = a[0]
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        if int(np.__version__.split(".")[0]) >= 2:
            # this python backend reads arrays through the NumPy 1.x C ABI: under NumPy 2 every output would
            # reach the client empty, so refuse to load instead
            raise DFlash2Error(f"NumPy {np.__version__} is first on the server's path; the python backend needs "
                               f"NumPy 1.x (see dflash2_trt.serving.triton.server.numpy1_dir)")
        import dflash2_trt

        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.dir = Path(args["model_repository"]) / args["model_version"] / params.get("export_dir", "export")
        self.name = f"{cfg['name']}/{args['model_instance_name']}"
        threads = int(params.get("ort_threads", "0")) or None
        speculation = params.get("speculation", "adaptive")
        if speculation not in SPECULATION_MODES:
            raise DFlash2Error(f"parameter speculation must be one of {', '.join(SPECULATION_MODES)}, "
                               f"got {speculation!r}")
        spinning = params.get("ort_spinning", "auto")
        if spinning not in ORT_SPINNING:
            raise DFlash2Error(f"parameter ort_spinning must be one of {', '.join(ORT_SPINNING)}, got {spinning!r}")
        self.gen = dflash2_trt.load(self.dir, params.get("backend", "auto"), threads=threads,
                                    verify_checksums=params.get("verify_checksums", "true") == "true",
                                    spinning=ORT_SPINNING[spinning])
        pb_utils.Logger.log_info(f"dflash2 {self.name}: {self.gen.note}")
        max_batch = int(params.get("max_batch", "8"))
        self.gen.set_batching(max_batch, adaptive=speculation == "adaptive")
        # an instance holds at most max_batch requests: beyond, execute waits, so Triton hands new requests to
        # another instance (or keeps them in its queue) instead of piling them onto this one's
        self.slots = threading.BoundedSemaphore(max_batch)
        try:  # a request's defaults (seed 0: an input not given is the same stream every time)
            self.defaults = GenerationRequest(
                max_new_tokens=int(params.get("default_max_tokens", "128")), seed=0, speculative=speculation != "off",
                draft_mode=params.get("default_selector_mode", "greedy"),
                proposer=params.get("default_proposer", DEFAULT_PROPOSER))
        except DFlash2Error as e:
            raise DFlash2Error(f"the model's default parameters: {e}") from None
        self.max_tokens_limit = int(params.get("max_tokens_limit", "4096"))
        labels = {"model": cfg["name"], "instance": args["model_instance_name"]}
        # a family must outlive its metrics: both are kept for the instance's lifetime
        self.f_active = pb_utils.MetricFamily(name="dflash2_active_requests",
                                              description="DFlash 2 requests being decoded",
                                              kind=pb_utils.MetricFamily.GAUGE)
        self.f_cancelled = pb_utils.MetricFamily(name="dflash2_cancelled_requests",
                                                 description="DFlash 2 requests stopped by a cancellation",
                                                 kind=pb_utils.MetricFamily.COUNTER)
        self.f_requests = pb_utils.MetricFamily(name="dflash2_requests", description="DFlash 2 requests decoded",
                                                kind=pb_utils.MetricFamily.COUNTER)
        self.f_batch = pb_utils.MetricFamily(name="dflash2_batch_steps",
                                             description="batch steps that decoded `size` sequences together",
                                             kind=pb_utils.MetricFamily.GAUGE)
        # the most requests this instance held at once since it loaded: at most max_batch (the admission cap
        # above); an operator sizing max_batch and instance counts reads it
        self.f_peak = pb_utils.MetricFamily(name="dflash2_active_requests_peak",
                                            description="most DFlash 2 requests this instance held at once",
                                            kind=pb_utils.MetricFamily.GAUGE)
        self.labels, self.m_batch = labels, {}
        self.active = self.peak = 0
        # every call into the python backend (send, is_cancelled, metrics, log) under one lock: the forwarding
        # threads made concurrent calls that crashed the server (boost::interprocess::lock_exception)
        self.ipc = threading.RLock()
        self.m_active = self.f_active.Metric(labels=labels)
        self.m_requests = self.f_requests.Metric(labels=labels)
        self.m_cancelled = self.f_cancelled.Metric(labels=labels)
        self.m_peak = self.f_peak.Metric(labels=labels)

    def execute(self, requests: list) -> None:
        for request in requests:
            try:
                self._submit(request)
            except Exception as e:  # noqa: BLE001 - nothing may escape: the stub would be marked unhealthy
                with self.ipc:
                    pb_utils.Logger.log_error(f"dflash2 {self.name}: {type(e).__name__}: {e}")
                try:
                    self._send_error(request.get_response_sender(), f"internal error: {type(e).__name__}: {e}",
                                     pb_utils.TritonError.INTERNAL)
                except Exception:  # noqa: BLE001 - the request was already completed
                    pass
        return None

    def finalize(self) -> None:
        self.gen.close()

    # -- one request -------------------------------------------------------------------------------------
    def _parse(self, request) -> tuple[list[int], GenerationRequest]:  # noqa: ANN001
        """A request's inputs -> (prompt ids, its GenerationRequest: the defaults with the inputs given)."""
        text = _scalar(request, "text_input")
        ids_t = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if (text is None) == (ids_t is None):
            raise DFlash2Error("give exactly one of the inputs 'text_input' (a user message) and 'input_ids' "
                               "(prompt token ids)")
        if text is not None:
            prompt = self.gen.encode(text)  # the chat template when the tokenizer has one, else the raw text
        else:
            prompt = [int(t) for t in ids_t.as_numpy().reshape(-1)]
        given = {"max_new_tokens": _scalar(request, "max_tokens"), "temperature": _scalar(request, "temperature"),
                 "seed": _scalar(request, "seed"), "draft_mode": _scalar(request, "selector_mode") or None,
                 "proposer": _scalar(request, "proposer") or None,
                 **{k: _scalar(request, k) for k in SAMPLING_SCALARS}}
        casts = {"max_new_tokens": int, "temperature": float, "seed": int, "draft_mode": str, "proposer": str,
                 **SAMPLING_SCALARS}
        req = dataclasses.replace(self.defaults, **{k: casts[k](v) for k, v in given.items() if v is not None})
        if req.max_new_tokens > self.max_tokens_limit:  # this deployment's cap (parameter max_tokens_limit)
            raise DFlash2Error(f"max_tokens must be at most {self.max_tokens_limit}, got {req.max_new_tokens}")
        return prompt, req

    def _submit(self, request) -> None:  # noqa: ANN001
        """Check and queue one request, then forward its chunks from a thread of its own."""
        try:
            with self.ipc:
                sender = request.get_response_sender()
                request_id = request.request_id()
                prompt, req = self._parse(request)
        except (DFlash2Error, ValueError, UnicodeError) as e:
            self._send_error(sender, str(e))
            return
        self.slots.acquire()  # released by the request's forwarder, or below
        try:
            handle = self.gen.submit(prompt, chat=False, request=req)
        except BaseException as e:
            self.slots.release()
            if not isinstance(e, DFlash2Error):
                raise
            self._send_error(sender, str(e))
            return
        with self.ipc:
            self.m_active.increment(1)
            self.m_requests.increment(1)
            self.active += 1
            if self.active > self.peak:
                self.peak = self.active
                self.m_peak.set(self.peak)
        threading.Thread(target=self._forward, args=(sender, handle, request_id), daemon=True,
                         name="dflash2-forward").start()

    def _forward(self, sender, handle, request_id: str) -> None:  # noqa: ANN001
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        tokens, accepted = 0, []
        try:
            for c in handle.chunks(poll=0.1):
                with self.ipc:
                    cancelled = sender.is_cancelled()
                if cancelled:
                    handle.cancel()  # out of the batch: its slot is free when this returns
                    with self.ipc:
                        self.m_cancelled.increment(1)
                        pb_utils.Logger.log_info(f"dflash2 {self.name}: request {request_id!r} cancelled after "
                                                 f"{tokens} tokens")
                        try:
                            sender.send(flags=final)
                        except Exception:  # noqa: BLE001 - the stream may already be gone; nothing is left to free
                            pass
                    return
                if c is None:
                    continue
                tokens += len(c.tokens)
                acc = [] if c.accepted is None else [c.accepted]
                accepted += acc
                with self.ipc:
                    sender.send(self._response(c.tokens, c.text, acc, self._tau(accepted)))
            with self.ipc:
                sender.send(self._response([], "", accepted, self._tau(accepted)), flags=final)
        except DFlash2Error as e:
            self._send_error(sender, str(e))
        except Exception as e:  # noqa: BLE001 - an unexpected failure fails this request, not the instance
            try:
                with self.ipc:
                    pb_utils.Logger.log_error(f"dflash2 {self.name}: {type(e).__name__}: {e}")
                self._send_error(sender, f"internal error: {type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)
            except Exception:  # noqa: BLE001 - the stream is gone
                pass
        finally:
            handle.cancel()  # no effect once finished; frees the slot when sending failed mid-stream
            with self.ipc:
                self.m_active.increment(-1)
                self.active -= 1  # before the slot is released: the next request's count starts from this one
            self.slots.release()
            with self.ipc:
                for size, steps in self.gen.batch_sizes.items():
                    if size not in self.m_batch:
                        self.m_batch[size] = self.f_batch.Metric(labels={**self.labels, "size": str(size)})
                    self.m_batch[size].set(steps)

    @staticmethod
    def _tau(accepted: list[int]) -> float:
        """Tokens per cycle so far (accepted drafts + the bonus token), pooled over the request's cycles."""
        return (sum(accepted) + len(accepted)) / len(accepted) if accepted else 0.0

    @staticmethod
    def _response(ids: list[int], text: str, accepted: list[int], tau: float):  # noqa: ANN205
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int64)),  # [n]
            pb_utils.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_)),  # [1]
            pb_utils.Tensor("accepted", np.asarray(accepted, dtype=np.int32)),  # [c]
            pb_utils.Tensor("tau", np.asarray([tau], dtype=np.float32)),  # [1]
        ])

    def _send_error(self, sender, message: str, code=None) -> None:  # noqa: ANN001
        with self.ipc:
            code = pb_utils.TritonError.INVALID_ARG if code is None else code
            error = pb_utils.TritonError(f"dflash2: {message}", code)
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
