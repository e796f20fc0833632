"""What the prefix cache saves a user: time to first token of a growing conversation, turn by turn, and of a long
prompt sent again, with the cache and without (two Generators on the same export, the same requests interleaved
request by request so that drift hits both alike), the tokens of each pair compared.

- conversation: a system prompt, then ``--turns`` user turns of ``--turn-tokens`` tokens (MT-Bench questions
  padded with context), each answered greedily with ``--max-new-tokens`` tokens (EOS ignored) that join the history
  (turn 6 at ~2.1k tokens by default);
- repeated: one ``--long``-token prompt sent ``--repeats`` times.

Prints the per-turn table (ms without, ms with, ratio, tokens restored) and the geometric mean of turns 2..6;
``--json`` writes every figure with ``dflash2_trt.bench.machine.describe()``.

``--peer URL``: the same conversation (the same system prompt and user turns; each engine continues with its own
answers, ``--max-new-tokens`` of them, end of sequence ignored) against a llama-server at URL (llama.cpp's server on
the demo pair converted to GGUF by llama.cpp's own script), time to the first streamed content token of
its OpenAI chat endpoint with ``cache_prompt`` false in slot 0 and true in slot 1 (start it with ``-np 2``, so
that the cached slot holds only the earlier turns), request by request as above. Our times are taken in process
(``Generator.stream``), the peer's over loopback HTTP (a few ms more).

    python benchmarks/prefix_cache_turns.py [--export DIR | --max-seq-len 4096] [--threads 2] [--turns 8]
                                            [--turn-tokens 170] [--max-new-tokens 180] [--long 1600]
                                            [--peer http://127.0.0.1:8081] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

TURN_FILLER = ("Here is some context from the previous work session, with file names, function names and the "
               "errors we saw, so that you can answer precisely. ")


def _ttft(gen, prompt, max_new: int) -> tuple[float, list[int], int]:  # noqa: ANN001
    """(seconds to the first chunk, the tokens, the prompt tokens restored from the cache)."""
    t = time.perf_counter()
    first = None
    stream = gen.stream(prompt, max_new_tokens=max_new, eos_ids=set())
    for _ in stream:
        if first is None:
            first = time.perf_counter() - t
    r = stream.result
    return first, list(r.tokens), r.stats.cached_tokens


def _peer_ttft(url: str, messages: list[dict], max_new: int, cache: bool) -> tuple[float, str, int]:
    """llama-server: (seconds to the first streamed content, the answer's text, prompt tokens it reused)."""
    import urllib.request

    body = {"messages": messages, "max_tokens": max_new, "temperature": 0, "stream": True, "cache_prompt": cache,
            "ignore_eos": True, "id_slot": int(cache)}  # slot 1 holds the cached conversation only
    rq = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=json.dumps(body).encode(),
                                headers={"Content-Type": "application/json"})
    t, first, text, reused = time.perf_counter(), None, [], 0
    with urllib.request.urlopen(rq, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - t
                    text.append(piece)
            timings = chunk.get("timings")
            if timings:
                reused = int(timings.get("cache_n", reused))
    assert first is not None, "the peer streamed no content"
    return first, "".join(text), reused


def _peer_turns(url: str, system: dict, user_turns: list[str], max_new: int) -> list[dict]:
    history, rows = [system], []
    for i, text in enumerate(user_turns):
        history.append({"role": "user", "content": text})
        t_off, _, _ = _peer_ttft(url, history, max_new, cache=False)
        t_on, answer, reused = _peer_ttft(url, history, max_new, cache=True)
        rows.append({"turn": i + 1, "off_ms": 1e3 * t_off, "on_ms": 1e3 * t_on, "ratio": t_off / t_on,
                     "cached_tokens": reused})
        print(f"peer turn {i + 1}: off {1e3 * t_off:.0f} ms, on {1e3 * t_on:.0f} ms, {t_off / t_on:.1f}x, "
              f"reused {reused}")
        history.append({"role": "assistant", "content": answer})
    return rows


def _user_turns(gen, n: int, turn_tokens: int) -> list[str]:  # noqa: ANN001
    from dflash2_trt.bench.prompts import load_prompts

    out = []
    for item in load_prompts("mtbench", limit=n):
        text = item["messages"][0]["content"]
        while len(gen.encode(text, chat=False)) < turn_tokens:
            text = TURN_FILLER + text
        out.append(text)
    return out


def main(argv: list[str] | None = None) -> int:
    import dflash2_trt
    from dflash2_trt.bench.demo import DEMO_DRAFT_VOCAB, demo_drafter_path
    from dflash2_trt.export.cache import cached_export
    from dflash2_trt.bench.machine import describe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", default=None, help="an export folder (default: the demo pair exported with "
                                                  "--max-seq-len positions, cached)")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=170)
    p.add_argument("--max-new-tokens", type=int, default=180)
    p.add_argument("--long", type=int, default=1600)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peer", default=None, help="a llama-server URL to run the same conversation against")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    export = a.export or cached_export("smollm2", demo_drafter_path(), max_seq_len=a.max_seq_len,
                                       draft_vocab=DEMO_DRAFT_VOCAB)
    off = dflash2_trt.load(export, backend="ort", threads=a.threads, prefix_cache_bytes=0)
    on = dflash2_trt.load(export, backend="ort", threads=a.threads)
    for g in (off, on):  # ONNX Runtime's first runs (allocations, thread pool) are nobody's time to first token
        g.generate("Hello", max_new_tokens=4)
    on.prefix_cache.clear()
    system = {"role": "system", "content": "You are a careful coding assistant. " + TURN_FILLER * 3}
    history = [system]
    user_turns = _user_turns(off, a.turns, a.turn_tokens)
    turns = []
    print(f"{'turn':>4} {'prompt':>7} {'off ms':>8} {'on ms':>8} {'ratio':>6} {'restored':>9} equal")
    for i, text in enumerate(user_turns):
        history.append({"role": "user", "content": text})
        n = len(off.encode(history))
        if n + a.max_new_tokens > off.max_positions:
            print(f"turn {i + 1}: {n} prompt tokens exceed the export's {off.max_positions} positions; stopping")
            break
        t_off, tok_off, _ = _ttft(off, history, a.max_new_tokens)
        t_on, tok_on, cached = _ttft(on, history, a.max_new_tokens)
        turns.append({"turn": i + 1, "prompt_tokens": n, "off_ms": 1e3 * t_off, "on_ms": 1e3 * t_on,
                      "ratio": t_off / t_on, "cached_tokens": cached, "equal": tok_off == tok_on})
        r = turns[-1]
        print(f"{r['turn']:>4} {n:>7} {r['off_ms']:8.0f} {r['on_ms']:8.0f} {r['ratio']:6.1f} {cached:>9} "
              f"{r['equal']}")
        history.append({"role": "assistant", "content": off.decode(tok_off)})
    later = [r["ratio"] for r in turns if 2 <= r["turn"] <= 6]
    gmean = math.exp(sum(map(math.log, later)) / len(later)) if later else float("nan")
    print(f"geometric mean of turns 2..6: {gmean:.1f}x")
    long_ids = off.encode(" ".join([TURN_FILLER] * 200), chat=False)[: a.long]
    repeated = []
    for k in range(a.repeats):
        t_off, tok_off, _ = _ttft(off, long_ids, 16)
        t_on, tok_on, cached = _ttft(on, long_ids, 16)
        repeated.append({"send": k + 1, "off_ms": 1e3 * t_off, "on_ms": 1e3 * t_on, "ratio": t_off / t_on,
                         "cached_tokens": cached, "equal": tok_off == tok_on})
        print(f"repeat {k + 1}: {len(long_ids)} tokens, off {1e3 * t_off:.0f} ms, on {1e3 * t_on:.0f} ms, "
              f"{t_off / t_on:.1f}x, restored {cached}, equal {tok_off == tok_on}")
    peer = _peer_turns(a.peer, system, user_turns[: len(turns)], a.max_new_tokens) if a.peer else None
    peer_gmean = None
    if peer:
        later = [r["ratio"] for r in peer if 2 <= r["turn"] <= 6]
        peer_gmean = math.exp(sum(map(math.log, later)) / len(later)) if later else float("nan")
        print(f"peer geometric mean of turns 2..6: {peer_gmean:.1f}x")
        for ours, theirs in zip(turns, peer):
            print(f"turn {ours['turn']}: cached time to first token, ours / peer's = "
                  f"{ours['on_ms'] / theirs['on_ms']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": describe(), "command": "python benchmarks/prefix_cache_turns.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]), "turns": turns,
                       "turns_2_6_geomean": gmean, "repeated": repeated, "peer": peer,
                       "peer_turns_2_6_geomean": peer_gmean}, f, indent=1)
    off.close()
    on.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
