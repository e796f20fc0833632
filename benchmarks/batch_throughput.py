"""Batched autoregressive throughput: total generated tokens/s of ``Generator.generate_batch`` (plain
decoding, continuous batching over the fused target, :mod:`dflash2_trt.runtime.batch`) at 1 / 2 / 4 / 8 / 16
concurrent streams vs single-stream AR (``Generator.generate(speculative=False)``, the unbatched path, one request after
another), SmolLM2-135M-Instruct fp32 fused (the demo's cached export), MT-Bench first turns, EOS off so every
stream makes exactly ``--tokens`` tokens (prefill included). Every cell decodes the same max(``--streams``)
prompts: at n streams at most n of them at once, a queued one joining as one leaves (continuous batching), so
each cell does the same work on the same prompts and only the concurrency differs::

    python benchmarks/batch_throughput.py --threads 2 --tokens 128 --repeats 2 --streams 1 2 4 8 16 --spec \
        --out benchmarks/results/batch_throughput_128.json

Each cell is the best of ``--repeats`` (cells interleaved per repeat); prints tokens per wall second and per
process CPU second (the work done; steadier than wall time on a loaded machine) with their ratios to the
single-stream AR run, and the load average (a shared machine: read the ratios, measured in one run). Also
checks that every batched stream's tokens equal its single-stream greedy tokens. ``--spec`` adds single-stream
speculative decoding (``generate``, guard on) and batched + adaptive speculation (``generate_batch``) with the
export's drafter (the demo's: the packaged SmolLM2 drafter), both with ``--proposer`` (default ``auto``: per
cycle the drafter or prompt lookup, whichever pays; ``dflash2``: the drafter alone; ``ngram``: lookup alone); each
speculative row reports each proposer's own cycles and τ (tokens per cycle) pooled over its streams.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _rates(tokens: int, t: tuple[float, float]) -> tuple[float, float]:
    """tokens per wall second and per process CPU second (the work: steadier on a loaded machine) since t."""
    w, c = _clock()
    return tokens / (w - t[0]), tokens / max(c - t[1], 1e-9)


def _best(old: tuple[float, float] | None, new: tuple[float, float]) -> tuple[float, float]:
    return new if old is None else (max(old[0], new[0]), max(old[1], new[1]))


def _per_proposer(results: list) -> dict[str, dict]:
    """{proposer: {"cycles": n, "tau": tokens per cycle or None}} pooled over the results' cycles (api.Result)."""
    from dflash2_trt.runtime.ngram import DFLASH2, NGRAM

    out = {}
    for who in (DFLASH2, NGRAM):
        acc = [x for r in results for x, p in zip(r.stats.accepted, r.stats.proposers) if p == who]
        out[who] = {"cycles": len(acc), "tau": sum(acc) / len(acc) + 1 if acc else None}
    return out


def main(argv: list[str] | None = None) -> int:
    import dflash2_trt
    from dflash2_trt.bench.prompts import encode_items, load_prompts
    from dflash2_trt.vocabulary import DEFAULT_PROPOSER, PROPOSERS

    sys.path.insert(0, str(ROOT / "benchmarks"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--spec", action="store_true", help="also speculative: single-stream and batched + adaptive")
    ap.add_argument("--proposer", choices=PROPOSERS, default=DEFAULT_PROPOSER,
                    help="who drafts in the speculative runs (--spec)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from dflash2_trt.bench.exports import demo_export

    a.export = demo_export(a.export)
    n_max = max(a.streams)
    with dflash2_trt.load(a.export, backend="ort", threads=a.threads) as g:
        be = g._backend
        prompts = encode_items(load_prompts("mtbench", n_max), g._tok.encode,
                               lambda m: g._tok.apply_chat_template(m))
        kw = dict(max_new_tokens=a.tokens, eos_ids=set())
        g.generate(prompts[0], speculative=False, **kw)  # warm-up (sessions, buffers)
        g.generate_batch(prompts, speculative=False, max_batch=n_max, **kw)
        best: dict[str, tuple[float, float]] = {}  # cell -> (wall, cpu) tokens/s
        single_tokens: dict[int, list[int]] = {}
        cycles: dict[int, tuple[int, int]] = {}  # streams -> (speculative cycles, plain steps) of the last run
        by_proposer: dict[str, dict] = {}  # cell -> each proposer's cycles and τ over its streams (the last run)
        for _ in range(a.repeats):
            t = _clock()
            for i, p in enumerate(prompts):
                single_tokens[i] = g.generate(p, speculative=False, **kw).tokens
            best["single"] = _best(best.get("single"), _rates(n_max * a.tokens, t))
            if a.spec:
                t = _clock()
                ss = [g.generate(p, proposer=a.proposer, **kw) for p in prompts]
                best["single_spec"] = _best(best.get("single_spec"), _rates(n_max * a.tokens, t))
                by_proposer["single_spec"] = _per_proposer(ss)
            for n in a.streams:
                t = _clock()
                out = g.generate_batch(prompts, speculative=False, max_batch=n, **kw)
                best[f"batch{n}"] = _best(best.get(f"batch{n}"), _rates(sum(len(r.tokens) for r in out), t))
                if a.spec:
                    t = _clock()
                    sp = g.generate_batch(prompts, max_batch=n, proposer=a.proposer, **kw)
                    best[f"spec{n}"] = _best(best.get(f"spec{n}"), _rates(sum(len(r.tokens) for r in sp), t))
                    cycles[n] = (sum(r.stats.cycles for r in sp), sum(r.stats.plain_steps for r in sp))
                    by_proposer[f"spec{n}"] = _per_proposer(sp)
                    out = out + sp
                same = sum(r.tokens == single_tokens[i % n_max] for i, r in enumerate(out))
                if same != len(out):
                    print(f"  note: {len(out) - same} of {len(out)} batched streams differ from single-stream greedy tokens "
                          f"(attention op {be.attention_op})")
        rows = [("single-stream AR (generate, one after another)", "single")]
        rows += [(f"batched AR, {n} streams", f"batch{n}") for n in a.streams]
        if a.spec:
            rows.append(("single-stream speculative (generate, guard on)", "single_spec"))
            rows += [(f"batched + adaptive spec., {n} streams (cycles {cycles[n][0]}, plain {cycles[n][1]})", f"spec{n}")
                     for n in a.streams]
        print(f"SmolLM2 fused fp32, {a.threads} threads, {a.tokens} tokens per stream, best of {a.repeats}, "
              f"attention {be.attention_op}, load average {os.getloadavg()[0]:.1f}"
              + (f", proposer {a.proposer}" if a.spec else ""))
        print(f"{'':66s} {'wall tok/s':>10s} {'x single':>8s} {'cpu tok/s':>10s} {'x single':>8s}")
        w0, c0 = best["single"]
        for name, key in rows:
            w, c = best[key]
            print(f"{name:66s} {w:10.1f} {w / w0:8.2f} {c:10.1f} {c / c0:8.2f}")
            if key in by_proposer:
                print("    " + ", ".join(f"{who}: {v['cycles']} cycles, tau {v['tau']:.2f}" if v["tau"] else
                                         f"{who}: 0 cycles" for who, v in by_proposer[key].items()))
        if a.out:
            Path(a.out).write_text(json.dumps({
                "machine": describe(),
                "command": " ".join(["python", "benchmarks/batch_throughput.py", *(argv or sys.argv[1:])]),
                "threads": a.threads, "tokens": a.tokens, "repeats": a.repeats, "loadavg": os.getloadavg()[0],
                "attention": be.attention_op, "tokens_per_s": best,
                "spec_cycles_plain": cycles, "proposer": a.proposer if a.spec else None,
                "spec_proposers": by_proposer}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
