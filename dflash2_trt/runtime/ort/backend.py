"""ONNX Runtime backend: runs an export folder's graphs (numpy, onnxruntime, tokenizers; no torch).

Providers: CUDAExecutionProvider when onnxruntime-gpu and a GPU are present (inputs and outputs go
through IOBinding; the fixed-shape head graph is captured as a CUDA graph), else CPUExecutionProvider.
KV caches live in host :class:`~dflash2_trt.runtime.protocol.KVBuffer` capacity buffers; a graph call feeds
the whole buffer plus a validity mask and returns only the new rows, so a cycle costs O(capacity), never
O(length²) (see :mod:`dflash2_trt.export.onnx_graphs`).

Ownership: an :class:`OrtBackend` owns its sessions (thread safe in ORT); each runner it hands out owns one
request's caches and must not be shared between threads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import (BLOCK_LAYERS, ORT_SUFFIX, TARGET_ORT, TARGET_STATE_ROWS, TARGET_WINDOW_POSITIONS,
                                  ExportManifest, GraphSpec, read_manifest)
from dflash2_trt.runtime.kv import KVBuffer, TargetState, WindowRing, layer_feed, split_present, target_ids
from dflash2_trt.runtime.linear_state import LinearStates
from dflash2_trt.runtime.prefix_cache import SlotState, restore_slot_state, slot_state
from dflash2_trt.runtime.protocol import (BackendBase, BackendUnavailable, BatchDraftRunner, BatchTargetRunner, Draft,
                                          independent_draft)
from dflash2_trt.runtime.ort.failures import ort_failures
from dflash2_trt.runtime.ort.fused_target import OrtFusedTargetRunner
from dflash2_trt.vocabulary import INDEPENDENT, ORT_ATTENTIONS, head_key

SPINNING_ENV = "DFLASH2_ORT_SPINNING"  # "1" (default): the target session's intra-op workers spin; "0": none
_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}


def import_ort():  # noqa: ANN201
    try:
        import onnxruntime as ort
    except ImportError:
        raise BackendUnavailable("ONNX Runtime is not installed: pip install onnxruntime (or onnxruntime-gpu)"
                                 ) from None
    return ort


def cpu_session_options(ort, threads: int | None, spin: bool = False):  # noqa: ANN001, ANN201
    """The session options of every graph this backend opens (benchmarks that profile a graph take them from here).

    ``spin``: the session's intra-op workers spin between ops (ONNX Runtime's own default, and onnxruntime-genai's)
    instead of sleeping; a sleeping pool pays a worker wake-up per parallel op, ≈ 4 ms of a 26 ms SmolLM2 decode
    step on a quiet 2-core machine. The backend lets only the target session spin (:data:`SPINNING_ENV`): two
    spinning pools in one decode loop (target and drafter) take the CPUs from each other — speculation fell to
    0.6-0.8x — and a drafter call is a few ms of small ops."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return so


def target_spins(spinning: bool | None = None) -> bool:
    """Whether the target session's workers spin: ``spinning`` (``load(spinning=...)``) when given, else
    :data:`SPINNING_ENV`: ``1`` (the default) the target session's workers spin; ``0`` no session spins — for
    machines whose CPUs are shared with other work, where spinning workers slow everyone (small graphs ran ~6x
    slower on a loaded 2-core machine)."""
    if spinning is not None:
        return bool(spinning)
    v = os.environ.get(SPINNING_ENV, "1")
    if v not in ("0", "1"):
        raise DFlash2Error(f"{SPINNING_ENV}={v!r}: expected 1 (the target session spins) or 0 (no session spins)")
    return v == "1"


class _Session:
    """One graph: plain ``run`` on CPU; IOBinding on CUDA (optionally replaying a captured CUDA graph)."""

    def __init__(self, ort, path: Path, provider: str, threads: int | None, cuda_graph: bool = False,  # noqa: ANN001
                 decode_attention: bool = False, spin: bool = False, panels: bool = False,
                 library: bool = False, panel_choice: bool | None = None, codes: bool = True) -> None:
        """``library``: the graph holds a node only the dflash2 custom-op library runs (the selector's plugin node,
        dflash2.DrafterLayer); ``panel_choice``, ``codes``: the MatMul swap and the weight codes
        (:func:`~dflash2_trt.runtime.ort.decode_attention.panels_wanted`, ``_swap_matmuls``)."""
        so = cpu_session_options(ort, threads, spin)
        model: str | bytes = str(path)
        self.rewritten = False
        if decode_attention or panels or library:  # our custom ops: runtime/ort/decode_attention.py
            from dflash2_trt.runtime.ort import decode_attention as DA

            # the fused target: DecodeAttention and PanelMatMul; a drafter graph: PanelMatMul
            swapped = (DA.prepare(so, path, panel_choice, codes) if decode_attention else
                       DA.prepare_panels(so, path, panel_choice, codes) if panels else None)
            if swapped is not None:
                model, self.rewritten = swapped, True
            elif library:
                DA.register(so, path)
        self.provider = provider
        self.cuda_graph = cuda_graph and provider == "CUDAExecutionProvider"
        if provider == "CUDAExecutionProvider":
            opts: dict[str, Any] = {"enable_cuda_graph": "1"} if self.cuda_graph else {}
            providers: list = [(provider, opts), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        counted = self.rewritten or library  # the library's kernels keep weights by code (PanelMatMul, DrafterLayer)
        before = DA.panel_codes() if counted else {}
        try:
            self.sess = ort.InferenceSession(model, so, providers=providers)
        except Exception as e:  # ORT raises its own exception types
            raise DFlash2Error(f"ONNX Runtime cannot load {path.name}: {str(e).splitlines()[0][:300]}") from None
        # this session's weight matrices by the exact code they are read as (kernels created while the session loaded)
        self.panel_codes = {k: v - before[k] for k, v in DA.panel_codes().items()} if counted else {}
        # the nodes the library runs in this session's graph (op type -> count), for Generator.note and /health
        self.library_nodes = (DA.library_nodes(DA.onnx_model(model) if self.rewritten else DA._load_graph(path))
                              if counted else {})
        if self.rewritten:
            DA.release_freed_memory()
        self.ort = ort
        self.path = str(path)
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self._bound: dict[str, Any] | None = None

    def run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.provider != "CUDAExecutionProvider":
            with ort_failures(self.path):
                return self.sess.run(self.outputs, feed)
        if self.cuda_graph:
            try:
                return self._run_graph(feed)
            except Exception:  # capture failed (e.g. a node on the CPU): fall back to eager IOBinding
                self.cuda_graph = False
                self._bound = None
                self.sess = self.ort.InferenceSession(self.path, self.sess.get_session_options(),
                                                      providers=[self.provider, "CPUExecutionProvider"])
        io = self.sess.io_binding()
        for k, v in feed.items():
            io.bind_cpu_input(k, np.ascontiguousarray(v))
        for o in self.outputs:
            io.bind_output(o, "cuda")
        with ort_failures(self.path):
            self.sess.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()

    def _run_graph(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """CUDA graphs replay fixed device buffers: inputs and outputs are bound once (batch 1, fixed shapes),
        new inputs are copied into them in place, then the captured graph is replayed. The bound OrtValues
        must live as long as the session (the graph holds their addresses)."""
        if self._bound is None:
            ins = {k: self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), "cuda", 0) for k, v in feed.items()}
            outs = {}
            for o in self.sess.get_outputs():
                shape = [1 if not isinstance(d, int) else d for d in o.shape]
                dt = {"tensor(float)": np.float32, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
                      "tensor(float16)": np.float16}[o.type]
                outs[o.name] = self.ort.OrtValue.ortvalue_from_shape_and_type(shape, dt, "cuda", 0)
            io = self.sess.io_binding()
            for k, v in ins.items():
                io.bind_ortvalue_input(k, v)
            for k, v in outs.items():
                io.bind_ortvalue_output(k, v)
            self.sess.run_with_iobinding(io)  # the first run captures the graph
            self._bound = {"io": io, "ins": ins, "outs": outs}
        else:
            for k, v in feed.items():
                self._bound["ins"][k].update_inplace(np.ascontiguousarray(v))
            self.sess.run_with_iobinding(self._bound["io"])
        return [self._bound["outs"][o].numpy() for o in self.outputs]


def _check_interface(s: _Session, g: GraphSpec) -> None:
    """The graph file has the interface the manifest records (names, ranks, fixed dims): a graph of another export
    (another block size) put in with re-signed checksums is refused here, not met as a shape error mid-decode."""
    got = {a.name: a.shape for a in (*s.sess.get_inputs(), *s.sess.get_outputs())}
    for t in (*g.inputs, *g.outputs):
        shape = got.get(t.name)
        if shape is None or len(shape) != len(t.shape) or any(
                isinstance(want, int) and want > 0 and have != want for have, want in zip(shape, t.shape)):
            raise DFlash2Error(f"{g.file}: tensor {t.name!r} is {shape if shape is not None else 'missing'} in the "
                               f"graph but {list(t.shape)} in the manifest: the graph does not belong to this export "
                               f"(re-export)")


class OrtBackend(BackendBase):
    """An export folder opened with ONNX Runtime."""

    name = "ort"

    def __init__(self, model_dir: str | Path, provider: str = "auto", verify_checksums: bool = True,
                 threads: int | None = None, flavour: str = "auto", attention: str = "auto", *,
                 spinning: bool | None = None, panels: bool | None = None, weight_codes: bool = True) -> None:
        """flavour: 'auto' runs the fused ONNX Runtime graphs (``target_ort`` and ``*_ort`` variants, see
        :mod:`dflash2_trt.runtime.ort.fused_target`) when the export has them and the provider is the CPU;
        'standard' runs the standard-ONNX graphs (the TensorRT flavour) only.
        attention (fused target only): 'auto' swaps GroupQueryAttention for dflash2.DecodeAttention when its
        library is built (:mod:`dflash2_trt.runtime.ort.decode_attention`), 'decode' requires it, 'gqa' keeps
        ORT's op. spinning, panels, weight_codes: :func:`dflash2_trt.load`'s (None: the environment's or the
        CPU's choice)."""
        for key, v in (("spinning", spinning), ("panels", panels), ("weight_codes", weight_codes)):
            if not (isinstance(v, bool) or v is None and key != "weight_codes"):
                raise DFlash2Error(f"{key} must be True, False{'' if key == 'weight_codes' else ' or None'}, got {v!r}")
        self.spinning, self.panels, self.weight_codes = spinning, panels, weight_codes
        self.dir = Path(model_dir)
        ort = import_ort()
        self.manifest: ExportManifest = read_manifest(self.dir, verify_checksums)
        self.ort = ort
        available = ort.get_available_providers()
        if provider == "auto":
            provider = "CUDAExecutionProvider" if "CUDAExecutionProvider" in available else "CPUExecutionProvider"
        if provider not in available:
            raise DFlash2Error(f"ONNX Runtime provider {provider} is not available (available: {', '.join(available)})")
        self.provider = provider
        self.threads = threads
        m = self.manifest
        self.dtype = np.float16 if m.dtype == "fp16" else np.float32
        if m.dtype == "bf16":
            raise DFlash2Error("bf16 exports cannot run with ONNX Runtime (numpy has no bfloat16); export fp32/fp16")
        self._sessions: dict[str, _Session] = {}
        if flavour not in ("auto", "standard"):
            raise DFlash2Error(f"ORT graph flavour must be 'auto' or 'standard', got {flavour!r}")
        self.fused = flavour == "auto" and provider == "CPUExecutionProvider" and TARGET_ORT in m.graphs
        if attention not in ORT_ATTENTIONS:
            raise DFlash2Error(f"attention must be one of {', '.join(ORT_ATTENTIONS)}, got {attention!r}")
        self.decode_attention = False
        self._library_absent = "op library not used: attention 'gqa' (ONNX Runtime's GroupQueryAttention)"
        if not self.fused:
            self._library_absent = "op library not used: the standard graphs (fused graphs run on the CPU only)"
        elif attention != "gqa":
            from dflash2_trt.runtime.ort import decode_attention as DA

            ok, why = DA.available()
            if not ok and attention == "decode":
                raise DFlash2Error(f"attention 'decode' is unavailable: {why}")
            self.decode_attention, self._library_absent = ok, why

    @property
    def description(self) -> str:
        return f"ONNX Runtime ({self.provider})"

    @property
    def graphs_note(self) -> str:
        """Which graphs run: 'fused' (+ quantization kind) or 'standard'."""
        q = self.manifest.quantization.kind
        return ("fused" + (f", {q}" if q != "none" else "")) if self.fused else "standard"

    @property
    def attention_op(self) -> str | None:
        """The fused target's attention op: 'DecodeAttention' or 'GroupQueryAttention' (None: not fused)."""
        if not self.fused:
            return None
        s = self._sessions.get(TARGET_ORT)
        swapped = s.rewritten if s is not None else self.decode_attention
        return "DecodeAttention" if swapped else "GroupQueryAttention"

    def session(self, key: str) -> _Session:
        if self.fused and key + ORT_SUFFIX in self.manifest.graphs:
            key = key + ORT_SUFFIX  # the (quantized) ONNX Runtime variant of the graph
        if key not in self._sessions:
            g = self.manifest.graphs.get(key)
            if g is None:
                raise DFlash2Error(f"{self.dir} has no {key!r} graph")
            library = g.selector == "plugin" or key == BLOCK_LAYERS
            if library and not self.decode_attention:
                raise DFlash2Error(f"graph {key!r} holds a node that ONNX Runtime runs only with the dflash2 custom-op "
                                   f"library on the CPU")
            s = _Session(self.ort, self.dir / g.file, self.provider, self.threads, cuda_graph=g.role == "drafter_head",
                         decode_attention=key == TARGET_ORT and self.decode_attention,
                         panels=key != TARGET_ORT and self.decode_attention, library=library,
                         spin=g.role == "target" and target_spins(self.spinning), panel_choice=self.panels,
                         codes=self.weight_codes)
            _check_interface(s, g)
            self._sessions[key] = s
        return self._sessions[key]

    def head_key(self, mode: str) -> str:
        """The drafter head graph a draft mode runs: the ``.plugin`` variant, whose selector is one node
        (``trt.plugins.DFlash2PathSelector``: the custom-op library runs the selector's CPU twin, the CUDA kernel's
        numbers bit for bit, in place of ≈ 120 small ONNX ops), else the decomposed head (:meth:`_library_graph`)."""
        return self._library_graph(head_key(mode, plugin=True), head_key(mode))

    def block_key(self) -> str:
        """The drafter block graph the runners use: ``drafter_block_layers`` (each decoder layer one
        ``dflash2.DrafterLayer`` node in place of ≈ 170 small ONNX ops), else ``drafter_block``
        (:meth:`_library_graph`)."""
        return self._library_graph(BLOCK_LAYERS, "drafter_block")

    def _library_graph(self, variant: str, standard: str) -> str:
        """``variant`` (a graph only the custom-op library runs) where the library is in use, the export has it and
        the drafter is not quantized (only ``standard`` has an ``*_ort`` variant), else ``standard``."""
        graphs = self.manifest.graphs
        if self.decode_attention and variant in graphs and standard + ORT_SUFFIX not in graphs:
            return variant
        return standard

    def op_library(self) -> str:
        """One line on the custom-op library: where it was loaded from and the nodes it runs in the graphs opened so
        far (the target graph is opened for it: its rewrite is the count that matters), or why the plain ONNX
        Runtime graph runs and what that costs."""
        if not self.decode_attention:
            return self._library_absent
        from dflash2_trt.runtime.ort import decode_attention as DA

        target = self.session(TARGET_ORT)
        nodes: dict[str, int] = {}
        for s in self._sessions.values():
            for k, v in s.library_nodes.items():
                nodes[k] = nodes.get(k, 0) + v
        where = f"op library loaded from {DA.find_library()}"
        if not target.rewritten:
            return f"{where}, but the target graph cannot take its ops: {DA.WITHOUT_LIBRARY}"
        listed = ", ".join(f"{k} {v}" for k, v in sorted(nodes.items()))
        return f"{where}: it runs {sum(nodes.values())} nodes ({listed})"

    def panel_codes(self) -> dict[str, int]:
        """The loaded sessions' weight matrices (PanelMatMul and DrafterLayer kernels) by the exact code they fit
        (:data:`~dflash2_trt.runtime.ort.decode_attention.PANEL_CODES`; "none": fp32); empty without the panels."""
        out: dict[str, int] = {}
        for s in self._sessions.values():
            for k, v in s.panel_codes.items():
                out[k] = out.get(k, 0) + v
        return out

    def target_runner(self) -> "OrtTargetRunner | OrtFusedTargetRunner":
        return OrtFusedTargetRunner.from_backend(self) if self.fused else OrtTargetRunner(self)

    def draft_runner(self, mode: str = "greedy") -> "OrtDraftRunner":
        """mode: a selector mode, or 'independent' (no selector: each row's argmax / sample)."""
        return OrtDraftRunner(self, self.manifest.check_draft_mode(mode))

    @property
    def batching(self) -> bool:
        """Many sequences per target call: the fused target (:mod:`dflash2_trt.runtime.ort.batched_target`), or the
        standard graph where the export has no fused one (targets with linear, sliding or routed-expert layers:
        :mod:`dflash2_trt.runtime.ort.batched_standard`). A dense export run on its standard graph by choice
        (``flavour="standard"``) serves one request after another."""
        return self.fused or self._standard_only

    @property
    def _standard_only(self) -> bool:
        return TARGET_ORT not in self.manifest.graphs

    @property
    def prefix_cache(self) -> bool:
        return True  # every runner above: prefix_rows / prefix_state / restore_prefix, the drafters' context rows

    def batch_target_runner(self, slots: int) -> BatchTargetRunner:
        if not self.fused and self._standard_only:
            from dflash2_trt.runtime.ort.batched_standard import OrtStandardBatchedTargetRunner

            return OrtStandardBatchedTargetRunner(self, slots)
        from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

        return OrtBatchedTargetRunner.from_backend(self, slots)

    def batch_draft_runner(self, mode: str, slots: int) -> BatchDraftRunner:
        from dflash2_trt.runtime.ort.batched_drafter import OrtBatchedDraftRunner

        return OrtBatchedDraftRunner(self, self.manifest.check_draft_mode(mode), slots)

    def close(self) -> None:
        self._sessions.clear()


class OrtTargetRunner(TargetState):
    """TargetRunner over ``target.onnx``: KV capacity buffers for the attention layers, ring buffers for the sliding
    layers (:class:`~dflash2_trt.runtime.kv.WindowRing`) and, for a target with linear layers, their states
    (:class:`~dflash2_trt.runtime.linear_state.LinearStates`); a crop into the last call rolls each back to the kept
    rows."""

    def __init__(self, be: OrtBackend) -> None:
        m = be.manifest
        t = m.target
        self.sess = be.session("target")
        self.vocab_size = t.vocab_size
        self.max_positions = m.max_seq_len
        self.eos_ids = set(t.eos_token_ids)
        self.kinds = m.layer_kinds
        count = {kind: self.kinds.count(kind) for kind in ("attention", "sliding")}
        linear = [i for i, k in enumerate(self.kinds) if k == "linear"]
        self.kv: KVBuffer = KVBuffer(count["attention"], t.num_key_value_heads, t.head_dim, be.dtype,
                                     m.kv_capacity_step, m.max_seq_len)
        self.names = m.target_kv_names()
        self.linear = LinearStates(linear, t.linear_state, be.dtype) if linear and t.linear_state else None
        self.ring = (WindowRing(count["sliding"], t.num_key_value_heads, t.head_dim, be.dtype, t.sliding_window)
                     if count["sliding"] and t.sliding_window else None)
        self._call_start = 0  # the cache length before the last forward (a rollback keeps rows of that call only)

    def forward(self, ids: list[int], last_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """ids [m] at positions cache_length.. -> logits [m, V] fp32 (``last_logits``: [1, V], the last row's; the
        graph computes every row's), context features [m, F]."""
        arr = target_ids(ids, self.vocab_size)  # [1, m]
        if self.linear is None:
            logits, feats = self._call(arr)
            return (logits[-1:] if last_logits else logits), feats
        self._call_start = self.kv.length
        step = self.linear.spec.max_rows_per_call
        every_row = arr.shape[1] <= step  # a call that may be rolled back (a verify): every row's state
        outs = [self._call(arr[:, a:a + step], every_row) for a in range(0, arr.shape[1], step)]
        logits = outs[-1][0][-1:] if last_logits else np.concatenate([o[0] for o in outs])
        return logits, np.concatenate([o[1] for o in outs])

    def _call(self, arr: np.ndarray, every_row: bool = False) -> tuple[np.ndarray, np.ndarray]:
        n, S = self.kv.length, arr.shape[1]
        self.kv.reserve(n + S)
        feed = {"input_ids": arr, "position_ids": np.arange(n, n + S, dtype=np.int64).reshape(1, -1),
                "attention_mask": np.concatenate([self.kv.valid_mask(), np.ones((1, S), dtype=np.int64)], axis=1)}
        if self.kv_only:
            feed.update(zip(self.names, self.kv.arrays))
            out = self.sess.run(feed)
            self.kv.append(out[2:])
            return out[0][0], out[1][0]
        states: dict[str, list[np.ndarray]] = {"attention": self.kv.arrays}
        if self.linear is not None:
            feed[TARGET_STATE_ROWS] = np.arange(S, dtype=np.int64) if every_row else np.array([S - 1], dtype=np.int64)
            states["linear"] = self.linear.feed()
        if self.ring is not None:
            states["sliding"], feed[TARGET_WINDOW_POSITIONS] = self.ring.feed()
        feed.update(zip(self.names, layer_feed(self.kinds, states)))
        out = self.sess.run(feed)
        new = split_present(self.kinds, out[2:])
        self.kv.append(new.get("attention", []))
        if self.linear is not None:
            self.linear.update(new["linear"], 0, {0: S}, every_row)
        if self.ring is not None:
            self.ring.write(0, n, new["sliding"])
        return out[0][0], out[1][0]

    @property
    def kv_only(self) -> bool:
        return self.linear is None and self.ring is None

    # -- the prefix cache (dflash2_trt.runtime.prefix_cache) ------------------------------------------------------
    def prefix_rows(self, n: int, slot: int = 0) -> list[np.ndarray]:
        return self.kv.rows(n)

    def prefix_state(self, slot: int = 0) -> SlotState | None:
        return None if self.kv_only else slot_state(self.linear, self.ring, 0)

    def restore_prefix(self, rows: list[np.ndarray], n: int, state: SlotState | None, slot: int = 0) -> None:
        self.kv.load(rows, n)
        restore_slot_state(self.linear, self.ring, 0, state)
        self._call_start = n

    def crop(self, length: int) -> None:
        if self.linear is not None and length < self.kv.length:
            self.linear.rollback(length - self._call_start)
        if self.ring is not None and length < self.kv.length:
            self.ring.crop(0, length)
        self.kv.crop(length)


class OrtDraftRunner:
    """DraftRunner over ``drafter_context`` and the block and head graphs :meth:`OrtBackend.block_key` and
    :meth:`OrtBackend.head_key` pick."""

    def __init__(self, be: OrtBackend, mode: str) -> None:
        m = be.manifest
        cfg = m.drafter_config
        self.block_size = cfg.block_size
        self.num_draft_rows = cfg.num_draft_rows
        self.mode = mode
        self.ctx_sess = be.session("drafter_context")
        self.block_sess = be.session(be.block_key())
        self.head_sess = be.session(be.head_key(mode))
        assert cfg.head_dim is not None
        self.kv = KVBuffer(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, be.dtype,
                           m.kv_capacity_step, m.max_seq_len)
        self.names = m.drafter_context_names()
        self.dtype = be.dtype
        self.top_k = cfg.selector_top_k

    def reset(self) -> None:
        self.kv.reset()

    # -- the prefix cache (dflash2_trt.runtime.prefix_cache) ------------------------------------------------------
    def context_length(self) -> int:
        return self.kv.length

    def context_rows(self, n: int) -> list[np.ndarray]:
        return self.kv.rows(n)

    def restore_context(self, rows: list[np.ndarray]) -> None:
        self.kv.load(rows, rows[0].shape[1] if rows else 0)

    def add_context(self, feats: np.ndarray, start: int) -> None:
        """feats [m, F] of positions start..start+m-1 -> the draft context cache."""
        if start != self.kv.length:
            raise DFlash2Error(f"draft context is at length {self.kv.length}, got features for position {start}")
        m = feats.shape[0]
        out = self.ctx_sess.run({"context_features": np.ascontiguousarray(feats[None], dtype=self.dtype),
                                 "position_ids": np.arange(start, start + m, dtype=np.int64).reshape(1, -1)})
        self.kv.append(out)

    def propose(self, anchor: int, pos: int, rows: int, temperature: float, uniforms: np.ndarray | None) -> Draft:
        if self.kv.length != pos:
            raise DFlash2Error(f"draft context holds {self.kv.length} positions, anchor is at {pos}")
        self.kv.reserve(max(1, pos))
        feed = {"anchor_ids": np.array([anchor], dtype=np.int64), "anchor_position": np.array([pos], dtype=np.int64),
                "context_mask": self.kv.valid_mask()}
        feed.update(zip(self.names, self.kv.arrays))
        hidden = self.block_sess.run(feed)[0]  # [1, bs, H]
        L = self.num_draft_rows
        hidden[:, 1 + rows:] = 0  # a final partial block: the path over the verified rows alone
        if self.mode == INDEPENDENT:
            logits = self.head_sess.run({"hidden": hidden})[0][0]  # [L, V] fp32
            return independent_draft(logits, temperature, uniforms, self.top_k)
        u = uniforms if uniforms is not None else np.zeros((1, L), dtype=np.float32)
        cand, path, q = self.head_sess.run({"hidden": hidden, "anchor_ids": np.array([anchor], dtype=np.int32),
                                            "temperature": np.array([temperature], dtype=np.float32),
                                            "uniforms": np.ascontiguousarray(u, dtype=np.float32)})
        return Draft(tokens=path[0].astype(np.int64), proposal=q[0], cand=cand[0].astype(np.int64))
