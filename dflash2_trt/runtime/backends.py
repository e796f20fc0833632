"""Backend selection: ``open_backend(model_dir, "auto" | "ort" | "trt") -> (backend, note)``.

``auto`` constructs the TensorRT backend and, when it raises
:class:`~dflash2_trt.runtime.protocol.BackendUnavailable`, falls back to ONNX Runtime; ``note`` says what was
chosen and why (the CLIs print it on stderr), e.g. ``TensorRT not available (TensorRT is not installed ...),
using ONNX Runtime (CPUExecutionProvider)``. Nothing is checked before a backend is constructed.
"""

from __future__ import annotations

from pathlib import Path

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.protocol import Backend, BackendUnavailable
from dflash2_trt.vocabulary import BACKEND_CHOICES


def open_backend(model_dir: str | Path, backend: str = "auto", verify_checksums: bool = True,
                 threads: int | None = None, *, spinning: bool | None = None, panels: bool | None = None,
                 weight_codes: bool = True) -> tuple[Backend, str]:
    """Open an export folder with the requested backend; returns it and a one-line note on the choice.
    ``threads``, ``spinning``, ``panels``, ``weight_codes``: ONNX Runtime's (:func:`dflash2_trt.load`)."""
    if backend not in BACKEND_CHOICES:
        raise DFlash2Error(f"backend must be one of {', '.join(BACKEND_CHOICES)}, got {backend!r}")
    model_dir = Path(model_dir)
    reason = ""
    if backend in ("trt", "auto"):
        from dflash2_trt.runtime.trt.backend import TrtBackend

        try:
            trt_be = TrtBackend(model_dir, verify_checksums=verify_checksums)
            return trt_be, f"using {trt_be.description}"
        except BackendUnavailable as e:
            if backend == "trt":
                raise DFlash2Error(f"TensorRT backend unavailable: {e}") from None
            reason = str(e)
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be = OrtBackend(model_dir, verify_checksums=verify_checksums, threads=threads, spinning=spinning, panels=panels,
                    weight_codes=weight_codes)
    if backend == "auto":
        return be, f"TensorRT not available ({reason}), using ONNX Runtime ({be.provider})"
    return be, f"using ONNX Runtime ({be.provider})"
