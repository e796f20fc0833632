"""``dflash2 serve`` under load: total tokens/s, time per output token (p50 / p95 over requests) and time to first
token at 1 / 4 / 8 / 16 concurrent streams, for a server with ``--speculation adaptive`` against one with
``--speculation off`` (batched plain decoding), and the single-stream overhead of HTTP: tokens/s of one stream
through the server against ``Generator.stream`` (the B = 1 loop) and ``Generator.submit`` (the batch loop the server
runs) in this process. SmolLM2-135M-Instruct fp32 fused (the demo's cached export), MT-Bench first turns sent as
token ids to ``/v1/completions``, greedy, EOS off (``ignore_eos``) so every request makes exactly ``--tokens``
tokens::

    DFLASH2_ORT_SPINNING=0 python benchmarks/serve_concurrency.py --threads 2 --tokens 128 --repeats 2 \
        --streams 1 4 8 16 --out benchmarks/results/serve_concurrency.json

Both servers run at once (``--max-batch`` = the largest ``--streams``), each on a free loopback port (with
``DFLASH2_ORT_SPINNING=0`` the idle one takes no CPU); every cell sends the same ``--requests`` prompts, at n
streams n at a time (a client thread takes the next prompt when its request ends), so the cells differ only in
concurrency; per repeat the two servers run each concurrency in turn (A B, then B A the next repeat) and the best
repeat counts (tokens/s: the total over the cell's wall time; TPOT per request: (last - first token) / (tokens - 1));
the ratio lines also print how far the repeats of a cell differ (the run's noise).
The single-stream comparison runs each prompt through the three paths in turn (rotating their order) and also
counts CPU seconds (the server process's and this one's: the work, steadier than wall time on a loaded machine).
The client is ``http.client`` reading the event stream (light: it shares the CPUs with the server). Also checks
that every streamed text equals its in-process greedy text (lossless through the server, at every concurrency).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODES = ("adaptive", "off")  # the server's --speculation: load-adaptive drafting | batched plain decoding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(export: Path, mode: str, threads: int, max_batch: int) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash2_trt.cli", "serve", str(export), "--port", str(port),
                             "--threads", str(threads), "--max-batch", str(max_batch), "--speculation", mode,
                             "--model-name", "m"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the {mode} server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the {mode} server did not start") from None
            time.sleep(0.3)


def _stream(port: int, ids: list[int], tokens: int) -> dict:
    """One streamed completion -> its text, times (send, first and last token), token count and τ."""
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {r.read()[:300]!r}")
    text, first, last, n, tau = [], None, None, 0, None
    for line in r:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            n = ev["usage"]["completion_tokens"]
            continue
        piece = ev["choices"][0]["text"]
        if piece:
            last = time.perf_counter()
            first = first or last
            text.append(piece)
        if "dflash2" in ev:
            tau = ev["dflash2"]["tau"] if ev["dflash2"]["cycles"] else None
    conn.close()
    return {"text": "".join(text), "t0": t0, "first": first, "last": last, "tokens": n, "tau": tau}


def _cell(port: int, prompts: list[list[int]], streams: int, tokens: int) -> list[dict]:
    """All prompts, ``streams`` at a time -> one record per request (in prompt order)."""
    todo: queue.Queue = queue.Queue()
    for i in range(len(prompts)):
        todo.put(i)
    out: list = [None] * len(prompts)

    def client() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            out[i] = _stream(port, prompts[i], tokens)

    threads = [threading.Thread(target=client) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _summary(recs: list[dict]) -> dict:
    wall = max(r["last"] for r in recs) - min(r["t0"] for r in recs)
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in recs if r["tokens"] > 1]
    taus = [r["tau"] for r in recs if r["tau"]]
    return {"tokens_per_s": sum(r["tokens"] for r in recs) / wall, "tpot_p50_ms": 1e3 * _pct(tpot, 0.5),
            "tpot_p95_ms": 1e3 * _pct(tpot, 0.95), "ttft_p50_ms": 1e3 * _pct([r["first"] - r["t0"] for r in recs], 0.5),
            "tau": sum(taus) / len(taus) if taus else None}


def main(argv: list[str] | None = None) -> int:
    import dflash2_trt
    from dflash2_trt.bench.prompts import encode_items, load_prompts

    sys.path.insert(0, str(ROOT / "benchmarks"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", default=None, help="export folder (default: the demo's cached export)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads of each server and in process")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per cell")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from dflash2_trt.bench.exports import demo_export

    a.export = demo_export(a.export)
    servers = {m: _start(a.export, m, a.threads, max(a.streams)) for m in MODES}
    best: dict[str, dict] = {}
    runs: dict[str, list[float]] = {}  # cell -> tokens/s of each repeat (their spread: the run's noise)
    single: dict[str, float] = {}  # path -> tokens per wall second
    single_cpu: dict[str, float] = {}  # path -> tokens per CPU second (HTTP: the server's and the client's)
    mismatches = 0
    try:
        with dflash2_trt.load(a.export, backend="ort", threads=a.threads) as g:
            prompts = encode_items(load_prompts("mtbench", a.requests), g._tok.encode,
                                   lambda m: g._tok.apply_chat_template(m))
            kw = dict(temperature=0.0, eos_ids=set())
            want = [g.generate(p, a.tokens, **kw).text for p in prompts]  # the references (and a warm-up)
            g.submit(prompts[0], 2, **kw).result()  # the batch loop's runners made before timing
            for m in MODES:
                _stream(servers[m][1], prompts[0], 2)  # warm-up
            adaptive_pid = servers["adaptive"][0].pid
            paths = {"http": lambda p: _stream(servers["adaptive"][1], p, a.tokens),
                     "stream": lambda p: [None for _c in g.stream(p, a.tokens, **kw)],
                     "submit": lambda p: [None for _c in g.submit(p, a.tokens, **kw)]}
            for rep in range(a.repeats):
                for n in a.streams:
                    for m in (MODES if rep % 2 == 0 else MODES[::-1]):
                        recs = _cell(servers[m][1], prompts, n, a.tokens)
                        mismatches += sum(r["text"] != w for r, w in zip(recs, want))
                        s = _summary(recs)
                        key = f"{m}/{n}"
                        runs.setdefault(key, []).append(s["tokens_per_s"])
                        if key not in best or s["tokens_per_s"] > best[key]["tokens_per_s"]:
                            best[key] = s
                # single stream, each prompt through HTTP (adaptive) | Generator.stream | submit in turn
                wall = dict.fromkeys(paths, 0.0)
                cpu = dict.fromkeys(paths, 0.0)
                for i, p in enumerate(prompts):
                    order = list(paths)[i % 3:] + list(paths)[:i % 3]
                    for k in order:
                        t, c, sc = time.perf_counter(), time.process_time(), _cpu_s(adaptive_pid)
                        paths[k](p)
                        wall[k] += time.perf_counter() - t
                        cpu[k] += time.process_time() - c + (_cpu_s(adaptive_pid) - sc if k == "http" else 0.0)
                for k in paths:
                    single[k] = max(single.get(k, 0.0), len(prompts) * a.tokens / wall[k])
                    single_cpu[k] = max(single_cpu.get(k, 0.0), len(prompts) * a.tokens / cpu[k])
    finally:
        for proc, _port in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    print(f"dflash2 serve, SmolLM2 fused fp32, {a.threads} threads per server, {a.tokens} tokens per request, "
          f"{a.requests} requests per cell, best of {a.repeats}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'speculation':12s} {'streams':>7s} {'tok/s':>8s} {'TPOT p50 ms':>11s} {'TPOT p95 ms':>11s} "
          f"{'TTFT p50 ms':>11s} {'tau':>5s}")
    for m in MODES:
        for n in a.streams:
            s = best[f"{m}/{n}"]
            tau = "-" if s["tau"] is None else f"{s['tau']:.2f}"
            print(f"{m:12s} {n:7d} {s['tokens_per_s']:8.1f} {s['tpot_p50_ms']:11.1f} {s['tpot_p95_ms']:11.1f} "
                  f"{s['ttft_p50_ms']:11.1f} {tau:>5s}")
    for n in a.streams:
        noise = max(1.0 - min(runs[f"{m}/{n}"]) / max(runs[f"{m}/{n}"]) for m in MODES)
        print(f"adaptive / off at {n:2d} streams: {best[f'adaptive/{n}']['tokens_per_s'] / best[f'off/{n}']['tokens_per_s']:.2f}x"
              f" (repeats of a cell differ by up to {100 * noise:.0f} %)")
    for what, d in (("wall", single), ("CPU", single_cpu)):
        print(f"single stream, tokens per {what} second: HTTP {d['http']:.1f}, Generator.stream {d['stream']:.1f} "
              f"(HTTP {d['http'] / d['stream']:.2f}x), Generator.submit {d['submit']:.1f} "
              f"(HTTP {d['http'] / d['submit']:.2f}x)")
    print(f"streamed texts equal to the in-process greedy text: "
          f"{'all' if not mismatches else f'{mismatches} differ'}")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "machine": describe(),
            "command": " ".join(["python", "benchmarks/serve_concurrency.py", *(argv or sys.argv[1:])]),
            "threads": a.threads, "tokens": a.tokens, "requests": a.requests, "repeats": a.repeats,
            "loadavg": os.getloadavg()[0], "cells": best, "repeats_tokens_per_s": runs, "single_stream_tokens_per_s": single,
            "single_stream_tokens_per_cpu_s": single_cpu,
            "mismatches": mismatches}, indent=1) + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
