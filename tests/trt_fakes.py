"""Recording fakes for the TensorRT backend's CPU tests.

They *record* what the code under test asks of CUDA and TensorRT; they never compute a model:

* :class:`FakeCuda` implements :class:`~dflash2_trt.runtime.trt.cuda_api.CudaApi` with host memory standing in
  for device memory, so copies (plain, 2-D pitched, H2D/D2H) move real bytes and the buffer arithmetic can
  be checked. Like ``cudaMalloc``, ``malloc`` hands out memory that is *not* zeroed: it is filled with
  0xFF bytes, a NaN in every float format, so a read of never-written device memory shows. Like CUDA, work enqueued on a capturing stream is *recorded into the graph, not executed*;
  ``graph_launch`` replays the recorded operations. ``fail_capture`` makes ``end_capture`` fail the way an
  invalidated capture does.
* :class:`FakeTrt` is a stand-in ``tensorrt`` module. The "builder" records flags and optimization profiles
  and serialises a JSON description of the graph's I/O (read from the ONNX file) as the "plan"; the "engine"
  answers I/O queries from it; ``execute_async_v3`` enqueues a record (engine, context, shapes, addresses)
  which, when it executes, zeroes the output buffers (a real engine writes every output; this one computes
  nothing) — or, with ``FakeTrt(cuda, compute=True)``, runs the engine's ONNX graph with ONNX Runtime on the
  bytes at the bound addresses and writes its outputs there (:class:`OrtEngineExecutor`), so decoding through
  the TensorRT backend produces real tokens that can be compared with the other backends; a graph with the
  ``DFlash2PathSelector`` plugin node runs that node through the plugin's host twin
  (``libdflash2_selector_host.so``, ``FakeTrt(..., selector_host=PATH)``), as TensorRT would run the plugin. Like TensorRT: the plugin registry's ``load_library`` returns None
  when a creator of the library is already registered (``IPluginRegistry::loadLibrary``); the ONNX parser
  fails with errors when ``parse_errors`` is set; ``set_optimization_profile_async`` raises RuntimeError
  (the Python binding's way of reporting false) when ``profile_error`` is set; ``deserialize_cuda_engine``
  returns None for the plan files named in ``refuse_plans``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.trt.cuda_api import DeviceInfo, HostBuffer


# ----------------------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------------------


@dataclass
class FakeGraph:
    ops: list[tuple] = field(default_factory=list)
    destroyed: bool = False


class FakeCuda:
    def __init__(self, name: str = "FakeGPU H0", cc: str = "9.0") -> None:
        self.info = DeviceInfo(name=name, compute_capability=cc, total_memory=1 << 34, driver_version=12080,
                               runtime_version=12080)
        self.calls: list[tuple] = []  # every API call: (name, *args)
        self.log: list[tuple] = []  # operations that actually executed (eagerly or by replay)
        self.dev: dict[int, np.ndarray] = {}
        self.host: dict[int, np.ndarray] = {}
        self.freed: list[int] = []
        self._next = 0x100000
        self.capturing: dict[int, FakeGraph] = {}
        self.execs: dict[int, FakeGraph] = {}
        self.fail_capture = False
        self._next_exec = 0
        self.streams: set[int] = set()
        self.executor: Any = None  # OrtEngineExecutor when FakeTrt(compute=True)

    # memory -------------------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        p = self._next
        self._next += (max(1, nbytes) + 255) // 256 * 256 + 256
        return p

    def _mem(self, ptr: int, n: int) -> np.ndarray:
        for table in (self.dev, self.host):
            for base, arr in table.items():
                if base <= ptr and ptr + n <= base + arr.size:
                    return arr[ptr - base: ptr - base + n]
        raise AssertionError(f"access to unallocated memory {ptr:#x} (+{n})")

    def device_info(self) -> DeviceInfo:
        return self.info

    def stream_create(self) -> int:
        s = 0x5000 + len(self.streams) + 1
        self.streams.add(s)
        self.calls.append(("stream_create", s))
        return s

    def stream_destroy(self, stream: int) -> None:
        self.calls.append(("stream_destroy", stream))

    def stream_synchronize(self, stream: int) -> None:
        assert stream not in self.capturing, "synchronize during capture is illegal"
        self.calls.append(("stream_synchronize", stream))

    def malloc(self, nbytes: int) -> int:
        p = self._alloc(nbytes)
        self.dev[p] = np.full(max(1, nbytes), 0xFF, dtype=np.uint8)  # garbage: NaN as fp16 / bf16 / fp32
        self.calls.append(("malloc", nbytes, p))
        return p

    def free(self, ptr: int) -> None:
        assert ptr in self.dev, f"free of unknown pointer {ptr:#x}"
        del self.dev[ptr]
        self.freed.append(ptr)
        self.calls.append(("free", ptr))

    def host_alloc(self, nbytes: int) -> HostBuffer:
        p = self._alloc(nbytes)
        arr = np.zeros(max(1, nbytes), dtype=np.uint8)
        self.host[p] = arr
        self.calls.append(("host_alloc", nbytes, p))
        return HostBuffer(ptr=p, nbytes=nbytes, array=arr[:nbytes])

    def host_free(self, buf: HostBuffer) -> None:
        del self.host[buf.ptr]
        self.calls.append(("host_free", buf.ptr))

    # stream work (executed now, or recorded into the graph being captured) -------------------------------
    def enqueue(self, stream: int, op: tuple) -> None:
        self.calls.append(op)
        if stream in self.capturing:
            self.capturing[stream].ops.append(op)
        else:
            self._execute(op)

    def _execute(self, op: tuple) -> None:
        self.log.append(op)
        kind = op[0]
        if kind == "copy":
            _, dst, src, n = op
            self._mem(dst, n)[:] = self._mem(src, n)
        elif kind == "copy2d":
            _, dst, dpitch, src, spitch, width, height = op
            for r in range(height):
                self._mem(dst + r * dpitch, width)[:] = self._mem(src + r * spitch, width)
        elif kind == "memset":
            _, ptr, value, n = op
            self._mem(ptr, n)[:] = value
        elif kind == "execute":  # a real engine writes all of its outputs; the plain fake writes zeros
            if self.executor is not None:
                self.executor(self, op)
            else:
                for ptr in op[6]:
                    self._rest_of_allocation(ptr)[:] = 0

    def _rest_of_allocation(self, ptr: int) -> np.ndarray:
        for base, arr in self.dev.items():
            if base <= ptr < base + arr.size:
                return arr[ptr - base:]
        raise AssertionError(f"engine output at unallocated memory {ptr:#x}")

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.enqueue(stream, ("copy", dst, src, nbytes))

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.enqueue(stream, ("copy", dst, src, nbytes))

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.enqueue(stream, ("copy", dst, src, nbytes))

    def memcpy2d_dtod_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                            stream: int) -> None:
        if width and height:
            self.enqueue(stream, ("copy2d", dst, dpitch, src, spitch, width, height))

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self.enqueue(stream, ("memset", ptr, value, nbytes))

    # graphs ---------------------------------------------------------------------------------------------
    def begin_capture(self, stream: int) -> None:
        assert stream not in self.capturing
        self.calls.append(("begin_capture", stream, "thread_local"))
        self.capturing[stream] = FakeGraph()

    def end_capture(self, stream: int) -> Any:
        g = self.capturing.pop(stream)
        self.calls.append(("end_capture", stream))
        if self.fail_capture:
            raise DFlash2Error("cudaStreamEndCapture failed: cudaErrorStreamCaptureInvalidated (fake)")
        return g

    def graph_instantiate(self, graph: Any) -> Any:
        self.calls.append(("graph_instantiate",))
        self._next_exec += 1
        h = 0x9000 + self._next_exec
        self.execs[h] = graph
        return h

    def graph_launch(self, graph_exec: Any, stream: int) -> None:
        g = self.execs[graph_exec]
        assert not g.destroyed, "launch of a destroyed graph"
        self.calls.append(("graph_launch", graph_exec))
        for op in g.ops:
            self._execute(op)

    def graph_destroy(self, graph: Any) -> None:
        graph.destroyed = True
        self.calls.append(("graph_destroy",))

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        self.calls.append(("graph_exec_destroy", graph_exec))
        del self.execs[graph_exec]

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)


# ----------------------------------------------------------------------------------------------------
# TensorRT
# ----------------------------------------------------------------------------------------------------

_TRT_DTYPE = {1: "FLOAT", 10: "HALF", 16: "BF16", 6: "INT32", 7: "INT64", 9: "BOOL"}  # ONNX elem type -> name


class _Enum:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def __int__(self) -> int:
        return 1


class _Ns:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FakeTrt:
    """A stand-in ``tensorrt`` module (instantiate one per test; its attributes record what happened)."""

    Builder: Any
    OnnxParser: Any

    def __init__(self, cuda: FakeCuda, version: str = "10.13.0.35", compute: bool = False,
                 selector_host: str | None = None) -> None:
        fake = self
        if compute:
            cuda.executor = OrtEngineExecutor(selector_host)
        self.__version__ = version
        self.cuda = cuda
        self.loaded_plugins: list[str] = []
        self.builds: list[dict[str, Any]] = []
        self.contexts: list[FakeContext] = []
        self.fail_execute = False
        self.profile_error: str | None = None  # set: set_optimization_profile_async raises RuntimeError(it)
        self.parse_errors: list[str] = []  # set: the ONNX parser fails with these
        self.shape_override: dict[str, tuple[int, ...]] = {}  # engine tensor shapes that differ from the ONNX
        self.dtype_override: dict[str, str] = {}  # engine tensor types that differ from the ONNX ("BF16", ...)
        self.aux_streams_override: int | None = None  # engines that report auxiliary streams
        self.refuse_plans: set[str] = set()  # plan file names deserialize_cuda_engine refuses (returns None)
        self.Logger = type("Logger", (), {"WARNING": "WARNING", "__init__": lambda s, sev=None: None})
        self.TensorIOMode = _Ns(INPUT=_Enum("INPUT"), OUTPUT=_Enum("OUTPUT"))
        self.ExecutionContextAllocationStrategy = _Ns(USER_MANAGED=_Enum("USER_MANAGED"))
        self.NetworkDefinitionCreationFlag = _Ns(STRONGLY_TYPED=_Enum("STRONGLY_TYPED"))
        self.BuilderFlag = _Ns(FP16=_Enum("FP16"), BF16=_Enum("BF16"), TF32=_Enum("TF32"))
        self.MemoryPoolType = _Ns(WORKSPACE=_Enum("WORKSPACE"))
        self.Dims = tuple

        class Registry:
            """Process-wide in TensorRT (here: per FakeTrt). The library registers one creator."""

            def __init__(self) -> None:
                self.creators: dict[tuple[str, str, str], str] = {}  # (name, version, namespace) -> library
                self.load_calls: list[str] = []

            def load_library(self, path: str) -> object | None:
                self.load_calls.append(path)
                if ("DFlash2PathSelector", "1", "") in self.creators:
                    return None  # "fail and return nullptr if any of the plugins are already registered"
                self.creators[("DFlash2PathSelector", "1", "")] = path
                fake.loaded_plugins.append(path)
                return object()

            def get_creator(self, name: str, version: str, namespace: str = "") -> object | None:
                return self.creators.get((name, version, namespace))

        self._registry = Registry()

        class Runtime:
            def __init__(self, logger: Any) -> None:
                pass

            def deserialize_cuda_engine(self, blob: bytes) -> FakeEngine | None:
                try:
                    plan = json.loads(blob)
                except ValueError:
                    return None
                if plan["file"].rsplit("/", 1)[-1] in fake.refuse_plans:
                    return None  # as TensorRT does for a plugin whose creator is missing
                return FakeEngine(fake, plan)

        self.Runtime = Runtime
        self.Builder = lambda logger: FakeBuilder(fake)
        self.OnnxParser = lambda network, logger: FakeParser(network, fake.parse_errors)

    def get_plugin_registry(self) -> Any:
        return self._registry


class FakeNetwork:
    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.io: dict[str, Any] = {}
        self.path = ""


class FakeParser:
    def __init__(self, network: FakeNetwork, errors: list[str]) -> None:
        self.network = network
        self.errors = list(errors)
        self.num_errors = 0

    def get_error(self, i: int) -> Any:
        return _Ns(desc=lambda: self.errors[i])

    def parse_from_file(self, path: str) -> bool:
        import onnx

        if self.errors:
            self.num_errors = len(self.errors)
            return False

        m = onnx.load(path, load_external_data=False)  # the fake reads only the I/O declarations

        def desc(vi: Any) -> dict[str, Any]:
            t = vi.type.tensor_type
            return {"dtype": _TRT_DTYPE[t.elem_type],
                    "shape": [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]}

        inits = {i.name for i in m.graph.initializer}
        self.network.io = {"inputs": {v.name: desc(v) for v in m.graph.input if v.name not in inits},
                           "outputs": {v.name: desc(v) for v in m.graph.output}}
        self.network.path = path
        return True


class FakeConfig:
    def __init__(self) -> None:
        self.flags_set: list[str] = []
        self.flags_cleared: list[str] = []
        self.profiles: list[dict[str, Any]] = []
        self.cache: Any = None
        self.max_aux_streams = -1  # TensorRT's default: the builder decides

    def set_flag(self, f: _Enum) -> None:
        self.flags_set.append(f.name)

    def clear_flag(self, f: _Enum) -> None:
        self.flags_cleared.append(f.name)

    def set_memory_pool_limit(self, pool: Any, size: int) -> None:
        pass

    def create_timing_cache(self, blob: bytes) -> Any:
        return _Ns(blob=bytes(blob), serialize=lambda: b"fake-timing-cache:" + bytes(blob)[:16])

    def set_timing_cache(self, cache: Any, ignore_mismatch: bool) -> bool:
        self.cache = cache
        return True

    def add_optimization_profile(self, p: Any) -> int:
        self.profiles.append(dict(p.shapes))
        return len(self.profiles) - 1


class FakeBuilder:
    def __init__(self, fake: FakeTrt) -> None:
        self.fake = fake

    def create_network(self, flags: int) -> FakeNetwork:
        return FakeNetwork(flags)

    def create_builder_config(self) -> FakeConfig:
        return FakeConfig()

    def create_optimization_profile(self) -> Any:
        prof = _Ns(shapes={})
        prof.set_shape = lambda name, lo, opt, hi: prof.shapes.__setitem__(name, [list(lo), list(opt), list(hi)])
        return prof

    def build_serialized_network(self, network: FakeNetwork, config: FakeConfig) -> bytes:
        rec = {"file": network.path, "flags": network.flags, "set": config.flags_set,
               "cleared": config.flags_cleared, "profiles": config.profiles, "aux": config.max_aux_streams,
               **network.io}
        self.fake.builds.append(rec)
        return json.dumps(rec).encode()


class FakeEngine:
    def __init__(self, fake: FakeTrt, plan: dict[str, Any]) -> None:
        self.fake, self.plan = fake, plan
        self.name = plan["file"].rsplit("/", 1)[-1]
        self.tensors = {**plan["inputs"], **plan["outputs"]}
        self.num_io_tensors = len(self.tensors)
        self.device_memory_size_v2 = 4096
        # the builder's heuristics may add auxiliary streams unless max_aux_streams = 0 was set
        self.num_aux_streams = fake.aux_streams_override if fake.aux_streams_override is not None else (
            1 if plan.get("aux", -1) < 0 else plan["aux"])

    def get_tensor_name(self, i: int) -> str:
        return list(self.tensors)[i]

    def get_tensor_mode(self, name: str) -> _Enum:
        return self.fake.TensorIOMode.INPUT if name in self.plan["inputs"] else self.fake.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> _Enum:
        return _Enum(self.fake.dtype_override.get(name, self.tensors[name]["dtype"]))

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.fake.shape_override.get(name, self.tensors[name]["shape"]))

    def create_execution_context(self, strategy: Any) -> FakeContext:
        assert strategy.name == "USER_MANAGED"
        ctx = FakeContext(self)
        self.fake.contexts.append(ctx)
        return ctx


class FakeContext:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.profile = -1
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.device_memory: tuple[int, int] | None = None
        self.shape_sets = 0

    def set_device_memory(self, ptr: int, size: int) -> None:
        self.device_memory = (ptr, size)

    def set_optimization_profile_async(self, p: int, stream: int) -> bool:
        if self.engine.fake.profile_error is not None:
            raise RuntimeError(self.engine.fake.profile_error)
        self.profile = p
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        lo, _, hi = self.engine.plan["profiles"][self.profile][name]
        self.shape_sets += 1
        if len(shape) != len(lo) or any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        assert name in self.engine.tensors, name
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream: int) -> bool:
        if self.engine.fake.fail_execute:
            return False
        missing = set(self.engine.plan["inputs"]) - set(self.shapes)
        assert not missing, f"inputs without shapes: {missing}"
        assert set(self.addresses) == set(self.engine.tensors)
        self.engine.fake.cuda.enqueue(stream, ("execute", self.engine.name, id(self), self.profile,
                                               tuple(sorted(self.shapes.items())),
                                               tuple(sorted(self.addresses.items())),
                                               tuple(self.addresses[n] for n in self.engine.plan["outputs"]),
                                               self.engine))
        return True


_NP_DTYPE = {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_}


class OrtEngineExecutor:
    """Runs a fake engine's ONNX graph with ONNX Runtime (CPU) when its ``execute`` operation executes: inputs
    are read from the fake device memory at the bound addresses with the set shapes, outputs are written back
    at theirs. ONNX Runtime has no DFlash2PathSelector kernel: a graph with that plugin node runs as ONNX
    Runtime up to the node's inputs, then the node through the plugin's host twin (``selector_host``: the path
    of ``libdflash2_selector_host.so``, the CPU twin the plugin's kernel is checked against bit for bit)."""

    def __init__(self, selector_host: str | None = None) -> None:
        self.sessions: dict[str, Any] = {}
        self.plugin_nodes: dict[str, Any] = {}  # plan file -> (node, constant inputs) for plugin graphs
        self.runs: dict[str, int] = {}
        self.selector_host = selector_host
        self.plugin_runs = 0

    def _session(self, path: str) -> Any:
        import onnx
        import onnxruntime as ort

        if path in self.sessions:
            return self.sessions[path]
        model = onnx.load(path)
        node = next((n for n in model.graph.node if n.op_type == "DFlash2PathSelector"), None)
        if node is None:
            sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        else:
            from onnx import helper, numpy_helper

            inits = {t.name: t for t in model.graph.initializer}
            graph_in = {v.name for v in model.graph.input}
            consts = {}
            for name in node.input:
                if name in inits:
                    arr = numpy_helper.to_array(inits[name])
                    consts[name] = arr.view(np.uint16) if arr.dtype.itemsize == 2 and arr.dtype != np.float16 else arr
            computed = [n for n in node.input if n not in inits and n not in graph_in]
            model.graph.node.remove(node)
            for n in list(model.graph.output):
                if n.name in node.output:
                    model.graph.output.remove(n)
            info = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
            outs = {v.name for v in model.graph.output}
            model.graph.output.extend(info[n] for n in dict.fromkeys(computed) if n not in outs)
            sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            self.plugin_nodes[path] = (node, consts)
        self.sessions[path] = sess
        return sess

    def _plugin(self, node: Any, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The DFlash2PathSelector node on ``values`` (its inputs by name) through the host twin."""
        import ctypes

        assert self.selector_host, "a plugin graph needs FakeTrt(..., selector_host=libdflash2_selector_host.so)"
        lib = ctypes.CDLL(self.selector_host)
        attrs = {a.name: (a.s.decode() if a.type == a.STRING else a.i) for a in node.attribute}
        cand, unary, hid, anchor, pred, succ, temp, uni = (np.ascontiguousarray(values[n]) for n in node.input)
        B, L, K = cand.shape
        V, r = pred.shape
        elem = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.uint16): 2}[hid.dtype]
        path = np.zeros((B, L), np.int32)
        probs = np.zeros((B, L, K), np.float32)
        keep = [cand.astype(np.int32), unary.astype(np.float32), anchor.astype(np.int32), temp.astype(np.float32),
                uni.astype(np.float32)]  # converted inputs, alive through the call
        ptr = [keep[0].ctypes.data_as(ctypes.c_void_p), keep[1].ctypes.data_as(ctypes.c_void_p),
               hid.ctypes.data_as(ctypes.c_void_p), keep[2].ctypes.data_as(ctypes.c_void_p),
               pred.ctypes.data_as(ctypes.c_void_p), succ.ctypes.data_as(ctypes.c_void_p),
               keep[3].ctypes.data_as(ctypes.c_void_p), keep[4].ctypes.data_as(ctypes.c_void_p)]
        I = ctypes.c_int32
        mode = {"greedy": 0, "viterbi": 1}[attrs.get("mode", "greedy")]
        rc = lib.dfl2SelectPathsHost(*ptr, I(B), I(L), I(K), I(r), I(V), I(elem), I(mode),
                                     path.ctypes.data_as(ctypes.c_void_p), probs.ctypes.data_as(ctypes.c_void_p),
                                     ctypes.c_void_p())
        assert rc == 0, f"dfl2SelectPathsHost refused its arguments ({rc})"
        self.plugin_runs += 1
        return dict(zip(node.output, (path, probs)))

    def __call__(self, cuda: FakeCuda, op: tuple) -> None:
        _, name, _, _, shapes, addresses, _, engine = op
        plan, shapes, addresses = engine.plan, dict(shapes), dict(addresses)
        sess = self._session(plan["file"])
        feeds = {}
        for n, spec in plan["inputs"].items():
            dt = np.dtype(_NP_DTYPE[spec["dtype"]])
            shape = shapes[n]
            raw = cuda._mem(addresses[n], int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
            feeds[n] = raw.view(dt).reshape(shape).copy()
        out_names = [o.name for o in sess.get_outputs()]
        results = dict(zip(out_names, sess.run(out_names, {k: v for k, v in feeds.items()
                                                           if k in {i.name for i in sess.get_inputs()}})))
        if plan["file"] in self.plugin_nodes:
            node, consts = self.plugin_nodes[plan["file"]]
            results.update(self._plugin(node, {**feeds, **consts, **results}))
        for n in plan["outputs"]:
            data = np.ascontiguousarray(results[n], dtype=_NP_DTYPE[plan["outputs"][n]["dtype"]]).view(np.uint8).ravel()
            cuda._mem(addresses[n], data.size)[:] = data
        self.runs[name] = self.runs.get(name, 0) + 1
