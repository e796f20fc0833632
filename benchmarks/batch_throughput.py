"""Batched autoregressive throughput (issue 29): total generated tokens/s of ``Generator.generate_batch`` (plain
decoding, continuous batching over the fused target, :mod:`dflash2_trt.runtime.batch`) at 1 / 2 / 4 / 8
concurrent streams vs single-stream AR (``Generator.generate(speculative=False)``, today's path, one request after
another), SmolLM2-135M-Instruct fp32 fused (the demo's cached export), MT-Bench first turns, EOS off so every
stream makes exactly ``--tokens`` tokens::

    python benchmarks/batch_throughput.py --threads 2 --tokens 64 --repeats 2 --out benchmarks/results/batch_throughput.json

Each cell is the best of ``--repeats`` (cells interleaved per repeat); prints tokens/s and the ratio to the
single-stream AR run, and the load average (a shared machine: read the ratios, measured in one run). Also
checks that every batched stream's tokens equal its single-stream greedy tokens. ``--spec`` adds single-stream
speculative decoding (``generate``, guard on) and batched + adaptive speculation (``generate_batch``) with the
export's drafter (the demo's: the packaged SmolLM2 drafter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    import dflash2_trt
    from dflash2_trt.bench.prompts import encode_items, load_prompts

    sys.path.insert(0, str(ROOT / "benchmarks"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--spec", action="store_true", help="also speculative: single-stream and batched + adaptive")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.export is None:
        from ort_op_profile import demo_export

        a.export = demo_export()
    n_max = max(a.streams)
    with dflash2_trt.load(a.export, backend="ort", threads=a.threads) as g:
        be = g._backend
        prompts = encode_items(load_prompts("mtbench", n_max), g._tok.encode,
                               lambda m: g._tok.apply_chat_template(m))
        kw = dict(max_new_tokens=a.tokens, eos_ids=set())
        g.generate(prompts[0], speculative=False, **kw)  # warm-up (sessions, buffers)
        g.generate_batch(prompts[:n_max], speculative=False, max_batch=n_max, **kw)
        best: dict[str, float] = {}
        single_tokens: dict[int, list[int]] = {}
        cycles: dict[int, tuple[int, int]] = {}  # streams -> (speculative cycles, plain steps) of the last run
        for _ in range(a.repeats):
            t = time.perf_counter()
            for i, p in enumerate(prompts[:n_max]):
                single_tokens[i] = g.generate(p, speculative=False, **kw).tokens
            best["single"] = max(best.get("single", 0.0), n_max * a.tokens / (time.perf_counter() - t))
            if a.spec:
                t = time.perf_counter()
                for p in prompts[:n_max]:
                    g.generate(p, **kw)
                best["single_spec"] = max(best.get("single_spec", 0.0), n_max * a.tokens / (time.perf_counter() - t))
            for n in a.streams:
                t = time.perf_counter()
                out = g.generate_batch(prompts[:n], speculative=False, max_batch=n, **kw)
                rate = sum(len(r.tokens) for r in out) / (time.perf_counter() - t)
                best[f"batch{n}"] = max(best.get(f"batch{n}", 0.0), rate)
                if a.spec:
                    t = time.perf_counter()
                    sp = g.generate_batch(prompts[:n], max_batch=n, **kw)
                    rate = sum(len(r.tokens) for r in sp) / (time.perf_counter() - t)
                    best[f"spec{n}"] = max(best.get(f"spec{n}", 0.0), rate)
                    cycles[n] = (sum(r.stats.cycles for r in sp), sum(r.stats.plain_steps for r in sp))
                    out = out + sp
                same = sum(r.tokens == single_tokens[i % n] for i, r in enumerate(out))
                if same != len(out):
                    print(f"  note: {len(out) - same} of {len(out)} batched streams differ from single-stream greedy tokens "
                          f"(attention op: single {be.attention_op}, batch GroupQueryAttention)")
        base = best["single"]
        rows = [("single-stream AR (generate, one after another)", base, 1.0)]
        rows += [(f"batched AR, {n} streams", best[f"batch{n}"], best[f"batch{n}"] / base) for n in a.streams]
        if a.spec:
            rows.append(("single-stream speculative (generate, guard on)", best["single_spec"], best["single_spec"] / base))
            rows += [(f"batched + adaptive speculation, {n} streams (cycles {cycles[n][0]}, plain {cycles[n][1]})",
                      best[f"spec{n}"], best[f"spec{n}"] / base) for n in a.streams]
        print(f"SmolLM2 fused fp32, {a.threads} threads, {a.tokens} tokens per stream, best of {a.repeats}, "
              f"single-stream attention {be.attention_op}, load average {os.getloadavg()[0]:.1f}")
        print(f"{'':72s} {'tok/s':>8s} {'x single':>9s}")
        for name, rate, ratio in rows:
            print(f"{name:72s} {rate:8.1f} {ratio:9.2f}")
        if a.out:
            Path(a.out).write_text(json.dumps({
                "command": " ".join(["python", "benchmarks/batch_throughput.py", *(argv or sys.argv[1:])]),
                "threads": a.threads, "tokens": a.tokens, "repeats": a.repeats, "loadavg": os.getloadavg()[0],
                "single_attention": be.attention_op, "tokens_per_s": best,
                "spec_cycles_plain": cycles}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
