"""Where a figure was measured: what every result file in ``benchmarks/results`` records beside its numbers."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path


def describe() -> dict[str, object]:
    """The date (UTC), the commit of the checkout (``+dirty`` with uncommitted changes), the CPU's model name, its
    SIMD flags that pick our kernels (AVX2, AVX-512), the core count and ONNX Runtime's version."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    root = Path(__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:
        ort = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "commit": commit, "cpu": cpu,
            "simd": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "fma")),
            "cores": os.cpu_count(), "onnxruntime": ort}
