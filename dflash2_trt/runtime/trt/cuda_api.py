"""The thin CUDA interface the TensorRT backend uses, and its implementation over cuda-python (cudart).

Everything CUDA the runtime does goes through :class:`CudaApi`: streams, device and pinned host memory,
async copies (plain and 2-D pitched), stream capture and graph launch, device identity. Tests substitute a
recording fake (``tests/trt_fakes.py``); :class:`CudaRuntime` is the real one, built on
``cuda.bindings.runtime`` (cuda-python >= 12; the older ``cuda.cudart`` module name is accepted too).
torch is never needed.

Handles are plain ``int`` (device pointers, ``cudaStream_t``) or opaque objects (graphs): TensorRT's
Python API takes ``int`` pointers and stream handles (``set_tensor_address``, ``execute_async_v3``).

Status: **never run on a GPU**. On a machine without a driver :class:`CudaRuntime` raises
:class:`~dflash2_trt.errors.DFlash2Error` ("CUDA is not usable here: cudaErrorInsufficientDriver ..."),
which is what the CPU tests check; every other call is type-checked against ``typings/cuda`` (a focused
stub of the cudart functions used here, pinned to the installed cuda-bindings by
``tests/test_trt_static.py``).

Thread safety: one :class:`CudaRuntime` per process is fine; streams and buffers belong to their runner.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.protocol import BackendUnavailable


@dataclass(frozen=True)
class HostBuffer:
    """Page-locked host memory ``nbytes`` long; ``array`` is a uint8 view of it (``ptr`` is its address)."""

    ptr: int
    nbytes: int
    array: np.ndarray  # [nbytes] uint8 over the pinned memory


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    compute_capability: str  # "9.0"
    total_memory: int  # bytes
    driver_version: int  # e.g. 12080
    runtime_version: int


class CudaApi(Protocol):
    """What the TensorRT backend needs from CUDA. Every method raises DFlash2Error on a CUDA error."""

    def device_info(self) -> DeviceInfo: ...

    def stream_create(self) -> int: ...

    def stream_destroy(self, stream: int) -> None: ...

    def stream_synchronize(self, stream: int) -> None: ...

    def malloc(self, nbytes: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def host_alloc(self, nbytes: int) -> HostBuffer: ...

    def host_free(self, buf: HostBuffer) -> None: ...

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    def memcpy2d_dtod_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                            stream: int) -> None: ...

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None: ...

    def begin_capture(self, stream: int) -> None:
        """Start stream capture in thread-local mode (other threads' CUDA calls are not affected)."""

    def end_capture(self, stream: int) -> Any:
        """End capture, return the captured graph (raises if capture was invalidated)."""

    def graph_instantiate(self, graph: Any) -> Any: ...

    def graph_launch(self, graph_exec: Any, stream: int) -> None: ...

    def graph_destroy(self, graph: Any) -> None: ...

    def graph_exec_destroy(self, graph_exec: Any) -> None: ...


def _import_cudart() -> Any:
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        try:
            from cuda import cudart as rt  # type: ignore[attr-defined, no-redef]  # cuda-python < 12.6
        except ImportError:
            raise BackendUnavailable("cuda-python is not installed: pip install cuda-python (needed by the TensorRT "
                               "backend)") from None
    return rt


class CudaRuntime:
    """:class:`CudaApi` over cudart (``cuda.bindings.runtime``) on the current device (device 0 unless the
    caller selected another with ``CUDA_VISIBLE_DEVICES``)."""

    def __init__(self, device: int = 0) -> None:
        try:
            from cuda.bindings import runtime as rt  # typed by typings/cuda
        except ImportError:  # the older module name, or BackendUnavailable: never an ImportError out of here
            rt = _import_cudart()
        self.rt = rt
        self.device = device
        err, count = rt.cudaGetDeviceCount()
        if err != rt.cudaError_t.cudaSuccess:
            raise BackendUnavailable(f"CUDA is not usable here: {self._name(err)} ({self._msg(err)})")
        if count <= device:
            raise BackendUnavailable(f"CUDA device {device} not present ({count} device(s) visible)")
        self._check(rt.cudaSetDevice(device)[0], "cudaSetDevice")

    # --- error handling -------------------------------------------------------------------------------
    def _name(self, err: Any) -> str:
        return str(getattr(err, "name", err))

    def _msg(self, err: Any) -> str:
        e, s = self.rt.cudaGetErrorString(err)
        return s.decode() if isinstance(s, bytes) else str(s)

    def _check(self, err: Any, what: str) -> None:
        if err != self.rt.cudaError_t.cudaSuccess:
            raise DFlash2Error(f"{what} failed: {self._name(err)} ({self._msg(err)})")

    # --- CudaApi ----------------------------------------------------------------------------------------
    def device_info(self) -> DeviceInfo:
        rt = self.rt
        err, prop = rt.cudaGetDeviceProperties(self.device)
        self._check(err, "cudaGetDeviceProperties")
        err, drv = rt.cudaDriverGetVersion()
        self._check(err, "cudaDriverGetVersion")
        err, rtv = rt.cudaRuntimeGetVersion()
        self._check(err, "cudaRuntimeGetVersion")
        name = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else str(prop.name)
        return DeviceInfo(name=name.rstrip("\x00").strip(), compute_capability=f"{prop.major}.{prop.minor}",
                          total_memory=int(prop.totalGlobalMem), driver_version=int(drv), runtime_version=int(rtv))

    def stream_create(self) -> int:
        err, s = self.rt.cudaStreamCreateWithFlags(self.rt.cudaStreamNonBlocking)
        self._check(err, "cudaStreamCreateWithFlags")
        return int(s)

    def stream_destroy(self, stream: int) -> None:
        self._check(self.rt.cudaStreamDestroy(stream)[0], "cudaStreamDestroy")

    def stream_synchronize(self, stream: int) -> None:
        self._check(self.rt.cudaStreamSynchronize(stream)[0], "cudaStreamSynchronize")

    def malloc(self, nbytes: int) -> int:
        err, ptr = self.rt.cudaMalloc(max(1, nbytes))
        self._check(err, f"cudaMalloc({nbytes})")
        return int(ptr)

    def free(self, ptr: int) -> None:
        self._check(self.rt.cudaFree(ptr)[0], "cudaFree")

    def host_alloc(self, nbytes: int) -> HostBuffer:
        err, ptr = self.rt.cudaHostAlloc(max(1, nbytes), self.rt.cudaHostAllocDefault)
        self._check(err, f"cudaHostAlloc({nbytes})")
        p = int(ptr)
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * max(1, nbytes)).from_address(p))[:nbytes]
        return HostBuffer(ptr=p, nbytes=nbytes, array=arr)

    def host_free(self, buf: HostBuffer) -> None:
        self._check(self.rt.cudaFreeHost(buf.ptr)[0], "cudaFreeHost")

    def _copy(self, dst: int, src: int, nbytes: int, kind: Any, stream: int, what: str) -> None:
        if nbytes:
            self._check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream)[0], what)

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._copy(dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream, "cudaMemcpyAsync(H2D)")

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._copy(dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream, "cudaMemcpyAsync(D2H)")

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._copy(dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream,
                   "cudaMemcpyAsync(D2D)")

    def memcpy2d_dtod_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                            stream: int) -> None:
        if width and height:
            self._check(self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                                  self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream)[0],
                        "cudaMemcpy2DAsync(D2D)")

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self._check(self.rt.cudaMemsetAsync(ptr, value, nbytes, stream)[0], "cudaMemsetAsync")

    def begin_capture(self, stream: int) -> None:
        self._check(self.rt.cudaStreamBeginCapture(
            stream, self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)[0], "cudaStreamBeginCapture")

    def end_capture(self, stream: int) -> Any:
        err, graph = self.rt.cudaStreamEndCapture(stream)
        self._check(err, "cudaStreamEndCapture")
        return graph

    def graph_instantiate(self, graph: Any) -> Any:
        err, exe = self.rt.cudaGraphInstantiate(graph, 0)
        self._check(err, "cudaGraphInstantiate")
        return exe

    def graph_launch(self, graph_exec: Any, stream: int) -> None:
        self._check(self.rt.cudaGraphLaunch(graph_exec, stream)[0], "cudaGraphLaunch")

    def graph_destroy(self, graph: Any) -> None:
        self._check(self.rt.cudaGraphDestroy(graph)[0], "cudaGraphDestroy")

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        self._check(self.rt.cudaGraphExecDestroy(graph_exec)[0], "cudaGraphExecDestroy")


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used here (None when a device answers)."""
    try:
        CudaRuntime()
    except DFlash2Error as e:
        return str(e)
    return None
