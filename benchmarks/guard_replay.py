"""Speculation policies replayed without timing noise: the acceptance guard (runtime/guard.py) and "always draft"
on the packaged drafter's per-position acceptance, at fixed cycle costs.

Greedy decoding commits the target's own tokens whatever the policy, and the drafter's proposal at an anchor
position depends only on the committed context (the decoder feeds the same features either way), so what a cycle
started at position i commits is a function of i alone. Step 1 (``--traces``, cached as JSON) records it: per
prompt the target's greedy continuation (``--tokens``, EOS off), then at every anchor position the drafts the
drafter proposes and the prompt lookup's, each compared with the continuation. Step 2 replays each policy over
those traces at a plain step = 1 and a drafter cycle = ``--cycle-cost`` plain steps (the guard's break-even;
measured t_cycle / t_step on this CPU: 1.07–1.34, mean 1.23, on MT-Bench at 2 threads), a lookup cycle 0.12
cheaper (no drafter call), and prints tokens per unit time (= the speedup over plain decoding) per set, with
``--proposer dflash2`` (the drafter alone) and ``auto`` (the drafter beside prompt lookup, the default). The
replay is the decision rule's effect alone: two policies compared on the same acceptance, at the same costs::

    python benchmarks/guard_replay.py --sets mtbench humaneval benchmarks/prompts/long_code.jsonl --limit 20 \\
        --traces benchmarks/results/guard_replay_traces.json --out benchmarks/results/guard_replay.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from dflash2_trt.runtime.request import GenerationRequest
from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOOKUP_SAVING = 0.12  # a lookup cycle costs the verify only: the drafter's ~3 ms of a ~24 ms step less


def record_traces(export: str, sets: list[str], limit: int, tokens: int, threads: int) -> dict:
    """{set: [{"drafter": [accepted per anchor position], "lookup": [...], "lookup_len": [drafts offered]}]}"""
    import dflash2_trt
    from dflash2_trt.bench.prompts import encode_items, load_prompts
    from dflash2_trt.runtime.decoder import target_generate
    from dflash2_trt.runtime.ngram import NGRAM_ROWS, lookup

    def matched(drafts: list[int], seq: list[int], pos: int) -> int:
        a = 0
        while a < len(drafts) and pos + 1 + a < len(seq) and drafts[a] == seq[pos + 1 + a]:
            a += 1
        return a

    out: dict[str, list] = {}
    with dflash2_trt.load(export, backend="ort", threads=threads) as g:
        target, drafter = g._runner(), g._drafter("greedy")
        L = drafter.num_draft_rows
        for name in sets:
            rows = []
            for p in encode_items(load_prompts(name, limit), g._tok.encode, lambda m: g._tok.apply_chat_template(m)):
                plain = GenerationRequest(max_new_tokens=tokens, eos_ids=set())
                seq = list(p) + target_generate(target, p, plain).tokens
                target.reset()
                _, feats = target.forward(seq[:-1])  # every position's features in one pass
                drafter.reset()
                drafter.add_context(feats[: len(p)], 0)
                arr = np.asarray(seq, dtype=np.int64)
                d_acc, n_acc, n_len = [], [], []
                for pos in range(len(p), len(seq) - 1):
                    d = [int(t) for t in drafter.propose(seq[pos], pos, L, 0.0, None).tokens[:L]]
                    d_acc.append(matched(d, seq, pos))
                    lk = lookup(arr[: pos + 1], NGRAM_ROWS)
                    n_acc.append(matched(lk, seq, pos))
                    n_len.append(len(lk))
                    drafter.add_context(feats[pos: pos + 1], pos)
                rows.append({"drafter": d_acc, "lookup": n_acc, "lookup_len": n_len})
                print(f"  {name}: prompt {len(rows)}, drafter tau if always {1 + np.mean(d_acc):.2f}", flush=True)
            out[name] = rows
    return out


def replay(trace: dict, guard_cfg: dict | None, cycle_cost: float, proposer: str) -> float:
    """Tokens per unit time of one prompt: plain step 1, drafter cycle ``cycle_cost``, lookup cycle 0.12 less;
    ``guard_cfg`` None: no guard (the drafter proposes every cycle it is chosen)."""
    from dflash2_trt.runtime.guard import AcceptanceGuard, GuardConfig
    from dflash2_trt.runtime.ngram import DFLASH2, NGRAM, ProposerChoice

    d_acc, n_acc, n_len = trace["drafter"], trace["lookup"], trace["lookup_len"]
    n = len(d_acc)
    guard = None if guard_cfg is None else AcceptanceGuard(GuardConfig(**guard_cfg))
    choice = ProposerChoice(proposer, [0], 4)  # its context unused: the lookup's drafts come from the trace
    i, t = 0, 0.0
    while i < n:
        drafts = [0] * n_len[i] if proposer != DFLASH2 else []
        who = choice.pick(drafts, 1.0, drafter=guard is None or not guard.plain_next())
        if who is None:
            t, i = t + 1.0, i + 1
            if guard is not None:
                guard.record_step(1.0)
            continue
        cost = cycle_cost - LOOKUP_SAVING if who == NGRAM else cycle_cost
        committed = min((n_acc[i] if who == NGRAM else d_acc[i]) + 1, n - i)
        t, i = t + cost, i + committed
        choice.record(who, committed, cost)
        if guard is not None and who == DFLASH2:
            guard.record_cycle(committed, cost)
    return n / t


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.bench.exports import demo_export

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--sets", nargs="+", default=["mtbench", "humaneval"])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--traces", default=None, help="JSON cache of the traces: read when it exists, else written")
    ap.add_argument("--cycle-cost", type=float, nargs="+", default=[1.15, 1.25, 1.35, 1.5])
    ap.add_argument("--min-spread", type=float, nargs="+", default=[0.0, 0.5],
                    help="guard configurations replayed (GuardConfig.min_spread; the rest default)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.traces and Path(a.traces).is_file():
        traces = json.loads(Path(a.traces).read_text())
    else:
        traces = record_traces(demo_export(a.export), a.sets, a.limit, a.tokens, a.threads)
        if a.traces:
            Path(a.traces).write_text(json.dumps(traces) + "\n")
    policies = {f"guard min_spread {m}": {"min_spread": m} for m in a.min_spread}
    policies["always"] = None
    table = []
    print(f"speedup over plain decoding (replayed; {', '.join(policies)})")
    for proposer in ("dflash2", "auto"):
        for cost in a.cycle_cost:
            for name, rows in traces.items():
                cell = {k: float(np.mean([replay(r, v, cost, proposer) for r in rows])) for k, v in policies.items()}
                table.append({"proposer": proposer, "cycle_cost": cost, "set": name, "prompts": len(rows), **cell})
                print(f"{proposer:7s} cycle {cost:4.2f}  {Path(name).stem:10s} "
                      + "  ".join(f"{v:6.3f}" for v in cell.values()))
    if a.out:
        Path(a.out).write_text(json.dumps({
            "machine": describe(),
            "command": " ".join(["python", "benchmarks/guard_replay.py", *(argv or sys.argv[1:])]),
            "lookup_saving": LOOKUP_SAVING, "table": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
