"""CUDA-graph cache for fixed-buffer steps (docs/tensorrt.md): warm up eagerly, capture thread-locally, replay.

A *step* is a callable that enqueues all its work on one stream (host→device copies from pinned buffers,
TensorRT ``execute_async_v3`` calls, device→host copies into pinned buffers) and never synchronises.
:meth:`GraphCache.run` executes a step for a :class:`GraphKey`:

1. key seen and captured → ``graph_launch`` (replay; no host work besides the launch);
2. key new → run the step eagerly (its result is this call's result), synchronise (the warm-up: TensorRT
   finishes lazy initialisation for these shapes), then capture the same step in thread-local mode,
   instantiate and keep the executable graph for the next call;
3. capture or instantiation fails → the key is remembered as eager-only and always runs eagerly after
   (the reason is kept in ``failures``); a capture left open is ended and its graph destroyed.

Invariant: a graph replays exactly the copies and kernels it captured, reading and writing the *same
addresses*. The key therefore holds every address the step touches (device buffers, pinned host buffers,
the execution context); when a buffer is freed or reallocated its owner calls :meth:`invalidate` with the
old addresses, which destroys every graph that referenced them — a stale graph is never replayed.
Graphs beyond ``max_graphs`` are evicted least-recently-used.

Not thread safe: one cache per runner (per stream).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dflash2_trt.runtime.trt.cuda_api import CudaApi


@dataclass(frozen=True)
class GraphKey:
    """What a captured graph depends on: engine/step name, optimization profile, shapes, addresses."""

    step: str
    profile: int
    shapes: tuple[Hashable, ...]
    addresses: tuple[int, ...]


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0  # warm-up runs + eager-only runs
    fallbacks: int = 0  # keys whose capture failed
    invalidated: int = 0
    evicted: int = 0


@dataclass
class _Entry:
    graph: Any
    exe: Any


@dataclass
class GraphCache:
    api: CudaApi
    enabled: bool = True
    max_graphs: int = 64
    stats: GraphStats = field(default_factory=GraphStats)
    failures: dict[GraphKey, str] = field(default_factory=dict)  # eager-only keys -> why capture failed
    _graphs: OrderedDict[GraphKey, _Entry] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs

    def run(self, key: GraphKey, stream: int, step: Callable[[], None]) -> str:
        """Run ``step`` for ``key`` on ``stream``; returns "replay", "captured" (eager + capture) or "eager".
        The caller synchronises the stream before reading outputs."""
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            self.api.graph_launch(entry.exe, stream)
            self.stats.replays += 1
            return "replay"
        step()  # eager: this call's result
        self.stats.eager += 1
        if not self.enabled or key in self.failures:
            return "eager"
        self.api.stream_synchronize(stream)  # warm-up done before capture (TensorRT's requirement)
        try:
            self._graphs[key] = self._capture(stream, step)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this key eagerly
            self.failures[key] = f"{type(e).__name__}: {e}"
            self.stats.fallbacks += 1
            return "eager"
        self.stats.captures += 1
        while len(self._graphs) > self.max_graphs:
            _, old = self._graphs.popitem(last=False)
            self._destroy(old)
            self.stats.evicted += 1
        return "captured"

    def _capture(self, stream: int, step: Callable[[], None]) -> _Entry:
        self.api.begin_capture(stream)
        try:
            step()
        except BaseException:
            try:  # end the broken capture so the stream is usable again
                g = self.api.end_capture(stream)
                if g is not None:
                    self.api.graph_destroy(g)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            raise
        graph = self.api.end_capture(stream)
        try:
            exe = self.api.graph_instantiate(graph)
        except BaseException:
            self.api.graph_destroy(graph)
            raise
        return _Entry(graph, exe)

    def invalidate(self, addresses: Iterable[int]) -> int:
        """Destroy every graph (and forget every eager-only verdict) whose key uses one of ``addresses``;
        returns the number of graphs destroyed."""
        dead = set(addresses)
        n = 0
        for key in [k for k in self._graphs if dead.intersection(k.addresses)]:
            self._destroy(self._graphs.pop(key))
            n += 1
        for key in [k for k in self.failures if dead.intersection(k.addresses)]:
            del self.failures[key]
        self.stats.invalidated += n
        return n

    def clear(self) -> None:
        while self._graphs:
            _, e = self._graphs.popitem()
            self._destroy(e)
        self.failures.clear()

    def _destroy(self, e: _Entry) -> None:
        self.api.graph_exec_destroy(e.exe)
        self.api.graph_destroy(e.graph)
