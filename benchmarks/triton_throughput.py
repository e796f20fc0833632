"""Serving throughput on a real ``tritonserver``: 1 / 2 / 4 / 8 / 16 concurrent gRPC streams of
MT-Bench first turns (SmolLM2-135M-Instruct fp32 fused + the packaged drafter: the demo's cached export),
``--tokens`` tokens each (EOS on: a request ends early at its EOS, the same tokens in every server), against
three servers built by ``dflash2 triton-repo`` and run by the bundled CPU server (:mod:`dflash2_trt.serving.triton.server`)::

    instances   today's layout: N instances (N = streams), each decoding one request at a time
                (--triton-instances N --triton-max-batch 1 --triton-speculation always), drafting every step
    batched_ar  one instance, all streams in one continuous batch, no drafting
                (--triton-max-batch 16 --triton-speculation off)
    adaptive    one instance, one continuous batch, drafting while the load-adaptive rule says it pays
                (--triton-max-batch 16 --triton-speculation adaptive)

    python benchmarks/triton_throughput.py --tokens 128 --out benchmarks/results/triton_throughput.json \
        --plot benchmarks/results/triton_throughput.png

Per cell (server x streams): every stream sends one request at the same moment; total output tokens / wall time
from the first send to the last final response; time per output token (TPOT) of each request = (last response
- first response) / (tokens - 1), p50 and p95 over the requests (over ``--rounds`` x streams requests); mean time
to the first token; the mean batch size the server decoded (its ``dflash2_batch_steps`` gauge) and, from the
responses, speculative cycles vs plain steps. Each server serves one warm-up request first. ``--repeats R`` runs
the servers R times in turn, odd repeats in reverse order (instances, batched_ar, adaptive, adaptive, batched_ar,
instances, ...: a steady drift of the machine's speed favours none), and keeps each cell's best run; it also prints
adaptive / batched_ar of each repeat (the two ran next to each other) and their median. Cells of one server measured
minutes after another's drift apart on a shared machine by more than the servers differ (one after the other,
6-24 % apart; three repeats in one order drifted 180 -> 134 tok/s). Checks that every request's tokens equal the
same prompt's tokens in every other server (greedy: the target's own). Prints the load average: on a shared machine
read the ratios, measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERVERS = {  # name -> (instances (None: = streams), max_batch, speculation)
    "instances": (None, 1, "always"),
    "batched_ar": (1, 16, "off"),
    "adaptive": (1, 16, "adaptive"),
}


def _request(url: str, ids: list[int], max_tokens: int) -> dict:
    """One streamed request -> {tokens, times (per response with tokens), cycles, plain, t0, error}."""
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    inputs = []
    for name, arr, dtype in (("input_ids", np.asarray(ids, dtype=np.int64), "INT64"),
                             ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")):
        i = grpcclient.InferInput(name, list(arr.shape), dtype)
        i.set_data_from_numpy(arr)
        inputs.append(i)
    client.start_stream(callback=lambda result, error: q.put((time.perf_counter(), result, error)))
    t0 = time.perf_counter()
    client.async_stream_infer("dflash2", inputs, enable_empty_final_response=True)
    out: dict = {"tokens": [], "times": [], "sizes": [], "cycles": 0, "plain": 0, "t0": t0, "error": None}
    while True:
        t, r, e = q.get(timeout=900)
        if e is not None:
            out["error"] = str(e)
            break
        resp = r.get_response()
        if resp.outputs:
            ids_ = r.as_numpy("output_ids").tolist()
            acc = r.as_numpy("accepted").tolist()
            if ids_:
                out["tokens"] += ids_
                out["times"].append(t)
                out["sizes"].append(len(ids_))
                out["cycles" if acc else "plain"] += 1
        if resp.parameters["triton_final_response"].bool_param:
            out["t_end"] = t
            break
    client.stop_stream()
    client.close()
    out["plain"] -= 1  # the prefill's first token
    return out


def _batch_steps(metrics_port: int) -> dict[int, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[int, float] = {}
    for size, v in re.findall(r'^dflash2_batch_steps{[^}]*size="(\d+)"[^}]*} (\S+)$', text, flags=re.M):
        out[int(size)] = out.get(int(size), 0.0) + float(v)
    return out


def _cell(srv, prompts: list[list[int]], streams: int, tokens: int, rounds: int) -> tuple[dict, list[list[int]]]:
    """``rounds`` times: ``streams`` requests sent at once (prompts i..i+streams-1) -> the cell's figures."""
    steps0 = _batch_steps(srv.metrics_port)
    reqs, wall, all_tokens = [], 0.0, []
    for r in range(rounds):
        batch = [prompts[(r * streams + i) % len(prompts)] for i in range(streams)]
        outs: list = [None] * streams
        go = threading.Barrier(streams)

        def client(i: int, batch=batch, outs=outs, go=go) -> None:  # noqa: ANN001
            go.wait()
            outs[i] = _request(srv.grpc_url, batch[i], tokens)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [o["error"] for o in outs if o["error"]]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
        wall += max(o["t_end"] for o in outs) - min(o["t0"] for o in outs)
        reqs += outs
        all_tokens += [o["tokens"] for o in outs]
    time.sleep(0.5)  # the model updates its batch gauge after a request's final response
    steps1 = _batch_steps(srv.metrics_port)
    d = {k: steps1.get(k, 0.0) - steps0.get(k, 0.0) for k in steps1}
    n_steps = sum(d.values())
    tpot = [(o["times"][-1] - o["times"][0]) / (len(o["tokens"]) - 1) for o in reqs if len(o["tokens"]) > 1]
    n_tok = sum(len(o["tokens"]) for o in reqs)
    return {"streams": streams, "requests": len(reqs), "tokens": n_tok, "wall_s": wall,
            "tokens_per_s": n_tok / wall, "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)),
            "tpot_p95_ms": 1e3 * float(np.percentile(tpot, 95)),
            "ttft_mean_ms": 1e3 * float(np.mean([o["times"][0] - o["t0"] for o in reqs])),
            "mean_batch": (sum(k * v for k, v in d.items()) / n_steps) if n_steps else None,
            "cycles": sum(o["cycles"] for o in reqs), "plain_steps": sum(o["plain"] for o in reqs)}, all_tokens


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.serving.triton import server as S
    from dflash2_trt.bench.prompts import encode_items, load_prompts
    from dflash2_trt.serving.triton import repo as T
    from dflash2_trt.paths import cache_dir
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="times each cell sends its streams' requests")
    ap.add_argument("--repeats", type=int, default=1, help="the servers run this many times in turn; best cell kept")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads per instance")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="PNG: tokens/s against streams, one line per server")
    a = ap.parse_args(argv)
    from dflash2_trt.bench.exports import demo_export

    a.export = demo_export(a.export)
    tok = TextTokenizer(a.export)
    n_prompts = max(a.streams) * a.rounds
    prompts = encode_items(load_prompts("mtbench", min(n_prompts, 80)), tok.encode,
                           lambda m: tok.apply_chat_template(m))
    tmp = tempfile.TemporaryDirectory(prefix="triton-bench-", dir=cache_dir())  # beside the export: hard links
    work = Path(tmp.name)
    backends = S.backend_dir(cache_dir())
    best: dict[str, dict[int, dict]] = {}  # server -> streams -> its best cell over the repeats
    runs: dict[str, dict[int, list[float]]] = {}  # server -> streams -> tokens/s of each repeat, in run order
    tokens_of: dict[tuple[str, int, int], list[int]] = {}  # (server, streams, request) -> tokens
    differs: list[tuple[str, int, int]] = []  # cells whose tokens changed between repeats
    load = [os.getloadavg()[0]]

    def run_server(name: str, instances: int, max_batch: int, speculation: str, streams: list[int]) -> None:
        repo = work / f"{name}-{instances}"
        T.write_triton_repo(a.export, repo, instances=instances, max_batch=max_batch, speculation=speculation,
                            ort_threads=a.threads, verify_checksums=False, default_max_tokens=a.tokens)
        with S.TritonServer(repo, backends, work / f"{name}-{instances}.log", timeout=600) as srv:
            _request(srv.grpc_url, prompts[0], 16)  # warm-up: sessions, buffers, measured costs
            for n in streams:
                cell, toks = _cell(srv, prompts, n, a.tokens, a.rounds)
                cell.update(server=name, instances=instances, max_batch=max_batch, speculation=speculation)
                runs.setdefault(name, {}).setdefault(n, []).append(cell["tokens_per_s"])
                old = best.setdefault(name, {}).get(n)
                if old is None or cell["tokens_per_s"] > old["tokens_per_s"]:
                    best[name][n] = cell
                for i, t in enumerate(toks):  # a repeat's tokens must equal the earlier repeats' too
                    if tokens_of.setdefault((name, n, i), t) != t:
                        differs.append((name, n, i))
                load.append(os.getloadavg()[0])
                print(f"{name:10s} {n:3d} streams: {cell['tokens_per_s']:7.1f} tok/s, TPOT p50 "
                      f"{cell['tpot_p50_ms']:6.1f} ms p95 {cell['tpot_p95_ms']:6.1f} ms, mean batch "
                      f"{cell['mean_batch'] or 0:.2f}, cycles {cell['cycles']} plain {cell['plain_steps']}",
                      flush=True)
        shutil.rmtree(repo)  # ours: made above in our own temporary folder

    for r in range(a.repeats):
        # odd repeats in reverse order (A B, B A, ...): a drift of the machine's speed favours no server
        for name in (a.servers if r % 2 == 0 else a.servers[::-1]):
            instances, max_batch, speculation = SERVERS[name]
            if instances is None:
                for n in a.streams:
                    run_server(name, n, max_batch, speculation, [n])
            else:
                run_server(name, instances, max(max_batch, max(a.streams)), speculation, a.streams)
    cells = {name: [best[name][n] for n in a.streams] for name in a.servers}

    # lossless: every request's tokens equal the same prompt's tokens in every other server
    same = not differs and all(t == tokens_of[(a.servers[0], k[1], k[2])] for k, t in tokens_of.items())
    print(f"same tokens in every server: {same}; load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs")
    print(f"{'streams':>7s} " + " ".join(f"{s + ' tok/s':>18s}" for s in a.servers) + "   adaptive / max(AR, spec. alone)")
    for j, n in enumerate(a.streams):
        row = {s: cells[s][j]["tokens_per_s"] for s in a.servers}
        ratio = ""
        if {"adaptive", "batched_ar", "instances"} <= set(a.servers):
            single_spec = cells["instances"][0]["tokens_per_s"] if a.streams[0] == 1 else float("nan")
            ratio = f"{row['adaptive'] / max(row['batched_ar'], single_spec):.2f}"
        print(f"{n:7d} " + " ".join(f"{row[s]:18.1f}" for s in a.servers) + f"   {ratio}")
    paired = {}  # streams -> adaptive / batched_ar of each repeat (the two ran next to each other)
    if {"adaptive", "batched_ar"} <= set(a.servers):
        paired = {n: [x / y for x, y in zip(runs["adaptive"][n], runs["batched_ar"][n])] for n in a.streams}
        for n, q in paired.items():
            print(f"{n:3d} streams: adaptive / batched_ar per repeat " + " ".join(f"{x:.2f}" for x in q)
                  + f", median {float(np.median(q)):.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "machine": describe(),
            "command": " ".join(["python", "benchmarks/triton_throughput.py", *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "export": str(a.export),
            "tokens": a.tokens, "rounds": a.rounds, "repeats": a.repeats, "ort_threads": a.threads, "cpus": os.cpu_count(),
            "loadavg_min_max": [min(load), max(load)], "same_tokens_every_server": same, "cells": cells,
            "tokens_per_s_per_repeat": runs, "adaptive_over_batched_ar_per_repeat": paired},
            indent=1) + "\n")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for s in a.servers:
            ax.plot([c["streams"] for c in cells[s]], [c["tokens_per_s"] for c in cells[s]], marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("total output tokens/s")
        ax.set_title(f"tritonserver (CPU), SmolLM2-135M fp32, {a.tokens} tokens")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
