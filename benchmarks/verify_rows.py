"""The speculation tax, row by row: one fused-target forward (SmolLM2-135M-Instruct fp32, ONNX Runtime CPU, the
runtime's runner) over 1 / 2 / 3 / 4 new rows on top of 256 / 1024 / 2032 cached positions, with ORT's
GroupQueryAttention ('gqa') and with dflash2.DecodeAttention ('decode', plugins/ortDecodeAttention), interleaved
cell by cell in one process (``bench.verify_cost.measure_many``: minimum over repeats), at 1 and 2 threads::

    python benchmarks/verify_rows.py --threads 2 1 --repeats 15 --out benchmarks/results/verify_rows.json

Prints ms and k-rows / 1-row ratios, and the load average (a shared machine: read the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.bench import verify_cost as VC
    from dflash2_trt.runtime.ort.backend import OrtBackend

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from ort_op_profile import demo_export

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--cached", type=int, nargs="+", default=[256, 1024, 2032])
    ap.add_argument("--attention", nargs="+", default=["gqa", "decode"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: latency; cpu: process CPU time (the work; steadier on a loaded machine)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    folder = Path(a.export) if a.export else demo_export()
    out: dict = {"args": vars(a), "runs": []}
    for threads in a.threads:
        runners = {}
        for att in a.attention:
            be = OrtBackend(folder, threads=threads, attention=att)
            runners[att] = be.target_runner()
            assert (be.attention_op == "DecodeAttention") == (att == "decode"), be.attention_op
        load0 = os.getloadavg()[0]
        tables = VC.measure_many(runners, rows=tuple(a.rows), cached=tuple(a.cached), repeats=a.repeats,
                                   clock=a.clock)
        load = (load0, os.getloadavg()[0])
        out["runs"].append({"threads": threads, "load_average": load, "tables": tables})
        print(f"\n{threads} thread(s), {a.clock} clock, minimum of {a.repeats} interleaved repeats, load average {load[0]:.1f} -> "
              f"{load[1]:.1f} on {os.cpu_count()} CPUs")
        print(VC.markdown(tables))
        base = tables[a.attention[0]]
        for att in a.attention[1:]:
            one = {(r["cached"]): r["ms"] for r in base if r["rows"] == 1}
            print(f"{att} 1-row step vs {a.attention[0]}: " + ", ".join(
                f"{n}: {one[n] / r['ms']:.2f}x" for n in one for r in tables[att] if r["cached"] == n and r["rows"] == 1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
