"""GPU check of the runtime's CUDA layer on real CUDA, without TensorRT (run by plugins/tests/gpu_check.sh):
:class:`~dflash2_trt.runtime.trt.cuda_api.CudaRuntime`, :class:`~dflash2_trt.runtime.trt.device_buffers.BufferPool` /
:class:`~dflash2_trt.runtime.trt.device_buffers.DeviceKV` and :class:`~dflash2_trt.runtime.trt.cuda_graphs.GraphCache`
— the parts of the TensorRT backend that are CUDA, not TensorRT. The CPU tests run the same code against
``tests/trt_fakes.FakeCuda``; this checks that the fake's semantics are CUDA's.

    PYTHONPATH=<repo> python plugins/tests/cuda_layer_check.py

Checks: copies (H2D, D2H, D2D, pitched 2-D, memset) move the right bytes; device KV buffers are zeroed when
allocated, grow by moving (rows kept, new slots zero, old addresses reported), append rows at the right
pitch; a captured step replays with new pinned inputs and reads the same addresses; invalidation destroys
the graph; a step that breaks capture (a synchronise inside it) falls back to eager, leaves the stream not
capturing and usable. Prints one line per check; exit 0 all passed, 1 a check failed, 77 no CUDA / no
cuda-python (skipped).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any


def main() -> int:
    try:
        import numpy  # noqa: F401 - the runtime needs it; report its absence as a skip

        from dflash2_trt.errors import DFlash2Error
        from dflash2_trt.runtime.trt.cuda_api import CudaRuntime

        api = CudaRuntime()
    except (ImportError, DFlash2Error) as e:  # BackendUnavailable is a DFlash2Error
        print(f"cuda_layer_check: skipped ({e})")
        return 77
    return run_checks(api)


def run_checks(api: Any) -> int:
    """The checks on ``api`` (a CudaRuntime; the CPU tests pass tests/trt_fakes.FakeCuda)."""
    import numpy as np

    from dflash2_trt.runtime.trt.cuda_graphs import GraphCache, GraphKey
    from dflash2_trt.runtime.trt.device_buffers import BufferPool, DeviceKV

    rt = getattr(api, "rt", None)  # cudart, for the capture-status query (None on the fake)
    info = api.device_info()
    print(f"cuda_layer_check: {info.name} (cc {info.compute_capability}), driver {info.driver_version}, "
          f"runtime {info.runtime_version}")
    stream = api.stream_create()
    pool = BufferPool(api)
    failed: list[str] = []

    def check(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            print(f"  ok    {name}")
        except Exception:  # noqa: BLE001 - report every check, then fail the run
            failed.append(name)
            print(f"  FAIL  {name}\n{traceback.format_exc()}")

    def download(ptr: int, nbytes: int) -> np.ndarray:
        h = pool.pinned(nbytes)
        api.memcpy_dtoh_async(h.ptr, ptr, nbytes, stream)
        api.stream_synchronize(stream)
        return h.array.copy()

    def copies() -> None:
        n = 4096
        src = pool.pinned(n)
        src.array[:] = np.arange(n, dtype=np.uint32).astype(np.uint8)
        a, b = pool.device(n), pool.device(n)
        api.memcpy_htod_async(a, src.ptr, n, stream)
        api.memcpy_dtod_async(b, a, n, stream)
        assert np.array_equal(download(b, n), src.array)
        api.memset_async(b, 7, 100, stream)
        got = download(b, n)
        assert (got[:100] == 7).all() and np.array_equal(got[100:], src.array[100:])
        # pitched 2-D: 8 rows of 64 bytes from pitch 512 to pitch 128
        c = pool.device(8 * 128)
        api.memset_async(c, 0, 8 * 128, stream)
        api.memcpy2d_dtod_async(c, 128, a, 512, 64, 8, stream)
        got = download(c, 8 * 128).reshape(8, 128)
        want = src.array.reshape(8, 512)[:, :64]
        assert np.array_equal(got[:, :64], want) and not got[:, 64:].any()

    def kv() -> None:
        moved: list[list[int]] = []
        heads, d, item = 2, 16, 2
        kvb = DeviceKV(api, pool, 1, heads, d, item, 32, 128, stream, moved.append)
        kvb.reserve(5)
        assert kvb.capacity == 32
        for p in kvb.ptrs:  # fresh cudaMalloc memory is garbage; the buffer must be zeros
            assert not download(p, heads * 32 * d * item).any()
        rows = 3
        stage_h = pool.pinned(heads * rows * d * item)
        stage_h.array[:] = (np.arange(stage_h.nbytes) % 251 + 1).astype(np.uint8)
        stage = [pool.device(stage_h.nbytes) for _ in range(2)]
        for s in stage:
            api.memcpy_htod_async(s, stage_h.ptr, stage_h.nbytes, stream)
        for _ in range(11):  # 33 rows: the cache grows from 32 to 64 slots and moves
            kvb.append(stage, rows)
        assert kvb.capacity == 64 and kvb.length == 33 and len(moved) == 1 and kvb.moves == 1
        got = download(kvb.ptrs[0], heads * 64 * d * item).reshape(heads, 64, d * item)
        want = stage_h.array.reshape(heads, rows, d * item)
        for r in range(33):
            assert np.array_equal(got[:, r], want[:, r % rows]), f"row {r}"
        assert not got[:, 33:].any()  # slots past length: zeros, never garbage

    def graphs() -> None:
        n = 256
        cache = GraphCache(api)
        h_in, h_out = pool.pinned(n), pool.pinned(n)
        d_a, d_b = pool.device(n), pool.device(n)

        def step() -> None:
            api.memcpy_htod_async(d_a, h_in.ptr, n, stream)
            api.memcpy_dtod_async(d_b, d_a, n, stream)
            api.memcpy_dtoh_async(h_out.ptr, d_b, n, stream)

        key = GraphKey("check", 0, (n,), (d_a, d_b, h_in.ptr, h_out.ptr))
        h_in.array[:] = 1
        assert cache.run(key, stream, step) == "captured"
        api.stream_synchronize(stream)
        assert (h_out.array == 1).all()
        for v in (2, 3, 4):
            h_in.array[:] = v
            assert cache.run(key, stream, step) == "replay"
            api.stream_synchronize(stream)
            assert (h_out.array == v).all(), "the replay did not read the new pinned input"
        assert cache.invalidate([d_b]) == 1 and key not in cache
        h_in.array[:] = 5
        assert cache.run(key, stream, step) == "captured"
        api.stream_synchronize(stream)
        assert (h_out.array == 5).all()
        cache.clear()

    def failed_capture() -> None:
        n = 64
        cache = GraphCache(api)
        h, d = pool.pinned(n), pool.device(n)

        def bad_step() -> None:  # synchronising a capturing stream is illegal: it invalidates the capture
            api.memcpy_htod_async(d, h.ptr, n, stream)
            api.stream_synchronize(stream)

        key = GraphKey("bad", 0, (n,), (d, h.ptr))
        h.array[:] = 9
        assert cache.run(key, stream, bad_step) == "eager"
        assert key in cache.failures and cache.stats.fallbacks == 1, cache.failures
        if rt is not None:
            err, status = rt.cudaStreamIsCapturing(stream)
            assert err == rt.cudaError_t.cudaSuccess, err
            assert status == rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone, status
        else:
            assert stream not in api.capturing
        h.array[:] = 11
        assert cache.run(key, stream, bad_step) == "eager"  # eager from now on, and the stream still works
        assert (download(d, n) == 11).all()

    try:
        check("copies: H2D, D2H, D2D, memset, pitched 2-D", copies)
        check("device KV: zeroed, appended at pitch, grows by moving", kv)
        check("graph cache: capture, replay with new inputs, invalidate, recapture", graphs)
        check("failed capture: eager fallback, stream not left capturing", failed_capture)
    finally:
        pool.close()
        api.stream_destroy(stream)
    print(f"cuda_layer_check: {4 - len(failed)}/4 checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
