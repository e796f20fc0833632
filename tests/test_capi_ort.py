"""libdflash2's ONNX Runtime backend (runtime/src/backends/ortBackend.cpp) on SmolLM2 with the identity-initialised
drafter (``identity_export``), against the Python runtime: ``examples/generate`` (built by test_capi's
``build/capi-tests``) decodes MT-Bench prompts from token ids, greedy, token for token equal to
``dflash2_trt.load(...).generate``; at T = 0.8 the library, driven
through ctypes with numpy's uniforms, equals it for the same seeds; a ``dfl2_batch`` of 8 prompts equals their
single runs; without ONNX Runtime, or with one whose C API is older than the headers', one line and exit status 1.

Both runtimes use the project's op library where the Python runtime finds it (scripts/setup.sh builds it): the fused
target rewritten at load with dflash2.DecodeAttention (and PanelMatMul where its kernels run AVX-512), the drafter's
one-node layers and the selector's plugin node; the C library takes the same file through $DFLASH2_ORT_OPS. Without
it (``DFLASH2_ORT_OPS`` naming no file) both run ONNX Runtime's own ops (GroupQueryAttention, the standard drafter
block, the decomposed selector head): sampled again on a few prompts.

A hybrid export (test_capi's ``hybrid_export``: ``make-tiny --arch qwen3_5 --accepting``, Gated DeltaNet layers
beside attention layers, manifest version 3): the library keeps and rolls back the linear layers' state, so greedy
and T = 0.8 runs equal the Python runtime's with partial acceptances; its planted bug (no rollback) is caught; a
batch equals its single runs; the example runs clean under ASan + UBSan. Sliding-window exports (gpt-oss, Muse
Glimmer) likewise, with their rings.

Tiny int4 (``--quantize int4``) and fp16 (``--dtype fp16``) exports of the accepting llama pair, drafting with the
greedy selector and with independent rows: greedy and T = 0.8 equal the Python runtime's, the int4 target rewritten
with as many PanelMatMulQ4 nodes as the Python rewrite makes; a bf16 export is refused by both runtimes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import pytest

from dflash2_trt.bench.capi import run_driver, wheel_venv
from test_capi import BUILD, _cmake_build, _need, _prompts, _run, capi_build, hybrid_export, vectors_path  # noqa: F401

pytestmark = pytest.mark.slow

N_PROMPTS = 20
MAX_NEW = 12
THREADS = 2
NO_LIBRARY = "/nonexistent/libdflash2_ort_ops.so"  # DFLASH2_ORT_OPS naming no file: neither runtime uses the library


def _ops_library() -> str:
    """The op library the Python runtime finds (its default search), for the C library's $DFLASH2_ORT_OPS."""
    from dflash2_trt.runtime.ort.decode_attention import find_library

    lib = find_library()
    assert lib is not None, "libdflash2_ort_ops.so not built (scripts/setup.sh builds it)"
    return str(lib)


@pytest.fixture(autouse=True)
def _venv(monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", wheel_venv())
    monkeypatch.delenv("ORT_LIBRARY", raising=False)


def _load(export: Path, ops: str, env: dict | None = None, selectors: tuple[str, ...] = ("greedy",)):  # noqa: ANN202
    """The Python runtime over ``export`` with $DFLASH2_ORT_OPS = ``ops`` (and ``env``) while its sessions open (the
    drafter graphs of each of ``selectors``)."""
    import dflash2_trt

    with mock.patch.dict(os.environ, {"DFLASH2_ORT_OPS": ops, **(env or {})}):
        g = dflash2_trt.load(export, backend="ort", threads=THREADS)
        for selector in selectors:  # the sessions open (and read the library's settings) here
            g.generate([1, 2], max_new_tokens=2, selector=selector)
    return g


@pytest.fixture(scope="module")
def py_gen(identity_export):
    g = _load(identity_export, _ops_library())
    assert g._backend.attention_op == "DecodeAttention"  # noqa: SLF001
    yield g
    g.close()


@pytest.fixture(scope="module")
def prompts(py_gen) -> list[list[int]]:
    from dflash2_trt.bench.prompts import encode_items, load_prompts

    items = load_prompts("mtbench", N_PROMPTS)
    ids = encode_items(items, py_gen._tok.encode, lambda m: py_gen._tok.apply_chat_template(m))  # noqa: SLF001
    # and one that crosses the first KV capacity (kv_capacity_step = 256) while it decodes: the caches grow
    # mid-request, the held positions copied
    long = [t for p in ids for t in p][:250]
    assert len(long) == 250 < 256 < 250 + MAX_NEW and py_gen._backend.manifest.kv_capacity_step == 256  # noqa: SLF001
    return ids + [long]


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
def c_greedy(capi_build, identity_export, prompts):
    return _example(capi_build, identity_export, prompts, "-s", "guard=true",
                    env={**os.environ, "DFLASH2_ORT_OPS": _ops_library()})


def test_example_greedy_equals_python_runtime(c_greedy, py_gen, prompts):
    """Greedy, the library's defaults plus the guard (as the Python API's): every prompt's ids equal (20 MT-Bench
    prompts and one of 250 tokens that decodes past the first cache capacity); drafts were accepted (τ > 1 printed for some
    request); the note says ONNX Runtime ran, which library file and which graphs."""
    got, err = c_greedy
    for ids, c_tokens in zip(prompts, got):
        assert c_tokens == py_gen.generate(ids, max_new_tokens=MAX_NEW).tokens
    note = err.splitlines()[0]
    assert re.match(r"generate: using ONNX Runtime 1\.\d+\.\d+ \(.*libonnxruntime\.so\.1", note), note
    assert "target_ort.onnx" in note and f"threads {THREADS}" in note
    from dflash2_trt.runtime.ort.decode_attention import panels_wanted

    attention = "DecodeAttention + PanelMatMul" if panels_wanted() else "DecodeAttention"
    assert f"attention {attention}, op library {_ops_library()}" in note
    assert "drafter_block_layers.onnx, drafter_head_greedy.plugin.onnx" in note
    taus = [float(t) for t in re.findall(r"tau (\d+\.\d+)", err)]
    assert len(taus) == len(prompts) and max(taus) > 1.0, err


def test_batch_of_8_equals_single_runs(capi_build, identity_export, prompts, c_greedy):
    """dfl2_batch over the ONNX Runtime model: 8 requests decoded together give each request's single-run ids."""
    got, err = _example(capi_build, identity_export, prompts[:8], "-b", "max_batch=8",
                        env={**os.environ, "DFLASH2_ORT_OPS": _ops_library()})
    assert got == c_greedy[0][:8]
    assert len(re.findall(r"request \d+: \d+ tokens", err)) == 8


# The C side of the sampling runs in its own process: one process must not hold the Python runtime's ONNX Runtime and
# the wheel's libonnxruntime with the op library registered in both (the library keeps one ONNX Runtime API table).
_SAMPLER = r"""
opts, model, session = options(req["options"]), V(), V()
ok(lib.dfl2_model_load(req["export"].encode(), opts, C.byref(model)))
ok(lib.dfl2_session_create(model, opts, C.byref(session)))
out = []
for prompt, seed in zip(req["prompts"], req["seeds"]):
    got = generate(session, prompt, seed)
    lps, k = P(Logprob)(), C.c_size_t()
    ok(lib.dfl2_session_get_logprobs(session, C.byref(lps), C.byref(k)))
    out.append({**got, "logprobs": [[lps[i].token, lps[i].logprob, lps[i].top_ids[: lps[i].n_top],
                                     lps[i].top_logprobs[: lps[i].n_top]] for i in range(k.value)]})
assert "onnxruntime" not in sys.modules
print(json.dumps(out))
"""


def _c_samples(build: Path, export: Path, prompts: list[list[int]], seeds: list[int], ops: str,
               temperature: float = 0.8, max_new: int = MAX_NEW, env: dict | None = None,
               options: tuple[str, ...] = ()) -> list[dict]:
    """Each prompt at ``temperature`` through one dfl2_session of the C library with numpy's uniforms
    (default_rng(seed)), in a process of its own (``env``: more of its environment; ``options``: more model and
    session options) -> per request {tokens, accepted, proposers}."""
    req = {"lib": str(build / "lib" / "libdflash2.so"), "export": str(export), "prompts": prompts, "seeds": seeds,
           "options": ["backend=ort", f"threads={THREADS}", f"max_new_tokens={max_new}", f"temperature={temperature}",
                       *options]}
    return run_driver(_SAMPLER, req, {"DFLASH2_ORT_OPS": ops, **(env or {})})


def _sampling_equal(build: Path, export: Path, py, prompts: list[list[int]], ops: str) -> tuple[int, int]:  # noqa: ANN001
    """The C library's and the Python runtime's (``py``) samples for seeds 100 + i: ids, accepted drafts and
    proposers equal -> (accepted drafts, drafter cycles)."""
    seeds = [100 + i for i in range(len(prompts))]
    accepted = drafter_cycles = 0
    for i, (ids, got) in enumerate(zip(prompts, _c_samples(build, export, prompts, seeds, ops))):
        want = py.generate(ids, max_new_tokens=MAX_NEW, temperature=0.8, seed=seeds[i], guard=False)
        assert got["tokens"] == want.tokens, i
        assert got["accepted"] == want.stats.accepted and got["proposers"] == want.stats.proposers, i
        accepted += sum(got["accepted"])
        drafter_cycles += got["proposers"].count("dflash2")
    return accepted, drafter_cycles


def test_sampling_equals_python_runtime_same_seed(capi_build, identity_export, py_gen, prompts):
    """T = 0.8, no guard (its timing would choose the step kinds), the default proposers (the drafter, prompt lookup
    where the context repeats itself): the library with numpy's uniforms for seed s gives the Python runtime's ids
    for seed s, on every prompt, with the same accepted drafts and proposer per cycle; drafter cycles rejection-sample
    against its proposal (the residual's draws differ when the proposal does), and drafts were accepted."""
    accepted, drafter_cycles = _sampling_equal(capi_build, identity_export, py_gen, prompts, _ops_library())
    assert accepted > 0 and drafter_cycles > len(prompts)


def test_sampling_without_the_op_library(capi_build, identity_export, prompts):
    """Both runtimes without the op library (ONNX Runtime's GroupQueryAttention, the standard drafter block and the
    decomposed selector head): sampling equal on 5 prompts."""
    g = _load(identity_export, NO_LIBRARY)
    try:
        assert g._backend.attention_op == "GroupQueryAttention"  # noqa: SLF001
        _, drafter_cycles = _sampling_equal(capi_build, identity_export, g, prompts[:5], NO_LIBRARY)
        assert drafter_cycles > 0
    finally:
        g.close()


_THREADS = r"""
import threading
errors = []
def ok(st):  # a failing call ends its thread, not the process
    if st:
        errors.append(lib.dfl2_status_message(st).decode())
        raise RuntimeError(errors[-1])
opts, model = options(req["options"]), V()
ok(lib.dfl2_model_load(req["export"].encode(), opts, C.byref(model)))
def run(i, out):  # one session per thread, two requests each (the same prompt twice: the session is reused)
    s = V()
    ok(lib.dfl2_session_create(model, opts, C.byref(s)))
    p = req["prompts"][i]
    for _ in range(2):
        ok(lib.dfl2_session_generate(s, (C.c_int32 * len(p))(*p), len(p), TOKENS(0), None))
        t, n = P(C.c_int32)(), C.c_size_t()
        ok(lib.dfl2_session_get_tokens(s, C.byref(t), C.byref(n)))
        out.setdefault(i, []).append(t[: n.value])
threads, out = [], {}
for i in range(len(req["prompts"])):
    threads.append(threading.Thread(target=run, args=(i, out)))
    threads[-1].start()
for t in threads:
    t.join()
print(json.dumps({"errors": errors, "tokens": [out.get(i) for i in range(len(req["prompts"]))]}))
"""


def test_sessions_on_threads(capi_build, identity_export, prompts, c_greedy):
    """Sessions of one ONNX Runtime model on 4 threads at once (the header: they run concurrently, each its own
    caches): every request's ids equal its single run's, a session reused for a second request too."""
    req = {"lib": str(capi_build / "lib" / "libdflash2.so"), "export": str(identity_export), "prompts": prompts[:4],
           "options": ["backend=ort", "threads=1", f"max_new_tokens={MAX_NEW}", "verify_checksums=false"]}
    got = run_driver(_THREADS, req, {"DFLASH2_ORT_OPS": _ops_library()})
    assert not got["errors"] and got["tokens"] == [[t, t] for t in c_greedy[0][:4]]


def _asan_build(vectors_path: Path) -> Path:
    """test_capi's build/capi-asan (test_capi.test_asan_ubsan_ctests_and_fuzz's configuration: one build)."""
    _need("clang")
    return _cmake_build(BUILD / "capi-asan", [
        "-DCMAKE_C_COMPILER=clang", "-DCMAKE_CXX_COMPILER=clang++", "-DDFLASH2_SANITIZE=address,undefined",
        "-DDFLASH2_FUZZ=ON", f"-DDFLASH2_CORE_VECTORS={vectors_path}",
        f"-DDFL2_FUZZ_SECONDS={os.environ.get('DFLASH2_FUZZ_SECONDS', '5')}",
    ])  # fmt: skip


ASAN_ENV = {"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}


def test_asan_ubsan_runs(identity_export, prompts, c_greedy, vectors_path):
    """examples/generate of the AddressSanitizer + UBSan build (test_capi's build/capi-asan: library, example, the
    protobuf rewrite all instrumented; libonnxruntime is not): 3 prompts in turn (the last one growing the caches)
    and a batch of the 3, with the op
    library, run clean (any report ends the process) and give the uninstrumented build's ids. LeakSanitizer is off
    here: its tracer does not survive the uninstrumented ONNX Runtime's threads at exit (it crashes, not reports);
    test_capi's ASan ctests keep it on for everything else."""
    build = _asan_build(vectors_path)
    env = {**os.environ, "DFLASH2_ORT_OPS": _ops_library(), **ASAN_ENV}
    pick = [0, 1, len(prompts) - 1]  # the last one grows the caches mid-request
    for mode in ("-s", "-b"):
        got, err = _example(build, identity_export, [prompts[i] for i in pick], mode, "guard=true", env=env)
        assert got == [c_greedy[0][i] for i in pick], mode
        assert "Sanitizer" not in err and "runtime error" not in err, err


def test_without_onnxruntime_one_line_exit_1(capi_build, identity_export, tmp_path):
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
        proc = subprocess.run([gen, str(identity_export), "1", "2", "3", "-o", "backend=ort"], capture_output=True,
                              text=True, env={**base, **env})
        assert proc.returncode == 1, (name, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("generate: load: ") and want in lines[0], (name, lines)
    assert "does not provide C API version" in proc.stderr


def test_a_pip_installed_libdflash2_finds_the_onnxruntime_wheel_beside_it(capi_build, identity_export, tmp_path):
    """No virtual environment active, no system libonnxruntime: a libdflash2 laid out as ``pip install`` lays it
    (site-packages/dflash2_trt/lib/) opens the onnxruntime wheel of the same site-packages, and its note names that
    rule and file. Negative control: the same library with no wheel beside it is "ONNX Runtime not found", naming
    where it looked."""
    import onnxruntime

    site = tmp_path / "site-packages"
    lib = site / "dflash2_trt" / "lib"
    lib.mkdir(parents=True)
    shutil.copy(capi_build / "lib" / "libdflash2.so.1", lib / "libdflash2.so.1")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "ORT_LIBRARY", "LD_LIBRARY_PATH")}
    env["LD_LIBRARY_PATH"] = str(lib)  # before the example's RUNPATH: this copy is the libdflash2 it loads
    cmd = [str(capi_build / "bin" / "generate"), str(identity_export), "1", "2", "3", "-o", "backend=ort"]
    alone = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert alone.returncode == 1 and "ONNX Runtime not found" in alone.stderr, alone.stderr
    assert "no onnxruntime wheel beside libdflash2" in alone.stderr, alone.stderr
    wheel = sorted((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so.1*"))[-1]
    (site / "onnxruntime" / "capi").mkdir(parents=True)
    (site / "onnxruntime" / "capi" / wheel.name).symlink_to(wheel)
    found = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert found.returncode == 0, found.stderr
    note = next(ln for ln in found.stderr.splitlines() if "onnxruntime wheel beside libdflash2" in ln)
    assert str(site / "onnxruntime" / "capi") in note or wheel.name in note, note


# ---- a hybrid target (Gated DeltaNet linear layers beside attention layers; manifest version 3) -----------------------
# test_capi's hybrid_export: the accepting qwen3_5 pair (make-tiny --arch qwen3_5 --accepting) at block size 8. Its
# target graph is the standard one (no target_ort): neither runtime uses the op library for it.

HYBRID_NEW = 24
PLANT_ENV = "DFLASH2_PLANT_SKIP_LINEAR_ROLLBACK"  # the library's planted bug: a crop leaves the linear state as it is


@pytest.fixture(scope="module")
def hybrid_py(hybrid_export):
    g = _load(hybrid_export, NO_LIBRARY)
    assert "linear" in g._backend.manifest.layer_kinds and not g._backend.fused  # noqa: SLF001
    yield g
    g.close()


@pytest.fixture(scope="module")
def hybrid_prompts() -> list[list[int]]:
    """20 prompts of 1-29 tokens and one of 150 (fed in calls of at most 64 rows, the graph's max_rows_per_call)."""
    short = _prompts(20, seed=11)
    return short + [[t for p in short for t in p][:150]]


def _hybrid_equal(build: Path, export: Path, py, prompts: list[list[int]], temperature: float,  # noqa: ANN001
                  env: dict | None = None, ops: str = NO_LIBRARY, selector: str = "greedy") -> tuple[int, list[int]]:
    """The C library's and the Python runtime's runs (seeds 100 + i, no guard, draft mode ``selector``) -> (prompts
    whose ids differ, the accepted drafts of every drafter cycle of the equal ones); ids, accepted drafts and
    proposers compared."""
    seeds = [100 + i for i in range(len(prompts))]
    differ, accepted = 0, []
    for i, (ids, got) in enumerate(zip(prompts, _c_samples(build, export, prompts, seeds, ops, temperature,
                                                            HYBRID_NEW, env, (f"draft_mode={selector}",)))):
        want = py.generate(ids, max_new_tokens=HYBRID_NEW, temperature=temperature, seed=seeds[i], guard=False,
                           selector=selector)
        if got["tokens"] != want.tokens:
            differ += 1
            continue
        assert got["accepted"] == want.stats.accepted and got["proposers"] == want.stats.proposers, i
        accepted += [a for a, who in zip(got["accepted"], got["proposers"]) if who == "dflash2"]
    return differ, accepted


TRANSFORMS = {"top_k": 8, "top_p": 0.9, "min_p": 0.02, "presence_penalty": 0.3, "frequency_penalty": 0.2,
              "repetition_penalty": 1.2, "logit_bias": {5: 2.0, 9: -3.0}, "logprobs": True, "top_logprobs": 3}


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "T0.8"])
def test_sampling_transforms_and_logprobs_equal_python_runtime(capi_build, hybrid_export, hybrid_py, hybrid_prompts,
                                                              temperature):
    """The sampling options (top_k, top_p, min_p, the three penalties, logit_bias) and logprobs with top_logprobs
    through a dfl2_session on the hybrid export: 6 prompts greedy and at T = 0.8 (numpy's uniforms per seed) give the
    Python runtime's ids, accepted drafts and logprobs (each chosen token's and its row's top 3, the target's after
    the transforms); the transforms change the answer of some prompt, and drafts are accepted under them; greedy, a
    dfl2_batch of them gives the same ids."""
    opts = [f"{k}={v}" for k, v in TRANSFORMS.items() if k != "logit_bias"] + ["logit_bias=5:2.0,9:-3.0"]
    prompts = hybrid_prompts[:6]
    seeds = [100 + i for i in range(len(prompts))]
    got = _c_samples(capi_build, hybrid_export, prompts, seeds, NO_LIBRARY, temperature, HYBRID_NEW, None,
                     tuple(o.replace("True", "true") for o in opts))
    plain = _c_samples(capi_build, hybrid_export, prompts, seeds, NO_LIBRARY, temperature, HYBRID_NEW)
    for i, (ids, g) in enumerate(zip(prompts, got)):
        want = hybrid_py.generate(ids, max_new_tokens=HYBRID_NEW, temperature=temperature, seed=seeds[i],
                                  guard=False, **TRANSFORMS)
        assert g["tokens"] == want.tokens and g["accepted"] == want.stats.accepted, i
        assert len(g["logprobs"]) == len(want.tokens), i
        for (tok, lp, top_ids, top_lps), w in zip(g["logprobs"], want.logprobs):
            assert tok == w.token and lp == pytest.approx(w.logprob, rel=1e-6, abs=1e-9), i
            assert top_ids == [t for t, _ in w.top] and top_lps == pytest.approx([x for _, x in w.top], abs=1e-9)
            if temperature == 0:
                assert top_ids[0] == tok  # greedy: the chosen token is its row's most likely
    assert any(g["tokens"] != p["tokens"] for g, p in zip(got, plain))
    assert sum(sum(g["accepted"]) for g in got) > 0
    if temperature == 0:  # a dfl2_batch (4 slots, every request drafting) applies them too
        batch, _ = _example(capi_build, hybrid_export, prompts, "-b", "max_batch=4", "adaptive=false",
                            f"max_new_tokens={HYBRID_NEW}", *(o.replace("True", "true") for o in opts),
                            env={**os.environ, "DFLASH2_ORT_OPS": NO_LIBRARY})
        assert batch == [g["tokens"] for g in got]


def _assert_partial_acceptances(accepted: list[int], rows: int) -> None:
    """Drafts accepted, and cycles that kept some but not all of them: crops into the verify call, whose linear
    state the library rolled back to the kept row."""
    assert sum(accepted) > 0 and any(0 < a < rows for a in accepted), accepted


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "T0.8"])
def test_hybrid_export_equals_python_runtime(capi_build, hybrid_export, hybrid_py, hybrid_prompts, temperature):
    """The library's ONNX Runtime backend on the hybrid export (per linear layer its convolution window and
    recurrent state fed in layer order, rolled back to the accepted row on every crop): 21 prompts greedy and at
    T = 0.8 (numpy's uniforms per seed) give the Python runtime's ids, accepted drafts and proposers, with drafts
    accepted and partial acceptances (rollbacks into a call)."""
    differ, accepted = _hybrid_equal(capi_build, hybrid_export, hybrid_py, hybrid_prompts, temperature)
    assert differ == 0
    _assert_partial_acceptances(accepted, hybrid_py._backend.manifest.num_draft_rows)  # noqa: SLF001


def test_hybrid_planted_rollback_bug_is_caught(capi_build, hybrid_export, hybrid_py, hybrid_prompts):
    """Negative control: with the planted bug (DFLASH2_PLANT_SKIP_LINEAR_ROLLBACK=1: a crop keeps the linear layers'
    state after all the verified rows) greedy ids differ from the Python runtime's, so the test above catches it."""
    differ, _ = _hybrid_equal(capi_build, hybrid_export, hybrid_py, hybrid_prompts, 0.0, env={PLANT_ENV: "1"})
    assert differ > 0


def _differing(got: list[list[int]], want: list[list[int]]) -> list[int]:
    """The indices of the requests whose ids differ (every request compared, not the first difference only)."""
    assert len(got) == len(want)
    return [i for i, (a, b) in enumerate(zip(got, want)) if a != b]


def _c_batch(build: Path, export: Path, prompts: list[list[int]], adaptive: bool,
             env: dict | None = None) -> tuple[list[list[int]], list[int]]:
    """dfl2_batch (examples/generate -b) over the prompts, 4 at a time, the load-adaptive rule on or every request
    drafting -> (each request's ids, its drafting cycles)."""
    env = {**os.environ, "DFLASH2_ORT_OPS": NO_LIBRARY, **(env or {})}
    ids, err = _example(build, export, prompts, "-b", "max_batch=4", f"max_new_tokens={HYBRID_NEW}",
                        f"adaptive={str(adaptive).lower()}", env=env)
    cycles = [int(c) for c in re.findall(r"request \d+: \d+ tokens, (\d+) cycles", err)]
    assert len(cycles) == len(prompts), err
    return ids, cycles


def _batch_equals_single_runs(build: Path, export: Path, py, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    """All the prompts (the long one among them) through dfl2_batch, 4 at a time, on the load-adaptive rule and with
    every request drafting (adaptive=false: each step a verify in every slot, cut back into that slot's own state),
    give their single runs' ids, which are the Python runtime's: no request differs in either; the always-drafting
    batch ran drafting cycles in every request (so per-slot rollbacks) -> the single runs' ids."""
    opts = (f"max_new_tokens={HYBRID_NEW}",)
    single, _ = _example(build, export, prompts, "-s", *opts, env={**os.environ, "DFLASH2_ORT_OPS": NO_LIBRARY})
    assert _differing(single, [py.generate(p, max_new_tokens=HYBRID_NEW, guard=False).tokens for p in prompts]) == []
    for adaptive in (True, False):
        batch, cycles = _c_batch(build, export, prompts, adaptive)
        assert _differing(batch, single) == [], adaptive
    assert min(cycles) >= 2 and sum(cycles) >= 4 * len(prompts), cycles  # adaptive=false: every request drafted
    return single


def test_hybrid_batch_equals_single_runs(capi_build, hybrid_export, hybrid_py, hybrid_prompts):
    """dfl2_batch over the hybrid export (each slot its own linear state): the 21 requests, the long one among them,
    decoded 4 at a time on the adaptive rule and always drafting give their single runs' ids, which are the Python
    runtime's."""
    _batch_equals_single_runs(capi_build, hybrid_export, hybrid_py, hybrid_prompts)


def test_hybrid_batch_planted_rollback_bug_is_caught(capi_build, hybrid_export, hybrid_prompts):
    """Negative control: with the planted bug (a crop keeps the linear state after every verified row) the always
    drafting batch's ids differ from the unplanted batch's in some requests, so the test above catches it."""
    want, _ = _c_batch(capi_build, hybrid_export, hybrid_prompts, False)
    got, _ = _c_batch(capi_build, hybrid_export, hybrid_prompts, False, env={PLANT_ENV: "1"})
    assert _differing(got, want)


def test_hybrid_asan_ubsan_runs(capi_build, hybrid_export, hybrid_prompts, vectors_path):
    """examples/generate of the ASan + UBSan build on the hybrid export (the linear state's buffers, copies and
    rollbacks instrumented): 3 prompts in turn, the long one among them, and a batch of the 3 run clean and give the
    uninstrumented build's ids."""
    build = _asan_build(vectors_path)
    pick = hybrid_prompts[:2] + hybrid_prompts[-1:]
    opts = (f"max_new_tokens={HYBRID_NEW}",)
    want, _ = _example(capi_build, hybrid_export, pick, "-s", *opts,
                       env={**os.environ, "DFLASH2_ORT_OPS": NO_LIBRARY})
    env = {**os.environ, "DFLASH2_ORT_OPS": NO_LIBRARY, **ASAN_ENV}
    for mode in ("-s", "-b"):
        got, err = _example(build, hybrid_export, pick, mode, *opts, env=env)
        assert got == want, mode
        assert "Sanitizer" not in err and "runtime error" not in err, err


# ---- sliding-window targets (gpt-oss, Muse Glimmer; manifest version 3) ---------------------------------------------
# make-tiny's accepting pairs exported at block size 8: windows of 8 in rings of 24 slots, so the prompts and decodes
# below (up to 150 + 24 positions) wrap the rings many times and every partial acceptance crops back into them.

RING_PLANT_ENV = "DFLASH2_PLANT_RING_KEEP_CUT"  # the library's planted bug: a crop leaves the cut rows' slots valid


@pytest.fixture(scope="module", params=["gpt_oss", "muse_glimmer", "gemma4"])
def sliding(request, tmp_path_factory):
    """(export, the Python runtime over it) for each sliding-window family and Gemma 4 (the same graph interface)."""
    from dflash2_trt.export.exporter import export_model
    from helpers import make_pair

    pair = make_pair(tmp_path_factory, f"capi_{request.param}", accepting=True, arch=request.param)
    out = tmp_path_factory.mktemp("export") / request.param
    export_model(pair / "target", pair / "drafter", out, progress=False, max_seq_len=512, block_size=8)
    g = _load(out, NO_LIBRARY)
    assert "sliding" in g._backend.manifest.layer_kinds and not g._backend.fused  # noqa: SLF001
    yield out, g
    g.close()


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "T0.8"])
def test_sliding_export_equals_python_runtime(capi_build, sliding, hybrid_prompts, temperature):
    """The library's ONNX Runtime backend on a sliding-window export (per sliding layer a key and a value ring and
    the window positions fed, the new rows written over the oldest slots, a crop dropping the cut rows' slots): 21
    prompts greedy and at T = 0.8 give the Python runtime's ids, accepted drafts and proposers, with drafts accepted
    and partial acceptances (rollbacks into a wrapped ring)."""
    export, py = sliding
    differ, accepted = _hybrid_equal(capi_build, export, py, hybrid_prompts, temperature)
    assert differ == 0
    _assert_partial_acceptances(accepted, py._backend.manifest.num_draft_rows)  # noqa: SLF001


def test_sliding_planted_ring_bug_is_caught(capi_build, sliding, hybrid_prompts):
    """Negative control: with the planted bug (DFLASH2_PLANT_RING_KEEP_CUT=1: a crop leaves the cut rows' keys valid
    in the rings) greedy ids differ from the Python runtime's, and the always drafting batch's from the unplanted
    batch's, so the tests above and below catch it."""
    export, py = sliding
    differ, _ = _hybrid_equal(capi_build, export, py, hybrid_prompts, 0.0, env={RING_PLANT_ENV: "1"})
    assert differ > 0
    want, _ = _c_batch(capi_build, export, hybrid_prompts, False)
    got, _ = _c_batch(capi_build, export, hybrid_prompts, False, env={RING_PLANT_ENV: "1"})
    assert _differing(got, want)


def test_sliding_batch_equals_single_runs_under_asan(capi_build, sliding, hybrid_prompts, vectors_path):
    """dfl2_batch over a sliding export (each slot its own rings): the 21 requests, the long one among them, decoded
    4 at a time on the adaptive rule and always drafting give their single runs' ids, which are the Python runtime's;
    the ASan + UBSan build gives the same ids for 3 of them, single and batched, and reports nothing."""
    export, py = sliding
    single = _batch_equals_single_runs(capi_build, export, py, hybrid_prompts)
    build = _asan_build(vectors_path)
    few = [hybrid_prompts[0], hybrid_prompts[1], hybrid_prompts[-1]]
    env = {**os.environ, "DFLASH2_ORT_OPS": NO_LIBRARY, **ASAN_ENV}
    for mode in ("-s", "-b"):
        got, err = _example(build, export, few, mode, f"max_new_tokens={HYBRID_NEW}", env=env)
        assert got == [single[0], single[1], single[-1]], mode
        assert "Sanitizer" not in err and "runtime error" not in err, err


# ---- int4 and fp16 exports, independent drafts -----------------------------------------------------------------------
# make-tiny's accepting llama pair exported at block size 8 with --quantize int4 (the fused target_ort with int4
# MatMulNBits, the drafter's *_ort graphs with int8-activation ones) and with --dtype fp16 (the standard graphs, fp16
# caches, features and hidden states). Both runtimes take the op library and the panels ($DFLASH2_ORT_PANELS=1, any
# CPU): the int4 target rewritten with DecodeAttention and PanelMatMulQ4; the fp16 export has no fused target, so
# neither uses the library for it.

PANELS_ENV = {"DFLASH2_ORT_PANELS": "1"}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from helpers import make_pair

    return make_pair(tmp_path_factory, "capi_ort_quant", accepting=True)


@pytest.fixture(scope="module", params=["int4", "fp16"])
def quant(request, tiny_pair, tmp_path_factory):
    """(kind, export, the Python runtime over it with both draft modes' sessions open)."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.export.quantize import QuantSpec

    kind = request.param
    out = tmp_path_factory.mktemp("export") / kind
    kw = {"quantization": QuantSpec("int4")} if kind == "int4" else {"dtype": "fp16"}
    export_model(tiny_pair / "target", tiny_pair / "drafter", out, progress=False, max_seq_len=512, block_size=8, **kw)
    g = _load(out, _ops_library(), PANELS_ENV, ("greedy", "independent"))
    be = g._backend  # noqa: SLF001
    assert be.fused == (kind == "int4") and be.manifest.dtype == ("fp16" if kind == "fp16" else "fp32")
    yield kind, out, g
    g.close()


@pytest.mark.parametrize("selector", ["greedy", "independent"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "T0.8"])
def test_int4_fp16_and_independent_equal_python_runtime(capi_build, quant, hybrid_prompts, selector, temperature):
    """The library's ONNX Runtime backend on the int4 and the fp16 export, drafting with the greedy selector and with
    independent rows (drafter_head_independent: each row's argmax, or its sample of the row's softmax by the row's
    uniform): 21 prompts greedy and at T = 0.8 (numpy's uniforms per seed) give the Python runtime's ids, accepted
    drafts and proposers, with drafts accepted."""
    _, export, py = quant
    differ, accepted = _hybrid_equal(capi_build, export, py, hybrid_prompts, temperature, PANELS_ENV, _ops_library(),
                                     selector)
    assert differ == 0
    assert sum(accepted) > 0


def test_int4_fp16_example_note_and_batch(capi_build, quant, hybrid_prompts):
    """examples/generate on each export says what runs it: the int4 target rewritten with as many PanelMatMulQ4 nodes
    as the Python rewrite makes (decode_attention.rewrite), the fp16 export's fp16 caches; greedy ids equal the
    Python runtime's, and a dfl2_batch of 8 (4 at a time) gives the same ids."""
    import onnx

    from dflash2_trt.runtime.ort import decode_attention as DA

    kind, export, py = quant
    env = {**os.environ, "DFLASH2_ORT_OPS": _ops_library(), **PANELS_ENV}
    pick = hybrid_prompts[:7] + hybrid_prompts[-1:]
    opts = (f"max_new_tokens={HYBRID_NEW}",)
    single, err = _example(capi_build, export, pick, "-s", *opts, env=env)
    note = err.splitlines()[0]
    if kind == "int4":
        model = onnx.load_from_string(DA.rewrite(export / "target_ort.onnx", panels=True))
        q4 = sum(n.op_type == DA.MATMUL_Q4_OP_TYPE for n in model.graph.node)
        assert q4 > 0 and "attention DecodeAttention + PanelMatMul" in note, note
        assert f"PanelMatMul + {q4} PanelMatMulQ4" in note, note
    else:
        assert "graphs target.onnx" in note and "fp16 caches" in note, note
    assert single == [py.generate(p, max_new_tokens=HYBRID_NEW, guard=False).tokens for p in pick]
    batch, _ = _example(capi_build, export, pick, "-b", "max_batch=4", *opts, env=env)
    assert batch == single


def test_bf16_refused_by_both_runtimes(capi_build, quant, tmp_path):
    """A bf16 export (here each export's manifest saying bf16: both runtimes decide from it before reading a graph)
    runs on neither: the Python ORT backend refuses it, and examples/generate says in one line why (ONNX Runtime's CPU
    provider has no bf16 kernels) and exits 1."""
    import shutil

    import dflash2_trt
    from dflash2_trt.errors import DFlash2Error

    kind, export, _ = quant
    bf16 = tmp_path / "bf16"
    shutil.copytree(export, bf16)
    manifest = bf16 / "manifest.json"
    dtype = "fp16" if kind == "fp16" else "fp32"
    assert f'"dtype": "{dtype}"' in manifest.read_text()
    manifest.write_text(manifest.read_text().replace(f'"dtype": "{dtype}"', '"dtype": "bf16"'))
    with pytest.raises(DFlash2Error, match="bf16"):
        dflash2_trt.load(bf16, backend="ort")
    proc = subprocess.run([str(capi_build / "bin" / "generate"), str(bf16), "1", "2", "-o", "backend=ort"],
                          capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "bf16 export" in lines[0] and "no bf16 kernels" in lines[0], lines


def test_int4_fp16_independent_asan_ubsan_runs(capi_build, quant, hybrid_prompts, vectors_path):
    """examples/generate of the ASan + UBSan build on each export with independent drafts at T = 0.8 (the example's
    own uniforms; the fp16 buffers, the int4 rewrite and the float32 sampling instrumented): 3 prompts in turn, the
    long one among them, and a batch of the 3 (adaptive speculation off: its timing would choose the step kinds, and
    with them the uniforms each request draws) run clean and give the uninstrumented build's ids, mode for mode."""
    kind, export, _ = quant
    build = _asan_build(vectors_path)
    pick = hybrid_prompts[:2] + hybrid_prompts[-1:]
    opts = (f"max_new_tokens={HYBRID_NEW}", "draft_mode=independent", "temperature=0.8", "seed=7", "adaptive=false")
    base = {**os.environ, "DFLASH2_ORT_OPS": _ops_library(), **PANELS_ENV}
    for mode in ("-s", "-b"):
        want, _ = _example(capi_build, export, pick, mode, *opts, env=base)
        got, err = _example(build, export, pick, mode, *opts, env={**base, **ASAN_ENV})
        assert got == want, mode
        assert "Sanitizer" not in err and "runtime error" not in err, err


@pytest.fixture(scope="module", params=["qwen3_5", "gpt_oss"])
def fp16_states(request, tmp_path_factory):
    """(export, the Python runtime over it): the accepting hybrid (qwen3_5) and sliding-window (gpt_oss) pairs
    exported with --dtype fp16 at block size 8 (fp16 KV caches, rings and convolution windows; fp32 recurrent
    states)."""
    from dflash2_trt.export.exporter import export_model
    from helpers import make_pair

    pair = make_pair(tmp_path_factory, f"capi_fp16_{request.param}", accepting=True, arch=request.param)
    out = tmp_path_factory.mktemp("export") / f"fp16_{request.param}"
    export_model(pair / "target", pair / "drafter", out, progress=False, max_seq_len=512, block_size=8, dtype="fp16")
    g = _load(out, NO_LIBRARY)
    assert g._backend.manifest.dtype == "fp16" and not g._backend.manifest.kv_only  # noqa: SLF001
    yield out, g
    g.close()


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "T0.8"])
def test_fp16_hybrid_and_sliding_equal_python_runtime(capi_build, fp16_states, hybrid_prompts, temperature):
    """fp16 exports of a hybrid and a sliding-window target (the linear layers' fp16 windows and fp32 recurrent
    states rolled back, the fp16 rings cropped): 21 prompts greedy and at T = 0.8 give the Python runtime's ids,
    accepted drafts and proposers, with partial acceptances."""
    export, py = fp16_states
    differ, accepted = _hybrid_equal(capi_build, export, py, hybrid_prompts, temperature)
    assert differ == 0
    _assert_partial_acceptances(accepted, py._backend.manifest.num_draft_rows)  # noqa: SLF001
