"""Where a figure was measured: what every result file in ``benchmarks/results`` records beside its numbers."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path


def describe() -> dict[str, object]:
    """The date (UTC), the commit of the checkout (``+dirty`` with uncommitted changes outside
    ``benchmarks/results``), the CPU's model name, its SIMD flags that pick our kernels (AVX2, AVX-512), the core
    count and ONNX Runtime's version."""
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
    # result files are not the code that measured: a rerun that has rewritten some of them is still at the commit
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results"):
        commit += "+dirty"
    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:
        ort = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "commit": commit, "cpu": cpu,
            "simd": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "fma")),
            "cores": os.cpu_count(), "onnxruntime": ort}


def main(argv: list[str] | None = None) -> int:
    """``python -m dflash2_trt.bench.machine --out F --command CMD IN [KEY=IN ...]``: a result file for a command that
    prints JSON without its machine (``dflash2 demo --json``): one ``IN`` -> its object (the last line of the file)
    with ``machine`` and ``command`` first; ``KEY=IN`` pairs -> one object holding each under its key."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m dflash2_trt.bench.machine", description=main.__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--command", required=True, help="the command(s) that printed the inputs")
    p.add_argument("inputs", nargs="+", help="a JSON file, or KEY=FILE pairs to join")
    a = p.parse_args(argv)

    def last_object(path: str) -> dict:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
        if not lines:
            p.error(f"{path} is empty")
        return json.loads(lines[-1])

    keyed = [i.partition("=") for i in a.inputs]
    if all(sep for _, sep, _ in keyed):
        body = {k: last_object(f) for k, _, f in keyed}
    elif len(a.inputs) == 1 and not keyed[0][1]:
        body = last_object(a.inputs[0])
    else:
        p.error("give one FILE or KEY=FILE pairs")
    Path(a.out).write_text(json.dumps({"machine": describe(), "command": a.command, **body}, indent=1) + "\n",
                           encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
