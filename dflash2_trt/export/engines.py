"""TensorRT engines for an export folder: ``dflash2 build-engines DIR`` (or ``dflash2 export ... --engines``).

    dflash2 build-engines DIR [--plugin LIB] [--selector plugin|decomposed|both] [--max-batch N]
                              [--weak-typing] [--tf32] [--workspace-gib N] [--prefill-rows N] [--quiet]

Each graph is parsed by the TensorRT ONNX parser *from its file* (so ``weights.bin`` resolves) after
``libdflash2_plugins.so`` is loaded into the plugin registry, and built into a plan::

    DIR/engines-<id>/target.plan                  profiles: prefill (rows 1..P), step (rows 1..bs); batch 1..N
                                                  (+ the linear layers' state inputs of a hybrid target, see below)
    DIR/engines-<id>/drafter_context.plan         profiles: prefill (rows 1..P), step (rows 1..bs)
    DIR/engines-<id>/drafter_block.plan           profile:  step (context capacity step..max)
    DIR/engines-<id>/drafter_head_{mode}[_plugin].plan   plugin variant by default; decomposed on request
    DIR/engines-<id>/libdflash2_plugins.so        the plugin library the engines were built with
    DIR/engines-<id>/timing.cache                 TensorRT timing cache (carried over to the next build)

Batch: the target engine's profiles take 1..N sequences per call, N = ``--max-batch`` (default 1: today's
B = 1 engines), tuned (opt) at N for the step profile (a loaded server's verify / plain steps) and at 1 for the
prefill profile; the sequences of one call share the capacity dim (each has its own valid length through
``attention_mask``: ragged caches). The drafter engines stay at batch 1: the runtimes draft per sequence (the C
API's batched TensorRT runner runs one B = 1 drafter per slot). N is recorded in the manifest as the profiles'
``batch`` dim ``[1, opt, N]`` (``EngineSet.max_batch`` reads it back), so manifests without the option stay
valid. Capacity dims run from the manifest's ``kv_capacity_step`` to ``max_seq_len`` rounded up to it;
P = ``--prefill-rows`` (default 256).

A target with linear layers (hybrid, manifest version 3) also takes each linear layer's state, ``past_conv.{i}``
[B, conv_dim, K - 1] and ``past_recurrent.{i}`` [B, heads, dk, dv] (fixed but for B: the shapes of
``target.linear_state``), and ``state_rows`` [R], the rows whose recurrent state the call returns. Its prefill
profile runs at most ``linear_state.max_rows_per_call`` rows (the graph's row limit; P above it is lowered to it) and
asks for the last row's state only (R = 1: a prompt is never rolled back); its step profile asks for every row (R
1..bs, a verify). The precision rules are the dense targets': the export refuses bf16 and ``--quantize`` for such a
target, and so does this build.

A target with sliding layers (gpt-oss, Muse Glimmer; manifest version 3) takes each sliding layer's past K/V over its
ring, [B, kv heads, ring_slots, d], and ``window_positions`` [B, ring_slots]: the ``ring_slots`` dim is fixed at
``target.sliding_window.ring_slots`` in both profiles.

Precision comes from the ONNX types: networks are strongly typed (TensorRT 11 always is; on 10.x the
STRONGLY_TYPED creation flag is set). ``--weak-typing`` (10.x only) instead enables the builder flag that
matches the export dtype (FP16 / BF16). TF32 is switched off unless ``--tf32`` (fp32 exports must match ONNX
Runtime token for token).

Manifest entry ``engines`` (written atomically with the new files' checksums; the previous engines folder is
removed only after the new manifest is in place, so the ONNX export is valid at every moment)::

    {"dir", "tensorrt_version", "gpu": {"name", "compute_capability"}, "cuda": {"driver", "runtime"},
     "plugin": {"file", "sha256", "source"} | null, "selector", "strongly_typed", "tf32", "dtype",
     "prefill_rows", "timing_cache", "plans": {graph key: {"file", "profiles": [{"name", "dims"}], "build_s"}}}

Without TensorRT (or a GPU) it stops with one line (exit 1) and leaves the folder untouched.
Status: the build path has **never run** (no TensorRT libraries on the machines this was written on); the
profile table, precision plan, CLI and failure paths are tested on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dflash2_trt import validate as V
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import (TARGET_STATE_ROWS, EnginePlan, EngineProfile, EngineSet, ExportManifest, GraphSpec,
                                 parse_engine_set, read_manifest, sha256_file, write_manifest)
from dflash2_trt.outdir import clean_stale_engines, lock_folder
from dflash2_trt.runtime.trt.cuda_api import CudaApi
from dflash2_trt.runtime.trt.env import (PLUGIN_ENV, current_identity, import_tensorrt, load_plugin_library,
                                         version_tuple)
from dflash2_trt.vocabulary import DTYPES, ENGINE_SELECTORS, SELECTOR_MODES, head_key

if TYPE_CHECKING:
    import tensorrt as trt

DEFAULT_PREFILL_ROWS = 256
DEFAULT_MAX_BATCH = 1
PLUGIN_NAME = "libdflash2_plugins.so"
_REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------
# Pure parts (tested on the CPU)
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionPlan:
    strongly_typed: bool
    set_flags: tuple[str, ...]  # BuilderFlag names to set
    clear_flags: tuple[str, ...]  # BuilderFlag names to clear (when the version has them)


def precision_plan(trt_version: str, dtype: str, weak_typing: bool = False, tf32: bool = False) -> PrecisionPlan:
    """Builder settings that give the engines the export's precision on this TensorRT version."""
    v = version_tuple(trt_version)
    if dtype not in DTYPES:
        raise DFlash2Error(f"export dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    clear = () if tf32 else ("TF32",)
    if v[:1] >= (11,):
        if weak_typing:
            raise DFlash2Error(f"TensorRT {trt_version} networks are always strongly typed: --weak-typing needs "
                               f"TensorRT 10.x")
        return PrecisionPlan(True, (), clear)
    if not weak_typing:
        return PrecisionPlan(True, (), clear)
    return PrecisionPlan(False, {"fp32": (), "fp16": ("FP16",), "bf16": ("BF16",)}[dtype], clear)


def graph_keys(manifest: ExportManifest, selector: str) -> list[str]:
    """The graphs to build: target, drafter context and block, and the heads of the chosen variant(s)."""
    if selector not in ENGINE_SELECTORS:
        raise DFlash2Error(f"--selector must be one of {', '.join(ENGINE_SELECTORS)}, got {selector!r}")
    if head_key(SELECTOR_MODES[0]) not in manifest.graphs:
        raise DFlash2Error("TensorRT engines for drafters without the candidate selector (DFlash v1) are not built "
                           "yet; run this export with ONNX Runtime (--backend ort --no-selector)")
    keys = ["target", "drafter_context", "drafter_block"]
    for mode in SELECTOR_MODES:
        if selector in ("plugin", "both"):
            keys.append(head_key(mode, plugin=True))
        if selector in ("decomposed", "both"):
            keys.append(head_key(mode))
    missing = [k for k in keys if k not in manifest.graphs]
    if missing:
        raise DFlash2Error(f"the export has no {', '.join(missing)} graph(s)")
    return keys


def source_graph(manifest: ExportManifest, key: str) -> str:
    """The graph an engine is built from: a quantized export's target engine from its Q/DQ flavour
    (``target_qdq``: int4/int8 weights behind DequantizeLinear, TensorRT's weight-only GEMMs), else ``key``."""
    from dflash2_trt.export.quantize import QDQ_KEY

    return QDQ_KEY if key == "target" and QDQ_KEY in manifest.graphs else key


#: the cache length TensorRT tunes the capacity dims at (profile opt): a typical request's prompt + output,
#: not the smallest bucket (tactics picked for 256 positions can be slow at the lengths requests run at)
TYPICAL_POSITIONS = 1024


def profiles_for(manifest: ExportManifest, key: str, prefill_rows: int,
                 max_batch: int = DEFAULT_MAX_BATCH) -> list[EngineProfile]:
    """Optimization profiles of one graph as named dim ranges ``{dim: (min, opt, max)}``. Capacity dims: min one
    ``kv_capacity_step`` bucket, opt the bucket holding ``TYPICAL_POSITIONS`` (at most the exported capacity).
    Batch: the target's 1..max_batch (opt max_batch for steps, 1 for prefills); every other graph's 1."""
    if int(max_batch) < 1:
        raise DFlash2Error(f"--max-batch must be >= 1, got {max_batch}")
    bs = manifest.block_size
    step = manifest.kv_capacity_step
    P = max(bs, min(int(prefill_rows), manifest.max_seq_len))
    batch = (1, 1, 1)
    nb = int(max_batch)
    typical = min(manifest.max_capacity, -(-TYPICAL_POSITIONS // step) * step)
    capacity = (step, typical, manifest.max_capacity)
    role = manifest.graphs[key].role
    if role == "target":
        def tgt(rows: tuple[int, int, int], b: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
            return {"batch": b, "sequence": rows, "capacity": capacity,
                    "capacity_plus_sequence": tuple(capacity[i] + rows[i] for i in range(3))}
        linear = manifest.target.linear_state is not None
        rows = min(P, linear_row_limit(manifest)) if linear else P
        prefill, verify = tgt((1, max(1, rows // 2), rows), (1, 1, nb)), tgt((1, bs, bs), (1, nb, nb))
        if linear:  # state_rows [R]: a prefill chunk asks for its last row's state, a verify for every row's
            R = state_rows_dim(manifest.graphs[key])
            prefill[R], verify[R] = (1, 1, 1), (1, bs, bs)
        sw = manifest.target.sliding_window
        if sw is not None:  # the sliding layers' rings and window_positions: the ring's fixed size
            for profile in (prefill, verify):
                profile[RING_SLOTS] = (sw.ring_slots,) * 3
        return [EngineProfile("prefill", prefill), EngineProfile("step", verify)]
    if role == "drafter_context":
        return [EngineProfile("prefill", {"batch": batch, "rows": (1, max(1, P // 2), P)}),
                EngineProfile("step", {"batch": batch, "rows": (1, bs, bs)})]
    if role == "drafter_block":
        return [EngineProfile("step", {"batch": batch, "context_capacity": capacity})]
    return [EngineProfile("step", {"batch": batch})]


RING_SLOTS = "ring_slots"  # the dynamic dim of a sliding layer's past K/V and of window_positions (targets.sliding)


def linear_row_limit(manifest: ExportManifest) -> int:
    """Rows of one call of a target graph with linear layers (``target.linear_state.max_rows_per_call``): its
    prefill profile stops there, and a verify of the block size must fit, else DFlash2Error."""
    ls = manifest.target.linear_state
    assert ls is not None
    if manifest.block_size > ls.max_rows_per_call:
        raise DFlash2Error(f"block size {manifest.block_size} exceeds the target graph's {ls.max_rows_per_call} rows "
                           f"per call (target.linear_state.max_rows_per_call): a verify could not be rolled back")
    return ls.max_rows_per_call


def state_rows_dim(graph: GraphSpec) -> str:
    """The name of the dynamic dim R of a target graph's ``state_rows`` [R] input (as the manifest records it)."""
    for t in graph.inputs:
        if t.name == TARGET_STATE_ROWS and len(t.shape) == 1 and isinstance(t.shape[0], str):
            return t.shape[0]
    raise DFlash2Error(f"{graph.file}: a target with linear layers needs a {TARGET_STATE_ROWS} [R] input of dynamic "
                       f"R (re-export)")


def check_precision(manifest: ExportManifest) -> None:
    """The export's refusals hold for its engines too: a target with linear layers builds at fp32 or fp16 and
    unquantized only (its graphs are verified at those), else DFlash2Error."""
    if "linear" in manifest.layer_kinds and (manifest.dtype == "bf16" or manifest.quantization.kind != "none"):
        raise DFlash2Error(f"a target with linear layers builds from fp32 or fp16 exports without quantization, "
                           f"this export is {manifest.dtype} with quantization {manifest.quantization.kind!r} "
                           f"(re-export it)")


def input_shapes(graph: GraphSpec, dims: dict[str, tuple[int, ...]]
                 ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shape of every graph input from the profile's named dims (manifest I/O shapes)."""
    out = {}
    for inp in graph.inputs:
        lo, opt, hi = [], [], []
        for d in inp.shape:
            if isinstance(d, int):
                r: tuple[int, ...] = (d, d, d)
            elif d in dims:
                r = dims[d]
            else:
                raise DFlash2Error(f"input {inp.name} has a dynamic dimension {d!r} that no optimization "
                                   f"profile covers (known: {', '.join(sorted(dims))})")
            lo.append(int(r[0]))
            opt.append(int(r[1]))
            hi.append(int(r[2]))
        out[inp.name] = (tuple(lo), tuple(opt), tuple(hi))
    return out


def find_plugin_library(explicit: str | Path | None = None) -> Path | None:
    """--plugin, else $DFLASH2_PLUGIN_LIB, else build/lib/ or build/*/lib/ of the working folder or repo."""
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise DFlash2Error(f"--plugin {p}: no such file")
        return p
    env = os.environ.get(PLUGIN_ENV)
    if env:
        if not Path(env).is_file():
            raise DFlash2Error(f"${PLUGIN_ENV}={env}: no such file")
        return Path(env)
    for root in (Path.cwd(), _REPO):
        for cand in [root / "build" / "lib" / PLUGIN_NAME, *sorted(root.glob(f"build/*/lib/{PLUGIN_NAME}"))]:
            if cand.is_file():
                return cand
    return None


# ----------------------------------------------------------------------------------------------------
# Build (needs TensorRT and a GPU)
# ----------------------------------------------------------------------------------------------------


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _parser_errors(parser: Any) -> str:
    errs = []
    for i in range(int(parser.num_errors)):
        e = parser.get_error(i)
        errs.append(str(e.desc()) if hasattr(e, "desc") else str(e))
    return "; ".join(errs)[:600] or "unknown parser error"


def _build_one(trt_mod: Any, logger: trt.ILogger, onnx_path: Path, graph: GraphSpec,
               profiles: list[EngineProfile], plan: PrecisionPlan, cache_blob: bytes | None,
               shared: dict[str, Any], workspace: int | None) -> bytes:
    builder: trt.Builder = trt_mod.Builder(logger)
    flags = 0
    if plan.strongly_typed and hasattr(trt_mod.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt_mod.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network: trt.INetworkDefinition = builder.create_network(flags)
    parser: trt.OnnxParser = trt_mod.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise DFlash2Error(f"TensorRT's ONNX parser rejected {onnx_path.name}: {_parser_errors(parser)}")
    config: trt.IBuilderConfig = builder.create_builder_config()
    for name in plan.set_flags:
        config.set_flag(getattr(trt_mod.BuilderFlag, name))
    for name in plan.clear_flags:
        if hasattr(trt_mod.BuilderFlag, name):
            config.clear_flag(getattr(trt_mod.BuilderFlag, name))
    if hasattr(config, "max_aux_streams"):
        # everything on the caller's one stream: a failed stream capture then cannot leave TensorRT's
        # auxiliary streams capturing, and the runtime's "one stream, in order" scratch sharing holds
        config.max_aux_streams = 0
    if workspace:
        config.set_memory_pool_limit(trt_mod.MemoryPoolType.WORKSPACE, workspace)
    if "cache" not in shared:  # one timing cache object for every engine of this build
        cache = config.create_timing_cache(cache_blob or b"")
        if not config.set_timing_cache(cache, False):  # the old cache belongs to another GPU / version
            cache = config.create_timing_cache(b"")
            config.set_timing_cache(cache, False)
        shared["cache"] = cache
    else:
        config.set_timing_cache(shared["cache"], False)
    for p in profiles:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in input_shapes(graph, p.dims).items():
            prof.set_shape(name, trt_mod.Dims(lo), trt_mod.Dims(opt), trt_mod.Dims(hi))
        if config.add_optimization_profile(prof) < 0:
            raise DFlash2Error(f"{onnx_path.name}: TensorRT refused optimization profile {p.name!r}")
    ser = builder.build_serialized_network(network, config)
    if ser is None:
        raise DFlash2Error(f"TensorRT could not build an engine from {onnx_path.name} (see the TensorRT log above)")
    return bytes(memoryview(ser))


def build_engines(model_dir: str | Path, *, plugin: str | Path | None = None, selector: str = "plugin",
                  weak_typing: bool = False, tf32: bool = False, workspace_gib: float | None = None,
                  prefill_rows: int = DEFAULT_PREFILL_ROWS, max_batch: int = DEFAULT_MAX_BATCH,
                  progress: bool = True, trt_module: ModuleType | None = None,
                  api: CudaApi | None = None) -> EngineSet:
    """Build the engines of an export folder and record them in its manifest; returns the ``engines`` entry.
    ``max_batch``: sequences per target engine call (its profiles' batch dim 1..max_batch).
    Raises DFlash2Error (folder untouched) when TensorRT, a GPU or the plugin library is missing."""
    d = Path(model_dir)
    manifest = read_manifest(d, verify_checksums=True)
    check_precision(manifest)
    clean_stale_engines(d)  # an interrupted build's folder: never listed, so no longer "ours" to replace freely
    keys = graph_keys(manifest, selector)
    if prefill_rows < 1:
        raise DFlash2Error(f"--prefill-rows must be >= 1, got {prefill_rows}")
    if max_batch < 1:
        raise DFlash2Error(f"--max-batch must be >= 1, got {max_batch}")
    trt_mod: Any = trt_module if trt_module is not None else import_tensorrt()
    if api is None:
        from dflash2_trt.runtime.trt.cuda_api import CudaRuntime

        api = CudaRuntime()
    ident = current_identity(trt_mod.__version__, api.device_info())
    plugin_path = None
    if any(manifest.graphs[k].selector == "plugin" for k in keys):
        plugin_path = find_plugin_library(plugin)
        if plugin_path is None:
            raise DFlash2Error(f"the plugin variant needs {PLUGIN_NAME}: build it (cmake -S . -B build && cmake "
                               f"--build build, see plugins/pathSelector/README.md), pass --plugin or set "
                               f"${PLUGIN_ENV}; or build --selector decomposed")
    plan = precision_plan(trt_mod.__version__, manifest.dtype, weak_typing, tf32)
    logger = trt_mod.Logger(trt_mod.Logger.WARNING)
    if plugin_path is not None:
        load_plugin_library(trt_mod, plugin_path, manifest.plugin)
    old = manifest.engines
    cache_blob = None
    if old is not None and old.timing_cache and (d / old.timing_cache).is_file():
        cache_blob = (d / old.timing_cache).read_bytes()
    name = f"engines-{uuid.uuid4().hex[:8]}"
    tmp = d / f".{name}.tmp"
    tmp.mkdir()
    lock = lock_folder(tmp)  # a live build is not stale
    try:
        shared: dict[str, Any] = {}
        plans: dict[str, EnginePlan] = {}
        for i, key in enumerate(keys):
            g = manifest.graphs[source_graph(manifest, key)]
            profiles = profiles_for(manifest, key, prefill_rows, max_batch)
            t0 = time.perf_counter()
            if progress:
                print(f"dflash2: building {key} ({i + 1}/{len(keys)})", file=sys.stderr, flush=True)
            blob = _build_one(trt_mod, logger, d / g.file, g, profiles, plan, cache_blob, shared,
                              int(workspace_gib * (1 << 30)) if workspace_gib else None)
            _atomic_write(tmp / f"{key}.plan", blob)
            plans[key] = EnginePlan(f"{name}/{key}.plan", tuple(profiles), round(time.perf_counter() - t0, 2))
        _atomic_write(tmp / "timing.cache", bytes(memoryview(shared["cache"].serialize())))
        plug_entry = None
        if plugin_path is not None:
            shutil.copy2(plugin_path, tmp / PLUGIN_NAME)
            plug_entry = {"file": f"{name}/{PLUGIN_NAME}", "sha256": sha256_file(tmp / PLUGIN_NAME),
                          "source": str(plugin_path.resolve())}
        entry = parse_engine_set({"dir": name, **ident, "plugin": plug_entry, "selector": selector,
                                  "strongly_typed": plan.strongly_typed, "tf32": tf32, "dtype": manifest.dtype,
                                  "prefill_rows": prefill_rows, "timing_cache": f"{name}/timing.cache",
                                  "plans": plans})
        tmp.rename(d / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)
    try:
        update_manifest_engines(d, entry)
    except BaseException:
        shutil.rmtree(d / name, ignore_errors=True)
        raise
    if old is not None and old.dir != name:
        shutil.rmtree(d / old.dir, ignore_errors=True)
    return entry


def update_manifest_engines(model_dir: Path, entry: EngineSet | None) -> ExportManifest:
    """Replace the manifest's ``engines`` entry (None removes it) and the checksums of the files it lists,
    atomically. Other checksums are kept as they are (no rehash of the ONNX export)."""
    m = read_manifest(model_dir, verify_checksums=False)
    old = m.engines
    files = {k: v for k, v in m.files.items() if not (old is not None and k.startswith(f"{old.dir}/"))}
    if entry is not None:
        for p in sorted((model_dir / entry.dir).rglob("*")):
            if p.is_file():
                files[p.relative_to(model_dir).as_posix()] = sha256_file(p)
    return write_manifest(model_dir, dataclasses.replace(m, engines=entry, files=files), rehash=False)


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", default=None, help=f"{PLUGIN_NAME} (default: ${PLUGIN_ENV}, else build/lib/)")
    p.add_argument("--selector", choices=ENGINE_SELECTORS, default="plugin",
                   help="drafter head variant(s) to build (default: the plugin)")
    p.add_argument("--weak-typing", action="store_true", help="TensorRT 10.x: precision flags instead of strong typing")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 exports (not token-exact)")
    p.add_argument("--workspace-gib", type=V.POSITIVE_NUMBER, default=None, help="builder workspace limit")
    p.add_argument("--prefill-rows", type=V.COUNT, default=DEFAULT_PREFILL_ROWS, help="max rows per prefill chunk")
    p.add_argument("--max-batch", type=V.COUNT, default=DEFAULT_MAX_BATCH,
                   help="sequences per target engine call (batched decoding; default 1)")


def run_build(model_dir: str | Path, a: argparse.Namespace, prog: str = "dflash2") -> int:
    """Build and print one line; DFlash2Error -> one line on stderr, exit 1 (the ONNX export stays intact)."""
    try:
        e = build_engines(model_dir, plugin=a.plugin, selector=a.selector, weak_typing=a.weak_typing, tf32=a.tf32,
                          workspace_gib=a.workspace_gib, prefill_rows=a.prefill_rows, max_batch=a.max_batch,
                          progress=not a.quiet)
    except DFlash2Error as err:
        print(f"{prog}: error: engines not built: {err} (the ONNX export in {model_dir} is intact)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (the ONNX export in {model_dir} is intact)", file=sys.stderr)
        return 1
    batch = f", target batch 1..{e.max_batch}" if e.max_batch > 1 else ""
    print(f"built {len(e.plans)} TensorRT engines (TensorRT {e.tensorrt_version}, {e.gpu.name}{batch}) "
          f"in {Path(model_dir) / e.dir}")
    return 0
