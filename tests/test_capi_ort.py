"""libdflash2's ONNX Runtime backend (runtime/src/backends/ortBackend.cpp) on the demo's SmolLM2 export, against the
Python runtime: ``examples/generate`` (built by test_capi's ``build/capi-tests``) decodes MT-Bench prompts from
token ids, greedy, token for token equal to ``dflash2_trt.load(...).generate``; at T = 0.8 the library, driven
through ctypes with numpy's uniforms, equals it for the same seeds; a ``dfl2_batch`` of 8 prompts equals their
single runs; without ONNX Runtime, or with one whose C API is older than the headers', one line and exit status 1.

The Python runtime runs here with its custom-op library off (``DFLASH2_ORT_OPS`` naming no file): then it runs the
graphs the C backend runs (the fused target with ONNX Runtime's GroupQueryAttention, the standard drafter block, the
decomposed selector head), so sampling can be compared bit for bit.
"""

from __future__ import annotations

import ctypes as C
import os
import re
import subprocess
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from test_capi import (BUILD, P, _check, _c_options, _numpy_uniforms, _run, _Stats, _TOKENS, _UNIFORM, capi_build,  # noqa: F401
                       lib, vectors_path)

pytestmark = pytest.mark.slow

N_PROMPTS = 20
MAX_NEW = 12
THREADS = 2
NO_LIBRARY = {"DFLASH2_ORT_OPS": "/nonexistent/libdflash2_ort_ops.so"}  # the Python backend without its op library


def _wheel_venv() -> str:
    """The virtual environment holding the onnxruntime wheel (the library's last search rule looks there)."""
    import onnxruntime

    return str(Path(onnxruntime.__file__).parents[4])  # VENV/lib/python3.X/site-packages/onnxruntime/__init__.py


@pytest.fixture(autouse=True)
def _venv(monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", _wheel_venv())
    monkeypatch.delenv("ORT_LIBRARY", raising=False)


@contextmanager
def _python_graphs():
    with mock.patch.dict(os.environ, NO_LIBRARY):
        yield


@pytest.fixture(scope="module")
def py_gen(smol_export):
    import dflash2_trt

    with _python_graphs():
        g = dflash2_trt.load(smol_export, backend="ort", threads=THREADS)
        assert g._backend.attention_op == "GroupQueryAttention" and not g._backend.decode_attention  # noqa: SLF001
        yield g
        g.close()


@pytest.fixture(scope="module")
def prompts(py_gen) -> list[list[int]]:
    from dflash2_trt.bench.prompts import encode_items, load_prompts

    items = load_prompts("mtbench", N_PROMPTS)
    return encode_items(items, py_gen._tok.encode, lambda m: py_gen._tok.apply_chat_template(m))  # noqa: SLF001


def _example(build: Path, export: Path, prompts: list[list[int]], mode: str, *options: str,
             env: dict | None = None) -> tuple[list[list[int]], str]:
    """examples/generate MODE (-s or -b) over the prompts -> (each request's ids, stderr)."""
    args = [str(build / "bin" / "generate"), str(export), mode]
    for i, p in enumerate(prompts):
        args += ([","] if i else []) + [str(t) for t in p]
    for o in ("backend=ort", f"threads={THREADS}", f"max_new_tokens={MAX_NEW}", *options):
        args += ["-o", o]
    proc = _run(args, "examples/generate", env=env)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(prompts), proc.stdout
    return [[int(t) for t in line.split()] for line in lines], proc.stderr


@pytest.fixture(scope="module")
def c_greedy(capi_build, smol_export, prompts):
    return _example(capi_build, smol_export, prompts, "-s", "guard=true")


def test_example_greedy_equals_python_runtime(c_greedy, py_gen, prompts):
    """Greedy, the library's defaults plus the guard (as the Python API's): every prompt's ids equal; drafts were
    accepted (τ > 1 printed for some request); the note says ONNX Runtime ran and which library file."""
    got, err = c_greedy
    for ids, c_tokens in zip(prompts, got):
        assert c_tokens == py_gen.generate(ids, max_new_tokens=MAX_NEW).tokens
    note = err.splitlines()[0]
    assert re.match(r"generate: using ONNX Runtime 1\.\d+\.\d+ \(.*libonnxruntime\.so\.1", note), note
    assert "target_ort.onnx" in note and f"threads {THREADS}" in note
    taus = [float(t) for t in re.findall(r"tau (\d+\.\d+)", err)]
    assert len(taus) == len(prompts) and max(taus) > 1.0, err


def test_batch_of_8_equals_single_runs(capi_build, smol_export, prompts, c_greedy):
    """dfl2_batch over the ONNX Runtime model: 8 requests decoded together give each request's single-run ids."""
    got, err = _example(capi_build, smol_export, prompts[:8], "-b", "max_batch=8")
    assert got == c_greedy[0][:8]
    assert len(re.findall(r"request \d+: \d+ tokens", err)) == 8


@contextmanager
def _c_session(lib, export: Path, options: dict):  # noqa: ANN001, ANN202
    """A dfl2_model loaded from the export with ``options`` and one session of it."""
    V = C.c_void_p
    model, session = V(), V()
    opts = _c_options(lib, options)
    try:
        _check(lib, lib.dfl2_model_load(str(export).encode(), opts, C.byref(model)))
        _check(lib, lib.dfl2_session_create(model, opts, C.byref(session)))
        yield session
    finally:
        lib.dfl2_session_free(session)
        lib.dfl2_model_free(model)
        lib.dfl2_options_free(opts)


def _c_sample(lib, session, prompt: list[int], seed: int) -> tuple[list[int], list[int], list[str]]:  # noqa: ANN001
    """One request through dfl2_session_generate with numpy's uniforms (default_rng(seed)) -> (ids, accepted per
    cycle, proposer per cycle)."""
    rng = np.random.default_rng(seed)

    def uniforms(u, use, out, n):  # noqa: ANN001, ANN202
        _numpy_uniforms(rng, use, out, n)
        return 0

    cb = _UNIFORM(uniforms)
    _check(lib, lib.dfl2_session_set_uniform_source(session, cb, None))
    arr = (C.c_int32 * len(prompt))(*prompt)
    _check(lib, lib.dfl2_session_generate(session, arr, len(prompt), _TOKENS(0), None))
    toks, n = P(C.c_int32)(), C.c_size_t()
    _check(lib, lib.dfl2_session_get_tokens(session, C.byref(toks), C.byref(n)))
    st = _Stats()
    _check(lib, lib.dfl2_session_get_stats(session, C.byref(st)))
    who, m = P(C.c_int32)(), C.c_size_t()
    _check(lib, lib.dfl2_session_get_proposers(session, C.byref(who), C.byref(m)))
    return list(toks[: n.value]), list(st.accepted[: st.cycles]), [("dflash2", "ngram")[w] for w in who[: m.value]]


def test_sampling_equals_python_runtime_same_seed(lib, smol_export, py_gen, prompts):
    """T = 0.8, no guard (its timing would choose the step kinds), the default proposers (the drafter, prompt lookup
    where the context repeats itself): the library with numpy's uniforms for seed s gives the Python runtime's ids
    for seed s, on every prompt, with the same accepted drafts and proposer per cycle; drafter cycles rejection-sample
    against its proposal (the residual's draws differ when the proposal does), and drafts were accepted."""
    opts = {"backend": "ort", "threads": THREADS, "max_new_tokens": MAX_NEW, "temperature": 0.8}
    accepted = drafter_cycles = 0
    with _c_session(lib, smol_export, opts) as session:
        for i, ids in enumerate(prompts):
            c_tokens, acc, who = _c_sample(lib, session, ids, 100 + i)
            want = py_gen.generate(ids, max_new_tokens=MAX_NEW, temperature=0.8, seed=100 + i, guard=False)
            assert c_tokens == want.tokens, i
            assert acc == want.stats.accepted and who == want.stats.proposers, i
            accepted += sum(acc)
            drafter_cycles += who.count("dflash2")
    assert accepted > 0 and drafter_cycles > len(prompts)


def test_without_onnxruntime_one_line_exit_1(capi_build, smol_export, tmp_path):
    """No libonnxruntime to be found (no $VIRTUAL_ENV, nothing on the loader's path), $ORT_LIBRARY naming a missing
    file, and a library whose C API is older than the headers' (a fake libonnxruntime answering GetApi with NULL):
    each one line on stderr naming the reason, exit status 1, no crash."""
    gen = str(capi_build / "bin" / "generate")
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "ORT_LIBRARY", "LD_LIBRARY_PATH")}
    cases = {"absent": ({}, "ONNX Runtime not found"),
             "missing": ({"ORT_LIBRARY": str(tmp_path / "libonnxruntime.so.1.99.0")}, "cannot open")}
    fake = tmp_path / "libonnxruntime.so.1.16.0"
    src = tmp_path / "fake.c"
    src.write_text('static const void* get_api(unsigned v) { (void) v; return 0; }\n'
                   'static const char* version(void) { return "1.16.0"; }\n'
                   'static struct { const void* (*GetApi)(unsigned); const char* (*GetVersionString)(void); } '
                   'base = {get_api, version};\n'
                   'const void* OrtGetApiBase(void) { return &base; }\n')
    _run(["cc", "-shared", "-fPIC", "-o", str(fake), str(src)], "cc fake libonnxruntime")
    cases["old"] = ({"ORT_LIBRARY": str(fake)}, "ONNX Runtime 1.16.0 ($ORT_LIBRARY")
    for name, (env, want) in cases.items():
        proc = subprocess.run([gen, str(smol_export), "1", "2", "3", "-o", "backend=ort"], capture_output=True,
                              text=True, env={**base, **env})
        assert proc.returncode == 1, (name, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("generate: load: ") and want in lines[0], (name, lines)
    assert "does not provide C API version" in proc.stderr
