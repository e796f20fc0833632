"""Where a fused-target forward spends its time, by op type: ONNX Runtime's per-node profile
(``SessionOptions.enable_profiling``) of ``target_ort.onnx`` over 1..4 new rows on top of 256 / 1024 / 2048 cached
positions, at 1 and 2 intra-op threads, through the runtime's own runner (IOBinding to the capacity KV buffers).

Each (cached, rows) cell runs ``--repeats`` forwards (each cropped back, as a rejected verify is); a node's time is
its *minimum* over the repeats (the least-disturbed run on a shared machine), summed by op category. "run" is the
minimum ``model_run`` (all of ``session.run``), "outside" the minimum wall time of ``forward()`` minus its run
(binding, output fetch, Python). With ``--genai DIR`` the onnxruntime-genai model builder's ``model.onnx`` is
profiled beside ours in the same cells, interleaved (same session options, its ``attention_mask`` input)::

    python benchmarks/ort_op_profile.py --threads 1 2 --rows 1 2 3 4 --cached 256 1024 2048 \
        --out benchmarks/results/ort_op_profile.json
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

CATEGORIES = ("MatMul", "LM head", "attention", "LayerNorm", "SiLU", "Gather", "Concat/copies", "other")


def category(op: str, node: str) -> str:
    if node in ("lm_head", "/lm_head/MatMul"):
        return "LM head"
    if op in ("MatMul", "Gemm", "FusedMatMul", "MatMulNBits"):
        return "MatMul"
    if op in ("GroupQueryAttention", "DecodeAttention"):
        return "attention"
    if op.endswith("LayerNormalization"):
        return "LayerNorm"
    if op in ("Sigmoid", "Mul", "QuickGelu"):
        return "SiLU"
    if op == "Gather":
        return "Gather"
    if op in ("Concat", "Slice", "Identity", "Reshape", "Transpose"):
        return "Concat/copies"
    return "other"


def session_options(ort, threads: int, profile_dir: str, prefix: str):  # noqa: ANN001, ANN201
    """The runtime's session options (:class:`dflash2_trt.runtime.ort.backend._Session`) + profiling."""
    from dflash2_trt.runtime.ort.backend import cpu_session_options, target_spins

    so = cpu_session_options(ort, threads, spin=target_spins())  # as the backend opens a target
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(profile_dir, prefix)
    return so


class GenaiRunner:
    """The builder's graph (``attention_mask`` instead of ``seqlens_k``) behind the runner interface."""

    def __init__(self, sess, ort, capacity: int) -> None:  # noqa: ANN001
        self.sess, self.vocab_size, self.n = sess, 49152, 0
        self.kv = [np.zeros((1, 3, capacity, 64), np.float32) for _ in range(60)]
        self.io = sess.io_binding()
        past = [i.name for i in sess.get_inputs() if i.name.startswith("past")]
        present = [o.name for o in sess.get_outputs() if o.name.startswith("present")]
        for a, p, q in zip(self.kv, past, present):
            v = ort.OrtValue.ortvalue_from_numpy(a)
            self.io.bind_ortvalue_input(p, v)
            self.io.bind_ortvalue_output(q, v)

    def reset(self) -> None:
        self.n = 0

    def forward(self, ids: list[int]):  # noqa: ANN201
        S = len(ids)
        self.io.bind_cpu_input("input_ids", np.asarray([ids], dtype=np.int64))
        self.io.bind_cpu_input("attention_mask", np.ones((1, self.n + S), dtype=np.int64))
        self.io.bind_output("logits")
        self.sess.run_with_iobinding(self.io)
        self.n += S
        return self.io.get_outputs()[0].numpy()[0], None

    def crop(self, n: int) -> None:
        self.n = min(self.n, n)


def parse_profile(path: str) -> list[tuple[float, float, list[tuple[str, str, float]]]]:
    """-> per model_run: (start us, dur us, [(op, node, dur us)])."""
    ev = json.loads(Path(path).read_text())
    runs = sorted((e["ts"], e["dur"]) for e in ev if e.get("cat") == "Session" and e.get("name") == "model_run")
    nodes = sorted((e["ts"], e["dur"], e["args"].get("op_name", ""), e["name"].removesuffix("_kernel_time"))
                   for e in ev if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"))
    out, j = [], 0
    for ts, dur in runs:
        mine = []
        while j < len(nodes) and nodes[j][0] < ts:
            j += 1
        while j < len(nodes) and nodes[j][0] <= ts + dur:
            mine.append((nodes[j][2], nodes[j][3], float(nodes[j][1])))
            j += 1
        out.append((float(ts), float(dur), mine))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--genai", default=None, help="onnxruntime-genai model folder to profile beside ours")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--cached", type=int, nargs="+", default=[256, 1024, 2048 - 16])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--attention", nargs="+", default=["gqa", "decode"], help="our target's attention op(s)")
    ap.add_argument("--out", default=None, help="JSON results")
    a = ap.parse_args(argv)

    import onnxruntime as ort

    from dflash2_trt.bench.exports import demo_export
    from dflash2_trt.manifest import TARGET_ORT, read_manifest
    from dflash2_trt.runtime.ort import decode_attention as DA
    from dflash2_trt.runtime.ort.fused_target import OrtFusedTargetRunner

    folder = demo_export(a.export)
    m = read_manifest(folder, verify_checksums=False)
    t = m.target
    results: list[dict] = []
    for threads in a.threads:
        tmp = tempfile.mkdtemp(prefix="ort_op_profile_")
        systems = {}
        for att in a.attention:
            path = folder / m.graphs[TARGET_ORT].file
            so = session_options(ort, threads, tmp, f"ours-{att}")
            model = DA.prepare(so, path) if att == "decode" else None
            if att == "decode" and model is None:
                raise SystemExit("DecodeAttention unavailable: " + DA.available()[1])
            systems[f"ours {att}"] = OrtFusedTargetRunner(
                ort.InferenceSession(model if model is not None else str(path), so, providers=["CPUExecutionProvider"]),
                ort, t.num_layers, t.num_key_value_heads, t.head_dim, t.vocab_size, m.max_seq_len,
                set(t.eos_token_ids), m.kv_capacity_step)
        if a.genai:
            s = ort.InferenceSession(str(Path(a.genai) / "model.onnx"), session_options(ort, threads, tmp, "genai"),
                                     providers=["CPUExecutionProvider"])
            systems["genai"] = GenaiRunner(s, ort, m.max_seq_len)
        rng = np.random.default_rng(0)
        walls: dict[str, list[float]] = {k: [] for k in systems}
        cells: list[tuple[int, int]] = []
        order: dict[str, list[int]] = {k: [] for k in systems}  # per system: index of each of its runs' cell
        for n in a.cached:
            ids = rng.integers(0, t.vocab_size, n).tolist()
            for k, r in systems.items():
                r.reset()
                for s0 in range(0, n, 256):
                    r.forward(ids[s0:s0 + 256])
                    order[k].append(-1)
                    walls[k].append(0.0)
            for rows in a.rows:
                cells.append((n, rows))
                for rep in range(a.repeats + 1):
                    new = rng.integers(0, t.vocab_size, rows).tolist()
                    for k, r in systems.items():
                        t0 = time.perf_counter()
                        r.forward(new)
                        walls[k].append(time.perf_counter() - t0)
                        order[k].append(len(cells) - 1 if rep else -1)
                        r.crop(n)
        for k, r in systems.items():
            runs = parse_profile(r.sess.end_profiling())
            assert len(runs) == len(order[k]), (len(runs), len(order[k]))
            for ci, (n, rows) in enumerate(cells):
                mine = [(runs[i], walls[k][i]) for i, c in enumerate(order[k]) if c == ci]
                per_node: dict[tuple[str, str], list[float]] = {}
                for (_, _, nodes), _ in mine:
                    for op, node, dur in nodes:
                        per_node.setdefault((op, node), []).append(dur)
                by_cat = {c: 0.0 for c in CATEGORIES}
                for (op, node), d in per_node.items():
                    by_cat[category(op, node)] += min(d) / 1e3
                run_ms = min(rr[1] for rr, _ in mine) / 1e3
                outside = min(w * 1e3 - rr[1] / 1e3 for rr, w in mine)
                results.append({"system": k, "threads": threads, "cached": n, "rows": rows,
                                "run_ms": round(run_ms, 3), "wall_ms": round(min(w for _, w in mine) * 1e3, 3),
                                "outside_ms": round(outside, 3), "nodes_ms": round(sum(by_cat.values()), 3),
                                **{c: round(v, 3) for c, v in by_cat.items()}})
    load = os.getloadavg()
    print(f"\nper-node minimum over {a.repeats} repeats, summed by op type (ms); load average {load[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print("| system | threads | cached | rows | run | outside run | " + " | ".join(CATEGORIES) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(CATEGORIES))
    for r in results:
        print(f"| {r['system']} | {r['threads']} | {r['cached']} | {r['rows']} | {r['run_ms']:.1f} | "
              f"{r['outside_ms']:.2f} | " + " | ".join(f"{r[c]:.2f}" for c in CATEGORIES) + " |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "machine": describe(),
            "args": vars(a), "load_average": load, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
