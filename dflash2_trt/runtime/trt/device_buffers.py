"""Fixed device buffers for the TensorRT backend: I/O tensors with pinned host mirrors, the device twin of
:class:`~dflash2_trt.runtime.kv.KVBuffer`, the device twin of :class:`~dflash2_trt.runtime.linear_state.LinearStates`
(the linear layers' state of a hybrid target) and the device twin of :class:`~dflash2_trt.runtime.kv.WindowRing`
(the sliding layers' rings).

Ownership and lifetime: a :class:`BufferPool` owns every allocation of one runner and frees
them in :meth:`BufferPool.close`. I/O buffers are allocated once at their largest shape and never move, so
CUDA graphs that read or write them stay valid for the runner's life. :class:`DeviceKV` buffers move when
the cache grows past its capacity bucket: new buffers are zeroed (stale slots are masked by adding -inf to
their scores, which a NaN or Inf left in device memory would still poison), the old contents are copied (pitched 2-D copies, one per
tensor), the stream is synchronised, the old buffers are freed, and ``on_move`` receives their addresses —
the owner passes them to :meth:`~dflash2_trt.runtime.trt.cuda_graphs.GraphCache.invalidate`, so no captured
graph that reads a freed cache is ever replayed. :class:`DeviceLinearState` buffers are allocated once and never
move (a linear layer's state has a fixed size), so graphs that bind them stay valid; its updates are device-to-device
copies enqueued on the runner's stream, outside any captured graph. :class:`DeviceWindowRing` buffers are allocated
once at the ring's size and never move either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import LinearStateSpec, SlidingWindowSpec
from dflash2_trt.runtime.kv import WindowRing, grown_capacity
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


class HostStaging:
    """A pinned bounce buffer for the prefix cache's copies between device buffers and host arrays
    (:mod:`dflash2_trt.runtime.prefix_cache` keeps its entries in host memory): made on first use, ``nbytes`` at a
    time, each piece's copy waited for before the buffer is reused."""

    def __init__(self, api: CudaApi, pool: BufferPool, stream: int, nbytes: int = 8 << 20) -> None:
        self.api, self.pool, self.stream, self.nbytes = api, pool, stream, nbytes
        self._buf: HostBuffer | None = None

    def _piece(self) -> HostBuffer:
        if self._buf is None:
            self._buf = self.pool.pinned(self.nbytes)
        return self._buf

    def to_host(self, src: int, out: np.ndarray) -> None:
        """The device bytes at ``src`` -> ``out`` (C-contiguous; as many bytes as it holds)."""
        flat, buf = out.reshape(-1).view(np.uint8), self._piece()
        for a in range(0, flat.size, self.nbytes):
            n = min(self.nbytes, flat.size - a)
            self.api.memcpy_dtoh_async(buf.ptr, src + a, n, self.stream)
            self.api.stream_synchronize(self.stream)
            flat[a: a + n] = buf.array[:n]

    def to_device(self, arr: np.ndarray, dst: int) -> None:
        """``arr``'s bytes (C order) -> the device at ``dst``."""
        flat, buf = np.ascontiguousarray(arr).reshape(-1).view(np.uint8), self._piece()
        for a in range(0, flat.size, self.nbytes):
            n = min(self.nbytes, flat.size - a)
            buf.array[:n] = flat[a: a + n]
            self.api.memcpy_htod_async(dst + a, buf.ptr, n, self.stream)
            self.api.stream_synchronize(self.stream)


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

    def rows(self, n: int, dtype: np.dtype, staging: HostStaging) -> list[np.ndarray]:
        """Host copies of positions 0..n-1 (n <= length): [heads, n, d] per buffer, as ``KVBuffer.rows``."""
        n = min(int(n), self.length)
        out = [np.empty((self.heads, n, self.head_dim), dtype) for _ in self.ptrs]
        for p, a in zip(self.ptrs, out):
            for h in range(self.heads):  # each head's rows are contiguous at the buffer's pitch
                staging.to_host(p + h * self.capacity * self.row_bytes, a[h])
        return out

    def load(self, rows: Sequence[np.ndarray], n: int, staging: HostStaging) -> None:
        """Hold exactly positions 0..n-1, :meth:`rows`' copies (a new sequence: the buffers keep their place where
        the capacity suffices)."""
        self.length = 0
        self.reserve(n)
        for p, a in zip(self.ptrs, rows):
            for h in range(self.heads):
                staging.to_device(a[h, :n], p + h * self.capacity * self.row_bytes)
        self.length = int(n)


class DeviceLinearState:
    """The linear layers' state of one sequence on the device: per linear layer a convolution buffer
    ``[1, conv_dim, K - 1]`` (``conv_itemsize`` bytes an element, the target's dtype) and a recurrent buffer
    ``[1, heads, dk, dv]`` fp32, bound in place as the engine's ``past_conv.{i}`` / ``past_recurrent.{i}`` inputs.

    The engine's outputs land in the runner's staging tensors, given here as ``conv_inputs`` (``present_conv.{i}``:
    the call's convolution inputs, contiguous ``[1, conv_dim, S]``) and ``row_states`` (``present_recurrent.{i}``:
    ``[1, R, heads, dk, dv]``, the state after each asked row). A call leaves the state buffers as they were (the
    state before the call, which a rollback needs); :meth:`called` records it and :meth:`commit` writes the state
    after its first ``keep`` rows, by copies on the device only:

    * recurrent <- ``row_states[:, keep - 1]`` (every row asked; ``[:, 0]``, the last row's, otherwise): one copy;
    * conv <- the last K - 1 columns of ``[conv | conv_inputs[:, :, :keep]]``: pitched 2-D copies, through
      ``scratch`` when old columns are kept (a copy within one buffer would overlap);
    * ``keep`` = 0: nothing (the state before the call is the state).

    The runner commits a call's every row before the next call (:meth:`commit` with ``keep`` None) and a
    verify's accepted rows at a crop (:meth:`rollback`), the same rules as :class:`LinearStates` (only the last
    call, only when it asked for every row). Buffers are zeroed when allocated and by :meth:`reset` (a new sequence).
    """

    def __init__(self, api: CudaApi, pool: BufferPool, n_layers: int, spec: LinearStateSpec, conv_itemsize: int,
                 conv_inputs: Sequence[int], row_states: Sequence[int], stream: int) -> None:
        self.api, self.stream, self.spec = api, stream, spec
        self.n_layers, self.conv_itemsize = n_layers, conv_itemsize
        self.conv_bytes = spec.conv_dim * (spec.conv_kernel - 1) * conv_itemsize
        self.state_bytes = spec.num_heads * spec.key_dim * spec.value_dim * 4  # fp32
        self.conv = [pool.device(self.conv_bytes) for _ in range(n_layers)]
        self.recurrent = [pool.device(self.state_bytes) for _ in range(n_layers)]
        self.scratch = pool.device(self.conv_bytes)
        self.conv_inputs, self.row_states = list(conv_inputs), list(row_states)
        self.pending: tuple[int, bool] | None = None  # the last call not yet committed: (rows S, every row asked)
        self.reset()

    @property
    def ptrs(self) -> list[int]:
        """The engine's state inputs in layer order: conv, recurrent per linear layer."""
        return [p for pair in zip(self.conv, self.recurrent) for p in pair]

    def reset(self) -> None:
        """Zero every layer's state (a new sequence; cudaMalloc memory is garbage) and forget the last call."""
        for p in self.conv:
            self.api.memset_async(p, 0, self.conv_bytes, self.stream)
        for p in self.recurrent:
            self.api.memset_async(p, 0, self.state_bytes, self.stream)
        self.pending = None

    def called(self, rows: int, every_row: bool) -> None:
        """A call of ``rows`` rows ran (its outputs are in the staging tensors; the state buffers hold the state
        before it). ``every_row``: it asked for each row's recurrent state, so it can be rolled back."""
        if self.pending is not None:
            raise DFlash2Error("linear state: the previous call was not committed before the next one")
        self.pending = (int(rows), bool(every_row))

    def commit(self, keep: int | None = None) -> None:
        """The state after the first ``keep`` rows of the last call (None: all of them); nothing when committed."""
        if self.pending is None:
            return
        rows, every_row = self.pending
        keep = rows if keep is None else int(keep)
        if not 0 <= keep <= rows or (keep != rows and not every_row):
            raise DFlash2Error(f"cannot keep {keep} rows of a call of {rows}")
        self.pending = None
        if keep == 0:
            return
        row = keep - 1 if every_row else 0
        for conv, rec, inputs, states in zip(self.conv, self.recurrent, self.conv_inputs, self.row_states):
            self.api.memcpy_dtod_async(rec, states + row * self.state_bytes, self.state_bytes, self.stream)
            self._shift_conv(conv, inputs, rows, keep)

    def _shift_conv(self, conv: int, inputs: int, rows: int, keep: int) -> None:
        """conv [conv_dim, K1] <- the last K1 columns of [conv | inputs[:, :keep]], inputs [conv_dim, rows]."""
        it, c, k1 = self.conv_itemsize, self.spec.conv_dim, self.spec.conv_kernel - 1
        new = min(keep, k1)  # columns from this call's inputs, after `old` columns kept from the state
        old = k1 - new
        dst = conv if old == 0 else self.scratch
        api, s = self.api, self.stream
        api.memcpy2d_dtod_async(dst, k1 * it, conv + new * it, k1 * it, old * it, c, s)
        api.memcpy2d_dtod_async(dst + old * it, k1 * it, inputs + (keep - new) * it, rows * it, new * it, c, s)
        if dst != conv:
            api.memcpy_dtod_async(conv, self.scratch, self.conv_bytes, s)

    def rollback(self, keep: int) -> None:
        """Keep the first ``keep`` rows of the last call (0 <= keep <= its rows): the state after them. Only into the
        last call, and only when it asked for every row (a verify), as :meth:`LinearStates.rollback`."""
        if self.pending is None or not self.pending[1]:
            raise DFlash2Error("the linear layers' state can be rolled back only into the last call, and only when "
                               "it recorded every row's state")
        self.commit(keep)

    def snapshot(self, conv_dtype: np.dtype, staging: HostStaging) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Host copies of every layer's convolution [conv_dim, K - 1] and recurrent [heads, dk, dv] state after
        the last call (committed first: a snapshot is taken where nothing rolls back), as
        ``LinearStates.snapshot``."""
        self.commit()
        spec = self.spec
        conv = [np.empty((spec.conv_dim, spec.conv_kernel - 1), conv_dtype) for _ in self.conv]
        rec = [np.empty((spec.num_heads, spec.key_dim, spec.value_dim), np.float32) for _ in self.recurrent]
        for p, a in (*zip(self.conv, conv), *zip(self.recurrent, rec)):
            staging.to_host(p, a)
        return conv, rec

    def restore(self, snap: tuple[list[np.ndarray], list[np.ndarray]], staging: HostStaging) -> None:
        """Hold :meth:`snapshot`'s state (a new sequence: nothing to roll back into)."""
        for p, a in (*zip(self.conv, snap[0]), *zip(self.recurrent, snap[1])):
            staging.to_device(a, p)
        self.pending = None


class DeviceWindowRing:
    """The sliding layers' K/V of one sequence on the device: 2 buffers per sliding layer ``[1, heads, ring_slots,
    d]``, bound in place as the engine's past inputs, with the bookkeeping of :class:`WindowRing` on the host (which
    position each slot holds: the engine's ``window_positions`` input; how deep a crop may go). A call's new rows
    arrive in the engine's ``present`` staging tensors ``[1, heads, S, d]`` and go to their slots by pitched 2-D
    copies (:meth:`append`: at most two runs per tensor, where the ring wraps); a crop only drops the cut rows'
    slots. Buffers are zeroed when allocated (a NaN in a masked slot would still poison its row)."""

    def __init__(self, api: CudaApi, pool: BufferPool, n_layers: int, heads: int, head_dim: int, itemsize: int,
                 spec: SlidingWindowSpec, stream: int) -> None:
        self.api, self.stream, self.heads, self.head_dim, self.slots = api, stream, heads, head_dim, spec.ring_slots
        self.row_bytes = head_dim * itemsize
        self.slots_bytes = spec.ring_slots * self.row_bytes
        self.ring = WindowRing(0, heads, head_dim, np.float32, spec)  # positions and floor only
        self.ptrs = [pool.device(heads * self.slots_bytes) for _ in range(2 * n_layers)]  # 2 per layer
        for p in self.ptrs:
            api.memset_async(p, 0, heads * self.slots_bytes, stream)

    @property
    def positions(self) -> np.ndarray:
        """[ring_slots] int64: the position each slot holds (-1: none)."""
        row: np.ndarray = self.ring.positions[0]
        return row

    def reset(self) -> None:
        self.ring.reset()

    def append(self, staging: Sequence[int], start: int, rows: int) -> None:
        """staging: 2 per sliding layer, device ``[1, heads, rows, d]`` contiguous, positions start.. -> their
        slots."""
        for src, dst, count in self.ring.place(0, start, rows):
            w = count * self.row_bytes
            for ring, st in zip(self.ptrs, staging):
                self.api.memcpy2d_dtod_async(ring + dst * self.row_bytes, self.slots_bytes,
                                             st + src * self.row_bytes, rows * self.row_bytes, w, self.heads,
                                             self.stream)

    def crop(self, length: int) -> None:
        self.ring.crop(0, length)

    def snapshot(self, dtype: np.dtype, staging: HostStaging) -> tuple[list[np.ndarray], np.ndarray, int]:
        """Host copies of the rings [heads, ring_slots, d] as they lie (rotated), the window positions and the
        floor: ``WindowRing.snapshot``'s form."""
        arrays = [np.empty((self.heads, self.slots, self.head_dim), dtype) for _ in self.ptrs]
        for p, a in zip(self.ptrs, arrays):
            staging.to_host(p, a)
        _, positions, floor = self.ring.snapshot(0)
        return arrays, positions, floor

    def restore(self, snap: tuple[list[np.ndarray], np.ndarray, int], staging: HostStaging) -> None:
        arrays, positions, floor = snap
        for p, a in zip(self.ptrs, arrays):
            staging.to_device(a, p)
        self.ring.restore(0, ([], positions, floor))
