"""Backend selection: ``open_backend(model_dir, "auto" | "ort" | "trt")``.

``auto`` picks TensorRT when it can run here, else ONNX Runtime, and records why in
``backend.selection_note`` (the CLIs print it on stderr), e.g. ``TensorRT not available (the tensorrt
Python package is not installed), using ONNX Runtime (CPUExecutionProvider)``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dflash2_trt.errors import DFlash2Error

BACKENDS = ("auto", "ort", "trt")


def tensorrt_unavailable_reason(model_dir: Path) -> str | None:
    """Why the TensorRT backend cannot run here (None when it can)."""
    spec = importlib.util.find_spec("tensorrt")
    if spec is None or spec.origin is None:  # absent, or only tensorrt-stubs' namespace folder
        return "the tensorrt Python package is not installed"
    from dflash2_trt.runtime.trt_backend import trt_unavailable_reason

    return trt_unavailable_reason(model_dir)


def open_backend(model_dir: str | Path, backend: str = "auto", verify_checksums: bool = True,
                 threads: int | None = None):  # noqa: ANN201
    """Open an export folder with the requested backend; ``.selection_note`` says what was chosen and why."""
    if backend not in BACKENDS:
        raise DFlash2Error(f"backend must be one of {BACKENDS}, got {backend!r}")
    model_dir = Path(model_dir)
    if backend in ("trt", "auto"):
        reason = tensorrt_unavailable_reason(model_dir)
        if reason is None:
            from dflash2_trt.runtime.trt_backend import TrtBackend

            try:
                trt_be = TrtBackend(model_dir, verify_checksums=verify_checksums)
                trt_be.selection_note = f"using {trt_be.description}"
                return trt_be
            except DFlash2Error as e:
                reason = str(e)
        if backend == "trt":
            raise DFlash2Error(f"TensorRT backend unavailable: {reason}")
    from dflash2_trt.runtime.ort_backend import OrtBackend

    be = OrtBackend(model_dir, verify_checksums=verify_checksums, threads=threads)
    if backend == "auto":
        be.selection_note = f"TensorRT not available ({reason}), using ONNX Runtime ({be.provider})"
    else:
        be.selection_note = f"using ONNX Runtime ({be.provider})"
    return be
