"""ONNX Runtime's own exceptions from running a graph, as the project's one error type.

What the load-time checks cannot see (a manifest field that only a graph's constants state, e.g. its RoPE table's
length) fails inside ONNX Runtime when a graph runs; every call into a session goes through :func:`ort_failures`,
so the user gets one line naming the graph instead of ORT's exception and its traceback.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from dflash2_trt.errors import DFlash2Error


@contextlib.contextmanager
def ort_failures(graph: str) -> Iterator[None]:
    """Run the body; an exception from ONNX Runtime (its own types) -> DFlash2Error naming ``graph`` (a path)."""
    try:
        yield
    except DFlash2Error:
        raise
    except Exception as e:  # onnxruntime raises its own exception types
        raise DFlash2Error(f"ONNX Runtime failed running {os.path.basename(graph)}: {str(e).splitlines()[0][:300]} (does the "
                           f"export's manifest match its graphs? re-export)") from None
