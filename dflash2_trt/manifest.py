"""``ExportManifest``: the typed contract between ``dflash2 export`` and every runtime (Python backends, the C
API, the Triton model) — ``DIR/manifest.json``, described by the JSON Schema ``manifest.schema.json`` beside
this module.

One writer (:func:`write_manifest`: fills the checksums, writes atomically) and one reader
(:func:`read_manifest`: parses and validates once, into frozen dataclasses; every problem is one
:class:`DFlash2Error` naming the field). Readers never touch the raw JSON.

Layout (``MANIFEST_VERSION`` 2; ``STATE_MANIFEST_VERSION`` 3 for a target with linear or sliding-window layers, whose
state the graph takes in another layout -- linear layers' states, sliding layers' ring buffers -- so that a reader that
knows only version 2 refuses such an export instead of misdecoding it)::

    {"format": "dflash2-trt-export", "manifest_version": 2 | 3, "project_version", "exporter_revision",
     "opset", "dtype": fp32|fp16|bf16,
     "quantization" + "drafter_quantization": {"kind": none|int8|int4 (drafter_quantization: or q8_0), ...},
     "draft_vocab",
     "max_seq_len", "kv_capacity_step",
     "target":  {"model_type", "vocab_size", "num_layers", "hidden_size", "num_key_value_heads", "head_dim",
                 "max_positions", "eos_token_ids", "layer_ids", "source",
                 "layer_kinds" (one of LAYER_KINDS per layer; absent: all attention), version 3: "linear_state":
                 {"conv_dim", "conv_kernel", "num_heads", "key_dim", "value_dim", "max_rows_per_call"} and
                 "sliding_window": {"window", "ring_slots"}},
     "drafter": the drafter's config.json (HF layout, DFlash2Config) with the exported block size,
     "plugin":  {"op_type", "domain", "plugin_version", "plugin_namespace"},
     "graphs":  {KEY: {"file", "role", "selector": decomposed|plugin|null, "mode",
                       "inputs": [{"name", "dtype", "shape"}], "outputs": [...]}},
     "weights": "weights.bin", "tokenizer": {"files", "chat_template"}, "verification": {...},
     "engines": null | {TensorRT engine set: identity, plugin, plans with profiles},
     "files":   {relative path: sha256 of every other file in the folder}}

Graph keys: ``target``, ``drafter_context``, ``drafter_block``, ``drafter_head_independent`` (draft-row logits, no
selector), and for drafters with a selector ``drafter_head_{greedy,viterbi}`` (decomposed selector) and
``drafter_head_{greedy,viterbi}_plugin`` (the TensorRT plugin node). The block size lives in the drafter
configuration only (``block_size``; ``num_draft_rows`` = block size - 1). ONNX Runtime flavour (``flavour``:
"ort", com.microsoft ops): ``target_ort`` (fused target, shared KV buffers) and, in quantized exports,
``KEY_ort`` (MatMulNBits) variants that the ORT backend runs instead of ``KEY``, and ``drafter_block_layers`` (each
decoder layer one ``dflash2.DrafterLayer`` node, run with the project's custom-op library). TensorRT flavour of a
quantized export (``flavour`` "qdq"): ``target_qdq`` (standard ONNX, DequantizeLinear weights), which
``build-engines`` builds the target engine from.

Imports only the standard library, ``errors``, ``vocabulary`` and the torch-free ``config``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from dflash2_trt.config import DFlash2Config
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.vocabulary import (DRAFT_MODES, DRAFTER_QUANTIZATIONS, DTYPES, GRAPH_FLAVOURS, INDEPENDENT,
                                    LAYER_KINDS, QUANTIZATIONS, SELECTOR_IMPLS, check_draft_mode, head_key)

FORMAT = "dflash2-trt-export"
MANIFEST_VERSION = 2
STATE_MANIFEST_VERSION = 3  # a target with linear or sliding layers: their state is graph input and output
MANIFEST_FILE = "manifest.json"
SCHEMA_FILE = Path(__file__).with_name("manifest.schema.json")
KV_CAPACITY_STEP = 256  # default KV capacity granularity (positions) of exports
BLOCK_HIDDEN = "hidden"  # drafter_block's output and the heads' input: [B, block_size, H]
REQUIRED_GRAPHS = ("target", "drafter_context", "drafter_block", head_key(INDEPENDENT))
TARGET_ORT = "target_ort"  # graph key of the fused ONNX Runtime target
ORT_SUFFIX = "_ort"  # graph key K + "_ort": the ONNX Runtime variant of K (the ORT backend prefers it)
# the block with each decoder layer one dflash2.DrafterLayer node (fp32 ONNX Runtime flavour; the ORT backend runs it
# where it runs the dflash2 custom-op library, runtime/ort/backend.py OrtBackend.block_key)
BLOCK_LAYERS = "drafter_block_layers"
# [B] int32: each sequence's cached length; an input of target_ort only once the runtime swapped in
# dflash2.DecodeAttention at load (runtime/ort/decode_attention.py: ragged rows per sequence in one batched call)
TARGET_PAST_SEQLENS = "past_seqlens"
# [B, R, 1] int64: of each sequence's S new rows, the R whose logits target_ort computes (a batched prefill needs
# its last row's only); an input only once the runtime rewrote the graph at load (runtime/ort/decode_attention.py)
TARGET_LOGITS_INDEX = "logits_index"


# Graph input/output names, spelt once (every exporter, verifier and runner takes them from here).
def kv_names(n_layers: int, prefix: str) -> list[str]:
    """``{prefix}.{i}.key`` / ``.value`` for i < n_layers, interleaved (2 per layer)."""
    return [f"{prefix}.{i}.{k}" for i in range(n_layers) for k in ("key", "value")]


def target_kv_names(n_layers: int) -> list[str]:
    """The target graph's KV inputs (capacity buffers), 2 per layer."""
    return kv_names(n_layers, "past_key_values")


def target_present_names(n_layers: int) -> list[str]:
    """The target graph's KV outputs, 2 per layer."""
    return kv_names(n_layers, "present")


def target_state_names(kinds: tuple[str, ...] | list[str], prefix: str = "past") -> list[str]:
    """The target graph's per-layer state, 2 per layer in layer order: an attention layer's KV
    (``past_key_values.{i}.key/.value`` inputs, ``present.{i}.*`` outputs), a linear layer's convolution and
    recurrent state (``past_conv.{i}`` / ``past_recurrent.{i}`` inputs; ``present_conv.{i}``, the call's convolution
    inputs, and ``present_recurrent.{i}``, the recurrent state after each asked row, outputs); an ``mlp`` layer (no
    state) none."""
    kv = "past_key_values" if prefix == "past" else prefix
    out = []
    for i, kind in enumerate(kinds):
        if kind != "mlp":
            out += [f"{prefix}_conv.{i}", f"{prefix}_recurrent.{i}"] if kind == "linear" else \
                [f"{kv}.{i}.key", f"{kv}.{i}.value"]
    return out


# [R] int64, an input of a target graph with linear layers: the rows of the call whose recurrent states it returns
TARGET_STATE_ROWS = "state_rows"
# [B, ring_slots] int64, an input of a target graph with sliding layers: the position each ring slot holds (-1: none)
TARGET_WINDOW_POSITIONS = "window_positions"


def drafter_context_names(n_layers: int) -> list[str]:
    """The drafter's context K/V (outputs of the context graph, inputs of the block graph), 2 per layer."""
    return kv_names(n_layers, "context")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[Union[int, str], ...]  # symbolic dims as names


@dataclass(frozen=True)
class GraphSpec:
    file: str
    role: str  # target | drafter_context | drafter_block | drafter_head
    selector: Union[str, None] = None  # decomposed | plugin | None (no selector in this graph)
    mode: Union[str, None] = None  # draft mode of a head graph
    # "ort": ONNX Runtime only (com.microsoft ops; runtime/ort/fused_target.py); "qdq": the TensorRT flavour of a
    # quantized export (explicit Q/DQ weights; build-engines builds the target engine from it)
    flavour: Union[str, None] = None
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()


@dataclass(frozen=True)
class LinearStateSpec:
    """A linear-attention layer's state: the convolution's last ``conv_kernel - 1`` inputs [conv_dim, kernel - 1]
    (the target's dtype) and one recurrent matrix per value head [num_heads, key_dim, value_dim] (fp32); a graph call
    takes at most ``max_rows_per_call`` rows."""

    conv_dim: int
    conv_kernel: int
    num_heads: int
    key_dim: int
    value_dim: int
    max_rows_per_call: int


@dataclass(frozen=True)
class SlidingWindowSpec:
    """The sliding layers' keys: each row attends to the last ``window`` positions; a sliding layer's K/V live in a
    ring buffer of ``ring_slots`` (>= window) slots, position p in slot p % ring_slots, so that a verify of up to
    ``ring_slots - window + 1`` rows writes over no key that a rollback into it needs again."""

    window: int
    ring_slots: int


@dataclass(frozen=True)
class TargetSpec:
    model_type: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_key_value_heads: int
    head_dim: int
    max_positions: int
    eos_token_ids: tuple[int, ...]
    layer_ids: tuple[int, ...]  # decoder layers tapped for the drafter's context features
    source: str = ""
    layer_kinds: tuple[str, ...] = ()  # one of LAYER_KINDS per layer; () = every layer attention
    linear_state: Union[LinearStateSpec, None] = None  # the linear layers' state (version 3)
    sliding_window: Union[SlidingWindowSpec, None] = None  # the sliding layers' window and ring (version 3)


@dataclass(frozen=True)
class PluginSpec:
    op_type: str
    domain: str
    plugin_version: str
    plugin_namespace: str


@dataclass(frozen=True)
class TokenizerSpec:
    files: tuple[str, ...]
    chat_template: bool


@dataclass(frozen=True)
class Quantization:
    kind: str = "none"  # QUANTIZATIONS (drafter_quantization: DRAFTER_QUANTIZATIONS)
    block_size: Union[int, None] = None  # weight-only: elements per quantization block
    accuracy_level: Union[int, None] = None  # MatMulNBits accuracy level (ORT)
    lm_head: bool = False  # LM head / embeddings quantized too
    symmetric: bool = True  # weight-only: no zero points


@dataclass(frozen=True)
class EngineProfile:
    name: str
    dims: dict[str, tuple[int, ...]]  # named dim -> (min, opt, max)


@dataclass(frozen=True)
class EnginePlan:
    file: str
    profiles: tuple[EngineProfile, ...]
    build_s: float = 0.0


@dataclass(frozen=True)
class EnginePlugin:
    file: str
    sha256: str
    source: str = ""


@dataclass(frozen=True)
class GpuIdentity:
    name: str
    compute_capability: str


@dataclass(frozen=True)
class EngineSet:
    """TensorRT engines built for this export: what they are tied to (TensorRT version, GPU, plugin) and
    the plan of each graph. Written by ``dflash2 build-engines``."""

    dir: str
    tensorrt_version: str
    gpu: GpuIdentity
    plans: dict[str, EnginePlan]
    cuda: dict[str, Any] = field(default_factory=dict)
    plugin: Union[EnginePlugin, None] = None
    selector: str = "plugin"
    strongly_typed: bool = True
    tf32: bool = False
    dtype: str = "fp32"
    prefill_rows: int = 256
    timing_cache: str = ""

    @property
    def max_batch(self) -> int:
        """Sequences the target engine takes in one call: the smallest upper end of its profiles' ``batch`` dim
        (``build-engines --max-batch``; 1 for engines built before the option, whose profiles say (1, 1, 1)).
        Derived from the profiles, not a field of its own: manifests of every version read and write alike."""
        plan = self.plans.get("target")
        if plan is None or not plan.profiles:
            return 1
        return min(int(p.dims.get("batch", (1, 1, 1))[2]) for p in plan.profiles)


@dataclass(frozen=True)
class VerifyCostRow:
    cached: int  # positions already in the cache
    rows: int  # new rows of the timed target call
    ms: float
    ratio: float  # ms / ms of 1 row at the same cached length


@dataclass(frozen=True)
class VerifyCost:
    """``dflash2 export --verify-cost``: the fused target's verification timed on the export machine
    (:func:`dflash2_trt.bench.verify_cost.record`) and the block size it recommends."""

    table: tuple[VerifyCostRow, ...]
    recommended_block_size: int
    assumed_acceptance: float = 0.0  # per-row conditional acceptance the recommendation assumed
    draft_cost: float = 0.0  # a drafter pass, in 1-row verify steps
    threads: Union[int, str] = "ort default"  # ONNX Runtime intra-op threads of the timing


@dataclass(frozen=True)
class ExportManifest:
    opset: int
    dtype: str
    max_seq_len: int
    target: TargetSpec
    drafter: dict[str, Any]  # the drafter's config.json; parsed by DFlash2Config (see ``drafter_config``)
    plugin: PluginSpec
    graphs: dict[str, GraphSpec]
    tokenizer: TokenizerSpec
    kv_capacity_step: int = KV_CAPACITY_STEP
    quantization: Quantization = Quantization()  # the target's weights
    drafter_quantization: Quantization = Quantization()  # the ONNX Runtime drafter graphs' (export --drafter-quantize)
    draft_vocab: int = 0  # export --draft-vocab: ids the drafter's LM head keeps (0 = the full vocabulary)
    weights: str = "weights.bin"
    # export-time checks: measure name -> figure (max errors, match rates), or a note (e.g. why one was skipped)
    verification: dict[str, Union[float, str]] = field(default_factory=dict)
    verify_cost: Union[VerifyCost, None] = None  # export --verify-cost (bench/verify_cost.py)
    engines: Union[EngineSet, None] = None
    files: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT
    manifest_version: int = MANIFEST_VERSION
    project_version: str = ""
    exporter_revision: int = 0

    # -- derived (the one place each is computed) --------------------------------------------------

    @functools.cached_property
    def drafter_config(self) -> DFlash2Config:
        return DFlash2Config.from_dict(self.drafter)

    @property
    def block_size(self) -> int:
        return self.drafter_config.block_size

    @property
    def num_draft_rows(self) -> int:
        return self.drafter_config.num_draft_rows

    @property
    def selector_top_k(self) -> int:
        return self.drafter_config.selector_top_k

    @property
    def max_capacity(self) -> int:
        """KV capacity needed for ``max_seq_len`` positions (a multiple of ``kv_capacity_step``)."""
        return -(-self.max_seq_len // self.kv_capacity_step) * self.kv_capacity_step

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The kind of every target layer (:data:`~dflash2_trt.vocabulary.LAYER_KINDS`)."""
        return self.target.layer_kinds or ("attention",) * self.target.num_layers

    @property
    def kv_only(self) -> bool:
        """Every target layer is full attention: its state a KV cache of positions, which a crop rolls back. Otherwise
        linear layers carry state through the graph and sliding layers keep ring buffers (version 3)."""
        return all(k == "attention" for k in self.layer_kinds)

    def target_kv_names(self) -> list[str]:
        """The target graph's state inputs, 2 per layer (attention: key, value; :func:`target_state_names`)."""
        return target_state_names(self.layer_kinds)

    def target_present_names(self) -> list[str]:
        return target_state_names(self.layer_kinds, "present")

    def drafter_context_names(self) -> list[str]:
        """The drafter's context K/V (inputs of the block graph, outputs of the context graph)."""
        return drafter_context_names(self.drafter_config.num_hidden_layers)

    @property
    def draft_modes(self) -> tuple[str, ...]:
        """Draft modes this export can run (selector modes need the selector heads)."""
        return tuple(m for m in DRAFT_MODES if head_key(m) in self.graphs)

    def check_draft_mode(self, mode: str) -> str:
        """``mode`` when this export can draft with it, else DFlash2Error."""
        return check_draft_mode(mode, self.draft_modes, "this export")

    def to_json(self) -> dict[str, Any]:
        return _encode(self)


# ----------------------------------------------------------------------------------------------------
# Reading: JSON -> frozen dataclasses, one error naming the field
# ----------------------------------------------------------------------------------------------------


def _decode(tp: Any, value: Any, where: str) -> Any:
    """``value`` (parsed JSON) as type ``tp``; DFlash2Error naming ``where`` when it does not fit."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _decode(a, value, where)
            except DFlash2Error as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise DFlash2Error(f"{where} must be an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        kw = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kw[f.name] = _decode(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise DFlash2Error(f"{where} lacks the required field {f.name!r}")
        return tp(**kw)
    if origin is tuple:
        if not isinstance(value, list):
            raise DFlash2Error(f"{where} must be a list, got {type(value).__name__}")
        (item, _) = typing.get_args(tp)
        return tuple(_decode(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise DFlash2Error(f"{where} must be an object, got {type(value).__name__}")
        _, item = typing.get_args(tp)
        return {str(k): _decode(item, v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DFlash2Error(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is int or tp is bool or tp is str:
        if type(value) is not tp:
            raise DFlash2Error(f"{where} must be {'an' if tp is int else 'a'} {tp.__name__}, got {value!r}")
        return value
    raise TypeError(f"manifest field type {tp} is not handled")  # a bug in this module, not user input


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def parse_manifest(data: Any, where: str = MANIFEST_FILE) -> ExportManifest:
    """Validate parsed manifest JSON (format, version, field types, graphs, modes, drafter config, fit)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DFlash2Error(f"{where} is not a {FORMAT} manifest")
    if data.get("manifest_version") not in (MANIFEST_VERSION, STATE_MANIFEST_VERSION):
        raise DFlash2Error(f"{where} has manifest_version {data.get('manifest_version')!r} (written by dflash2-trt "
                           f"{data.get('project_version', '?')}); this runtime reads versions {MANIFEST_VERSION} and "
                           f"{STATE_MANIFEST_VERSION}: re-export with this version's dflash2 export")
    m: ExportManifest = _decode(ExportManifest, data, "manifest")
    _check_layer_kinds(m, where)
    if m.dtype not in DTYPES:
        raise DFlash2Error(f"manifest.dtype must be one of {', '.join(DTYPES)}, got {m.dtype!r}")
    for name, kinds in (("quantization", QUANTIZATIONS), ("drafter_quantization", DRAFTER_QUANTIZATIONS)):
        if getattr(m, name).kind not in kinds:
            raise DFlash2Error(f"manifest.{name}.kind must be one of {', '.join(kinds)}, got {getattr(m, name).kind!r}")
    for g in REQUIRED_GRAPHS:
        if g not in m.graphs:
            raise DFlash2Error(f"{where} lists no {g!r} graph")
    for key, g in m.graphs.items():
        if g.selector is not None and g.selector not in SELECTOR_IMPLS:
            raise DFlash2Error(f"manifest.graphs.{key}.selector must be one of {', '.join(SELECTOR_IMPLS)} or null, "
                               f"got {g.selector!r}")
        if g.flavour is not None and g.flavour not in GRAPH_FLAVOURS:
            raise DFlash2Error(f"manifest.graphs.{key}.flavour must be one of {', '.join(GRAPH_FLAVOURS)} or null, "
                               f"got {g.flavour!r}")
        if g.mode is not None and g.mode not in DRAFT_MODES:
            raise DFlash2Error(f"manifest.graphs.{key}.mode must be one of {', '.join(DRAFT_MODES)}, got {g.mode!r}")
    if not 0 <= m.draft_vocab <= m.target.vocab_size:
        raise DFlash2Error(f"manifest.draft_vocab must be in [0, {m.target.vocab_size}], got {m.draft_vocab}")
    if m.max_seq_len < 1 or m.kv_capacity_step < 1:
        raise DFlash2Error("manifest.max_seq_len and manifest.kv_capacity_step must be >= 1")
    cfg = m.drafter_config  # DFlash2Error naming the config field when the drafter entry is bad
    ls = m.target.linear_state
    if ls is not None and ls.max_rows_per_call < cfg.block_size:
        raise DFlash2Error(f"{where}: target.linear_state.max_rows_per_call is {ls.max_rows_per_call} but the "
                           f"drafter's block size is {cfg.block_size}: a verify would not be one graph call, and "
                           f"could not be rolled back")
    for key, g in m.graphs.items():  # the drafter's hidden states [B, block_size, H] fit its block size
        for t in (*g.inputs, *g.outputs):
            if t.name == BLOCK_HIDDEN and len(t.shape) == 3 and isinstance(t.shape[1], int) and \
                    t.shape[1] != cfg.block_size:
                raise DFlash2Error(f"{where}: graph {key!r} has {t.name} of {t.shape[1]} rows but the drafter's "
                                   f"block size is {cfg.block_size} (graphs of another export?)")
    if cfg.vocab_size != m.target.vocab_size or cfg.target_hidden_size != m.target.hidden_size:
        raise DFlash2Error(f"{where}: drafter (vocab {cfg.vocab_size}, target hidden {cfg.target_hidden_size}) "
                           f"does not fit the target (vocab {m.target.vocab_size}, hidden {m.target.hidden_size})")
    if not 2 <= m.max_seq_len <= m.target.max_positions:
        raise DFlash2Error(f"{where}: max_seq_len is {m.max_seq_len} but the target's max_positions is "
                           f"{m.target.max_positions}")
    check_graph_fields(m, where)
    return m


def _check_layer_kinds(m: ExportManifest, where: str) -> None:
    """The target's layer kinds fit its layer count and the manifest version; linear layers come with their state."""
    kinds = m.target.layer_kinds
    if kinds and (len(kinds) != m.target.num_layers or any(k not in LAYER_KINDS for k in kinds)):
        raise DFlash2Error(f"{where}: target.layer_kinds must list one of {', '.join(LAYER_KINDS)} per layer "
                           f"({m.target.num_layers}), got {list(kinds)}")
    version = MANIFEST_VERSION if m.kv_only else STATE_MANIFEST_VERSION
    if m.manifest_version != version:
        raise DFlash2Error(f"{where}: manifest_version is {m.manifest_version} but a target with layer kinds "
                           f"{sorted(set(m.layer_kinds))} is version {version}")
    if ("linear" in m.layer_kinds) != (m.target.linear_state is not None):
        raise DFlash2Error(f"{where}: target.linear_state must be given exactly when the target has linear layers")
    sw = m.target.sliding_window
    if ("sliding" in m.layer_kinds) != (sw is not None):
        raise DFlash2Error(f"{where}: target.sliding_window must be given exactly when the target has sliding layers")
    if sw is not None and not 1 <= sw.window <= sw.ring_slots:
        raise DFlash2Error(f"{where}: target.sliding_window needs 1 <= window <= ring_slots, got {sw}")
    if "attention" not in m.layer_kinds:
        raise DFlash2Error(f"{where}: the target has no full attention layer (the export's graphs need one)")


def graph_field_rules(m: ExportManifest) -> list[tuple[str, int, str, int]]:
    """What the graphs' inputs and outputs state about the manifest's fields, as rules (tensor name pattern, dim,
    field, value): a tensor matching the pattern (``{i}``: a layer index) has ``value`` at ``dim`` (negative:
    from the end) where its shape fixes that dim. The C API applies the same rules (runtime/src/manifest.cpp)."""
    t, cfg = m.target, m.drafter_config
    return [
        ("past_key_values.{i}.*", 1, "target.num_key_value_heads", t.num_key_value_heads),
        ("past_key_values.{i}.*", 3, "target.head_dim", t.head_dim),
        ("present.{i}.*", 1, "target.num_key_value_heads", t.num_key_value_heads),
        ("present.{i}.*", 3, "target.head_dim", t.head_dim),
        ("context.{i}.*", 1, "drafter.num_key_value_heads", cfg.num_key_value_heads),
        ("context.{i}.*", 3, "drafter.head_dim", int(cfg.head_dim or 0)),
        ("context_features", -1, "target.hidden_size x len(target.layer_ids)", t.hidden_size * len(t.layer_ids)),
        (BLOCK_HIDDEN, -1, "drafter.hidden_size", cfg.hidden_size),
    ] + _linear_state_rules(t.linear_state)


def _linear_state_rules(ls: LinearStateSpec | None) -> list[tuple[str, int, str, int]]:
    """:func:`graph_field_rules` of the linear layers' state tensors (none without linear layers)."""
    if ls is None:
        return []
    f = "target.linear_state."
    return [("past_conv.{i}", 1, f + "conv_dim", ls.conv_dim), ("past_conv.{i}", 2, f + "conv_kernel - 1",
                                                                ls.conv_kernel - 1),
            ("present_conv.{i}", 1, f + "conv_dim", ls.conv_dim),
            *((name, dim + off, f + key, getattr(ls, key)) for name, off in (("past_recurrent.{i}", 0),
                                                                             ("present_recurrent.{i}", 1))
              for dim, key in ((1, "num_heads"), (2, "key_dim"), (3, "value_dim")))]


def check_graph_fields(m: ExportManifest, where: str = MANIFEST_FILE) -> None:
    """Every field of the manifest that its graphs' inputs and outputs also state agrees with them: the layer counts
    (one ``past_key_values.{i}`` / ``present.{i}`` pair per attention layer of the target, one state pair per linear
    layer, one ``context.{i}`` per drafter layer),
    heads, head size, feature width, hidden size, the target's vocabulary (its logits) -> DFlash2Error naming the
    field and both values (an edited manifest, or graphs of another export)."""
    import re

    attention = {i for i, k in enumerate(m.layer_kinds) if k in ("attention", "sliding")}
    linear = {i for i, k in enumerate(m.layer_kinds) if k == "linear"}
    if m.target.layer_kinds:
        att = (f"target.layer_kinds has {len(attention)} attention layers", attention)
        lin = (f"target.layer_kinds has {len(linear)} linear layers", linear)
    else:
        att = lin = (f"target.num_layers is {m.target.num_layers}", attention)
    n_ctx = m.drafter_config.num_hidden_layers
    layers = {"past_key_values": att, "present": att, "past_conv": lin, "past_recurrent": lin, "present_conv": lin,
              "present_recurrent": lin, "context": (f"drafter.num_hidden_layers is {n_ctx}", set(range(n_ctx)))}
    rules = graph_field_rules(m)
    for key, g in m.graphs.items():
        seen: dict[str, set[int]] = {}
        for t in (*g.inputs, *g.outputs):
            kv = re.fullmatch(r"(past_key_values|present|context)\.(\d+)\.(key|value)", t.name)
            state = re.fullmatch(r"(past_conv|past_recurrent|present_conv|present_recurrent)\.(\d+)", t.name)
            if kv or state:
                found = kv or state
                seen.setdefault(found[1], set()).add(int(found[2]))
            pattern = f"{kv[1]}.{{i}}.*" if kv else f"{state[1]}.{{i}}" if state else t.name
            checks = [(dim, field_, want) for p, dim, field_, want in rules if p == pattern]
            if t.name == "logits" and g.role == "target":
                checks.append((-1, "target.vocab_size", m.target.vocab_size))
            for dim, field_, want in checks:
                have = t.shape[dim] if -len(t.shape) <= dim < len(t.shape) else None
                if isinstance(have, int) and have != want:
                    raise DFlash2Error(f"{where}: {field_} is {want} but graph {key!r} has {t.name} of "
                                       f"{have} at dim {dim % len(t.shape)}")
        for prefix, ids in seen.items():
            field_, want = layers[prefix]
            if ids != want:
                raise DFlash2Error(f"{where}: {field_} but graph {key!r} has {prefix} tensors for {len(ids)} layers")


def parse_engine_set(data: Any) -> EngineSet:
    """An ``engines`` entry from JSON-like data (dataclasses inside are fine), validated like the reader does."""
    return _decode(EngineSet, _encode(data), "manifest.engines")


def export_folder(model_dir: str | Path) -> Path:
    """``model_dir`` as a Path when it is a folder holding a manifest, else DFlash2Error saying which it lacks."""
    d = Path(model_dir)
    if not d.is_dir():
        raise DFlash2Error(f"model folder not found: {d}")
    if not (d / MANIFEST_FILE).is_file():
        raise DFlash2Error(f"{d} has no {MANIFEST_FILE}: not a dflash2 export folder (run dflash2 export)")
    return d


def read_manifest(model_dir: str | Path, verify_checksums: bool = True) -> ExportManifest:
    """Read and validate DIR/manifest.json; with ``verify_checksums`` every listed file is hashed.

    Raises :class:`DFlash2Error` for a missing folder or file, invalid JSON, another format or manifest
    version, a bad field (named), a missing graph, or a checksum mismatch (naming the file).
    """
    d = export_folder(model_dir)
    mf = d / MANIFEST_FILE
    try:
        data = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlash2Error(f"{mf} is not valid JSON (corrupt manifest): {e}") from None
    m = parse_manifest(data, str(mf))
    for rel in m.files:
        if not (d / rel).is_file():
            raise DFlash2Error(f"{d / rel} is missing (listed in the manifest)")
    for g in m.graphs.values():
        if g.file not in m.files:
            raise DFlash2Error(f"graph file {g.file} has no checksum in the manifest")
    if verify_checksums:
        for rel, digest in m.files.items():
            if sha256_file(d / rel) != digest:
                raise DFlash2Error(f"checksum mismatch for {d / rel}: the file was changed or corrupted "
                                   f"after export (re-export the model)")
    return m


# ----------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(model_dir: Path, manifest: ExportManifest, rehash: bool = True) -> ExportManifest:
    """Write DIR/manifest.json atomically and return what was written.

    ``rehash``: ``files`` becomes the sha256 of every file in the folder (but the manifest); otherwise the
    given ``files`` are kept (callers that add files update them themselves)."""
    model_dir = Path(model_dir)
    if rehash:
        files = {p.relative_to(model_dir).as_posix(): sha256_file(p) for p in sorted(model_dir.rglob("*"))
                 if p.is_file() and p.name != MANIFEST_FILE}
        manifest = dataclasses.replace(manifest, files=files)
    text = json.dumps(manifest.to_json(), indent=2) + "\n"
    parse_manifest(json.loads(text))  # never write what the reader would refuse
    fd, tmp = tempfile.mkstemp(dir=model_dir, prefix=".manifest-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a server running as another user reads it
        os.replace(tmp, model_dir / MANIFEST_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return manifest
