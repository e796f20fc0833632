"""What a long prompt joining the batch costs the streams already running: one stream decodes, a ``--long``-token
prompt is submitted after ``--after`` of its tokens, and the stream's inter-token gaps are timed — its median
before the join, its worst gap from the join to the long prompt's first token — for each ``--chunks`` setting of
``Generator.set_batching`` (``none``: whole prompts; N: N rows a step, no time budget; ``share=X``: the default
row cap with ``prefill_share=X``), side by side in one run, with the long prompt's time to first token. ``--json``
writes every figure with ``dflash2_trt.bench.machine.describe()``.

    python benchmarks/prefill_join_gap.py [--export DIR] [--threads 2] [--long 1500] [--chunks none 32 share=2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time


def _run(gen, long_ids: list[int], after: int, stream_tokens: int) -> dict:  # noqa: ANN001
    """One stream, the long prompt joining after ``after`` of its tokens -> the figures."""
    h = gen.submit("Tell me a long story about a lighthouse keeper and the sea.", max_new_tokens=stream_tokens,
                   eos_ids=set())
    stamps, joined, first = [], {}, {}

    def join() -> None:
        joined["t"] = time.perf_counter()
        b = gen.submit(long_ids, max_new_tokens=4, eos_ids=set(), chat=False)
        for _ in b:
            first.setdefault("t", time.perf_counter())
        b.result()

    joiner = threading.Thread(target=join)
    for chunk in h:
        stamps.append((time.perf_counter(), len(chunk.tokens)))
        if sum(n for _, n in stamps) >= after and not joined:
            joiner.start()
            while "t" not in joined:
                time.sleep(0.0005)
    h.result()
    joiner.join()  # the long request done: the next setting may restart the loop
    t_join, t_first = joined["t"], first["t"]
    gaps = [(b[0] - a[0], b[0]) for a, b in zip(stamps, stamps[1:])]
    before = [g for g, t in gaps if t < t_join]
    during = [g for g, t in gaps if t_join <= t <= t_first + 0.5] or [0.0]
    med = statistics.median(before)
    return {"median_gap_ms": 1e3 * med, "worst_gap_ms": 1e3 * max(during), "worst_over_median": max(during) / med,
            "long_ttft_ms": 1e3 * (t_first - t_join)}


def _setting(c: str) -> dict:
    """A ``--chunks`` value -> set_batching's prefill arguments."""
    from dflash2_trt.runtime.batch import DEFAULT_PREFILL_CHUNK

    if c == "none":
        return {"prefill_chunk": None, "prefill_share": None}
    if c.startswith("share="):
        return {"prefill_chunk": DEFAULT_PREFILL_CHUNK, "prefill_share": float(c.split("=", 1)[1])}
    return {"prefill_chunk": int(c), "prefill_share": None}


def main(argv: list[str] | None = None) -> int:
    import dflash2_trt
    from dflash2_trt.bench.exports import demo_export
    from dflash2_trt.bench.machine import describe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", default=None, help="an export folder (default: the demo's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--long", type=int, default=1500)
    p.add_argument("--after", type=int, default=24, help="stream tokens before the long prompt joins")
    p.add_argument("--chunks", nargs="+", default=["none", "32", "share=2"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    out = []
    with dflash2_trt.load(demo_export(a.export), backend="ort", threads=a.threads, prefix_cache_bytes=0) as gen:
        text = " ".join(f"Section {i}: the keeper logged wind, tide and the ships that passed." for i in range(400))
        long_ids = gen.encode(text, chat=False)[: a.long]
        stream_tokens = 160
        print(f"{'chunk':>6} {'median gap ms':>14} {'worst gap ms':>13} {'worst/median':>13} {'long TTFT ms':>13}")
        for rep in range(a.repeats):
            for c in a.chunks:
                gen.set_batching(max_batch=4, adaptive=True, **_setting(c))
                gen.generate_batch(["Hi"], max_new_tokens=2)  # the loop's warm-up
                r = {"chunk": c, "repeat": rep, **_run(gen, long_ids, a.after, stream_tokens)}
                out.append(r)
                print(f"{c:>6} {r['median_gap_ms']:14.1f} {r['worst_gap_ms']:13.1f} {r['worst_over_median']:13.1f} "
                      f"{r['long_ttft_ms']:13.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": describe(), "command": "python benchmarks/prefill_join_gap.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]), "runs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
