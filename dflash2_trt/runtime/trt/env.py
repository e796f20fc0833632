"""The TensorRT environment: importing TensorRT, versions, the target layer kinds the engines run, what an engine
set is tied to (TensorRT version, GPU, plugin library) and where the plugin library is. Shared by ``dflash2
build-engines`` (:mod:`dflash2_trt.export.engines`) and the TensorRT backend; no backend lives here.

Imports TensorRT lazily (:func:`import_tensorrt`); everything else is the standard library.
"""

from __future__ import annotations

import importlib
import os
import threading
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

from dflash2_trt.manifest import EngineSet, ExportManifest, PluginSpec, sha256_file
from dflash2_trt.runtime.protocol import BackendUnavailable
from dflash2_trt.runtime.trt.cuda_api import DeviceInfo

MIN_TRT = (10, 3)
SUPPORTED_TRT_MAJORS = (10, 11)  # the plugin library is built for one of these (plugins/CMakeLists.txt)
PLUGIN_ENV = "DFLASH2_PLUGIN_LIB"

# Plugin libraries registered in this process, per tensorrt module (one in real use; the CPU tests' fakes
# each have their own registry): sha256 -> path. TensorRT's registry is process-wide and
# IPluginRegistry::loadLibrary returns nullptr (Python: None) when any creator of the library is already
# registered — by an earlier load_library of the same file or of a copy (build-engines copies the library
# next to the engines), or by the library's own load-time registration. So a second backend in one process
# must not treat None as failure: the record and a creator look-up decide.
_LOADED_PLUGINS: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
_PLUGIN_LOCK = threading.Lock()


def import_tensorrt() -> ModuleType:
    """The real ``tensorrt`` module, or :class:`BackendUnavailable`. ``tensorrt-stubs`` alone leaves an empty
    namespace package named ``tensorrt`` behind: that counts as not installed."""
    try:
        mod = importlib.import_module("tensorrt")
    except ImportError as e:
        raise BackendUnavailable(f"TensorRT is not installed ({e.msg}): install TensorRT >= 10.3 for this GPU "
                                 f"(pip install tensorrt, or JetPack 6.2 on Jetson)") from None
    except OSError as e:  # the wheel is there but libnvinfer cannot load
        raise BackendUnavailable(f"TensorRT cannot load its libraries: {e}") from None
    if not hasattr(mod, "Builder") or not isinstance(getattr(mod, "__version__", None), str):
        raise BackendUnavailable("TensorRT is not installed (only type stubs or a placeholder package named "
                                 "'tensorrt' were found): install TensorRT >= 10.3 for this GPU")
    v = version_tuple(mod.__version__)
    if v[:2] < MIN_TRT:
        raise BackendUnavailable(f"TensorRT {mod.__version__} is too old: >= {MIN_TRT[0]}.{MIN_TRT[1]} is needed "
                                 f"(JetPack 6.2 ships 10.3)")
    if v[0] not in SUPPORTED_TRT_MAJORS:
        raise BackendUnavailable(f"TensorRT {mod.__version__} is not supported: this release supports TensorRT "
                                 f"{' and '.join(map(str, SUPPORTED_TRT_MAJORS))} (pip install "
                                 f"'dflash2-trt[trt]' or '[trt11]')")
    return mod


def _creator_registered(registry: Any, spec: PluginSpec) -> bool:
    try:
        return registry.get_creator(spec.op_type, spec.plugin_version, spec.plugin_namespace) is not None
    except (RuntimeError, TypeError):  # older bindings without the V3 look-up answer "not found" this way
        return False


def load_plugin_library(trt_mod: Any, path: str | Path, spec: PluginSpec) -> None:
    """Register the DFlash2 plugin library ``path`` (whose creator is the manifest's ``spec``: op type,
    plugin version and namespace) with TensorRT's process-wide plugin registry, once.

    Idempotent across backends and builds in one process. Raises :class:`BackendUnavailable` when TensorRT
    cannot load it, or when a *different* build of the library (another sha256) is already registered in
    this process (TensorRT would silently run the engines with the other build's creator)."""
    p = Path(path)
    digest = sha256_file(p)
    with _PLUGIN_LOCK:
        loaded = _LOADED_PLUGINS.setdefault(trt_mod, {})
        if digest in loaded:
            return
        if loaded:
            other = next(iter(loaded.values()))
            raise BackendUnavailable(f"another build of the DFlash2 plugin library ({other}) is already loaded in "
                                     f"this process; TensorRT cannot load {p} beside it (use one library per "
                                     f"process)")
        registry = trt_mod.get_plugin_registry()
        handle = None if _creator_registered(registry, spec) else registry.load_library(str(p))
        if handle is None and not _creator_registered(registry, spec):
            raise BackendUnavailable(f"TensorRT could not load the plugin library {p} (see the TensorRT log "
                                     f"above; a library built for another TensorRT major version refuses to "
                                     f"load)")
        loaded[digest] = str(p)


def version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def current_identity(trt_version: str, dev: DeviceInfo) -> dict[str, Any]:
    """What an engine is tied to: TensorRT version and GPU (name, compute capability) — the identity fields
    of :class:`~dflash2_trt.manifest.EngineSet`."""
    return {"tensorrt_version": trt_version,
            "gpu": {"name": dev.name, "compute_capability": dev.compute_capability},
            "cuda": {"driver": dev.driver_version, "runtime": dev.runtime_version}}


def check_engine_identity(entry: EngineSet, current: dict[str, Any], plugin_sha256: str | None) -> None:
    """Raise :class:`BackendUnavailable` when the engines cannot run here: another TensorRT version, another
    GPU, or another / a missing plugin library."""
    rebuild = "rebuild them here with: dflash2 build-engines DIR"
    built, here = entry.tensorrt_version, str(current["tensorrt_version"])
    if built != here:
        raise BackendUnavailable(f"engines were built with TensorRT {built}, this is TensorRT {here} (TensorRT "
                                 f"engines only load in the version that built them): {rebuild}")
    g_here = current["gpu"]
    if (entry.gpu.compute_capability, entry.gpu.name) != (g_here["compute_capability"], g_here["name"]):
        raise BackendUnavailable(f"engines were built on {entry.gpu.name} (compute capability "
                                 f"{entry.gpu.compute_capability}), this GPU is {g_here['name']} (compute capability "
                                 f"{g_here['compute_capability']}): {rebuild}")
    plug = entry.plugin
    if plug:
        if plugin_sha256 is None:
            raise BackendUnavailable(f"the engines use the DFlash2PathSelector plugin but its library was not "
                                     f"found (expected {plug.file}; or set {PLUGIN_ENV})")
        if plugin_sha256 != plug.sha256:
            raise BackendUnavailable(f"plugin library checksum {plugin_sha256[:12]}… differs from the one the "
                                     f"engines were built with ({plug.sha256[:12]}…): use that library or {rebuild}")


def engine_set(manifest: ExportManifest, model_dir: Path) -> EngineSet:
    """The manifest's engines, or :class:`BackendUnavailable` when none were built."""
    if manifest.engines is None:
        raise BackendUnavailable(f"{model_dir} has no TensorRT engines: build them with dflash2 build-engines "
                                 f"{model_dir}")
    return manifest.engines


def resolve_plugin(entry: EngineSet, model_dir: Path, override: str | Path | None) -> Path | None:
    """The plugin library to load: ``override`` / $DFLASH2_PLUGIN_LIB, else the copy stored with the engines."""
    if entry.plugin is None:
        return None
    p = Path(override or os.environ.get(PLUGIN_ENV) or (model_dir / entry.plugin.file))
    return p if p.is_file() else None
