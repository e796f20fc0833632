"""libdflash2 on ONNX Runtime against the Python runtime: tokens/s on the same export and threads, side by side in
one run, autoregressive and speculative (with the acceptance guard, the Python API's default, and without).

    python benchmarks/capi_vs_python.py [--export DIR] [--prompts 10] [--max-new 64] [--threads 2] [--rounds 2]

The C side is runtime/examples/generate (``-s``: the prompts in turn through one session) of a libdflash2 build
(``--build``, default build/capi-release: ``cmake -S runtime -B build/capi-release -DCMAKE_BUILD_TYPE=Release``,
then ``cmake --build build/capi-release -j2``), with the project's op library as the Python
runtime finds it ($DFLASH2_ORT_OPS); the Python side is ``dflash2_trt.load(DIR, backend="ort", threads=N)``. Each round
runs C and Python for each mode, back to back (alternating which goes first); tokens/s = tokens / decode seconds
summed over the prompts (model load excluded,
prefill included, as both runtimes count ``elapsed_s``). Greedy ids must be equal (checked). Prints a Markdown table
(the README's) and ``--json`` the numbers. Default export: SmolLM2 with the identity-initialised drafter
(``dflash2_trt.bench.exports.identity_export``, the one tests/test_capi_ort.py compares the runtimes on).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_c(build: Path, export: Path, prompts: list[list[int]], max_new: int, threads: int, speculative: bool,
          guard: bool, ops: str) -> tuple[list[list[int]], float, str]:
    """-> (ids per prompt, tokens/s over the prompts, the library's note)."""
    args = [str(build / "bin" / "generate"), str(export), "-s"]
    for i, p in enumerate(prompts):
        args += ([","] if i else []) + [str(t) for t in p]
    for o in ("backend=ort", f"threads={threads}", f"max_new_tokens={max_new}", f"guard={'true' if guard else 'false'}",
              f"speculative={'true' if speculative else 'false'}", "eos_ids="):
        args += ["-o", o]
    env = {**os.environ, "DFLASH2_ORT_OPS": ops, "VIRTUAL_ENV": os.environ.get("VIRTUAL_ENV", sys.prefix)}
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"capi_vs_python: generate failed: {proc.stderr.strip()[-500:]}")
    ids = [[int(t) for t in line.split()] for line in proc.stdout.strip().splitlines()]
    runs = re.findall(r"(\d+) tokens, .*?, (\d+\.\d+) s, ", proc.stderr)
    tokens, seconds = sum(int(n) for n, _ in runs), sum(float(s) for _, s in runs)
    return ids, tokens / seconds, proc.stderr.splitlines()[0].removeprefix("generate: ")


def run_python(gen, prompts: list[list[int]], max_new: int, speculative: bool, guard: bool  # noqa: ANN001
               ) -> tuple[list[list[int]], float]:
    ids, tokens, seconds = [], 0, 0.0
    for p in prompts:
        r = gen.generate(p, max_new_tokens=max_new, speculative=speculative, guard=guard, eos_ids=set())
        ids.append(r.tokens)
        tokens += len(r.tokens)
        seconds += r.stats.elapsed_s
    return ids, tokens / seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, default=None)
    ap.add_argument("--build", type=Path, default=ROOT / "build" / "capi-release")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import dflash2_trt
    from dflash2_trt.bench.exports import identity_export
    from dflash2_trt.bench.prompts import encode_items, load_prompts
    from dflash2_trt.runtime.ort.decode_attention import find_library

    export = identity_export(a.export)
    ops = str(find_library() or "")
    gen = dflash2_trt.load(export, backend="ort", threads=a.threads)
    prompts = encode_items(load_prompts("mtbench", a.prompts), gen._tok.encode,  # noqa: SLF001
                           gen._tok.apply_chat_template)  # noqa: SLF001
    gen.generate(prompts[0], max_new_tokens=4)  # sessions open
    # speculative: the guard on (both APIs' way to decode with a drafter that may not pay); "no guard": every step a
    # cycle where a proposer has drafts (the step kinds do not follow the measured times: the same work on both sides)
    modes = {"autoregressive": (False, True), "speculative": (True, True), "speculative, no guard": (True, False)}
    rates: dict[str, dict[str, list[float]]] = {m: {"c": [], "python": []} for m in modes}
    note = ""
    for r in range(a.rounds):
        for mode, (spec, guard) in modes.items():
            if r % 2:  # every other round Python first: a drift of the machine's load hits both sides alike
                py_ids, py_rate = run_python(gen, prompts, a.max_new, spec, guard)
            c_ids, c_rate, note = run_c(a.build, export, prompts, a.max_new, a.threads, spec, guard, ops)
            if not r % 2:
                py_ids, py_rate = run_python(gen, prompts, a.max_new, spec, guard)
            if c_ids != py_ids:
                sys.exit(f"capi_vs_python: {mode}: the C library's ids differ from the Python runtime's")
            rates[mode]["c"].append(c_rate)
            rates[mode]["python"].append(py_rate)
    cpu = platform.processor() or platform.machine()
    print(f"{a.prompts} MT-Bench prompts x {a.max_new} tokens, greedy, {a.threads} threads, {a.rounds} rounds "
          f"(median), {os.cpu_count()} CPUs ({cpu}); C: {note}")
    print("| mode | Python runtime tok/s | libdflash2 (C) tok/s | C / Python (median of the rounds' ratios) |")
    print("|---|---|---|---|")
    out = {}
    for mode, r in rates.items():
        py, c = statistics.median(r["python"]), statistics.median(r["c"])
        ratio = statistics.median(cr / pr for cr, pr in zip(r["c"], r["python"]))
        out[mode] = {"python": r["python"], "c": r["c"]}
        print(f"| {mode} | {py:.1f} | {c:.1f} | {ratio:.2f}x |")
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
