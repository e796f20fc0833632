"""Fixed device buffers for the TensorRT backend: I/O tensors with pinned host mirrors, and the device
twin of :class:`~dflash2_trt.runtime.protocol.KVBuffer`.

Ownership and lifetime (STYLE rule 12): a :class:`BufferPool` owns every allocation of one runner and frees
them in :meth:`BufferPool.close`. I/O buffers are allocated once at their largest shape and never move, so
CUDA graphs that read or write them stay valid for the runner's life. :class:`DeviceKV` buffers move when
the cache grows past its capacity bucket: new buffers are zeroed (stale slots are masked by adding -inf to
their scores, which a NaN or Inf left in device memory would still poison), the old contents are copied (pitched 2-D copies, one per
tensor), the stream is synchronised, the old buffers are freed, and ``on_move`` receives their addresses —
the owner passes them to :meth:`~dflash2_trt.runtime.trt.cuda_graphs.GraphCache.invalidate`, so no captured
graph that reads a freed cache is ever replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.kv import grown_capacity
from dflash2_trt.runtime.trt.cuda_api import CudaApi, HostBuffer


def nbytes_of(shape: Sequence[int], dtype: np.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * np.dtype(dtype).itemsize


@dataclass
class IOTensor:
    """One engine I/O tensor: a device buffer of ``max_shape`` and (for host-visible tensors) a pinned
    mirror of the same size. Smaller shapes use the buffer's prefix (row-major, contiguous)."""

    name: str
    dtype: np.dtype
    max_shape: tuple[int, ...]
    dev: int
    host: HostBuffer | None

    def host_view(self, shape: Sequence[int]) -> np.ndarray:
        """The pinned mirror as an array of ``shape`` (a view: writes go straight to pinned memory)."""
        if self.host is None:
            raise DFlash2Error(f"tensor {self.name} has no host mirror")
        nb = nbytes_of(shape, self.dtype)
        if nb > self.host.nbytes:
            raise DFlash2Error(f"tensor {self.name}: shape {tuple(shape)} exceeds its buffer {self.max_shape}")
        return self.host.array[:nb].view(self.dtype).reshape(tuple(shape))


class BufferPool:
    """Every device / pinned allocation of one runner."""

    def __init__(self, api: CudaApi) -> None:
        self.api = api
        self._dev: set[int] = set()
        self._host: list[HostBuffer] = []

    def device(self, nbytes: int) -> int:
        ptr = self.api.malloc(nbytes)
        self._dev.add(ptr)
        return ptr

    def release(self, ptr: int) -> None:
        self._dev.discard(ptr)
        self.api.free(ptr)

    def pinned(self, nbytes: int) -> HostBuffer:
        buf = self.api.host_alloc(nbytes)
        self._host.append(buf)
        return buf

    def tensor(self, name: str, dtype: np.dtype, max_shape: Sequence[int], host: bool) -> IOTensor:
        nb = nbytes_of(max_shape, dtype)
        return IOTensor(name, np.dtype(dtype), tuple(int(s) for s in max_shape), self.device(nb),
                        self.pinned(nb) if host else None)

    def close(self) -> None:
        for p in sorted(self._dev):
            self.api.free(p)
        self._dev.clear()
        for h in self._host:
            self.api.host_free(h)
        self._host.clear()


class DeviceKV:
    """K/V of one sequence on the device: 2 buffers per layer laid out ``[1, heads, capacity, d]``.

    Same invariants as :class:`~dflash2_trt.runtime.protocol.KVBuffer` (slots ``0..length-1`` valid, capacity in
    multiples of ``step`` up to ``max_length`` rounded up, crop = lower ``length``). The buffers are bound
    in place as the engine's ``past`` inputs (no copy per step); new rows arrive in a contiguous staging
    tensor ``[1, heads, S, d]`` (the engine's ``present`` output) and are written to slots
    ``length..length+S-1`` by one pitched 2-D copy per tensor (:meth:`append`).
    """

    def __init__(self, api: CudaApi, pool: BufferPool, n_layers: int, heads: int, head_dim: int, itemsize: int,
                 step: int, max_length: int, stream: int, on_move: Callable[[list[int]], object]) -> None:
        self.api, self.pool, self.stream, self.on_move = api, pool, stream, on_move
        self.n_layers, self.heads, self.head_dim, self.itemsize = n_layers, heads, head_dim, itemsize
        self.step = max(1, int(step))
        self.max_capacity = -(-max_length // self.step) * self.step
        self.length = 0
        self.capacity = 0
        self.ptrs: list[int] = []  # 2 per layer: key, value
        self.moves = 0

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.itemsize

    def reset(self) -> None:
        self.length = 0

    def reserve(self, n: int) -> None:
        cap = grown_capacity(n, self.capacity, self.step, self.max_capacity)
        if cap == self.capacity:
            return
        nbytes = self.heads * cap * self.row_bytes
        new = [self.pool.device(nbytes) for _ in range(2 * self.n_layers)]
        for p in new:  # cudaMalloc hands out garbage: a NaN in a masked slot still turns its row NaN (0 * NaN)
            self.api.memset_async(p, 0, nbytes, self.stream)
        for dst, src in zip(new, self.ptrs):  # per head: the first `length` rows of the old pitch
            self.api.memcpy2d_dtod_async(dst, cap * self.row_bytes, src, self.capacity * self.row_bytes,
                                         self.length * self.row_bytes, self.heads, self.stream)
        old = self.ptrs
        self.ptrs, self.capacity = new, cap
        if old:
            self.api.stream_synchronize(self.stream)  # copies done before the old buffers go
            for p in old:
                self.pool.release(p)
            self.moves += 1
            self.on_move(old)

    def valid_mask(self, out: np.ndarray) -> None:
        """out [capacity] (int64 view of a pinned buffer): 1 for slots holding a position, else 0."""
        out[: self.length] = 1
        out[self.length: self.capacity] = 0

    def append(self, staging: Sequence[int], rows: int) -> None:
        """staging: 2 per layer, device ``[1, heads, rows, d]`` contiguous -> slots length..length+rows-1."""
        self.reserve(self.length + rows)
        w = rows * self.row_bytes
        for dst, src in zip(self.ptrs, staging):
            self.api.memcpy2d_dtod_async(dst + self.length * self.row_bytes, self.capacity * self.row_bytes,
                                         src, w, w, self.heads, self.stream)
        self.length += rows

    def crop(self, length: int) -> None:
        self.length = min(self.length, max(0, int(length)))
