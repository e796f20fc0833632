"""The Triton model's input checks, in process: ``serving/triton/templates/dflash2_model.py``'s ``_submit`` with a
stand-in for the python backend's ``triton_python_backend_utils`` (the real one exists only inside
``tritonserver``), over the tiny export's Generator. Hypothesis generates requests over every optional input with
the config's data types and any shape — ids of any int64, invalid UTF-8 text, NaN / infinite temperatures,
extreme seeds and token counts, bogus modes, sampling transforms in and out of range — and each must end in exactly one final response: its tokens, or an
INVALID_ARG error; an INTERNAL error (the server's fault) for a client's input fails. tests/test_triton.py checks
the same model under the real server with chosen bad requests.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the dev extra")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dflash2_trt  # noqa: E402
from dflash2_trt.runtime.request import SAMPLING_SCALARS, GenerationRequest  # noqa: E402

MODEL_FILE = Path(dflash2_trt.__file__).parent / "serving" / "triton" / "templates" / "dflash2_model.py"
FINAL = 1
LIMIT = 6  # the deployment's max_tokens_limit here: every accepted request decodes a few tokens


class _Error:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message: str, code: str) -> None:
        self.message, self.code = message, code


class _Response:
    def __init__(self, output_tensors: list, error: _Error | None = None) -> None:
        self.outputs, self.error = output_tensors, error


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class _Metric:
    def increment(self, n: float) -> None:
        pass

    def set(self, v: float) -> None:
        pass


def _backend_utils() -> types.ModuleType:
    """What the model uses of ``triton_python_backend_utils``."""
    m = types.ModuleType("triton_python_backend_utils")
    m.TritonError = _Error
    m.InferenceResponse = _Response
    m.Tensor = _Tensor
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    m.Logger = types.SimpleNamespace(log_info=lambda msg: None, log_error=lambda msg: None)
    m.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    return m


class _Sender:
    """A response sender: records what the model sends; ``done`` once the final flag came."""

    def __init__(self) -> None:
        self.responses: list[_Response] = []
        self.finals = 0
        self.done = threading.Event()

    def send(self, response: _Response | None = None, flags: int = 0) -> None:
        if response is not None:
            self.responses.append(response)
        if flags & FINAL:
            self.finals += 1
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


class _Request:
    def __init__(self, inputs: dict[str, np.ndarray]) -> None:
        self.inputs = {k: _Tensor(k, v) for k, v in inputs.items()}
        self.sender = _Sender()

    def get_response_sender(self) -> _Sender:
        return self.sender

    def request_id(self) -> str:
        return "r"


@pytest.fixture(scope="module")
def model(tiny_export):
    """The model's instance as ``initialize`` would leave it (its metrics stand-ins), on the tiny export."""
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "triton_python_backend_utils", _backend_utils())
    spec = importlib.util.spec_from_file_location("dflash2_model_under_test", MODEL_FILE)
    mod = importlib.util.module_from_spec(spec)
    mp.setitem(sys.modules, spec.name, mod)  # the plant finds the module by the instance's class
    spec.loader.exec_module(mod)
    inst = object.__new__(mod.TritonPythonModel)
    with dflash2_trt.load(tiny_export, "ort", threads=1) as gen:
        inst.gen, inst.name, inst.max_tokens_limit = gen, "dflash2/0", LIMIT
        inst.defaults = GenerationRequest(max_new_tokens=4, seed=0)
        inst.slots, inst.ipc = threading.BoundedSemaphore(4), threading.RLock()
        inst.active = inst.peak = 0
        inst.labels, inst.m_batch = {}, {}
        inst.m_active = inst.m_requests = inst.m_cancelled = inst.m_peak = _Metric()
        inst.f_batch = types.SimpleNamespace(Metric=lambda labels: _Metric())
        yield inst
    mp.undo()


def _array(dtype: Any, elements: st.SearchStrategy) -> st.SearchStrategy:
    """An input tensor of the config's type: usually one value, sometimes none or several."""
    return st.lists(elements, min_size=0, max_size=3).map(lambda v: np.array(v, dtype=dtype)) | elements.map(
        lambda v: np.array([v], dtype=dtype))


INT64 = st.integers(-2**63, 2**63 - 1) | st.integers(-3, 40)
ANY = st.fixed_dictionaries({}, optional={
    "input_ids": st.lists(INT64, max_size=12).map(lambda v: np.array(v, dtype=np.int64)),
    "text_input": _array(np.object_, st.binary(max_size=20) | st.text(max_size=10).map(str.encode)),
    "max_tokens": _array(np.int32, st.integers(-2**31, 2**31 - 1) | st.integers(-1, LIMIT + 1)),
    "temperature": _array(np.float32, st.floats(width=32) | st.sampled_from([0.0, 0.7, 2.0])),
    "seed": _array(np.int64, INT64),
    "selector_mode": _array(np.object_, st.sampled_from([b"greedy", b"viterbi", b"independent", b"", b"\xff",
                                                         b"bogus"])),
    "proposer": _array(np.object_, st.sampled_from([b"dflash2", b"ngram", b"auto", b"", b"\xfe\xff", b"x"])),
    **{k: _array(np.float32, st.floats(width=32) | st.sampled_from([0.0, 0.5, 1.0, 1.5]))
       for k, t in SAMPLING_SCALARS.items() if t is float},
    "top_k": _array(np.int32, st.integers(-2**31, 2**31 - 1) | st.integers(-2, 5)),
})
VALID = st.fixed_dictionaries({  # a request the model takes, with one generated input over it
    "input_ids": st.lists(st.integers(0, 15), min_size=1, max_size=8).map(lambda v: np.array(v, dtype=np.int64)),
    "max_tokens": st.integers(1, LIMIT).map(lambda v: np.array([v], dtype=np.int32))})
INPUTS = ANY | st.tuples(VALID, ANY).map(lambda p: {**p[0], **dict(list(p[1].items())[:1])})


def check_inputs(model: Any) -> dict[str, int]:
    """300 generated requests through ``execute``: each ends in exactly one final response, its error (if any)
    INVALID_ARG -> how many were decoded and how many refused."""
    seen = {"ok": 0, "invalid": 0}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(INPUTS)
    def one(inputs: dict) -> None:
        req = _Request(inputs)
        model.execute([req])
        assert req.sender.done.wait(30), "no final response"
        errors = [r.error for r in req.sender.responses if r.error is not None]
        assert req.sender.finals == 1 and len(errors) <= 1, (inputs, req.sender.responses)
        if errors:
            assert errors[0].code == _Error.INVALID_ARG, (inputs, errors[0].message)
        seen["invalid" if errors else "ok"] += 1

    one()
    return seen


def test_every_request_ends_in_tokens_or_invalid_arg(model):
    seen = check_inputs(model)
    assert seen["ok"] >= 50 and seen["invalid"] >= 100, seen  # both paths ran, not only refusals


def test_every_request_ends_in_tokens_or_invalid_arg_plant(model, monkeypatch):
    """Negative control: an input of no values read as if it held one (the size check of ``_scalar`` one-sided)
    raises IndexError, which execute answers INTERNAL: the check fails."""
    mod = sys.modules[type(model).__module__]
    src = inspect.getsource(mod._scalar)
    assert src.count("if a.size != 1:") == 1
    scope: dict = {}
    exec(compile(src.replace("if a.size != 1:", "if a.size > 1:"), str(MODEL_FILE), "exec"), vars(mod), scope)  # noqa: S102
    monkeypatch.setattr(mod, "_scalar", scope["_scalar"])
    with pytest.raises(AssertionError, match="INTERNAL|IndexError"):
        check_inputs(model)


def _output_ids(model: Any, inputs: dict) -> tuple[list[int], list[_Error]]:
    req = _Request(inputs)
    model.execute([req])
    assert req.sender.done.wait(60), "no final response"
    ids = [int(t) for r in req.sender.responses for o in r.outputs if o.name == "output_ids" for t in o.array]
    return ids, [r.error for r in req.sender.responses if r.error is not None]


def test_sampling_inputs_reach_the_request(model):
    """The sampling inputs (top_p, top_k, min_p and the penalties: SAMPLING_SCALARS) become the request record's
    fields: greedy output with penalties = the Python API's with the same fields, and differs from the output
    without them; a value out of range is INVALID_ARG naming the field."""
    kw = {"presence_penalty": 2.0, "frequency_penalty": 1.5, "repetition_penalty": 3.0, "top_k": 4, "top_p": 0.9,
          "min_p": 0.01}
    gen, rng = model.gen, np.random.default_rng(0)
    for _ in range(20):  # a prompt whose greedy output the penalties change (the random target rarely repeats)
        p = rng.integers(4, 64, 6).tolist() * 2
        want = gen.generate(p, request=GenerationRequest(max_new_tokens=LIMIT, seed=0, **kw)).tokens
        plain = gen.generate(p, request=GenerationRequest(max_new_tokens=LIMIT, seed=0)).tokens
        if want != plain:
            break
    assert want != plain
    inputs = {"input_ids": np.array(p, np.int64), "max_tokens": np.array([LIMIT], np.int32),
              **{k: np.array([v], np.int32 if isinstance(v, int) else np.float32) for k, v in kw.items()}}
    got, errors = _output_ids(model, inputs)
    assert not errors and got == want
    for name, bad in (("top_p", 1.5), ("presence_penalty", 3.0), ("top_k", -2)):
        _, errors = _output_ids(model, {"input_ids": np.array(p, np.int64), name: np.array(
            [bad], np.int32 if name == "top_k" else np.float32)})
        assert len(errors) == 1 and errors[0].code == _Error.INVALID_ARG and name in errors[0].message, name
