"""Where a speculative cycle's time goes, against one plain step: the demo pair (SmolLM2-135M-Instruct fp32 fused +
the packaged drafter, ONNX Runtime CPU) decoding greedy with the guard off, the runners wrapped in timers.

Per cycle: draft (``drafter.propose``), verify (the k-row ``target.forward``), commit (``target.crop`` +
``drafter.add_context`` of the accepted rows), other (the rest of the cycle: acceptance, bookkeeping, Python);
beside the plain step of autoregressive decoding (its ``target.forward`` and the rest of its step). Each
``--attention`` variant (``gqa``: ORT's GroupQueryAttention = before, ``decode``: dflash2.DecodeAttention = after)
(and ``--drafter-graphs`` variant: ``auto`` the backend's drafter block and head, ``standard`` the layers and the
selector as small ONNX ops) runs the same prompts, interleaved prompt by prompt, at each ``--threads``::

    python benchmarks/cycle_profile.py --sets humaneval mtbench --limit 5 --max-new-tokens 64 --threads 2 1 \
        --out benchmarks/results/cycle_profile.json

Medians over cycles (ms); tok/s from the summed wall time; the load average is printed (a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from dflash2_trt.runtime.request import GenerationRequest
from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, float, float, int]] = []  # (kind, start, seconds, rows)

    def timed(self, kind: str, fn, rows: int = 0):  # noqa: ANN001, ANN201
        t0 = time.perf_counter()
        out = fn()
        self.events.append((kind, t0, time.perf_counter() - t0, rows))
        return out


class TimedTarget:
    def __init__(self, inner, log: Log) -> None:  # noqa: ANN001
        self.inner, self.log = inner, log
        self.vocab_size, self.max_positions, self.eos_ids = inner.vocab_size, inner.max_positions, inner.eos_ids

    @property
    def cache_length(self) -> int:
        return self.inner.cache_length

    def reset(self) -> None:
        self.inner.reset()

    def forward(self, ids: list[int]):  # noqa: ANN201
        return self.log.timed("forward", lambda: self.inner.forward(ids), len(ids))

    def crop(self, n: int) -> None:
        self.log.timed("crop", lambda: self.inner.crop(n))


class TimedDrafter:
    def __init__(self, inner, log: Log) -> None:  # noqa: ANN001
        self.inner, self.log = inner, log
        self.block_size, self.num_draft_rows = inner.block_size, inner.num_draft_rows

    def reset(self) -> None:
        self.inner.reset()

    def add_context(self, feats, start: int) -> None:  # noqa: ANN001
        self.log.timed("add_context", lambda: self.inner.add_context(feats, start), int(feats.shape[0]))

    def propose(self, *a):  # noqa: ANN002, ANN201
        return self.log.timed("propose", lambda: self.inner.propose(*a))


def profile_spec(target, drafter, prompt: list[int], n: int) -> tuple[list[dict], dict]:  # noqa: ANN001
    from dflash2_trt.runtime import decoder as D

    log = Log()
    ends: list[float] = []
    res = D.speculative_generate(TimedTarget(target, log), TimedDrafter(drafter, log), prompt,
                                 GenerationRequest(max_new_tokens=n, eos_ids=set(), proposer="dflash2", guard=False),
                                 D.DecodeHooks(on_cycle=lambda a, r: ends.append(time.perf_counter())))
    # cycles start after the prefill's add_context (the first event of that kind)
    start = next(t0 + dt for kind, t0, dt, _ in log.events if kind == "add_context")
    cycles = []
    for end in ends:
        ev = [e for e in log.events if start <= e[1] < end]
        c = {"draft": sum(e[2] for e in ev if e[0] == "propose"),
             "verify": sum(e[2] for e in ev if e[0] == "forward"),
             "commit": sum(e[2] for e in ev if e[0] in ("crop", "add_context")),
             "rows": max([e[3] for e in ev if e[0] == "forward"] or [0])}
        c["total"] = end - start
        c["other"] = c["total"] - c["draft"] - c["verify"] - c["commit"]
        cycles.append(c)
        start = end
    return cycles, {"tokens": len(res.tokens), "s": res.elapsed_s, "accepted": res.accepted}


def profile_ar(target, prompt: list[int], n: int) -> tuple[list[dict], dict]:  # noqa: ANN001
    from dflash2_trt.runtime import decoder as D

    log = Log()
    stamps: list[float] = []
    res = D.target_generate(TimedTarget(target, log), prompt, GenerationRequest(max_new_tokens=n, eos_ids=set()),
                            on_tokens=lambda t: stamps.append(time.perf_counter()))
    fwd = [e for e in log.events if e[0] == "forward"][1:]  # the prefill excluded
    steps = [{"forward": f[2], "total": b - a} for f, a, b in zip(fwd, stamps[:-1], stamps[1:])]
    for s in steps:
        s["other"] = s["total"] - s["forward"]
    return steps, {"tokens": len(res.tokens), "s": res.elapsed_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--attention", nargs="+", default=["gqa", "decode"])
    ap.add_argument("--drafter-graphs", nargs="+", default=["auto"], choices=["auto", "standard"],
                    help="the drafter's block and head graphs: the backend's choice (where the custom-op library "
                         "runs: each layer one dflash2.DrafterLayer node, the selector's plugin node), or the "
                         "standard graphs (the layers' small ops, the decomposed selector)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from dflash2_trt.bench.prompts import encode_items, load_prompts
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.tokenizer import TextTokenizer
    from dflash2_trt.vocabulary import head_key
    from dflash2_trt.bench.exports import demo_export

    folder = demo_export(a.export)
    tok = TextTokenizer(folder)
    prompts = {s: encode_items(load_prompts(s, a.limit), tok.encode, tok.apply_chat_template) for s in a.sets}
    rows_out: list[dict] = []
    for threads in a.threads:
        systems = {}
        for att in a.attention:
            be = OrtBackend(folder, threads=threads, attention=att)
            for graphs in a.drafter_graphs:
                drafter = be.draft_runner("greedy")
                if graphs == "standard":
                    drafter.block_sess, drafter.head_sess = be.session("drafter_block"), be.session(head_key("greedy"))
                name = f"{Path(drafter.block_sess.path).stem} + {Path(drafter.head_sess.path).stem}"
                systems[f"{att}, {name}"] = (be.target_runner(), drafter)
        load0 = os.getloadavg()[0]
        for s, plist in prompts.items():
            acc: dict[str, dict[str, list]] = {k: {"cycles": [], "steps": [], "spec": [], "ar": []} for k in systems}
            for p in plist:
                for k, (t, d) in systems.items():
                    cyc, spec = profile_spec(t, d, p, a.max_new_tokens)
                    steps, ar = profile_ar(t, p, a.max_new_tokens)
                    assert spec["tokens"] and ar["tokens"]
                    acc[k]["cycles"] += cyc
                    acc[k]["steps"] += steps
                    acc[k]["spec"].append(spec)
                    acc[k]["ar"].append(ar)
            for k, r in acc.items():
                med = lambda xs, f: 1e3 * float(np.median([x[f] for x in xs]))  # noqa: E731
                spec_tps = sum(x["tokens"] for x in r["spec"]) / sum(x["s"] for x in r["spec"])
                ar_tps = sum(x["tokens"] for x in r["ar"]) / sum(x["s"] for x in r["ar"])
                accepted = [c for x in r["spec"] for c in x["accepted"]]
                rows_out.append({
                    "threads": threads, "set": s, "attention": k, "cycles": len(r["cycles"]),
                    "draft_ms": med(r["cycles"], "draft"), "verify_ms": med(r["cycles"], "verify"),
                    "commit_ms": med(r["cycles"], "commit"), "other_ms": med(r["cycles"], "other"),
                    "cycle_ms": med(r["cycles"], "total"), "step_forward_ms": med(r["steps"], "forward"),
                    "step_other_ms": med(r["steps"], "other"), "step_ms": med(r["steps"], "total"),
                    "tau": 1 + float(np.mean(accepted)), "spec_tok_s": spec_tps, "ar_tok_s": ar_tps,
                    "speedup": spec_tps / ar_tps, "load_average": (load0, os.getloadavg()[0])})
    print(f"\n{a.limit} prompts per set, {a.max_new_tokens} new tokens, greedy, guard off; medians over cycles / steps "
          f"(ms); load average {rows_out[0]['load_average'][0]:.1f} -> {rows_out[-1]['load_average'][1]:.1f} on "
          f"{os.cpu_count()} CPUs")
    print("| threads | set | attention, drafter graphs | draft | verify | commit | other | cycle | "
          "plain step (forward + other) | τ | "
          "cycle ÷ step | spec tok/s | AR tok/s | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['threads']} | {r['set']} | {r['attention']} | {r['draft_ms']:.1f} | {r['verify_ms']:.1f} | "
              f"{r['commit_ms']:.1f} | {r['other_ms']:.2f} | {r['cycle_ms']:.1f} | {r['step_ms']:.1f} "
              f"({r['step_forward_ms']:.1f} + {r['step_other_ms']:.2f}) | {r['tau']:.2f} | "
              f"{r['cycle_ms'] / r['step_ms']:.2f} | {r['spec_tok_s']:.1f} | {r['ar_tok_s']:.1f} | {r['speedup']:.2f} |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"machine": describe(), "args": vars(a), "rows": rows_out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
