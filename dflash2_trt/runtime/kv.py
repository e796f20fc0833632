"""The KV capacity policy and the host KV buffer the backends share, the sliding layers' ring buffer, the target
graph's per-layer state in layer order (:func:`layer_feed`, :func:`split_present`), the target's id check, and
what a target runner keeps between forwards (:class:`TargetState`, :class:`BatchSlots`).

Imports only numpy, mmap, weakref, the project error type and the manifest's window spec.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
from numpy.typing import DTypeLike

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import SlidingWindowSpec

Kinds = tuple[str, ...] | list[str]
T = TypeVar("T")


def target_ids(ids: list[int], vocab_size: int) -> np.ndarray:
    """A target call's token ids as [1, m] int64, or DFlash2Error when one is outside [0, vocab_size)."""
    arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise DFlash2Error(f"token id out of range [0, {vocab_size}) in target input")
    return arr


def check_slot_rows(rows: dict[int, list[int]], active: np.ndarray, lengths: np.ndarray, vocab_size: int,
                    max_positions: int) -> None:
    """A batched target call's rows (slot -> token ids) are valid: each slot active, with at least one id, every id in
    [0, vocab_size), and its length plus its rows within ``max_positions`` -- else DFlash2Error saying which."""
    for b, r in rows.items():
        if not active[b]:
            raise DFlash2Error(f"batch slot {b} is not active")
        if not r:
            raise DFlash2Error(f"batch slot {b}: no rows")
        arr = np.asarray(r)
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise DFlash2Error(f"token id out of range [0, {vocab_size}) in target input")
        if int(lengths[b]) + len(r) > max_positions:
            raise DFlash2Error(f"sequence of {int(lengths[b]) + len(r)} positions exceeds the exported cache capacity "
                               f"{max_positions} (re-export with a larger --max-seq-len)")


class BatchSlots:
    """The slot bookkeeping of a batched target runner (the fused and the standard ONNX Runtime ones): ``slots``,
    ``active`` [slots] bool and ``lengths`` [slots] int64; a runner with per-slot state of its own resets it in
    :meth:`_joined`."""

    slots: int
    active: np.ndarray
    lengths: np.ndarray

    def join(self) -> int:
        """The lowest free slot, now active with length 0 (lowest: keeps the bound ranges short)."""
        free = np.flatnonzero(~self.active)
        if not free.size:
            raise DFlash2Error(f"all {self.slots} batch slots are in use")
        b = int(free[0])
        self.active[b], self.lengths[b] = True, 0
        self._joined(b)
        return b

    def _joined(self, slot: int) -> None:
        """A new sequence in ``slot``: the runner's own per-slot state starts over (none here)."""

    def leave(self, slot: int) -> None:
        self.active[slot], self.lengths[slot] = False, 0

    @property
    def free_slots(self) -> int:
        return int((~self.active).sum())


def grown_capacity(n: int, capacity: int, step: int, max_capacity: int) -> int:
    """The KV capacity policy shared by the host and device buffers: the capacity that holds ``n``
    positions — ``capacity`` when it fits, else ``n`` rounded up to a multiple of ``step`` (at most
    ``max_capacity``); beyond ``max_capacity`` a :class:`DFlash2Error`."""
    if n > max_capacity:
        raise DFlash2Error(f"sequence of {n} positions exceeds the exported cache capacity {max_capacity} "
                           f"(re-export with a larger --max-seq-len)")
    if n <= capacity:
        return capacity
    return min(max_capacity, -(-n // step) * step)


def lazy_zeros(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """A zero array whose pages the kernel zeroes when first written, in small (4 kB) pages: a KV buffer grown while
    other sequences decode costs what is copied into it, not the zeroing of its whole capacity (numpy's own large
    arrays ask for transparent huge pages, so a first write anywhere zeroes 2 MB: growing a batch's buffers to a
    joining 1.5k-token prompt's length then stalled the running streams while all of it was zeroed). Where the
    platform cannot map anonymous memory so, plain ``np.zeros``."""
    dt = np.dtype(dtype)
    size = int(np.prod(shape)) * dt.itemsize
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if size < 1 << 21 or advice is None:
        return np.zeros(shape, dtype=dt)
    buf = mmap.mmap(-1, size)  # anonymous: zero-filled by the kernel, page by page on first touch
    buf.madvise(advice)
    return np.frombuffer(buf, dtype=dt).reshape(shape)


def grown_slot_buffers(arrays: list[np.ndarray], capacity: int, n: int, step: int, max_capacity: int,
                       shape: tuple[int, int, int, int], dtype: DTypeLike, lengths: np.ndarray
                       ) -> tuple[list[np.ndarray], int]:
    """The batched runners' caches: ``shape[0]`` buffers [slots, heads, C, d] (``shape`` = (count, slots, heads, d))
    grown to hold ``n`` positions by :func:`grown_capacity`, each slot's first ``lengths[slot]`` positions copied
    (the new buffers are :func:`lazy_zeros`: only what is copied is touched) -> (buffers, capacity); the same buffers
    when they hold ``n``."""
    cap = grown_capacity(n, capacity, step, max_capacity)
    if cap == capacity:
        return arrays, capacity
    count, slots, heads, d = shape
    new = [lazy_zeros((slots, heads, cap, d), dtype) for _ in range(count)]
    held = [(b, int(m)) for b, m in enumerate(lengths) if m > 0]
    for a, old in zip(new, arrays):
        for b, m in held:
            a[b, :, :m] = old[b, :, :m]
    return new, cap


def take_rows(arrays: list[np.ndarray], slot: int, n: int) -> list[np.ndarray]:
    """Copies of one sequence's first ``n`` positions from capacity buffers [slots, heads, C, d]: [heads, n, d] each
    (what the prefix cache keeps, :mod:`dflash2_trt.runtime.prefix_cache`)."""
    return [a[slot, :, :n].copy() for a in arrays]


def put_rows(arrays: list[np.ndarray], slot: int, rows: list[np.ndarray]) -> None:
    """:func:`take_rows`' rows [heads, n, d] back into slot ``slot`` of the buffers, positions 0..n-1."""
    for a, r in zip(arrays, rows):
        a[slot, :, : r.shape[1]] = r


class TargetState:
    """What a single-sequence target runner keeps between forwards (the ONNX Runtime and TensorRT runners, host or
    device buffers alike): ``kv``, the attention layers' cache, whose ``length`` is the cache length; ``linear`` and
    ``ring``, a hybrid target's linear states and a sliding target's rings (None where it has none), each with a
    ``reset()``; ``_call_start``, the cache length before the last forward (a rollback keeps rows of that call
    only)."""

    kv: Any
    linear: Any
    ring: Any
    _call_start: int

    def reset(self) -> None:
        self.kv.reset()
        for state in (self.linear, self.ring):
            if state is not None:
                state.reset()
        self._call_start = 0

    @property
    def cache_length(self) -> int:
        return self.kv.length


class KVBuffer:
    """K/V of one sequence for ``n_layers`` layers in capacity buffers ``[1, heads, capacity, d]``.

    Invariant: slots ``0..length-1`` hold positions ``0..length-1``; slots beyond are stale and masked by
    :meth:`valid_mask`. Capacity grows in multiples of ``step`` (so graph input shapes change rarely) up
    to ``max_length`` rounded up; cropping only lowers ``length`` (no copy). Growing reallocates: a captured
    CUDA graph bound to the old arrays must be dropped then.

    The prefix cache's rows: :meth:`rows` hands out copies and remembers them (weakly) with how many leading slots
    still hold what was copied (``_intact``: every write from slot s on — :meth:`append`, a graph writing in place,
    which reports it through :meth:`wrote`, a reallocation — lowers it to s). :meth:`load` of those same copies
    within that count only sets the length: the buffers already hold them (the next turn of a conversation on the
    runner that ran the last one); any other rows are copied in.
    """

    def __init__(self, n_layers: int, heads: int, head_dim: int, dtype: np.dtype, step: int, max_length: int
                 ) -> None:
        self.n_layers, self.heads, self.head_dim = n_layers, heads, head_dim
        self.dtype = np.dtype(dtype)
        self.step = max(1, int(step))
        self.max_capacity = -(-max_length // self.step) * self.step
        self.length = 0
        self.capacity = 0
        self.arrays: list[np.ndarray] = []  # 2 per layer: key, value
        self._taken: list[weakref.ref] = []  # the copies the last rows() handed out
        self._intact = 0  # leading slots unchanged since those copies were taken

    def reset(self) -> None:
        self.length = 0

    def wrote(self, start: int) -> None:
        """Slots from ``start`` on are being overwritten (a graph writing its new rows in place)."""
        self._intact = min(self._intact, int(start))

    def reserve(self, n: int) -> None:
        """Make room for ``n`` positions."""
        cap = grown_capacity(n, self.capacity, self.step, self.max_capacity)
        if cap == self.capacity:
            return
        new = [lazy_zeros((1, self.heads, cap, self.head_dim), self.dtype) for _ in range(2 * self.n_layers)]
        for a, b in zip(new, self.arrays):
            a[:, :, : self.length] = b[:, :, : self.length]
        self.arrays, self.capacity = new, cap
        self.wrote(self.length)  # slots past the length were not carried over

    def valid_mask(self) -> np.ndarray:
        """[1, capacity] int64: 1 for slots holding a position."""
        m = np.zeros((1, self.capacity), dtype=np.int64)
        m[0, : self.length] = 1
        return m

    def append(self, new: list[np.ndarray]) -> None:
        """new: 2 per layer [1, heads, S, d] -> slots length..length+S-1."""
        S = new[0].shape[2]
        self.reserve(self.length + S)
        self.wrote(self.length)
        for buf, x in zip(self.arrays, new):
            buf[:, :, self.length: self.length + S] = x
        self.length += S

    def crop(self, length: int) -> None:
        self.length = min(self.length, max(0, int(length)))

    def rows(self, n: int) -> list[np.ndarray]:
        """Copies of positions 0..n-1 (n <= length): [heads, n, d] per array."""
        n = min(n, self.length)
        out = take_rows(self.arrays, 0, n)
        self._taken, self._intact = [weakref.ref(a) for a in out], n
        return out

    def holds(self, rows: list[np.ndarray], n: int) -> bool:
        """Whether positions 0..n-1 of the buffers are still ``rows`` (views of the last :meth:`rows` copies)."""
        return (bool(rows) and n <= self._intact and len(rows) == len(self._taken)
                and all((r if r.base is None else r.base) is t() for r, t in zip(rows, self._taken)))

    def load(self, rows: list[np.ndarray], n: int) -> None:
        """Hold exactly positions 0..n-1, :meth:`rows`' copies (in place where the capacity suffices; no copy where
        the buffers still hold them, see the class docstring)."""
        if self.holds(rows, n):
            self.length = n
            return
        self.length = 0
        self.reserve(n)
        self.wrote(0)
        put_rows(self.arrays, 0, rows)
        self.length = n
        if rows and all(r.base is not None for r in rows):  # views of an entry's copies: a later load of it skips too
            self._taken, self._intact = [weakref.ref(r.base) for r in rows], n


def layer_feed(kinds: Kinds, states: dict[str, list[np.ndarray]]) -> list[np.ndarray]:
    """The target graph's per-layer state inputs in layer order (2 per layer with state), each taken from its kind's
    list in ``states`` (each list in its own layers' order): an attention or sliding layer's key and value, a linear
    layer's convolution and recurrent state; an ``mlp`` layer has none."""
    its = {kind: iter(arrays) for kind, arrays in states.items()}
    out = []
    for kind in kinds:
        if kind != "mlp":
            out += [next(its[kind]), next(its[kind])]
    return out


def split_present(kinds: Kinds, present: Sequence[T]) -> dict[str, list[T]]:
    """The graph's per-layer outputs (or their names; 2 per layer with state, layer order, an ``mlp`` layer has
    none) -> kind -> that kind's in its own layers' order (every kind of ``kinds`` a key): what :func:`layer_feed`
    takes back."""
    out: dict[str, list[T]] = {kind: [] for kind in kinds}
    at = 0
    for kind in kinds:
        if kind != "mlp":
            out[kind].extend(present[at: at + 2])
            at += 2
    return out


class WindowRing:
    """K/V of the sliding layers of ``slots`` sequences in ring buffers ``[slots, heads, ring_slots, d]``: position
    p lives in slot p % ring_slots, and ``positions [slots, ring_slots]`` (the target graph's ``window_positions``)
    says which position each slot holds (-1: none). Memory is bounded by the ring, whatever the context.

    A call's new rows are written over the oldest slots; since the ring holds ``ring_slots - window`` more slots
    than the window, a crop back into a call of at most ``ring_slots - window + 1`` rows finds every key its next
    row needs (the overwritten ones are older than any window after the crop) and only drops the cut rows' slots.
    A crop below that (:attr:`floor`) raises instead of decoding with keys lost."""

    def __init__(self, n_layers: int, heads: int, head_dim: int, dtype: DTypeLike, spec: SlidingWindowSpec,
                 slots: int = 1) -> None:
        self.spec, self.slots = spec, int(slots)
        self.arrays = [np.zeros((slots, heads, spec.ring_slots, head_dim), dtype=dtype) for _ in range(2 * n_layers)]
        self.positions = np.full((slots, spec.ring_slots), -1, dtype=np.int64)
        self.floor = np.zeros(slots, dtype=np.int64)  # per slot: the lowest length a crop can return to

    def reset(self, slot: int | None = None) -> None:
        """Empty one slot's ring (every slot's when None): a new sequence."""
        rows = slice(None) if slot is None else slice(slot, slot + 1)
        self.positions[rows] = -1
        self.floor[rows] = 0

    def feed(self, lo: int = 0, hi: int | None = None) -> tuple[list[np.ndarray], np.ndarray]:
        """(the rings of slots lo..hi-1, 2 per sliding layer; their ``window_positions``): views."""
        hi = self.slots if hi is None else hi
        return [a[lo:hi] for a in self.arrays], self.positions[lo:hi]

    def write(self, slot: int, start: int, new: list[np.ndarray], row: int = 0) -> None:
        """Slot ``slot``'s new rows at positions start.. : ``new`` 2 per sliding layer [n, heads, S, d], this slot's
        rows at index ``row`` (the ring keeps the last ``ring_slots`` of them)."""
        for src, dst, count in self.place(slot, start, new[0].shape[2]):
            for buf, x in zip(self.arrays, new):
                buf[slot][:, dst:dst + count] = x[row][:, src:src + count]

    def place(self, slot: int, start: int, rows: int) -> list[tuple[int, int, int]]:
        """Record that slot ``slot``'s ``rows`` new rows at positions start.. go into its ring -> where they go, as
        contiguous runs (first row of the call, first ring slot, count; at most two): the last ``ring_slots`` of
        the rows, each at slot position % ring_slots. (The device ring copies by these runs.)"""
        R, W = self.spec.ring_slots, self.spec.window
        first = max(0, rows - R)
        runs = []
        while first < rows:
            dst = (start + first) % R
            count = min(rows - first, R - dst)
            runs.append((first, dst, count))
            self.positions[slot, dst:dst + count] = start + first + np.arange(count)
            first += count
        # the lowest key the ring holds only rises within a sequence (a cut row's slot stays lost to its older
        # position), so neither does the floor: a short call after a crop must not lower it below the lost keys
        self.floor[slot] = max(self.floor[slot], start + rows - (R - W) - 1)
        return runs

    def crop(self, slot: int, length: int) -> None:
        """Slot ``slot`` keeps positions < ``length``, or DFlash2Error when the ring no longer holds the keys the row
        at ``length`` needs (a crop deeper than a verify's rows into the last call)."""
        if length < self.floor[slot]:
            raise DFlash2Error(f"the sliding-window ring of {self.spec.ring_slots} slots cannot return to length "
                               f"{length}: it holds the keys of lengths >= {int(self.floor[slot])} only")
        p = self.positions[slot]
        p[p >= length] = -1

    def snapshot(self, slot: int) -> tuple[list[np.ndarray], np.ndarray, int]:
        """Copies of slot ``slot``'s rings, window positions and floor: what :meth:`restore` puts back, the ring as
        it is (rotated: position p in slot p % ring_slots)."""
        return [a[slot].copy() for a in self.arrays], self.positions[slot].copy(), int(self.floor[slot])

    def restore(self, slot: int, snap: tuple[list[np.ndarray], np.ndarray, int]) -> None:
        arrays, positions, floor = snap
        for a, x in zip(self.arrays, arrays):
            a[slot] = x
        self.positions[slot], self.floor[slot] = positions, floor

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays) + self.positions.nbytes
