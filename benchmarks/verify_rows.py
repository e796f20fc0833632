"""The speculation tax, row by row: one fused-target forward (SmolLM2-135M-Instruct fp32, ONNX Runtime CPU, the
runtime's runner) over 1 / 2 / 3 / 4 new rows on top of 256 / 1024 / 2032 cached positions, with ORT's
GroupQueryAttention ('gqa') and with dflash2.DecodeAttention ('decode', plugins/ortDecodeAttention), interleaved
cell by cell in one process (``bench.verify_cost.measure_many``: minimum over repeats), at 1 and 2 threads::

    python benchmarks/verify_rows.py --threads 2 1 --repeats 15 --out benchmarks/results/verify_rows.json

Prints ms and k-rows / 1-row ratios, and the load average (a shared machine: read the ratios). ``--before-lib
PATH`` adds 'decode-before': the same op from another build of ``plugins/ortDecodeAttention`` (an earlier
commit's batch-1 op, fed GroupQueryAttention's inputs: the graph without ``past_seqlens``), timed beside
'decode' and checked bit-equal to it on every cell's rows (a side-by-side of B = 1 before / after a change of the
op's wrapper)::

    python benchmarks/verify_rows.py --threads 2 --attention decode --before-lib build/ort_ops_before/libdflash2_ort_ops.so
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def before_runner(folder: Path, threads: int, lib: str):  # noqa: ANN201
    """The fused target with dflash2.DecodeAttention from the library ``lib``, fed GroupQueryAttention's inputs:
    the load-time rewrite as it was before the op took a batch (no past_seqlens; no logits_index, the LM head on
    every row), behind the runtime's runner."""
    import onnx
    import onnxruntime as ort

    from dflash2_trt.manifest import TARGET_LOGITS_INDEX, TARGET_ORT, TARGET_PAST_SEQLENS, read_manifest
    from dflash2_trt.runtime.ort import decode_attention as DA
    from dflash2_trt.runtime.ort.backend import cpu_session_options, target_spins
    from dflash2_trt.runtime.ort.fused_target import OrtFusedTargetRunner

    m = read_manifest(folder, verify_checksums=False)
    t = m.target
    path = folder / m.graphs[TARGET_ORT].file
    model = onnx.load_from_string(DA.rewrite(path))
    gather = next(n for n in model.graph.node if TARGET_LOGITS_INDEX in n.input)
    for node in model.graph.node:
        if node.op_type == DA.OP_TYPE:
            del node.input[7]
        if list(node.output) == ["logits"]:
            node.input[0] = gather.input[0]
    model.graph.node.remove(gather)
    kept = [i for i in model.graph.input if i.name not in (TARGET_PAST_SEQLENS, TARGET_LOGITS_INDEX)]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    so = cpu_session_options(ort, threads, spin=target_spins())  # as the backend opens a target
    so.register_custom_ops_library(str(Path(lib).resolve()))
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return OrtFusedTargetRunner(sess, ort, t.num_layers, t.num_key_value_heads, t.head_dim, t.vocab_size,
                                m.max_seq_len, set(t.eos_token_ids), m.kv_capacity_step)


def check_bit_equal(a, b, rows: list[int], cached: list[int]) -> int:  # noqa: ANN001
    """Runners a and b on the same random prompt and rows: logits and features of every call equal bit for bit
    (else SystemExit) -> calls compared."""
    import numpy as np

    rng = np.random.default_rng(1)
    calls = 0
    for n in cached:
        ids = rng.integers(0, a.vocab_size, n).tolist()
        for r in (a, b):
            r.reset()
        for s0 in range(0, n, 256):
            for x, y in zip(a.forward(ids[s0:s0 + 256]), b.forward(ids[s0:s0 + 256])):
                calls += 1
                if not np.array_equal(x, y):
                    raise SystemExit(f"decode-before differs from decode (prefill at {s0} of {n})")
        for k in rows:
            new = rng.integers(0, a.vocab_size, k).tolist()
            for x, y in zip(a.forward(new), b.forward(new)):
                calls += 1
                if not np.array_equal(x, y):
                    raise SystemExit(f"decode-before differs from decode ({k} rows at {n} cached)")
            a.crop(n)
            b.crop(n)
    return calls // 2


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.bench import verify_cost as VC
    from dflash2_trt.bench.exports import demo_export
    from dflash2_trt.runtime.ort.backend import OrtBackend

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--cached", type=int, nargs="+", default=[256, 1024, 2032])
    ap.add_argument("--attention", nargs="+", default=["gqa", "decode"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: latency; cpu: process CPU time (the work; steadier on a loaded machine)")
    ap.add_argument("--before-lib", default=None, help="also 'decode-before': the op library at PATH with the "
                    "graph of before past_seqlens (see the docstring)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.before_lib and "decode" not in a.attention:
        ap.error("--before-lib compares with 'decode': add it to --attention")
    folder = demo_export(a.export)
    out: dict = {"machine": describe(), "args": vars(a), "runs": []}
    for threads in a.threads:
        runners = {}
        for att in a.attention:
            be = OrtBackend(folder, threads=threads, attention=att)
            runners[att] = be.target_runner()
            assert (be.attention_op == "DecodeAttention") == (att == "decode"), be.attention_op
        if a.before_lib:
            runners["decode-before"] = before_runner(folder, threads, a.before_lib)
            n_eq = check_bit_equal(runners["decode"], runners["decode-before"], a.rows, a.cached)
            print(f"decode-before = decode bit for bit on {n_eq} calls (logits and features)")
            out.setdefault("bit_equal_calls", {})[threads] = n_eq
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
