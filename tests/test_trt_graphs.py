"""CUDA-graph cache and device buffers of the TensorRT backend, against the recording FakeCuda."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime.trt.cuda_graphs import GraphCache, GraphKey
from dflash2_trt.runtime.trt.device_buffers import BufferPool, DeviceKV
from trt_fakes import FakeCuda


def _step(cuda: FakeCuda, stream: int, src: int, dst: int, n: int, tag: list[int]):
    def step() -> None:
        tag.append(1)  # host side of the step ran (eager run or capture)
        cuda.memcpy_dtod_async(dst, src, n, stream)
    return step


def test_capture_once_then_replay():
    cuda = FakeCuda()
    s = cuda.stream_create()
    a, b = cuda.malloc(64), cuda.malloc(64)
    cache = GraphCache(cuda)
    key = GraphKey("verify", 1, (16, 256), (a, b))
    host_runs: list[int] = []
    step = _step(cuda, s, a, b, 64, host_runs)
    assert cache.run(key, s, step) == "captured"
    # warm-up ran eagerly and synchronised before the thread-local capture; the capture did not execute
    names = [c[0] for c in cuda.calls[-6:]]
    assert names == ["copy", "stream_synchronize", "begin_capture", "copy", "end_capture", "graph_instantiate"]
    assert ("begin_capture", s, "thread_local") in cuda.calls
    assert len(cuda.log) == 1 and len(host_runs) == 2
    for _ in range(3):
        cuda.dev[a][:] = np.arange(64, dtype=np.uint8) + len(cuda.log)
        assert cache.run(key, s, step) == "replay"
        np.testing.assert_array_equal(cuda.dev[b], cuda.dev[a])  # the replay moved the bytes
    assert len(host_runs) == 2  # replays run no host code
    assert cache.stats.captures == 1 and cache.stats.replays == 3 and cuda.count("graph_launch") == 3
    # another shape bucket is another graph
    assert cache.run(GraphKey("verify", 1, (16, 512), (a, b)), s, step) == "captured"
    assert len(cache) == 2


def test_capture_failure_falls_back_to_eager_for_that_key():
    cuda = FakeCuda()
    s = cuda.stream_create()
    a, b = cuda.malloc(8), cuda.malloc(8)
    cache = GraphCache(cuda)
    key = GraphKey("draft", 0, (256,), (a, b))
    cuda.fail_capture = True
    assert cache.run(key, s, _step(cuda, s, a, b, 8, [])) == "eager"
    assert key in cache.failures and "CaptureInvalidated" in cache.failures[key]
    assert cache.stats.fallbacks == 1 and len(cache) == 0 and s not in cuda.capturing
    cuda.fail_capture = False
    n_begin = cuda.count("begin_capture")
    assert cache.run(key, s, _step(cuda, s, a, b, 8, [])) == "eager"  # not retried: eager from now on
    assert cuda.count("begin_capture") == n_begin and cache.stats.eager == 2


def test_capture_error_inside_step_ends_capture():
    cuda = FakeCuda()
    s = cuda.stream_create()
    cache = GraphCache(cuda)
    calls = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 2:  # fails only while capturing
            raise DFlash2Error("TensorRT execution failed")

    assert cache.run(GraphKey("x", 0, (), (1,)), s, step) == "eager"
    assert s not in cuda.capturing and cuda.count("graph_destroy") == 1


def test_invalidate_destroys_graphs_that_use_freed_addresses():
    cuda = FakeCuda()
    s = cuda.stream_create()
    a, b, c = cuda.malloc(8), cuda.malloc(8), cuda.malloc(8)
    cache = GraphCache(cuda)
    k1, k2 = GraphKey("t", 0, (1,), (a, b)), GraphKey("t", 0, (2,), (c, b))
    cache.run(k1, s, _step(cuda, s, a, b, 8, []))
    cache.run(k2, s, _step(cuda, s, c, b, 8, []))
    assert cache.invalidate([a]) == 1
    assert k1 not in cache and k2 in cache
    assert cuda.count("graph_exec_destroy") == 1 and cuda.count("graph_destroy") == 1
    assert cache.run(k1, s, _step(cuda, s, a, b, 8, [])) == "captured"  # re-captured on next use
    cache.clear()
    assert len(cache) == 0 and not cuda.execs


def test_lru_eviction_and_disabled_cache():
    cuda = FakeCuda()
    s = cuda.stream_create()
    a = cuda.malloc(8)
    cache = GraphCache(cuda, max_graphs=2)
    for i in range(3):
        cache.run(GraphKey("t", 0, (i,), (a,)), s, _step(cuda, s, a, a, 8, []))
    assert len(cache) == 2 and cache.stats.evicted == 1 and GraphKey("t", 0, (0,), (a,)) not in cache
    off = GraphCache(cuda, enabled=False)
    assert off.run(GraphKey("t", 0, (9,), (a,)), s, _step(cuda, s, a, a, 8, [])) == "eager"
    assert len(off) == 0


def test_device_kv_growth_moves_buffers_keeps_rows_and_invalidates():
    cuda = FakeCuda()
    s = cuda.stream_create()
    pool = BufferPool(cuda)
    moved: list[list[int]] = []
    heads, d, item = 2, 4, 4
    kv = DeviceKV(cuda, pool, n_layers=1, heads=heads, head_dim=d, itemsize=item, step=8, max_length=20,
                  stream=s, on_move=moved.append)
    assert kv.max_capacity == 24
    rng = np.random.default_rng(0)
    ref = np.zeros((heads, 0, d), np.float32)

    def append(rows: int) -> None:
        nonlocal ref
        new = [rng.standard_normal((heads, rows, d)).astype(np.float32) for _ in range(2)]
        staging = []
        for x in new:
            p = pool.device(x.nbytes)
            cuda.dev[p][: x.nbytes] = x.view(np.uint8).reshape(-1)
            staging.append(p)
        kv.append(staging, rows)
        ref = np.concatenate([ref, new[0]], axis=1)

    def keys() -> np.ndarray:
        buf = cuda.dev[kv.ptrs[0]][: heads * kv.capacity * d * item].view(np.float32)
        return buf.reshape(heads, kv.capacity, d)[:, : kv.length]

    append(5)
    first = list(kv.ptrs)
    assert kv.capacity == 8 and not moved
    append(3)
    assert kv.ptrs == first and kv.capacity == 8  # fits: same addresses, graphs stay valid
    append(4)  # 12 > 8: grows to 16, old buffers freed and reported
    assert kv.capacity == 16 and kv.ptrs != first and moved == [first]
    assert all(p in cuda.freed for p in first)
    np.testing.assert_array_equal(keys(), ref)  # rows survived the pitched copy
    kv.crop(6)
    ref = ref[:, :6]
    append(2)
    np.testing.assert_array_equal(keys(), ref)
    mask = np.full(kv.capacity, 7, np.int64)
    kv.valid_mask(mask)
    assert mask.tolist() == [1] * 8 + [0] * 8
    with pytest.raises(DFlash2Error, match="exceeds the exported cache capacity 24"):
        kv.reserve(25)
    pool.close()
    assert not cuda.dev


def test_graph_cache_and_kv_together():
    """A captured step that reads the cache is dropped when the cache grows (never replayed stale)."""
    cuda = FakeCuda()
    s = cuda.stream_create()
    pool = BufferPool(cuda)
    cache = GraphCache(cuda)
    kv = DeviceKV(cuda, pool, 1, 1, 2, 4, step=4, max_length=16, stream=s, on_move=cache.invalidate)
    out = pool.device(8)
    kv.reserve(1)
    key = GraphKey("draft", 0, (kv.capacity,), (*kv.ptrs, out))
    cache.run(key, s, lambda: cuda.memcpy_dtod_async(out, kv.ptrs[0], 8, s))
    assert key in cache
    kv.reserve(5)
    assert key not in cache and cache.stats.invalidated == 1


def test_gpu_cuda_layer_check_passes_on_the_fake():
    """plugins/tests/cuda_layer_check.py (run on real CUDA by gpu_check.sh) holds against FakeCuda: the
    script's expectations are the semantics the CPU tests assume, so a GPU failure means CUDA differs."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "plugins" / "tests" / "cuda_layer_check.py"
    spec = importlib.util.spec_from_file_location("cuda_layer_check", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cuda = FakeCuda()
    assert mod.run_checks(cuda) == 0
    assert cuda.count("begin_capture") >= 3 and cuda.count("graph_launch") == 3
