"""Batched drafter cost: the drafting of one batch step at B = 1, 2, 4, 8 drafting sequences, as
ONE batched proposal (:class:`~dflash2_trt.runtime.ort.batched_drafter.OrtBatchedDraftRunner`: one context call, one
block call, one head call) vs B separate B = 1 proposals (:class:`~dflash2_trt.runtime.ort.backend.OrtDraftRunner`
per sequence: B context calls, B block calls, B head calls — the batch loop before the batched drafter), on the
demo's cached export (SmolLM2-135M-Instruct + the packaged drafter, fp32, the ORT drafter graphs)::

    python benchmarks/batched_draft_cost.py --threads 2 --out benchmarks/results/batched_draft_cost.json

Each sequence starts with ``--context`` positions of draft context (random features: the cost does not depend on
their values), then every step adds ``--new`` rows of context (a cycle's accepted rows + bonus) and proposes a full
block at temperature 0. A cell is the median over ``--steps`` steps of the step's process CPU time (and wall time),
the two systems interleaved step by step; every proposal of the batched runner is checked equal to its B = 1 twin.
Prints ms per step and the ratio separate / batched, and the load average (a shared machine: read the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.ort.batched_drafter import OrtBatchedDraftRunner

    sys.path.insert(0, str(ROOT / "benchmarks"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--mode", default="greedy")
    ap.add_argument("--context", type=int, default=200, help="draft context positions before the first step")
    ap.add_argument("--new", type=int, default=2, help="context rows added per sequence per step")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from dflash2_trt.bench.exports import demo_export

    a.export = demo_export(a.export)
    rng = np.random.default_rng(0)
    cells: dict[int, dict[str, float]] = {}
    with OrtBackend(a.export, threads=a.threads) as be:
        cfg = be.manifest.drafter_config
        F, L, V = cfg.context_in_features, cfg.num_draft_rows, be.manifest.target.vocab_size
        for B in a.batch:
            batched = OrtBatchedDraftRunner(be, a.mode, B)
            single = [be.draft_runner(a.mode) for _ in range(B)]
            for b in range(B):
                f = rng.standard_normal((a.context, F)).astype(np.float32)
                batched.add_context(b, f, 0)
                single[b].add_context(f, 0)
            times: dict[str, list[tuple[float, float]]] = {"batched": [], "separate": []}
            for step in range(a.steps + 1):  # step 0: warm-up (shapes, buffers)
                feats = [rng.standard_normal((a.new, F)).astype(np.float32) for _ in range(B)]
                anchors = rng.integers(0, V, B).tolist()
                start = int(batched.lengths[0])
                pos = start + a.new
                order = ("batched", "separate") if step % 2 else ("separate", "batched")
                for which in order:
                    t = time.perf_counter(), time.process_time()
                    if which == "batched":
                        batched.add_contexts({b: (feats[b], start) for b in range(B)})
                        got = batched.propose_batch(list(range(B)), anchors, [pos] * B, [L] * B, [0.0] * B, [None] * B)
                    else:
                        want = []
                        for b in range(B):
                            single[b].add_context(feats[b], start)
                            want.append(single[b].propose(anchors[b], pos, L, 0.0, None))
                    if step:
                        times[which].append((time.perf_counter() - t[0], time.process_time() - t[1]))
                for g, w in zip(got, want):
                    if not np.array_equal(g.tokens, w.tokens):
                        print(f"  note: B = {B} step {step}: a batched draft differs from its B = 1 twin")
            med = {k: (statistics.median(x for x, _ in v) * 1e3, statistics.median(c for _, c in v) * 1e3)
                   for k, v in times.items()}
            cells[B] = {"batched_wall_ms": med["batched"][0], "batched_cpu_ms": med["batched"][1],
                        "separate_wall_ms": med["separate"][0], "separate_cpu_ms": med["separate"][1]}
    print(f"drafter proposal cost per step, {Path(a.export).name}, mode {a.mode}, {a.threads} threads, context "
          f"{a.context}+, {a.new} new rows per sequence per step, median of {a.steps} steps, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'B':>3s} {'batched cpu ms':>15s} {'separate cpu ms':>16s} {'x':>6s} {'batched wall ms':>16s} "
          f"{'separate wall ms':>17s} {'x':>6s}")
    for B, c in cells.items():
        print(f"{B:3d} {c['batched_cpu_ms']:15.2f} {c['separate_cpu_ms']:16.2f} "
              f"{c['separate_cpu_ms'] / c['batched_cpu_ms']:6.2f} {c['batched_wall_ms']:16.2f} "
              f"{c['separate_wall_ms']:17.2f} {c['separate_wall_ms'] / c['batched_wall_ms']:6.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "machine": describe(),
            "command": " ".join(["python", "benchmarks/batched_draft_cost.py", *(argv or sys.argv[1:])]),
            "export": Path(a.export).name, "mode": a.mode, "threads": a.threads, "context": a.context, "new": a.new,
            "steps": a.steps, "loadavg": os.getloadavg()[0], "ms_per_step": cells}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
