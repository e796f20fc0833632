"""Where a batched plain step's time goes: ONNX Runtime's per-node profile of ``target_ort.onnx`` (the
demo's SmolLM2 fused fp32 export, DecodeAttention, the panel kernels) running one plain step for B sequences at once
(B rows, each sequence its own cache of ``--cached`` + a few positions, through the runtime's batched runner) beside
B = 1, summed by op type, at each ``--threads``; with the wall time of the same steps unprofiled::

    python benchmarks/batch_step_profile.py --batch 1 8 16 --threads 2 1 --cached 128 \
        --out benchmarks/results/batch_step_profile.json

A node's time is its median over the ``--steps`` steps (after 5 warm-up steps); "run" the median ``model_run``,
"gaps" run minus the nodes (ORT between nodes); "wall" the median wall time of the runner's ``forward`` in a session
without profiling (binding and output copies included). One process; cells one after another (a shared machine:
read the ratios of one run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

OPS = ("PanelMatMul", "DecodeAttention", "SkipSimplifiedLayerNormalization", "QuickGelu", "Mul")


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    from dflash2_trt.manifest import TARGET_ORT, read_manifest
    from dflash2_trt.runtime.ort import decode_attention as DA
    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner
    from ort_op_profile import parse_profile, session_options

    from dflash2_trt.bench.exports import demo_export

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--cached", type=int, default=128, help="positions each sequence holds before the steps")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    folder = demo_export(a.export)
    m = read_manifest(folder, verify_checksums=False)
    t = m.target
    ok, why = DA.available()
    if not ok:
        raise SystemExit("DecodeAttention unavailable: " + why)
    results = []
    for threads in a.threads:
        for profile in (False, True):
            tmp = tempfile.mkdtemp(prefix="batch_step_profile_")
            so = session_options(ort, threads, tmp, "b")
            so.enable_profiling = profile
            sess = ort.InferenceSession(DA.prepare(so, folder / m.graphs[TARGET_ORT].file), so,
                                        providers=["CPUExecutionProvider"])
            rng = np.random.default_rng(0)
            marks = []  # per batch: (first, last) model_run index of its timed steps
            walls = {}
            runs = 0
            for B in a.batch:
                r = OrtBatchedTargetRunner(sess, ort, t.num_layers, t.num_key_value_heads, t.head_dim, t.vocab_size,
                                           m.max_seq_len, set(), B, m.kv_capacity_step)
                for b in range(B):
                    r.join()
                    runs += 1  # a prefill: one call
                    r.forward({b: rng.integers(0, t.vocab_size, a.cached + b % 8).tolist()}, last_logits=True)
                w = []
                for s in range(5 + a.steps):
                    t0 = time.perf_counter()
                    r.forward({b: [int(rng.integers(0, t.vocab_size))] for b in range(B)})  # one call
                    w.append(time.perf_counter() - t0)
                    runs += 1
                marks.append((runs - a.steps, runs))
                walls[B] = float(np.median(w[5:]) * 1e3)
            if not profile:
                for B in a.batch:
                    results.append({"threads": threads, "batch": B, "wall_ms": round(walls[B], 3)})
                continue
            prof = parse_profile(sess.end_profiling())
            assert len(prof) == runs, (len(prof), runs)
            for B, (lo, hi) in zip(a.batch, marks):
                per: dict[tuple[str, str], list[float]] = {}
                for _, _, nodes in prof[lo:hi]:
                    for op, node, d in nodes:
                        per.setdefault((op, node), []).append(d)
                by_op = {op: 0.0 for op in OPS} | {"other": 0.0}
                for (op, _), d in per.items():
                    by_op[op if op in OPS else "other"] += float(np.median(d)) / 1e3
                run_ms = float(np.median([x[1] for x in prof[lo:hi]])) / 1e3
                row = next(x for x in results if x["threads"] == threads and x["batch"] == B)
                row.update({"run_ms": round(run_ms, 3), "gaps_ms": round(run_ms - sum(by_op.values()), 3),
                            **{k: round(v, 3) for k, v in by_op.items()}})
    load = os.getloadavg()[0]
    print(f"SmolLM2 fused fp32, one plain step of B sequences ({a.cached}+ cached each), median of {a.steps} steps, "
          f"ms; load average {load:.1f} on {os.cpu_count()} CPUs")
    cols = ("wall_ms", "run_ms", *OPS, "other", "gaps_ms")
    print("| threads | B | " + " | ".join(c.removesuffix("_ms") for c in cols) + " | wall ÷ B = 1 |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    for r in results:
        one = next(x for x in results if x["threads"] == r["threads"] and x["batch"] == a.batch[0])
        print(f"| {r['threads']} | {r['batch']} | " + " | ".join(f"{r[c]:.2f}" for c in cols)
              + f" | {r['wall_ms'] / one['wall_ms']:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "machine": describe(),
            "command": " ".join(["python", "benchmarks/batch_step_profile.py", *(argv or sys.argv[1:])]),
            "load_average": load, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
