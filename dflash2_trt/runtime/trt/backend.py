"""TensorRT backend: the runners of :mod:`dflash2_trt.runtime.protocol` over the engines that
``dflash2 build-engines`` wrote (see :mod:`dflash2_trt.export.engines` for the manifest entry).

Same NumPy decoder loop as ONNX Runtime (:mod:`dflash2_trt.runtime.decoder`); only the graph calls differ,
so token equality with ORT / PyTorch reduces to engine-vs-ONNX equality.

Per engine: the deserialised ``ICudaEngine`` and one scratch allocation (``device_memory_size_v2``) shared by
its execution contexts (``USER_MANAGED`` memory). Every engine a runner can use (target, drafter context and
block, the head of each selector mode) is deserialised while the backend is constructed, with one context per
optimization profile for eager calls, so a TensorRT that refuses any of them raises ``BackendUnavailable``
there and ``--backend auto`` falls back. Captured steps add one context per shape bucket, at most
``max_contexts`` per engine (least recently used dropped with its graphs) — a captured CUDA graph fixes the
context's shapes and addresses, so a context that has a graph is never re-shaped. Profiles are shared between
contexts of one backend, which never run concurrently: all work of a backend runs in order on one stream
(engines are built without auxiliary streams), which is also what makes sharing the scratch safe.

Steps and graphs (:mod:`dflash2_trt.runtime.trt.cuda_graphs`): the target's verify / decode call (rows <= the
block size) and the drafter step (block pass + head with the selector, one graph for both engines) each run
as one CUDA graph per (rows, capacity bucket, buffers): inputs are written into pinned host buffers, the
graph copies them in, runs the engine(s) and copies logits / features / drafts out. The KV caches are bound
in place as the ``past`` inputs; the new rows (the ``present`` outputs, in staging buffers) are committed by
2-D copies after the graph, because their destination moves every step. Prefill and long context updates run
in chunks of ``prefill_rows`` rows on the prefill profile, eagerly.

A target with linear layers (hybrid; manifest version 3) keeps their state on the device
(:class:`~dflash2_trt.runtime.trt.device_buffers.DeviceLinearState`): buffers allocated once, bound in place as the
``past_conv`` / ``past_recurrent`` inputs, so its steps are captured like a dense target's (the addresses never
change). The engine returns the call's convolution inputs and the recurrent state after each asked row into fixed
staging buffers; the state after the accepted rows is written from them by device-to-device copies outside the
graph (at the crop after a verify, or before the next call: every row), never through the host. Its prompts run in
chunks of at most the graph's row limit (``target.linear_state.max_rows_per_call``, the prefill profile's rows).

Status: **never run** — no GPU and no TensorRT libraries were available while this was written. The logic
above is exercised on the CPU against recording fakes (``tests/test_trt_runtime.py``; hybrid targets:
``tests/test_trt_hybrid.py``) and type-checked against ``tensorrt-stubs`` (``tests/test_trt_static.py``);
``benchmarks/trt_gpu_check.py`` is the check to run on a GPU.

Ownership: a :class:`TrtBackend` owns its engines, stream and graph cache; runners own their buffers. Not
thread safe (one backend per thread / concurrent request); call :meth:`TrtBackend.close` to free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import (TARGET_STATE_ROWS, TARGET_WINDOW_POSITIONS, EngineProfile, ExportManifest,
                                  LinearStateSpec, read_manifest, sha256_file)
from dflash2_trt.runtime.kv import TargetState, split_present
from dflash2_trt.runtime.prefix_cache import SlotState
from dflash2_trt.runtime.protocol import BackendBase, BackendUnavailable, Draft
from dflash2_trt.runtime.trt.cuda_api import CudaApi, CudaRuntime
from dflash2_trt.runtime.trt.cuda_graphs import GraphCache, GraphKey
from dflash2_trt.runtime.trt.device_buffers import (BufferPool, DeviceKV, DeviceLinearState, DeviceWindowRing,
                                                    HostStaging, IOTensor, nbytes_of)
from dflash2_trt.runtime.trt.env import (check_engine_identity, current_identity, engine_set, import_tensorrt,
                                         load_plugin_library, resolve_plugin)
from dflash2_trt.vocabulary import LAYER_KINDS, SELECTOR_MODES, head_key

if TYPE_CHECKING:
    import tensorrt as trt

# TensorRT DataType name -> numpy dtype (bf16 travels as its uint16 bit pattern)
_NP_OF_TRT = {"FLOAT": np.float32, "HALF": np.float16, "BF16": np.uint16, "INT32": np.int32, "INT64": np.int64,
              "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_}


def np_dtype(trt_dtype: object) -> np.dtype:
    name = str(getattr(trt_dtype, "name", trt_dtype)).split(".")[-1]
    if name not in _NP_OF_TRT:
        raise DFlash2Error(f"TensorRT tensor type {name} is not supported by this runtime")
    return np.dtype(_NP_OF_TRT[name])


# ----------------------------------------------------------------------------------------------------
# One engine
# ----------------------------------------------------------------------------------------------------


class TrtEngine:
    """A deserialised engine, its shared scratch memory and its execution contexts."""

    def __init__(self, be: TrtBackend, key: str, path: Path, profiles: Sequence[EngineProfile]) -> None:
        self.be, self.key, self.profiles = be, key, profiles
        trt_mod = be.trt
        engine = be.runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:  # the identity check passed, so this is a TensorRT / driver / plugin refusal here
            raise BackendUnavailable(f"TensorRT could not deserialize {path.name} (built by another TensorRT "
                                     f"version or GPU, corrupt, or the plugin library is missing): rebuild with "
                                     f"dflash2 build-engines")
        self.engine: trt.ICudaEngine = engine
        self.names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in self.names if engine.get_tensor_mode(n) == trt_mod.TensorIOMode.INPUT]
        self.outputs = [n for n in self.names if n not in self.inputs]
        self.dtypes = {n: np_dtype(engine.get_tensor_dtype(n)) for n in self.names}
        # engines from dflash2 build-engines use none; one built with auxiliary streams is never captured: a
        # failed capture could leave TensorRT's own streams capturing, out of this backend's reach
        self.aux_streams = int(getattr(engine, "num_aux_streams", 0))
        self.scratch_bytes = int(engine.device_memory_size_v2)
        self.scratch = be.pool.device(self.scratch_bytes)
        self._eager: dict[int, trt.IExecutionContext] = {}
        # captured shape buckets' contexts, least recently used first (bounded by be.max_contexts)
        self._graph_ctx: OrderedDict[tuple[int, tuple[tuple[str, tuple[int, ...]], ...]],
                                     trt.IExecutionContext] = OrderedDict()
        self.evicted = 0

    def profile_index(self, name: str) -> int:
        for i, p in enumerate(self.profiles):
            if p.name == name:
                return i
        raise DFlash2Error(f"engine {self.key} has no {name!r} optimization profile")

    def max_dim(self, profile: str, dim: str) -> int:
        return int(self.profiles[self.profile_index(profile)].dims[dim][2])

    def _new_context(self, profile: int) -> trt.IExecutionContext:
        """A context on ``profile``. Profiles are shared between contexts (TensorRT 10+ always allows it);
        TensorRT refusing a context or a profile here means "cannot run here": BackendUnavailable."""
        trt_mod = self.be.trt
        ctx = self.engine.create_execution_context(trt_mod.ExecutionContextAllocationStrategy.USER_MANAGED)
        if ctx is None:
            raise BackendUnavailable(f"TensorRT could not create an execution context for {self.key} (see the "
                                     f"TensorRT log above)")
        ctx.set_device_memory(self.scratch, self.scratch_bytes)
        if self.be.profiler is not None:  # per-layer timing (GPU check); profiled steps run eagerly
            ctx.profiler = self.be.profiler
        try:  # the Python binding raises RuntimeError where the C++ API returns false
            ok = ctx.set_optimization_profile_async(profile, self.be.stream)
        except RuntimeError as e:
            raise BackendUnavailable(f"{self.key}: TensorRT cannot select optimization profile {profile} "
                                     f"({self.profiles[profile].name}) for a new execution context: {e}") from None
        if not ok:
            raise BackendUnavailable(f"{self.key}: TensorRT cannot select optimization profile {profile} "
                                     f"({self.profiles[profile].name}) for a new execution context")
        return ctx

    def open_contexts(self) -> None:
        """Create the eager context of every profile now, so that a TensorRT that cannot run these engines
        fails while the backend is being constructed (and ``--backend auto`` falls back)."""
        for i in range(len(self.profiles)):
            if i not in self._eager:
                self._eager[i] = self._new_context(i)

    @property
    def n_contexts(self) -> int:
        return len(self._eager) + len(self._graph_ctx)

    def bind(self, profile: int, shapes: Mapping[str, tuple[int, ...]], addresses: Mapping[str, int], captured: bool
             ) -> trt.IExecutionContext:
        """A context with ``shapes`` set on the inputs and every tensor bound to ``addresses``.
        ``captured``: the shape bucket's own context (fixed shapes), else the profile's eager context.

        Captured contexts are bounded by ``be.max_contexts`` per engine: the least recently used one is
        dropped, after every graph that used it (its key holds the context's identity) is destroyed."""
        skey = (profile, tuple(sorted(shapes.items())))
        if captured:
            ctx = self._graph_ctx.get(skey)
            fresh = ctx is None
            if ctx is None:
                while len(self._graph_ctx) >= self.be.max_contexts:
                    _, old = self._graph_ctx.popitem(last=False)
                    self.be.graphs.invalidate([id(old)])
                    self.evicted += 1
                ctx = self._graph_ctx[skey] = self._new_context(profile)
            else:
                self._graph_ctx.move_to_end(skey)
        else:
            ctx = self._eager.get(profile)
            if ctx is None:
                ctx = self._eager[profile] = self._new_context(profile)
            fresh = True
        if fresh:
            for name, shape in shapes.items():
                if not ctx.set_input_shape(name, shape):
                    raise DFlash2Error(f"{self.key}: input {name} shape {shape} is outside optimization profile "
                                       f"{profile} ({self.profiles[profile].name})")
        for name in self.names:
            if not ctx.set_tensor_address(name, addresses[name]):
                raise DFlash2Error(f"{self.key}: cannot bind tensor {name}")
        return ctx

    def check_static_shape(self, name: str, expected: tuple[int, ...]) -> None:
        """The engine's static dims of ``name`` must equal ``expected`` (the buffer sizes the runner derives
        from the manifest): a mismatch would let TensorRT write past the runner's buffers."""
        dims = self.engine.get_tensor_shape(name)
        got = tuple(int(dims[i]) for i in range(len(dims)))
        if len(got) != len(expected) or any(g >= 0 and g != e for g, e in zip(got, expected)):
            raise DFlash2Error(f"{self.key}: engine tensor {name} has shape {got}, the manifest implies "
                               f"{expected}: the engines do not belong to this export (rebuild with dflash2 "
                               f"build-engines)")

    def check_float_output(self, name: str) -> None:
        """The host reads ``name`` as fp32 or fp16: a bf16 output (it arrives as its uint16 bit pattern) would be
        misread as integers, so it is refused at load."""
        if self.dtypes[name] not in (np.dtype(np.float32), np.dtype(np.float16)):
            kind = "BF16" if self.dtypes[name] == np.dtype(np.uint16) else str(self.dtypes[name])
            raise DFlash2Error(f"{self.key}: engine output {name} is {kind}; this runtime reads fp32 or fp16 only "
                               f"(rebuild with dflash2 build-engines)")

    def execute(self, ctx: trt.IExecutionContext) -> None:
        if not ctx.execute_async_v3(self.be.stream):
            raise DFlash2Error(f"TensorRT execution of {self.key} failed (see the TensorRT log above)")


# ----------------------------------------------------------------------------------------------------
# Backend
# ----------------------------------------------------------------------------------------------------


class TrtBackend(BackendBase):
    """An export folder's TensorRT engines. ``trt_module`` / ``api`` exist for the CPU tests' fakes.

    Raises :class:`~dflash2_trt.runtime.protocol.BackendUnavailable` when TensorRT, CUDA or a GPU is missing, the
    export has no engines, or they were built for another TensorRT version, GPU or plugin library."""

    name = "trt"

    #: captured shape-bucket contexts kept per engine (each holds TensorRT per-context state; the oldest is
    #: dropped with its graphs beyond this) and captured graphs kept per backend
    max_contexts = 16
    max_graphs = 48

    def __init__(self, model_dir: str | Path, verify_checksums: bool = True, plugin: str | Path | None = None,
                 cuda_graphs: bool = True, trt_module: ModuleType | None = None, api: CudaApi | None = None
                 ) -> None:
        self.dir = Path(model_dir)
        self.trt: Any = trt_module if trt_module is not None else import_tensorrt()
        self.manifest: ExportManifest = read_manifest(self.dir, verify_checksums)
        self.entry = engine_set(self.manifest, self.dir)
        self.api: CudaApi = api if api is not None else CudaRuntime()
        self.device = self.api.device_info()
        plugin_path = resolve_plugin(self.entry, self.dir, plugin)
        check_engine_identity(self.entry, current_identity(self.trt.__version__, self.device),
                              sha256_file(plugin_path) if plugin_path else None)
        self.logger = self.trt.Logger(self.trt.Logger.WARNING)
        if plugin_path is not None:
            load_plugin_library(self.trt, plugin_path, self.manifest.plugin)
        self.plugin_path = plugin_path
        self.runtime = self.trt.Runtime(self.logger)
        self.stream = self.api.stream_create()
        self._closed = False
        self.pool = BufferPool(self.api)
        self.staging = HostStaging(self.api, self.pool, self.stream)  # the prefix cache's copies
        self.graphs = GraphCache(self.api, enabled=cuda_graphs, max_graphs=self.max_graphs)
        self._engines: dict[str, TrtEngine] = {}
        self.profiler: trt.IProfiler | None = None  # set before creating runners to time layers
        try:  # deserialise every engine a runner can use and open a context per profile now (see open_contexts)
            for key in self.engine_keys():
                self.engine(key).open_contexts()
        except BaseException:
            self.close()
            raise

    @property
    def description(self) -> str:
        return f"TensorRT {self.trt.__version__} on {self.device.name}"

    @property
    def prefix_cache(self) -> bool:
        return True  # both runners: host copies of the device K/V, linear states and rings (HostStaging)

    def engine(self, key: str) -> TrtEngine:
        if key not in self._engines:
            plan = self.entry.plans.get(key)
            if plan is None:
                raise DFlash2Error(f"{self.dir} has no TensorRT engine for graph {key!r} (built: "
                                   f"{', '.join(sorted(self.entry.plans))}); rebuild with "
                                   f"dflash2 build-engines --selector ...")
            self._engines[key] = TrtEngine(self, key, self.dir / plan.file, plan.profiles)
        return self._engines[key]

    def engine_keys(self) -> list[str]:
        """The engines the runners of this export use: target, drafter context and block, and per selector mode
        the head :meth:`head_engine_key` picks. All are opened while the backend is constructed — the head
        (plugin creator missing, another TensorRT major) is the likeliest to fail, and a failure after
        ``open_backend`` returned could no longer fall back to ONNX Runtime."""
        keys: list[str] = [k for k in ("target", "drafter_context", "drafter_block") if k in self.entry.plans]
        for mode in SELECTOR_MODES:
            keys += [k for k in (head_key(mode, plugin=True), head_key(mode)) if k in self.entry.plans][:1]
        return keys

    def head_engine_key(self, mode: str) -> str:
        for k in (head_key(mode, plugin=True), head_key(mode)):
            if k in self.entry.plans:
                return k
        raise DFlash2Error(f"{self.dir} has no TensorRT engine for the {mode} drafter head")

    def target_runner(self) -> TrtTargetRunner:
        return TrtTargetRunner(self)

    def draft_runner(self, mode: str = "greedy") -> TrtDraftRunner:
        if mode not in SELECTOR_MODES:
            raise DFlash2Error(f"the TensorRT backend runs the selector modes {', '.join(SELECTOR_MODES)} only, got "
                               f"{mode!r} (no-selector drafting runs with --backend ort)")
        return TrtDraftRunner(self, mode)

    def sync(self) -> None:
        self.api.stream_synchronize(self.stream)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.graphs.clear()
        self._engines.clear()
        self.pool.close()
        self.api.stream_destroy(self.stream)


def _io(be: TrtBackend, eng: TrtEngine, max_shapes: dict[str, tuple[int, ...]], host: set[str]
        ) -> dict[str, IOTensor]:
    return {n: be.pool.tensor(n, eng.dtypes[n], max_shapes[n], n in host) for n in max_shapes}


class TrtTargetRunner(TargetState):
    """TargetRunner over the ``target`` engine (profiles ``prefill`` and ``step``): the attention layers' KV in
    :class:`DeviceKV`, for a target with linear layers their state in :class:`DeviceLinearState`, for one with
    sliding layers their rings in :class:`DeviceWindowRing` (bound in place at the ring's fixed size, the
    ``window_positions`` input from its host bookkeeping, the call's new rows copied into their slots after it).

    Linear layers: a forward of at most ``step_rows`` rows (a verify, a short prompt) asks for every row's recurrent
    state, so a crop into it keeps the accepted rows' state (device copies); a longer one runs in chunks of at most
    the graph's row limit (the prefill profile's rows) that ask for their last row's only and cannot be rolled back
    (a prompt: the decoder never rolls one back)."""

    def __init__(self, be: TrtBackend) -> None:
        m = be.manifest
        t = m.target
        self.be = be
        self.eng = be.engine("target")
        self.vocab_size = t.vocab_size
        self.max_positions = m.max_seq_len
        self.eos_ids = set(t.eos_token_ids)
        kvh, d = t.num_key_value_heads, t.head_dim
        self.kinds = m.layer_kinds
        past, present = _by_kind(self.kinds, m.target_kv_names()), _by_kind(self.kinds, m.target_present_names())
        self.kv_names, self.linear_names, self.ring_names = past["attention"], past["linear"], past["sliding"]
        self.present, self.linear_present, self.ring_present = (present["attention"], present["linear"],
                                                                present["sliding"])
        self.kv: DeviceKV = DeviceKV(be.api, be.pool, len(self.kv_names) // 2, kvh, d,
                                     self.eng.dtypes[self.kv_names[0]].itemsize, m.kv_capacity_step,
                                     m.max_seq_len, be.stream, be.graphs.invalidate)
        self.chunk = self.eng.max_dim("prefill", "sequence")
        self.step_rows = self.eng.max_dim("step", "sequence")
        F = int(self.eng.engine.get_tensor_shape("context_features")[2])
        cap = self.kv.max_capacity
        shapes = {"input_ids": (1, self.chunk), "position_ids": (1, self.chunk),
                  "attention_mask": (1, cap + self.chunk), "logits": (1, self.chunk, self.vocab_size),
                  "context_features": (1, self.chunk, F)}
        shapes.update({n: (1, kvh, self.chunk, d) for n in (*self.present, *self.ring_present)})
        host = {"input_ids", "position_ids", "attention_mask", "logits", "context_features"}
        sw = t.sliding_window if self.ring_names else None  # given with sliding layers (the manifest reader's rule)
        if sw is not None:
            shapes[TARGET_WINDOW_POSITIONS] = (1, sw.ring_slots)
            shapes.update({n: (1, kvh, sw.ring_slots, d) for n in self.ring_names})
            host.add(TARGET_WINDOW_POSITIONS)
        spec = t.linear_state if self.linear_names else None  # given with linear layers (the manifest reader's rule)
        if spec is not None:
            shapes.update(self._linear_shapes(spec))
            host.add(TARGET_STATE_ROWS)
        for name in ("logits", *self.present, *self.linear_present, *self.linear_names, *self.ring_present):
            self.eng.check_static_shape(name, shapes[name])  # buffer sizes from the manifest: the engine must agree
        self.eng.check_float_output("logits")
        bound = {*self.linear_names, *self.ring_names}  # the state buffers, bound in place
        self.io = _io(be, self.eng, {n: s for n, s in shapes.items() if n not in bound}, host)
        self.linear: DeviceLinearState | None = None
        if spec is not None:
            self.linear = DeviceLinearState(be.api, be.pool, len(self.linear_names) // 2, spec,
                                            self.eng.dtypes[self.linear_names[0]].itemsize,
                                            [self.io[n].dev for n in self.linear_present[0::2]],
                                            [self.io[n].dev for n in self.linear_present[1::2]], be.stream)
        self.ring: DeviceWindowRing | None = None
        if sw is not None:
            self.ring = DeviceWindowRing(be.api, be.pool, len(self.ring_names) // 2, kvh, d,
                                         self.eng.dtypes[self.ring_names[0]].itemsize, sw, be.stream)
        self.state_shapes = {n: shapes[n] for n in (*self.linear_names, *self.ring_names)}  # state inputs (fixed)
        self._call_start = 0  # the cache length before the last forward (a rollback keeps rows of that call only)
        self.last_path = ""  # "replay" | "captured" | "eager" (for the GPU check)

    def _linear_shapes(self, spec: LinearStateSpec) -> dict[str, tuple[int, ...]]:
        """The linear layers' tensors at their largest: state inputs (fixed), the call's conv inputs (a chunk's
        rows), the per-row recurrent states (every row of a step) and ``state_rows``."""
        state = (spec.num_heads, spec.key_dim, spec.value_dim)
        rows = self.step_rows
        shapes: dict[str, tuple[int, ...]] = {TARGET_STATE_ROWS: (rows,)}
        for conv, rec in zip(self.linear_names[0::2], self.linear_names[1::2]):
            shapes[conv], shapes[rec] = (1, spec.conv_dim, spec.conv_kernel - 1), (1, *state)
        for conv, rec in zip(self.linear_present[0::2], self.linear_present[1::2]):
            shapes[conv], shapes[rec] = (1, spec.conv_dim, self.chunk), (1, rows, *state)
        return shapes

    def forward(self, ids: list[int], last_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """ids [m] at positions cache_length.. -> logits [m, V] fp32 (``last_logits``: [1, V], the last row's; the
        engine computes every row's), context features [m, F]."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise DFlash2Error("target input is empty")
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise DFlash2Error(f"token id out of range [0, {self.vocab_size}) in target input")
        self._call_start = self.kv.length
        every_row = arr.size <= self.step_rows  # a call that may be rolled back (a verify): every row's state
        outs = [self._call(arr[i: i + self.chunk], every_row) for i in range(0, arr.size, self.chunk)]
        if last_logits:
            return outs[-1][0][-1:], (outs[0][1] if len(outs) == 1 else np.concatenate([o[1] for o in outs]))
        if len(outs) == 1:
            return outs[0]
        return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs])

    def _call(self, ids: np.ndarray, every_row: bool) -> tuple[np.ndarray, np.ndarray]:
        be, io, kv = self.be, self.io, self.kv
        n, S = kv.length, int(ids.size)
        kv.reserve(n + S)
        C = kv.capacity
        step_profile = S <= self.step_rows
        captured = step_profile and self.eng.aux_streams == 0
        profile = self.eng.profile_index("step" if step_profile else "prefill")
        io["input_ids"].host_view((1, S))[0] = ids.astype(io["input_ids"].dtype)
        io["position_ids"].host_view((1, S))[0] = np.arange(n, n + S, dtype=io["position_ids"].dtype)
        mask = io["attention_mask"].host_view((1, C + S))[0]
        kv.valid_mask(mask)
        mask[C:] = 1
        shapes: dict[str, tuple[int, ...]] = {"input_ids": (1, S), "position_ids": (1, S),
                                              "attention_mask": (1, C + S)}
        shapes.update({k: (1, kv.heads, C, kv.head_dim) for k in self.kv_names})
        addr = {k: t.dev for k, t in io.items()}
        addr.update(zip(self.kv_names, kv.ptrs))
        h2d: list[tuple[IOTensor, tuple[int, ...]]] = [(io[k], (1, S)) for k in ("input_ids", "position_ids")]
        h2d.append((io["attention_mask"], (1, C + S)))
        R = self._bind_linear(S, every_row, shapes, addr, h2d)
        self._bind_ring(shapes, addr, h2d)
        ctx = self.eng.bind(profile, shapes, addr, captured)
        F = io["context_features"].max_shape[2]
        d2h: list[tuple[IOTensor, tuple[int, ...]]] = [(io["logits"], (1, S, self.vocab_size)),
                                                       (io["context_features"], (1, S, F))]
        step = _step(be, [(self.eng, ctx)], h2d, d2h)
        if captured:
            key = GraphKey("target", profile, (S, C, R), _addresses(addr, io, ctx))
            self.last_path = be.graphs.run(key, be.stream, step)
        else:
            step()
            self.last_path = "eager"
        kv.append([io[p].dev for p in self.present], S)  # commit: destinations move every step (not captured)
        if self.linear is not None:
            self.linear.called(S, every_row)
        if self.ring is not None:
            self.ring.append([io[p].dev for p in self.ring_present], n, S)
        be.sync()
        logits = io["logits"].host_view((1, S, self.vocab_size))[0].astype(np.float32)
        feats = io["context_features"].host_view((1, S, F))[0].copy()
        return logits, feats

    def _bind_linear(self, S: int, every_row: bool, shapes: dict[str, tuple[int, ...]], addr: dict[str, int],
                     h2d: list[tuple[IOTensor, tuple[int, ...]]]) -> int:
        """A call's linear-layer part (none without linear layers: R = 0): the previous call's state committed (all
        its rows, unless a crop kept fewer), the state buffers bound in place, ``state_rows`` = every row or the
        last -> R, the rows asked."""
        if self.linear is None:
            return 0
        self.linear.commit()
        R = S if every_row else 1
        rows = self.io[TARGET_STATE_ROWS]
        rows.host_view((R,))[:] = np.arange(S) if every_row else S - 1
        h2d.append((rows, (R,)))
        shapes[TARGET_STATE_ROWS] = (R,)
        shapes.update({n: self.state_shapes[n] for n in self.linear_names})
        addr.update(zip(self.linear_names, self.linear.ptrs))
        return R

    def _bind_ring(self, shapes: dict[str, tuple[int, ...]], addr: dict[str, int],
                   h2d: list[tuple[IOTensor, tuple[int, ...]]]) -> None:
        """A call's sliding-layer part (none without sliding layers): the rings bound in place, ``window_positions``
        from their bookkeeping."""
        if self.ring is None:
            return
        wp = self.io[TARGET_WINDOW_POSITIONS]
        wp.host_view(wp.max_shape)[0] = self.ring.positions
        h2d.append((wp, wp.max_shape))
        shapes[TARGET_WINDOW_POSITIONS] = wp.max_shape
        shapes.update({n: self.state_shapes[n] for n in self.ring_names})
        addr.update(zip(self.ring_names, self.ring.ptrs))

    def crop(self, length: int) -> None:
        if self.linear is not None and length < self.kv.length:
            self.linear.rollback(length - self._call_start)
        if self.ring is not None and length < self.kv.length:
            self.ring.crop(length)
        self.kv.crop(length)

    # -- the prefix cache (dflash2_trt.runtime.prefix_cache): host copies through the backend's pinned staging ----
    def prefix_rows(self, n: int, slot: int = 0) -> list[np.ndarray]:
        return self.kv.rows(n, self.eng.dtypes[self.kv_names[0]], self.be.staging)

    def prefix_state(self, slot: int = 0) -> SlotState | None:
        if self.linear is None and self.ring is None:
            return None
        st = self.be.staging
        return SlotState(
            None if self.linear is None else self.linear.snapshot(self.eng.dtypes[self.linear_names[0]], st),
            None if self.ring is None else self.ring.snapshot(self.eng.dtypes[self.ring_names[0]], st))

    def restore_prefix(self, rows: list[np.ndarray], n: int, state: SlotState | None, slot: int = 0) -> None:
        self.kv.load(rows, n, self.be.staging)
        if state is not None and self.linear is not None and state.linear is not None:
            self.linear.restore(state.linear, self.be.staging)
        if state is not None and self.ring is not None and state.ring is not None:
            self.ring.restore(state.ring, self.be.staging)
        self._call_start = n


class TrtDraftRunner:
    """DraftRunner over ``drafter_context``, ``drafter_block`` and the head engine of ``mode`` (plugin
    variant when built, else decomposed). Block + head run as one captured step."""

    def __init__(self, be: TrtBackend, mode: str) -> None:
        m = be.manifest
        cfg = m.drafter_config
        self.be, self.mode = be, mode
        self.block_size, self.num_draft_rows = cfg.block_size, cfg.num_draft_rows
        self.ctx_eng = be.engine("drafter_context")
        self.block_eng = be.engine("drafter_block")
        self.head_eng = be.engine(be.head_engine_key(mode))
        nl, kvh, H = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size
        assert cfg.head_dim is not None
        hd = cfg.head_dim
        self.names = m.drafter_context_names()
        self.kv = DeviceKV(be.api, be.pool, nl, kvh, hd, self.ctx_eng.dtypes[self.names[0]].itemsize,
                           m.kv_capacity_step, m.max_seq_len, be.stream, be.graphs.invalidate)
        self.chunk = self.ctx_eng.max_dim("prefill", "rows")
        self.step_rows = self.ctx_eng.max_dim("step", "rows")
        Fin = int(self.ctx_eng.engine.get_tensor_shape("context_features")[2])
        bs, L, K = self.block_size, cfg.num_draft_rows, cfg.selector_top_k
        cap = self.kv.max_capacity
        shapes = {"context_features": (1, self.chunk, Fin), "position_ids": (1, self.chunk)}
        shapes.update({n: (1, kvh, self.chunk, hd) for n in self.names})
        self.cio = _io(be, self.ctx_eng, shapes, {"context_features", "position_ids"})
        self.bio = _io(be, self.block_eng, {"anchor_ids": (1,), "anchor_position": (1,), "context_mask": (1, cap),
                                            "hidden": (1, bs, H)}, {"anchor_ids", "anchor_position", "context_mask"})
        self.hio = _io(be, self.head_eng, {"anchor_ids": (1,), "temperature": (1,), "uniforms": (1, L),
                                           "cand_ids": (1, L, K), "path_ids": (1, L), "proposal_probs": (1, L, K)},
                       {"anchor_ids", "temperature", "uniforms", "cand_ids", "path_ids", "proposal_probs"})
        for name in ("cand_ids", "path_ids", "proposal_probs", "uniforms"):  # the manifest's sizes vs the engine
            self.head_eng.check_static_shape(name, self.hio[name].max_shape)
        self.head_eng.check_static_shape("hidden", self.bio["hidden"].max_shape)
        self.block_eng.check_static_shape("hidden", self.bio["hidden"].max_shape)
        self.head_eng.check_float_output("proposal_probs")
        self.K, self.L = K, L
        self.last_path = ""

    def reset(self) -> None:
        self.kv.reset()

    # -- the prefix cache (dflash2_trt.runtime.prefix_cache) ------------------------------------------------------
    def context_length(self) -> int:
        return self.kv.length

    def context_rows(self, n: int) -> list[np.ndarray]:
        return self.kv.rows(n, self.ctx_eng.dtypes[self.names[0]], self.be.staging)

    def restore_context(self, rows: list[np.ndarray]) -> None:
        self.kv.load(rows, rows[0].shape[1] if rows else 0, self.be.staging)

    def add_context(self, feats: np.ndarray, start: int) -> None:
        """feats [m, F] of positions start..start+m-1 -> the draft context cache."""
        if start != self.kv.length:
            raise DFlash2Error(f"draft context is at length {self.kv.length}, got features for position {start}")
        for i in range(0, feats.shape[0], self.chunk):
            self._context(feats[i: i + self.chunk], start + i)

    def _context(self, feats: np.ndarray, start: int) -> None:
        be, io, m = self.be, self.cio, int(feats.shape[0])
        step_profile = m <= self.step_rows
        captured = step_profile and self.ctx_eng.aux_streams == 0
        profile = self.ctx_eng.profile_index("step" if step_profile else "prefill")
        Fin = io["context_features"].max_shape[2]
        io["context_features"].host_view((1, m, Fin))[0] = feats.astype(io["context_features"].dtype, copy=False)
        io["position_ids"].host_view((1, m))[0] = np.arange(start, start + m, dtype=io["position_ids"].dtype)
        addr = {k: t.dev for k, t in io.items()}
        ctx = self.ctx_eng.bind(profile, {"context_features": (1, m, Fin), "position_ids": (1, m)}, addr, captured)
        h2d: list[tuple[IOTensor, tuple[int, ...]]] = [(io["context_features"], (1, m, Fin)),
                                                       (io["position_ids"], (1, m))]
        step = _step(be, [(self.ctx_eng, ctx)], h2d, [])
        if captured:
            be.graphs.run(GraphKey("drafter_context", profile, (m,), _addresses(addr, io, ctx)), be.stream, step)
        else:
            step()
        self.kv.append([io[n].dev for n in self.names], m)

    def propose(self, anchor: int, pos: int, rows: int, temperature: float, uniforms: np.ndarray | None) -> Draft:
        be, kv, bio, hio = self.be, self.kv, self.bio, self.hio
        if kv.length != pos:
            raise DFlash2Error(f"draft context holds {kv.length} positions, anchor is at {pos}")
        kv.reserve(max(1, pos))
        C, L, K = kv.capacity, self.L, self.K
        bio["anchor_ids"].host_view((1,))[0] = anchor
        bio["anchor_position"].host_view((1,))[0] = pos
        kv.valid_mask(bio["context_mask"].host_view((1, C))[0])
        hio["anchor_ids"].host_view((1,))[0] = anchor
        hio["temperature"].host_view((1,))[0] = temperature
        u = hio["uniforms"].host_view((1, L))
        u[...] = 0.0 if uniforms is None else np.asarray(uniforms, dtype=np.float32).reshape(1, L)
        baddr = {k: t.dev for k, t in bio.items()}
        baddr.update(zip(self.names, kv.ptrs))
        bshapes: dict[str, tuple[int, ...]] = {"anchor_ids": (1,), "anchor_position": (1,), "context_mask": (1, C)}
        bshapes.update({n: (1, kv.heads, C, kv.head_dim) for n in self.names})
        captured = self.block_eng.aux_streams == 0 and self.head_eng.aux_streams == 0
        bctx = self.block_eng.bind(0, bshapes, baddr, captured)
        haddr = {k: t.dev for k, t in hio.items()}
        haddr["hidden"] = bio["hidden"].dev  # the block's output is the head's input: no copy
        hctx = self.head_eng.bind(0, {"hidden": bio["hidden"].max_shape, "anchor_ids": (1,), "temperature": (1,),
                                      "uniforms": (1, L)}, haddr, captured)
        h2d = [(bio["anchor_ids"], (1,)), (bio["anchor_position"], (1,)), (bio["context_mask"], (1, C)),
               (hio["anchor_ids"], (1,)), (hio["temperature"], (1,)), (hio["uniforms"], (1, L))]
        d2h = [(hio[k], hio[k].max_shape) for k in ("cand_ids", "path_ids", "proposal_probs")]
        runs = [(self.block_eng, bctx), (self.head_eng, hctx)]
        if rows < L:  # a final partial block, eagerly: the rows past the verified ones get zero hidden states
            H, hid = bio["hidden"].max_shape[-1], bio["hidden"]
            _step(be, runs[:1], h2d, [])()
            be.api.memset_async(hid.dev + nbytes_of((1 + rows, H), hid.dtype), 0,
                                nbytes_of((L - rows, H), hid.dtype), be.stream)
            _step(be, runs[1:], [], d2h)()
            self.last_path = "eager"
        elif captured:
            key = GraphKey(f"drafter_step:{self.mode}", 0, (C,),
                           _addresses(baddr, bio, bctx) + _addresses(haddr, hio, hctx))
            self.last_path = be.graphs.run(key, be.stream, _step(be, runs, h2d, d2h))
        else:
            _step(be, runs, h2d, d2h)()
            self.last_path = "eager"
        be.sync()
        return Draft(tokens=hio["path_ids"].host_view((1, L))[0].astype(np.int64),
                     proposal=hio["proposal_probs"].host_view((1, L, K))[0].astype(np.float32),
                     cand=hio["cand_ids"].host_view((1, L, K))[0].astype(np.int64))


def _by_kind(kinds: Sequence[str], names: Sequence[str]) -> dict[str, list[str]]:
    """The target's per-layer state names -> kind -> that kind's names (every kind of LAYER_KINDS a key)."""
    return {kind: [] for kind in LAYER_KINDS} | split_present(list(kinds), names)


def _addresses(addr: dict[str, int], io: dict[str, IOTensor], ctx: object) -> tuple[int, ...]:
    """Every address a step touches: device tensors, pinned mirrors, and the context (by identity)."""
    pinned = [t.host.ptr for t in io.values() if t.host is not None]
    return tuple(sorted(addr.values())) + tuple(pinned) + (id(ctx),)


def _step(be: TrtBackend, runs: Sequence[tuple[TrtEngine, Any]], h2d: Sequence[tuple[IOTensor, tuple[int, ...]]],
          d2h: Sequence[tuple[IOTensor, tuple[int, ...]]]) -> Callable[[], None]:
    """The enqueue-only body of a step (captured as one graph): copies in, engines in order, copies out."""
    api, stream = be.api, be.stream

    def step() -> None:
        for t, shape in h2d:
            assert t.host is not None
            api.memcpy_htod_async(t.dev, t.host.ptr, nbytes_of(shape, t.dtype), stream)
        for eng, ctx in runs:
            eng.execute(ctx)
        for t, shape in d2h:
            assert t.host is not None
            api.memcpy_dtoh_async(t.host.ptr, t.dev, nbytes_of(shape, t.dtype), stream)

    return step
