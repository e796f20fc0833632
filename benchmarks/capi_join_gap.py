"""What a long prompt joining a C library batch (dfl2_batch over ONNX Runtime) costs the stream already running, the
twin of benchmarks/prefill_join_gap.py for the C loop: one stream decodes, a ``--long``-token prompt is submitted
after ``--after`` of its tokens, and the stream's inter-token gaps are timed — its median before the join, its worst
from the join to the long prompt's first token — for each ``--chunks`` setting of the batch options (``none``: whole
prompts; N: N rows a step, no time budget; ``share=X``: the default row cap with ``prefill_share=X``), side by side
in one run, with the long prompt's time to first token. The batch runs in a process of its own (the library opens
the onnxruntime wheel's libonnxruntime; dflash2_trt.bench.capi.run_driver). ``--json`` writes every figure with
``dflash2_trt.bench.machine.describe()``.

    python benchmarks/capi_join_gap.py [--lib build/capi-tests/lib/libdflash2.so] [--export DIR] [--threads 2]
        [--long 1500] [--chunks none 32 share=1.5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def _setting(c: str) -> list[str]:
    """A ``--chunks`` value -> the batch's options (max_batch 4, adaptive speculation, as prefill_join_gap.py)."""
    base = ["max_batch=4", "adaptive=true"]
    if c == "none":
        return [*base, "prefill_chunk=0", "prefill_share=0"]
    if c.startswith("share="):
        return [*base, "prefill_chunk=512", f"prefill_share={float(c.split('=', 1)[1])}"]
    return [*base, f"prefill_chunk={int(c)}", "prefill_share=0"]


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.bench.capi import run_driver
    from dflash2_trt.bench.exports import demo_export
    from dflash2_trt.bench.machine import describe
    from dflash2_trt.runtime.ort.decode_attention import find_library
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", default="build/capi-tests/lib/libdflash2.so", help="libdflash2 (default: the tests' build)")
    p.add_argument("--export", default=None, help="an export folder (default: the demo's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--long", type=int, default=1500)
    p.add_argument("--after", type=int, default=24, help="stream tokens before the long prompt joins")
    p.add_argument("--chunks", nargs="+", default=["none", "32", "share=1.5"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not Path(a.lib).is_file():
        print(f"capi_join_gap: {a.lib} not found (pytest tests/test_capi.py builds it)", file=sys.stderr)
        return 1
    export = demo_export(a.export)
    tok = TextTokenizer(export)
    text = " ".join(f"Section {i}: the keeper logged wind, tide and the ships that passed." for i in range(400))
    req = {"lib": str(Path(a.lib).resolve()), "export": str(export), "model": ["backend=ort", f"threads={a.threads}"],
           "stream": tok.apply_chat_template([{"role": "user", "content":
                                               "Tell me a long story about a lighthouse keeper and the sea."}]),
           "long": tok.encode(text)[: a.long], "stream_tokens": 160, "after": a.after, "repeats": a.repeats,
           "settings": [(c, _setting(c)) for c in a.chunks]}
    ops = find_library()  # the op library the Python runtime uses, whichever libdflash2 runs
    out = run_driver(_JOIN, req, {"DFLASH2_ORT_OPS": str(ops or "/nonexistent")})
    print(f"{'chunk':>9} {'median gap ms':>14} {'worst gap ms':>13} {'worst/median':>13} {'long TTFT ms':>13}")
    for r in out:
        print(f"{r['chunk']:>9} {r['median_gap_ms']:14.1f} {r['worst_gap_ms']:13.1f} {r['worst_over_median']:13.1f} "
              f"{r['long_ttft_ms']:13.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": describe(), "command": "python benchmarks/capi_join_gap.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]), "runs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
