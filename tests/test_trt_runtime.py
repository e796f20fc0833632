"""TensorRT runtime backend on the CPU: bindings, CUDA-graph use, KV buffers and identity checks against the
recording fakes, and backend selection. Plain FakeTrt engines compute nothing (values are meaningless there);
``FakeTrt(compute=True)`` engines run their ONNX graphs with ONNX Runtime, so the backend's decoding is checked
token for token against the ORT backend on the accepting pair. Real TensorRT engines run only in
benchmarks/trt_gpu_check.py on a GPU."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.export import engines as E
from dflash2_trt.runtime.protocol import BackendUnavailable
from dflash2_trt.runtime.trt.backend import TrtBackend
from test_plugin_selector import plugin_build  # noqa: F401  (the host twin of the plugin, built once)
from trt_fakes import FakeCuda, FakeTrt
from helpers import req


@pytest.fixture(scope="module")
def fake_engines(tiny_export, tmp_path_factory):
    """A copy of the tiny export with FakeTrt "engines" (JSON I/O descriptions) recorded in its manifest."""
    d = tmp_path_factory.mktemp("trt") / "exp"
    shutil.copytree(tiny_export, d)
    plugin = d.parent / "libdflash2_plugins.so"
    plugin.write_bytes(b"\x7fELF fake plugin")
    cuda = FakeCuda()
    E.build_engines(d, plugin=plugin, selector="both", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    return d


def _open(d, **kw):
    cuda = kw.pop("cuda", None) or FakeCuda()
    trt = kw.pop("trt", None) or FakeTrt(cuda)
    return TrtBackend(d, trt_module=trt, api=cuda, **kw), trt, cuda


def _executes(ops):
    return [op for op in ops if op[0] == "execute"]


def test_identity_checked_before_anything_loads(fake_engines):
    be, trt, _ = _open(fake_engines)
    assert trt.loaded_plugins and trt.loaded_plugins[0].endswith("libdflash2_plugins.so")
    be.close()
    cuda = FakeCuda()
    with pytest.raises(DFlash2Error, match="built with TensorRT 10.13.0.35, this is TensorRT 10.3.0.26"):
        _open(fake_engines, cuda=cuda, trt=FakeTrt(cuda, version="10.3.0.26"))
    with pytest.raises(DFlash2Error, match="built on FakeGPU H0 .* this GPU is Jetson AGX Orin"):
        _open(fake_engines, cuda=FakeCuda(name="Jetson AGX Orin", cc="8.7"))
    other = fake_engines.parent / "other.so"
    other.write_bytes(b"another build of the plugin")
    with pytest.raises(DFlash2Error, match="plugin library checksum .* differs"):
        _open(fake_engines, plugin=other)


def test_target_verify_is_captured_once_and_replayed(fake_engines):
    be, trt, cuda = _open(fake_engines)
    tgt = be.target_runner()
    assert tgt.chunk == 256 and tgt.step_rows == 16
    logits, feats = tgt.forward(list(range(1, 21)))  # prefill: 20 rows > 16 -> prefill profile, eager
    assert logits.shape == (20, 512) and logits.dtype == np.float32 and feats.shape == (20, 128)
    assert tgt.last_path == "eager" and tgt.cache_length == 20 and tgt.kv.capacity == 256
    ex = _executes(cuda.log)[-1]
    assert ex[3] == 0 and dict(ex[4])["input_ids"] == (1, 20) and dict(ex[4])["attention_mask"] == (1, 276)
    # KV bound in place: the past inputs are the cache buffers
    assert [dict(ex[5])[f"past_key_values.{i}.{k}"] for i in range(4) for k in ("key", "value")] == tgt.kv.ptrs
    tgt.forward(list(range(16)))  # verify: step profile, eager warm-up + capture
    assert tgt.last_path == "captured"
    n_exec_calls = sum(1 for c in cuda.calls if c[0] == "execute")
    tgt.crop(21)
    start = len(cuda.log)
    tgt.forward(list(range(16)))  # same (rows, capacity, buffers): replay
    assert tgt.last_path == "replay"
    assert sum(1 for c in cuda.calls if c[0] == "execute") == n_exec_calls  # no host-side enqueue on replay
    replayed = cuda.log[start:]
    ex = _executes(replayed)
    assert len(ex) == 1 and ex[0][3] == 1 and dict(ex[0][4])["input_ids"] == (1, 16)
    # the graph copies inputs in before and outputs out after the engine; the KV commit follows it
    kinds = [op[0] for op in replayed]
    assert kinds == ["copy"] * 3 + ["execute"] + ["copy"] * 2 + ["copy2d"] * 8
    row = 16 * 4  # head_dim * fp32
    assert replayed[-8][1] == tgt.kv.ptrs[0] + 21 * row and replayed[-8][2] == 256 * row  # slot 21, pitch C
    # the pinned inputs hold this call's values (the replay reads them)
    assert tgt.io["position_ids"].host_view((1, 16))[0].tolist() == list(range(21, 37))
    mask = tgt.io["attention_mask"].host_view((1, 272))[0]
    assert mask[:21].all() and not mask[21:256].any() and mask[256:].all()
    # AR decoding (1 row) is its own bucket
    tgt.forward([3])
    assert tgt.last_path == "captured"
    be.close()


def test_cache_growth_moves_buffers_and_recaptures(fake_engines):
    be, trt, cuda = _open(fake_engines)
    tgt = be.target_runner()
    tgt.forward(list(range(1, 240)))
    tgt.forward(list(range(16)))
    assert tgt.last_path == "captured" and len(be.graphs) == 1
    old = list(tgt.kv.ptrs)
    tgt.forward(list(range(16)))  # 255 + 16 > 256: the cache grows to 512 and moves
    assert tgt.kv.capacity == 512 and tgt.kv.ptrs != old and all(p in cuda.freed for p in old)
    assert be.graphs.stats.invalidated == 1 and tgt.last_path == "captured"  # never replays the stale graph
    with pytest.raises(DFlash2Error, match="exceeds the exported cache capacity 512"):
        tgt.forward(list(range(300)))
    be.close()


def test_drafter_step_is_one_graph_for_block_and_head(fake_engines):
    be, trt, cuda = _open(fake_engines)
    dr = be.draft_runner("viterbi")
    assert dr.head_eng.key == "drafter_head_viterbi_plugin"
    feats = np.random.default_rng(0).standard_normal((20, 128)).astype(np.float32)
    dr.add_context(feats, 0)
    assert dr.kv.length == 20
    # the context features reached the pinned buffer that the prefill run copied from
    np.testing.assert_array_equal(dr.cio["context_features"].host_view((1, 20, 128))[0], feats)
    d1 = dr.propose(anchor=5, pos=20, rows=15, temperature=0.0, uniforms=None)
    assert dr.last_path == "captured" and d1.tokens.shape == (15,) and d1.cand.shape == (15, 16)
    start = len(cuda.log)
    d2 = dr.propose(anchor=7, pos=20, rows=15, temperature=0.7, uniforms=np.full((1, 15), 0.25, np.float32))
    assert dr.last_path == "replay" and d2.proposal.shape == (15, 16)
    ex = _executes(cuda.log[start:])
    assert [e[1] for e in ex] == ["drafter_block.onnx", "drafter_head_viterbi.plugin.onnx"]
    assert dict(ex[0][5])["hidden"] == dict(ex[1][5])["hidden"]  # block output feeds the head in place
    assert dr.hio["temperature"].host_view((1,))[0] == np.float32(0.7)
    assert dr.hio["anchor_ids"].host_view((1,))[0] == 7 and dr.hio["anchor_ids"].dtype == np.int32
    assert dr.bio["anchor_ids"].dtype == np.int64
    with pytest.raises(DFlash2Error, match="anchor is at 21"):
        dr.propose(5, 21, 15, 0.0, None)
    dr.add_context(feats[:3], 20)  # a cycle's commit: step profile, captured
    assert dr.kv.length == 23
    be.close()


def test_capture_failure_runs_eagerly_and_decoder_loop_runs(fake_engines):
    from dflash2_trt.runtime.decoder import speculative_generate, target_generate

    cuda = FakeCuda()
    cuda.fail_capture = True
    be, trt, _ = _open(fake_engines, cuda=cuda)
    tgt, dr = be.target_runner(), be.draft_runner("greedy")
    res = speculative_generate(tgt, dr, list(range(1, 30)), req(40, eos_ids=set()))
    assert len(res.tokens) == 40 and len(res.accepted) >= 2
    # every step's capture failed once, then ran eagerly: nothing captured, nothing replayed
    assert be.graphs.stats.fallbacks >= 2 and len(be.graphs) == 0 and be.graphs.stats.replays == 0
    assert {k.step for k in be.graphs.failures} >= {"target", "drafter_step:greedy"}
    # fake engines write zeros: every value here is meaningless - only the plumbing ran
    assert target_generate(tgt, list(range(1, 10)), req(5, eos_ids=set())).tokens == [0] * 5
    be.close()


def test_execution_failure_is_a_clear_error(fake_engines):
    be, trt, _ = _open(fake_engines, cuda_graphs=False)
    trt.fail_execute = True
    with pytest.raises(DFlash2Error, match="TensorRT execution of target failed"):
        be.target_runner().forward([1, 2, 3])
    be.close()


def test_decomposed_head_used_when_only_it_is_built(tiny_export, tmp_path):
    d = tmp_path / "exp"
    shutil.copytree(tiny_export, d)
    cuda = FakeCuda()
    E.build_engines(d, selector="decomposed", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    be, trt, _ = _open(d)
    assert not trt.loaded_plugins and be.draft_runner("greedy").head_eng.key == "drafter_head_greedy"
    be.close()


def test_auto_falls_back_to_ort_saying_why(fake_engines):
    from dflash2_trt.runtime.backends import open_backend

    be, note = open_backend(fake_engines, "auto")
    assert be.name == "ort"
    assert note.startswith("TensorRT not available (TensorRT is not installed")
    assert "using ONNX Runtime" in note
    with pytest.raises(DFlash2Error, match="TensorRT backend unavailable: TensorRT is not installed"):
        open_backend(fake_engines, "trt")


def test_no_engines_message(tiny_export):
    from dflash2_trt.runtime.protocol import BackendUnavailable

    cuda = FakeCuda()
    with pytest.raises(BackendUnavailable, match="has no TensorRT engines: build them with dflash2 build-engines"):
        TrtBackend(tiny_export, trt_module=FakeTrt(cuda), api=cuda)


def test_second_backend_and_another_plugin_build(fake_engines, tmp_path):
    """Two backends in one process share TensorRT's registry: the second finds the creator registered (a
    load_library would answer None) and works; a different build of the library is refused in one line."""
    cuda = FakeCuda()
    trt = FakeTrt(cuda)
    with TrtBackend(fake_engines, trt_module=trt, api=cuda), TrtBackend(fake_engines, trt_module=trt, api=cuda):
        pass
    assert len(trt.get_plugin_registry().load_calls) == 1
    from dflash2_trt.manifest import read_manifest
    from dflash2_trt.runtime.trt.env import load_plugin_library

    spec = read_manifest(fake_engines).plugin  # the creator the library registers
    other = tmp_path / "libother.so"
    other.write_bytes(b"another build")
    with pytest.raises(BackendUnavailable, match="another build of the DFlash2 plugin library .* already loaded"):
        load_plugin_library(trt, other, spec)
    fresh = FakeTrt(cuda)  # a registry where the library cannot load (e.g. built for another major)
    fresh.get_plugin_registry().creators[("Other", "1", "")] = "x"
    fresh.get_plugin_registry().load_library = lambda path: None
    with pytest.raises(BackendUnavailable, match="TensorRT could not load the plugin library"):
        load_plugin_library(fresh, other, spec)


def _patch_trt(monkeypatch, trt, cuda):
    import dflash2_trt.runtime.trt.backend as tb

    monkeypatch.setattr(tb, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(tb, "CudaRuntime", lambda: cuda)


def test_profile_refusal_falls_back_to_ort_and_bugs_do_not(fake_engines, monkeypatch):
    """set_optimization_profile_async raises RuntimeError in Python: while constructing the backend that is
    BackendUnavailable, so auto falls back to ONNX Runtime (and frees what it allocated); a bug (here an
    AttributeError inside TensorRT calls) is not turned into a fallback."""
    from dflash2_trt.runtime.backends import open_backend
    from trt_fakes import FakeEngine

    cuda = FakeCuda()
    trt = FakeTrt(cuda)
    trt.profile_error = "IExecutionContext::setOptimizationProfileAsync: profile 1 is in use"
    _patch_trt(monkeypatch, trt, cuda)
    be, note = open_backend(fake_engines, "auto")
    assert be.name == "ort" and "cannot select optimization profile 0 (prefill)" in note and "in use" in note
    assert set(cuda.dev) == set() and cuda.count("stream_destroy") == 1  # nothing left allocated
    be.close()
    with pytest.raises(DFlash2Error, match="TensorRT backend unavailable: target: TensorRT cannot select"):
        open_backend(fake_engines, "trt")
    trt.profile_error = None
    n0 = len(trt.contexts)
    be, note = open_backend(fake_engines, "auto")
    assert be.name == "trt" and note == "using TensorRT 10.13.0.35 on FakeGPU H0"
    # the probe opened a context per profile of target, drafter_context (2 each), drafter_block and the two
    # heads (1 each)
    assert [c.profile for c in trt.contexts[n0:]] == [0, 1, 0, 1, 0, 0, 0]
    be.close()

    def broken(self, strategy):
        raise AttributeError("a bug")

    monkeypatch.setattr(FakeEngine, "create_execution_context", broken)
    with pytest.raises(AttributeError, match="a bug"):
        open_backend(fake_engines, "auto")


def test_auto_falls_back_when_the_head_engine_fails(fake_engines, monkeypatch, capsys):
    """Every engine a runner uses is opened while the backend is constructed, the plugin head included (the
    likeliest to fail: creator missing, another TensorRT major): a head plan TensorRT refuses ends on ONNX
    Runtime with the reason printed, nothing left allocated; with it, both heads were opened up front."""
    from dflash2_trt.bench.cli import open_generator

    cuda = FakeCuda()
    trt = FakeTrt(cuda)
    trt.refuse_plans = {"drafter_head_viterbi.plugin.onnx"}
    _patch_trt(monkeypatch, trt, cuda)
    gen = open_generator(str(fake_engines), "auto")
    err = capsys.readouterr().err
    assert gen.backend.startswith("ONNX Runtime") and err.startswith("dflash2: TensorRT not available (TensorRT could not deserialize")
    assert "drafter_head_viterbi_plugin" in err and "using ONNX Runtime" in err, err
    assert set(cuda.dev) == set() and cuda.count("stream_destroy") == 1
    gen.close()
    trt.refuse_plans = set()
    with TrtBackend(fake_engines, trt_module=trt, api=cuda) as tbe:
        assert tbe.engine_keys() == ["target", "drafter_context", "drafter_block", "drafter_head_greedy_plugin",
                                     "drafter_head_viterbi_plugin"]
        assert set(tbe._engines) == set(tbe.engine_keys())


def test_auto_falls_back_without_cuda_python(fake_engines, monkeypatch):
    """TensorRT importable but cuda-python missing: one line and ONNX Runtime, not an ImportError."""
    import sys

    import dflash2_trt.runtime.trt.backend as tb
    from dflash2_trt.runtime.backends import open_backend

    for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import raises ImportError
    monkeypatch.setattr(tb, "import_tensorrt", lambda: FakeTrt(FakeCuda()))
    be, note = open_backend(fake_engines, "auto")
    assert be.name == "ort" and note.startswith("TensorRT not available (cuda-python is not installed"), note
    be.close()


def test_contexts_and_graphs_are_bounded(fake_engines):
    be, trt, cuda = _open(fake_engines)
    be.max_contexts = 2
    tgt = be.target_runner()
    tgt.forward(list(range(1, 21)))
    for rows in (1, 2, 3):  # three shape buckets, room for two captured contexts
        tgt.forward(list(range(rows)))
        assert tgt.last_path == "captured"
    assert tgt.eng.n_contexts == 2 + 2 and tgt.eng.evicted == 1  # eager prefill + step, two buckets
    assert be.graphs.stats.invalidated == 1 and len(be.graphs) == 2  # the evicted context's graph went with it
    tgt.forward([5])  # the evicted bucket: a new context, captured again (never a replay of the old graph)
    assert tgt.last_path == "captured" and tgt.eng.evicted == 2
    tgt.forward([6, 7, 8])
    assert tgt.last_path == "replay"
    assert be.graphs.max_graphs == TrtBackend.max_graphs
    be.close()


def test_device_kv_is_zeroed_and_garbage_never_reaches_the_engine(fake_engines):
    """cudaMalloc memory is garbage (FakeCuda: NaN bytes); masked KV slots must hold zeros, as on the CPU."""
    be, trt, cuda = _open(fake_engines)
    tgt = be.target_runner()
    tgt.forward(list(range(1, 6)))
    for p in tgt.kv.ptrs:
        assert not cuda.dev[p].any()  # 5 rows written (zeros from the fake engine), every other slot zeroed
    be.close()


def test_head_buffers_sized_by_the_engine(fake_engines):
    """The head's output buffers come from the manifest: an engine that disagrees is refused before it can
    write past them."""
    be, trt, cuda = _open(fake_engines)
    trt.shape_override = {"cand_ids": (1, 15, 32)}
    with pytest.raises(DFlash2Error, match=r"cand_ids has shape \(1, 15, 32\), the manifest implies \(1, 15, 16\)"):
        be.draft_runner("greedy")
    be.close()


def test_bf16_outputs_are_refused_at_load(fake_engines):
    """The host reads logits and proposals as fp32 / fp16; a bf16 engine output (its uint16 bits) would be
    misread as integers: refused when the runner is made, in one line."""
    be, trt, cuda = _open(fake_engines)
    trt.dtype_override = {"logits": "BF16", "proposal_probs": "BF16"}
    be.close()
    be, _, _ = _open(fake_engines, cuda=cuda, trt=trt)
    with pytest.raises(DFlash2Error, match="target: engine output logits is BF16; this runtime reads fp32 or fp16"):
        be.target_runner()
    with pytest.raises(DFlash2Error, match="engine output proposal_probs is BF16"):
        be.draft_runner("greedy")
    be.close()


def test_engines_with_auxiliary_streams_are_never_captured(fake_engines):
    """An engine that uses TensorRT auxiliary streams (not one of build-engines': max_aux_streams = 0) runs
    eagerly: a failed capture could leave those streams capturing."""
    be, trt, cuda = _open(fake_engines)
    assert be.engine("target").aux_streams == 0  # as built
    be.close()
    cuda = FakeCuda()
    trt = FakeTrt(cuda)
    trt.aux_streams_override = 2
    be, _, _ = _open(fake_engines, cuda=cuda, trt=trt)
    tgt, dr = be.target_runner(), be.draft_runner("greedy")
    tgt.forward(list(range(1, 21)))
    for _ in range(2):
        tgt.forward([1, 2, 3])
        assert tgt.last_path == "eager"
    dr.add_context(np.zeros((20, 128), np.float32), 0)
    dr.propose(1, 20, 15, 0.0, None)
    assert dr.last_path == "eager"
    assert cuda.count("begin_capture") == 0 and len(be.graphs) == 0
    be.close()


@pytest.fixture(scope="module")
def acc_engines(acc_export, tmp_path_factory):
    """The accepting pair's export (block size 16) with FakeTrt engines of the decomposed-selector heads."""
    d = tmp_path_factory.mktemp("trt") / "acc"
    shutil.copytree(acc_export, d)
    cuda = FakeCuda()
    E.build_engines(d, selector="decomposed", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    return d


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_decodes_like_ort_on_the_accepting_pair(acc_engines, cuda_graphs):
    """The TensorRT backend's buffers, bindings, KV crop/commit and (replayed) CUDA graphs around engines that
    really compute (FakeTrt(compute=True) runs each engine's ONNX graph with ONNX Runtime): greedy output equals
    the target's own and the ORT backend's, cycle for cycle, with drafts accepted; T = 0.8 sampling (greedy and
    Viterbi chains) equals ORT's, drafts accepted."""
    from helpers import assert_accepts
    from dflash2_trt.runtime.backends import open_backend
    from dflash2_trt.runtime.decoder import speculative_generate, target_generate

    cuda = FakeCuda()
    be, trt, _ = _open(acc_engines, cuda=cuda, trt=FakeTrt(cuda, compute=True), cuda_graphs=cuda_graphs)
    ort_be, _ = open_backend(acc_engines, "ort")
    tgt, ort_tgt = be.target_runner(), ort_be.target_runner()
    rng = np.random.default_rng(11)
    accepted: dict[str, list[int]] = {"greedy": [], "viterbi": []}
    for i in range(4):
        mode = ("greedy", "viterbi")[i % 2]
        p = rng.integers(4, 500, size=int(rng.integers(5, 40))).tolist()
        got = speculative_generate(tgt, be.draft_runner(mode), p, req(40, eos_ids=set()))
        want = speculative_generate(ort_tgt, ort_be.draft_runner(mode), p, req(40, eos_ids=set()))
        assert got.tokens == want.tokens == target_generate(ort_tgt, p, req(40, eos_ids=set())).tokens
        assert got.accepted == want.accepted
        assert target_generate(tgt, p, req(12, eos_ids=set())).tokens == want.tokens[:12]
        accepted[mode] += got.accepted
    for mode, acc in accepted.items():
        assert_accepts(acc, 15, ("TensorRT backend", mode))
    sampled = []
    for mode in ("greedy", "viterbi"):  # T = 0.8: the same samples, drafts accepted by the rejection rule
        p = rng.integers(4, 500, size=20).tolist()
        got = speculative_generate(tgt, be.draft_runner(mode), p,
                                   req(30, temperature=0.8, eos_ids=set(), seed=3))
        want = speculative_generate(ort_tgt, ort_be.draft_runner(mode), p,
                                    req(30, temperature=0.8, eos_ids=set(), seed=3))
        assert got.tokens == want.tokens and got.accepted == want.accepted
        sampled += got.accepted
    assert_accepts(sampled, 15, "TensorRT backend, T = 0.8")
    runs = cuda.executor.runs
    assert runs["target.onnx"] and runs["drafter_block.onnx"] and runs["drafter_head_viterbi.onnx"]
    assert (be.graphs.stats.replays > 0) == cuda_graphs
    be.close()
    ort_be.close()


@pytest.fixture(scope="module")
def acc_plugin_engines(acc_export, tmp_path_factory):
    """The accepting pair's export with FakeTrt engines of the plugin heads (the default TensorRT path)."""
    d = tmp_path_factory.mktemp("trt") / "acc-plugin"
    shutil.copytree(acc_export, d)
    plugin = d.parent / "libdflash2_plugins.so"
    plugin.write_bytes(b"\x7fELF fake plugin")
    cuda = FakeCuda()
    E.build_engines(d, plugin=plugin, selector="plugin", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    return d


def test_plugin_heads_decode_like_ort_on_the_accepting_pair(acc_plugin_engines, plugin_build):  # noqa: F811
    """The default TensorRT path, plugin heads, decodes: the fake runs each head's DFlash2PathSelector node
    through the plugin's host twin (the CPU twin the kernel is checked against bit for bit), the rest of the
    head with ONNX Runtime. Greedy and Viterbi, T = 0 and 0.8: token for token the ORT backend's output
    (decomposed selector graphs), drafts accepted."""
    from helpers import assert_accepts
    from dflash2_trt.runtime.backends import open_backend
    from dflash2_trt.runtime.decoder import speculative_generate

    cuda = FakeCuda()
    trt = FakeTrt(cuda, compute=True, selector_host=str(plugin_build / "lib" / "libdflash2_selector_host.so"))
    be, _, _ = _open(acc_plugin_engines, cuda=cuda, trt=trt)
    ort_be, _ = open_backend(acc_plugin_engines, "ort")
    tgt, ort_tgt = be.target_runner(), ort_be.target_runner()
    rng = np.random.default_rng(12)
    accepted: list[int] = []
    for mode, temp in (("greedy", 0.0), ("viterbi", 0.0), ("greedy", 0.8), ("viterbi", 0.8)):
        dr = be.draft_runner(mode)
        assert dr.head_eng.key == f"drafter_head_{mode}_plugin"
        p = rng.integers(4, 500, size=int(rng.integers(5, 30))).tolist()
        got = speculative_generate(tgt, dr, p, req(30, temperature=temp, eos_ids=set(), seed=4))
        want = speculative_generate(ort_tgt, ort_be.draft_runner(mode), p,
                                    req(30, temperature=temp, eos_ids=set(), seed=4))
        assert got.tokens == want.tokens and got.accepted == want.accepted, (mode, temp)
        accepted += got.accepted
    assert_accepts(accepted, 15, "TensorRT plugin heads")
    runs = cuda.executor.runs
    assert runs["drafter_head_greedy.plugin.onnx"] and runs["drafter_head_viterbi.plugin.onnx"]
    assert cuda.executor.plugin_runs == runs["drafter_head_greedy.plugin.onnx"] + runs["drafter_head_viterbi.plugin.onnx"]
    be.close()
    ort_be.close()


class _HiddenSpy:
    """Wraps an ONNX Runtime session: records each ``hidden`` input it is fed."""

    def __init__(self, sess, seen: list) -> None:  # noqa: ANN001
        self.sess, self.seen = sess, seen

    def run(self, feed: dict):  # noqa: ANN201
        self.seen.append(feed["hidden"].copy())
        return self.sess.run(feed)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_partial_block_draft_is_the_verified_rows_path(acc_engines, acc_drafter, temperature):
    """A final partial block (n < L rows verified): the ORT and TensorRT draft runners hand the Viterbi head zero
    hidden states past row n (ORT: the array fed to the head; TensorRT: a memset between the block and head
    engines, run eagerly) and draft what the PyTorch drafter drafts with ``verified_rows=n`` — whose path is
    the reference walk of the n-row lattice (tests/test_model.py)."""
    from dflash2_trt.runtime.backends import open_backend
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner

    cuda = FakeCuda()
    be, _, _ = _open(acc_engines, cuda=cuda, trt=FakeTrt(cuda, compute=True))
    ort_be, _ = open_backend(acc_engines, "ort")
    runners = {"trt": be.draft_runner("viterbi"), "ort": ort_be.draft_runner("viterbi"),
               "torch": TorchDraftRunner(acc_drafter, "viterbi")}
    seen: list[np.ndarray] = []
    runners["ort"].head_sess = _HiddenSpy(runners["ort"].head_sess, seen)
    rng = np.random.default_rng(5)
    feats = rng.standard_normal((20, acc_drafter.fc.weight.shape[1])).astype(np.float32)
    for r in runners.values():
        r.add_context(feats, 0)
    L = runners["trt"].L
    hid = runners["trt"].bio["hidden"]
    row_bytes = hid.max_shape[-1] * np.dtype(hid.dtype).itemsize
    for n in (0, 3, 9, L):
        u = rng.random((1, L), dtype=np.float32) if temperature > 0 else None
        start = len(cuda.log)
        d = {k: r.propose(7, 20, n, temperature, u) for k, r in runners.items()}
        for k in ("trt", "ort"):
            assert d[k].tokens[:n].tolist() == d["torch"].tokens[:n].tolist(), (k, n)
            assert d[k].cand[:n].tolist() == d["torch"].cand[:n].tolist(), (k, n)
            np.testing.assert_allclose(d[k].proposal[:n], d["torch"].proposal[:n], atol=1e-4)
        h = seen[-1][0]  # [bs, H]: what the ORT head was fed
        assert not h[1 + n:].any() and h[: 1 + n].any(axis=-1).all(), n
        memsets = [op[1:] for op in cuda.log[start:] if op[0] == "memset"]
        assert memsets == ([(hid.dev + (1 + n) * row_bytes, 0, (L - n) * row_bytes)] if n < L else []), n
        assert runners["trt"].last_path == ("eager" if n < L else "captured"), n
    be.close()
    ort_be.close()


def test_prefix_cache_restores_device_buffers_exactly(acc_engines, monkeypatch):
    """The prefix cache on the TensorRT backend (engines that compute): each decode after a hit (the next turn, a
    branch inside the answer, the prompt again) equals ONNX Runtime's from an empty cache, cycle for cycle — the
    device K/V of target and drafter copied out through the pinned staging buffer and back. Planted bug: a restore
    that loads the first head only is caught."""
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.trt.device_buffers import DeviceKV
    from helpers import prefix_cache_equals_uncached

    cuda = FakeCuda()
    be, _, _ = _open(acc_engines, cuda=cuda, trt=FakeTrt(cuda, compute=True))
    ort_be = OrtBackend(acc_engines)
    assert be.prefix_cache
    prefix_cache_equals_uncached(be, ort_be)
    real = DeviceKV.load

    def first_head_only(self, rows, n, staging):  # noqa: ANN001, ANN202
        real(self, [np.concatenate([r[:1], np.zeros_like(r[1:])]) for r in rows], n, staging)

    monkeypatch.setattr(DeviceKV, "load", first_head_only)
    with pytest.raises(AssertionError):
        prefix_cache_equals_uncached(be, ort_be)
    be.close()
    ort_be.close()
