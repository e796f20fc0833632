"""What a long prompt joining the batch costs the streams already running: one stream decodes, a ``--long``-token
prompt is submitted after ``--after`` of its tokens, and the stream's inter-token gaps are timed — its median
before the join, its worst gap from the join to the long prompt's first token — for each ``--chunks`` setting of
``Generator.set_batching`` (``none``: whole prompts; N: N rows a step, no time budget; ``share=X``: the default
row cap with ``prefill_share=X``), side by side in one run, with the long prompt's time to first token. With
``--lib`` the same run in the C library's ``dfl2_batch`` over ONNX Runtime (its ``prefill_chunk`` /
``prefill_share`` options; the batch in a process of its own, dflash2_trt.bench.capi.run_driver). ``--json``
writes every figure with ``dflash2_trt.bench.machine.describe()``.

    python benchmarks/prefill_join_gap.py [--export DIR] [--threads 2] [--long 1500] [--chunks none 32 share=2]
        [--lib build/capi-tests/lib/libdflash2.so]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

STREAM_PROMPT = "Tell me a long story about a lighthouse keeper and the sea."  # the running stream's (chat)
STREAM_TOKENS = 160


def _run(gen, long_ids: list[int], after: int, stream_tokens: int) -> dict:  # noqa: ANN001
    """One stream, the long prompt joining after ``after`` of its tokens -> the figures."""
    h = gen.submit(STREAM_PROMPT, max_new_tokens=stream_tokens, eos_ids=set())
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


# Per setting and repeat, a fresh batch: the stream submitted, stepped until it holds `after` tokens, then the long
# prompt submitted between two steps, stepped until both finish; every on_tokens call timestamped.
_JOIN = r"""
import statistics, time
model = V()
ok(lib.dfl2_model_load(req["export"].encode(), options(req["model"]), C.byref(model)))
def submit(batch, ids, new, stamps):
    prompt = (C.c_int32 * len(ids))(*ids)
    cb = TOKENS(lambda u, t, n: stamps.append((time.perf_counter(), n)) or 0)
    q = Request(C.sizeof(Request), C.cast(prompt, P(C.c_int32)), len(ids),
                options([f"max_new_tokens={new}", "eos_ids="]), cb, DONE(0), None, UNIFORM(0), None)
    rid = C.c_uint64()
    ok(lib.dfl2_batch_submit(batch, C.byref(q), C.byref(rid)))
    return prompt, cb
out = []
for rep in range(req["repeats"]):
    for name, opts in req["settings"]:
        batch = V()
        ok(lib.dfl2_batch_create(model, options(opts), C.byref(batch)))
        keep, warm = [], []
        keep.append(submit(batch, req["stream"][:8], 2, warm))  # the loop's warm-up
        n = C.c_size_t()
        while True:
            ok(lib.dfl2_batch_step(batch, C.byref(n)))
            if n.value == 0:
                break
        stream, long, joined = [], [], None
        keep.append(submit(batch, req["stream"], req["stream_tokens"], stream))
        while True:
            ok(lib.dfl2_batch_step(batch, C.byref(n)))
            if joined is None and sum(k for _, k in stream) >= req["after"]:
                joined = time.perf_counter()
                keep.append(submit(batch, req["long"], 4, long))
            if n.value == 0 and joined is not None:
                break
        first = long[0][0]
        gaps = [(b[0] - a[0], b[0]) for a, b in zip(stream, stream[1:])]
        before = [g for g, t in gaps if t < joined]
        during = [g for g, t in gaps if joined <= t <= first + 0.5] or [0.0]
        med = statistics.median(before)
        out.append({"chunk": name, "repeat": rep, "median_gap_ms": 1e3 * med, "worst_gap_ms": 1e3 * max(during),
                    "worst_over_median": max(during) / med, "long_ttft_ms": 1e3 * (first - joined)})
        lib.dfl2_batch_free(batch)
print(json.dumps(out))
"""


def _c_options(c: str) -> list[str]:
    """A ``--chunks`` value -> the C batch's options (as :func:`_setting` and ``set_batching(max_batch=4)``)."""
    kw = _setting(c)
    return ["max_batch=4", "adaptive=true", f"prefill_chunk={kw['prefill_chunk'] or 0}",
            f"prefill_share={kw['prefill_share'] or 0}"]


def _c_runs(lib: str, export: str, stream_ids: list[int], long_ids: list[int], a: argparse.Namespace) -> list[dict]:
    """Every setting and repeat in the C library's dfl2_batch (``lib``) over ``export`` -> the runs' figures."""
    from dflash2_trt.bench.capi import run_driver
    from dflash2_trt.runtime.ort.decode_attention import find_library

    req = {"lib": str(Path(lib).resolve()), "export": str(export), "model": ["backend=ort", f"threads={a.threads}"],
           "stream": stream_ids, "long": long_ids, "stream_tokens": STREAM_TOKENS, "after": a.after,
           "repeats": a.repeats, "settings": [(c, _c_options(c)) for c in a.chunks]}
    ops = find_library()  # the op library the Python runtime uses, whichever libdflash2 runs
    return run_driver(_JOIN, req, {"DFLASH2_ORT_OPS": str(ops or "/nonexistent")})


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
    p.add_argument("--lib", default=None, help="libdflash2: run the C library's batch instead (e.g. "
                                               "build/capi-tests/lib/libdflash2.so, which pytest tests/test_capi.py builds)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.lib and not Path(a.lib).is_file():
        print(f"prefill_join_gap: {a.lib} not found", file=sys.stderr)
        return 1
    export = demo_export(a.export)
    with dflash2_trt.load(export, backend="ort", threads=a.threads, prefix_cache_bytes=0) as gen:
        text = " ".join(f"Section {i}: the keeper logged wind, tide and the ships that passed." for i in range(400))
        long_ids = gen.encode(text, chat=False)[: a.long]
        if a.lib:
            out = _c_runs(a.lib, export, gen.encode(STREAM_PROMPT), long_ids, a)
        else:
            out = []
            for rep in range(a.repeats):
                for c in a.chunks:
                    gen.set_batching(max_batch=4, adaptive=True, **_setting(c))
                    gen.generate_batch(["Hi"], max_new_tokens=2)  # the loop's warm-up
                    out.append({"chunk": c, "repeat": rep, **_run(gen, long_ids, a.after, STREAM_TOKENS)})
    print(f"{'chunk':>9} {'median gap ms':>14} {'worst gap ms':>13} {'worst/median':>13} {'long TTFT ms':>13}")
    for r in out:
        print(f"{r['chunk']:>9} {r['median_gap_ms']:14.1f} {r['worst_gap_ms']:13.1f} {r['worst_over_median']:13.1f} "
              f"{r['long_ttft_ms']:13.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": describe(), "command": "python benchmarks/prefill_join_gap.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]), "runs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
