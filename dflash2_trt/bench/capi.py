"""The C library (libdflash2) from Python through ctypes, for the tests and benchmarks that drive it: its types and
signatures written once (runtime/include/dflash2/dflash2.h: the callback types, the structs, :func:`declare` for
every function's argument and return types), :func:`numpy_uniforms` (the Python runtime's draws as a uniform
source), :func:`wheel_venv` (where the library finds libonnxruntime) and :func:`run_driver`, which runs a driver
script in a process of its own with these names, ``lib``, ``req``, ``ok``, ``options`` and ``generate`` already
defined (one process per driver: the library opens the onnxruntime wheel's library, and a process must not hold the
Python runtime's ONNX Runtime too)."""

from __future__ import annotations

import ctypes as C
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

V, P = C.c_void_p, C.POINTER

# dfl2_callbacks' functions
TR = C.CFUNCTYPE(C.c_int32, V)  # target_reset, drafter_reset
TF = C.CFUNCTYPE(C.c_int32, V, P(C.c_int32), C.c_int32, P(C.c_float), P(C.c_float))
TC = C.CFUNCTYPE(C.c_int32, V, C.c_int32)
DA = C.CFUNCTYPE(C.c_int32, V, P(C.c_float), C.c_int32, C.c_int32)
DP = C.CFUNCTYPE(C.c_int32, V, C.c_int32, C.c_int32, C.c_int32, C.c_float, P(C.c_float), P(C.c_int32), P(C.c_float),
                 P(C.c_int32), P(C.c_float), P(C.c_int32))
# the batched callbacks (API 1.1), appended to dfl2_callbacks
BSLOT = C.CFUNCTYPE(C.c_int32, V, C.c_int32)
BTF = C.CFUNCTYPE(C.c_int32, V, C.c_int32, P(C.c_int32), P(C.c_int32), P(C.c_int32), P(C.c_int32), C.c_int32,
                  P(C.c_float), P(C.c_float))
BTC = C.CFUNCTYPE(C.c_int32, V, C.c_int32, C.c_int32)
BDA = C.CFUNCTYPE(C.c_int32, V, C.c_int32, P(C.c_float), C.c_int32, C.c_int32)
BDP = C.CFUNCTYPE(C.c_int32, V, C.c_int32, C.c_int32, C.c_int32, C.c_int32, C.c_float, P(C.c_float), P(C.c_int32),
                  P(C.c_float), P(C.c_int32), P(C.c_float), P(C.c_int32))
# the caller's callbacks
TOKENS = C.CFUNCTYPE(C.c_int32, V, P(C.c_int32), C.c_size_t)
UNIFORM = C.CFUNCTYPE(C.c_int32, V, C.c_int, P(C.c_double), C.c_size_t)
DONE = C.CFUNCTYPE(None, V, C.c_uint64, C.c_int, V)


class Callbacks(C.Structure):
    _fields_ = [("struct_size", C.c_uint32), ("user_data", V), ("vocab_size", C.c_int32), ("feature_dim", C.c_int32),
                ("block_size", C.c_int32), ("top_k", C.c_int32), ("max_positions", C.c_int32),
                ("eos_ids", P(C.c_int32)), ("n_eos_ids", C.c_size_t), ("target_reset", TR), ("target_forward", TF),
                ("target_crop", TC), ("drafter_reset", TR), ("drafter_add_context", DA), ("drafter_propose", DP)]


class BatchCallbacks(Callbacks):
    _fields_ = [("max_batch", C.c_int32), ("batch_target_reset", BSLOT), ("batch_target_release", BSLOT),
                ("batch_target_forward", BTF), ("batch_target_crop", BTC), ("batch_drafter_reset", BSLOT),
                ("batch_drafter_add_context", BDA), ("batch_drafter_propose", BDP)]


class Request(C.Structure):
    _fields_ = [("struct_size", C.c_uint32), ("prompt", P(C.c_int32)), ("n_prompt", C.c_size_t), ("options", V),
                ("on_tokens", TOKENS), ("on_done", DONE), ("user_data", V), ("uniforms", UNIFORM),
                ("uniforms_user_data", V)]


class BatchInfo(C.Structure):
    _fields_ = [("max_batch", C.c_int32), ("active", C.c_int32), ("queued", C.c_int32), ("largest_step", C.c_int32),
                ("largest_plain", C.c_int32), ("steps", C.c_int64), ("drafting_steps", C.c_int64),
                ("cycles", C.c_int64), ("prefill_calls", C.c_int64), ("prefill_rows", C.c_int64),
                ("prefix_hits", C.c_int64), ("cached_tokens", C.c_int64), ("prefix_cache_bytes", C.c_int64),
                ("prefix_entries", C.c_int64), ("prefix_evictions", C.c_int64)]


class Stats(C.Structure):
    _fields_ = [("tau", C.c_double), ("oracle_tau", C.c_double), ("cycles", C.c_int32), ("n_tokens", C.c_int32),
                ("n_positions", C.c_int32), ("finish_reason", C.c_int), ("per_position_cumulative", P(C.c_double)),
                ("per_position_conditional", P(C.c_double)), ("accepted", P(C.c_int32)),
                ("proposed", P(C.c_int32)), ("oracle_accepted", P(C.c_int32)), ("elapsed_s", C.c_double),
                ("cached_tokens", C.c_int32)]


class ModelInfo(C.Structure):
    _fields_ = [("vocab_size", C.c_int32), ("block_size", C.c_int32), ("top_k", C.c_int32),
                ("max_positions", C.c_int32), ("backend", C.c_char_p)]


class Logprob(C.Structure):
    _fields_ = [("token", C.c_int32), ("logprob", C.c_double), ("n_top", C.c_int32), ("top_ids", P(C.c_int32)),
                ("top_logprobs", P(C.c_double))]


def declare(lib: C.CDLL) -> C.CDLL:
    """``lib`` (libdflash2) with every function's argument and return types set -> ``lib``."""
    lib.dfl2_status_code.restype, lib.dfl2_status_code.argtypes = C.c_int, [V]
    lib.dfl2_status_message.restype, lib.dfl2_status_message.argtypes = C.c_char_p, [V]
    lib.dfl2_status_free.argtypes = [V]
    lib.dfl2_api_version.restype = C.c_uint32
    for name, args in {
        "dfl2_options_create": [P(V)], "dfl2_options_parse": [V, C.c_char_p],
        "dfl2_model_create_callbacks": [P(Callbacks), V, P(V)], "dfl2_model_load": [C.c_char_p, V, P(V)],
        "dfl2_model_get_note": [V, P(C.c_char_p)], "dfl2_model_get_info": [V, P(ModelInfo)],
        "dfl2_session_create": [V, V, P(V)], "dfl2_session_generate": [V, P(C.c_int32), C.c_size_t, TOKENS, V],
        "dfl2_session_set_uniform_source": [V, UNIFORM, V],
        "dfl2_session_get_tokens": [V, P(P(C.c_int32)), P(C.c_size_t)], "dfl2_session_get_stats": [V, P(Stats)],
        "dfl2_session_get_proposers": [V, P(P(C.c_int32)), P(C.c_size_t)],
        "dfl2_session_get_logprobs": [V, P(P(Logprob)), P(C.c_size_t)],
        "dfl2_batch_create": [V, V, P(V)], "dfl2_batch_submit": [V, P(Request), P(C.c_uint64)],
        "dfl2_batch_cancel": [V, C.c_uint64], "dfl2_batch_step": [V, P(C.c_size_t)],
        "dfl2_batch_get_result": [V, C.c_uint64, P(P(C.c_int32)), P(C.c_size_t), P(Stats), P(C.c_int32)],
        "dfl2_batch_get_info": [V, P(BatchInfo)],
        "dfl2_batch_get_proposers": [V, C.c_uint64, P(P(C.c_int32)), P(C.c_size_t)],
    }.items():  # fmt: skip
        getattr(lib, name).restype, getattr(lib, name).argtypes = V, args
    for name in ("dfl2_options_free", "dfl2_model_free", "dfl2_session_free", "dfl2_batch_free"):
        getattr(lib, name).argtypes = [V]
    return lib


def numpy_uniforms(seed: int):  # noqa: ANN201
    """A dfl2 uniform source (wrap it in :data:`UNIFORM`) drawing numpy's uniforms as the Python runtime does for
    ``seed``: a float32 row for proposal draws (use 0), one double otherwise."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def uniforms(user_data, use, buf, n):  # noqa: ANN001, ANN202
        vals = rng.random((1, n), dtype=np.float32).reshape(-1) if use == 0 else np.array([rng.random()])
        np.ctypeslib.as_array(buf, (n,))[:] = vals
        return 0

    return uniforms


# What every driver script starts with: ``req`` (its JSON request from stdin, "lib" the library's path), ``lib``
# declared, ``ok`` (a status -> exit with its message), ``options`` (key=value strings -> a dfl2_options),
# ``generate`` (a session's generate with numpy's uniforms for a seed -> {tokens, accepted, cached, proposers}).
_PREAMBLE = r"""
import ctypes as C, json, sys
from dflash2_trt.bench.capi import *
req = json.loads(sys.stdin.read())
lib = declare(C.CDLL(req["lib"]))
def ok(st):
    if st:
        sys.exit("status: " + lib.dfl2_status_message(st).decode())
def options(kvs):
    o = V()
    ok(lib.dfl2_options_create(C.byref(o)))
    for kv in kvs:
        ok(lib.dfl2_options_parse(o, kv.encode()))
    return o
def generate(session, prompt, seed):
    cb = UNIFORM(numpy_uniforms(seed))
    ok(lib.dfl2_session_set_uniform_source(session, cb, None))
    ok(lib.dfl2_session_generate(session, (C.c_int32 * len(prompt))(*prompt), len(prompt), TOKENS(0), None))
    toks, n, st, who, m = P(C.c_int32)(), C.c_size_t(), Stats(), P(C.c_int32)(), C.c_size_t()
    ok(lib.dfl2_session_get_tokens(session, C.byref(toks), C.byref(n)))
    ok(lib.dfl2_session_get_stats(session, C.byref(st)))
    ok(lib.dfl2_session_get_proposers(session, C.byref(who), C.byref(m)))
    return {"tokens": toks[: n.value], "accepted": st.accepted[: st.cycles], "cached": st.cached_tokens,
            "proposers": [("dflash2", "ngram")[w] for w in who[: m.value]]}
"""


def wheel_venv() -> str:
    """The venv whose onnxruntime wheel the library's ONNX Runtime backend opens (its $VIRTUAL_ENV rule)."""
    import onnxruntime

    return str(Path(onnxruntime.__file__).parents[4])  # VENV/lib/python3.X/site-packages/onnxruntime/__init__.py


def run_driver(body: str, req: dict[str, Any], env: dict[str, str] | None = None) -> Any:  # noqa: ANN401
    """``body`` after the preamble in a fresh Python with ``req`` on stdin, $VIRTUAL_ENV the onnxruntime wheel's venv
    (where the library finds libonnxruntime) and ``env`` -> the JSON it printed (its exit status asserted 0)."""
    proc = subprocess.run([sys.executable, "-c", _PREAMBLE + body], input=json.dumps(req), capture_output=True,
                          text=True, env={**os.environ, "VIRTUAL_ENV": wheel_venv(), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
