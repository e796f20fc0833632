"""GPU check of the TensorRT path on a machine WITH TensorRT (run by ``benchmarks/trt_gpu_check.sh``).

    python benchmarks/trt_gpu_check.py DIR [--plugin LIB] [--prompts 4] [--max-new-tokens 32] [--json]

DIR is an export folder whose engines were built with ``dflash2 build-engines DIR --selector both``. Checks,
one row each in the printed table (markdown; ``--json`` for machine-readable output):

1. **version**: TensorRT version and major supported; the plugin library built for the same major
   (``dfl2PluginsTensorRTMajor``);
2. **double load**: TensorRT's raw ``load_library`` of an already registered library answers None (the
   semantics the CPU fakes model), and :func:`~dflash2_trt.runtime.trt.env.load_plugin_library` accepts a
   second load; two backends open in one process;
3. **contexts on one profile**: verify steps of every row count 1..block size (one execution context per
   shape bucket, all on the ``step`` profile) give the same logits as the eager backend;
4. **capture/replay**: the verify step's logits from graph replay are bit-equal to eager;
5. **plugin head = decomposed head**: one block pass; its output buffer is fed to the plugin head and to the
   decomposed head engine (identical inputs, :func:`head_on`): equal candidates and paths, proposals within
   1e-6;
6. **target vs ORT**: autoregressive decoding on TensorRT and ONNX Runtime token by token; at the first
   divergence the position, both tokens, ORT's top-1 minus top-2 logit margin there and the largest
   |logit difference|. A divergence where that margin is below ``TIE_REL`` (1e-4) x max|logit| is a near-tie
   (float rounding decides it, both continuations are right): reported, not a failure (:func:`verdict`);
7. **graph vs eager decoding**: speculative decoding with graphs on and off, token by token;
8. **verify-step timing**: eager vs graph replay, milliseconds per step.

The former per-layer "selector share" is gone: once TensorRT fuses layers, layer names no longer say which
work belongs to the selector. Exit 1 when a check of 1-7 fails; 8 is a measurement. Status: never run (no
machine with TensorRT was available while writing it; see dflash2_trt/runtime/trt/README.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from dflash2_trt.runtime.request import GenerationRequest


TIE_REL = 1e-4  # a top-1 / top-2 margin below TIE_REL * max|logit| is a tie up to float rounding


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(8, 40))).tolist() for _ in range(n)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the token lists differ (length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(logits: np.ndarray) -> float:
    """logits [V]: top-1 minus top-2 value."""
    part = np.partition(np.asarray(logits, np.float64), -2)[-2:]
    return float(part[1] - part[0])


def near_tie(logits: np.ndarray, rel: float = TIE_REL) -> bool:
    """logits [V]: top-1 minus top-2 below ``rel`` times the largest |logit| (a tie up to float rounding)."""
    return top2_margin(logits) < rel * float(np.abs(np.asarray(logits, np.float64)).max())


def verdict(t_tok: list[int], o_tok: list[int], o_logits: list[np.ndarray]) -> tuple[str, int | None]:
    """TensorRT vs ORT greedy tokens (ORT's logits [V] per step): ("same", None), ("tie", k) when they first
    differ at step k where ORT's logits are a near-tie, else ("diverged", k)."""
    k = first_divergence(t_tok, o_tok)
    if k is None:
        return "same", None
    if k < len(o_logits) and near_tie(o_logits[k]):
        return "tie", k
    return "diverged", k


def head_on(dr: Any, hidden: int, anchor: int, temperature: float, uniforms: np.ndarray | None) -> Any:
    """Runs the draft runner's head engine alone on the device hidden states at address ``hidden``
    ([1, bs, H], e.g. another runner's block output), eagerly; returns its Draft."""
    from dflash2_trt.runtime.protocol import Draft
    from dflash2_trt.runtime.trt.backend import _step

    be, hio, L, K = dr.be, dr.hio, dr.L, dr.K
    hio["anchor_ids"].host_view((1,))[0] = anchor
    hio["temperature"].host_view((1,))[0] = temperature
    hio["uniforms"].host_view((1, L))[...] = 0.0 if uniforms is None else np.asarray(uniforms, np.float32).reshape(1, L)
    addr = {k: t.dev for k, t in hio.items()}
    addr["hidden"] = hidden
    ctx = dr.head_eng.bind(0, {"hidden": dr.bio["hidden"].max_shape, "anchor_ids": (1,), "temperature": (1,),
                               "uniforms": (1, L)}, addr, False)
    h2d = [(hio["anchor_ids"], (1,)), (hio["temperature"], (1,)), (hio["uniforms"], (1, L))]
    d2h = [(hio[k], hio[k].max_shape) for k in ("cand_ids", "path_ids", "proposal_probs")]
    _step(be, [(dr.head_eng, ctx)], h2d, d2h)()
    be.sync()
    return Draft(tokens=hio["path_ids"].host_view((1, L))[0].astype(np.int64),
                 proposal=hio["proposal_probs"].host_view((1, L, K))[0].astype(np.float32),
                 cand=hio["cand_ids"].host_view((1, L, K))[0].astype(np.int64))


def _ar_with_logits(target: Any, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy autoregressive decoding that keeps each step's logits [V]."""
    target.reset()
    logits, _ = target.forward(prompt)
    toks: list[int] = []
    rows = [logits[-1]]
    for _ in range(n):
        toks.append(int(np.argmax(rows[-1])))
        logits, _ = target.forward([toks[-1]])
        rows.append(logits[-1])
    return toks, rows[:-1]


def check(d: Path, plugin: Path | None, n_prompts: int, max_new: int) -> list[dict[str, Any]]:
    import tensorrt as trt

    from dflash2_trt.runtime.decoder import speculative_generate
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.trt.backend import TrtBackend
    from dflash2_trt.runtime.trt.env import SUPPORTED_TRT_MAJORS, load_plugin_library, version_tuple
    from dflash2_trt.vocabulary import head_key

    rows: list[dict[str, Any]] = []

    def row(name: str, ok: bool | None, detail: str) -> None:
        rows.append({"check": name, "ok": ok, "detail": detail})
        print(f"trt_gpu_check: {name}: {'PASS' if ok else ('-' if ok is None else 'FAIL')} {detail}", file=sys.stderr)

    # 1. versions
    major = version_tuple(trt.__version__)[0]
    built = None
    if plugin is not None:
        built = int(ctypes.CDLL(str(plugin)).dfl2PluginsTensorRTMajor())
    row("version", major in SUPPORTED_TRT_MAJORS and built in (None, major),
        f"TensorRT {trt.__version__}; plugin library built for TensorRT {built if built is not None else '-'}")

    # 2. double load: the raw registry answers None for a registered library; ours accepts it
    if plugin is not None:
        from dflash2_trt.manifest import read_manifest

        spec = read_manifest(d, verify_checksums=False).plugin
        load_plugin_library(trt, plugin, spec)
        raw = trt.get_plugin_registry().load_library(str(plugin))
        load_plugin_library(trt, plugin, spec)
        row("double load_library", raw is None, f"raw second load_library -> {raw!r}; load_plugin_library twice ok")
    g = TrtBackend(d, cuda_graphs=True, plugin=plugin)
    e = TrtBackend(d, cuda_graphs=False, plugin=plugin, verify_checksums=False)
    o = OrtBackend(d, verify_checksums=False)
    m = g.manifest
    bs, vocab = m.drafter_config.block_size, m.target.vocab_size
    prompts = _prompts(vocab, n_prompts)
    tg, te, to = g.target_runner(), e.target_runner(), o.target_runner()

    # 3-4. contexts on one profile; capture/replay = eager (bitwise)
    p = prompts[0]
    worst, bitwise = 0.0, True
    for rows_n in range(1, bs + 1):
        ids = [(7 * i + rows_n) % vocab for i in range(rows_n)]
        outs = []
        for t in (tg, te):
            t.reset()
            t.forward(p)
            outs.append(t.forward(ids)[0])  # graph backend: captured (first use of this bucket)
        tg.crop(len(p))
        replay = tg.forward(ids)[0]
        bitwise &= tg.last_path == "replay" and np.array_equal(replay, outs[1])
        worst = max(worst, float(np.abs(outs[0] - outs[1]).max()))
    n_ctx = tg.eng.n_contexts
    row("several contexts on one profile", worst == 0.0,
        f"{bs} shape buckets on the step profile, {n_ctx} contexts; max |captured - eager| = {worst:.3g}")
    row("capture/replay bit-equal to eager", bitwise, f"verify logits of rows 1..{bs}, replay vs eager")

    # 5. plugin head = decomposed head, on identical inputs: one block pass feeds both heads
    if head_key("greedy", plugin=True) in e.entry.plans and head_key("greedy") in e.entry.plans:
        to.reset()
        feats = to.forward(p)[1]  # [len(p), F] context features
        same, dq = True, 0.0
        for mode, temp in (("greedy", 0.0), ("viterbi", 0.0), ("viterbi", 0.8)):
            plug = e.draft_runner(mode)  # the plugin head (preferred when built)
            e.head_engine_key = lambda mode: head_key(mode)  # type: ignore[method-assign]
            dec = e.draft_runner(mode)
            del e.head_engine_key
            plug.reset()
            plug.add_context(feats, 0)
            u = np.full((1, plug.L), 0.37, np.float32) if temp > 0 else None
            d_plug = plug.propose(p[-1], len(p), plug.L, temp, u)
            d_dec = head_on(dec, plug.bio["hidden"].dev, p[-1], temp, u)
            same &= np.array_equal(d_plug.cand, d_dec.cand) and np.array_equal(d_plug.tokens, d_dec.tokens)
            dq = max(dq, float(np.abs(d_plug.proposal - d_dec.proposal).max()))
        row("plugin head = decomposed head", same and dq <= 1e-6,
            f"one block output into both heads; greedy, Viterbi T=0 and T=0.8: ids {'equal' if same else 'DIFFER'}, "
            f"max |dq| = {dq:.3g}")
    else:
        row("plugin head = decomposed head", None, "engines not built with --selector both")

    # 6. target vs ORT, token by token, with the margin at the first divergence
    diverged, detail = 0, []
    for i, q in enumerate(prompts):
        t_tok, t_logits = _ar_with_logits(tg, q, max_new)
        o_tok, o_logits = _ar_with_logits(to, q, max_new)
        kind, k = verdict(t_tok, o_tok, o_logits)
        if k is not None:
            diverged += kind == "diverged"
            detail.append(f"prompt {i}: {'near-tie' if kind == 'tie' else 'DIVERGED'} at step {k}: TRT {t_tok[k]} vs "
                          f"ORT {o_tok[k]}, ORT margin {top2_margin(o_logits[k]):.3g}, max |dlogit| "
                          f"{float(np.abs(t_logits[k] - o_logits[k]).max()):.3g}")
    row("target logits vs ORT", diverged == 0,
        f"{len(prompts)} prompts x {max_new} tokens: " + ("identical" if not detail else "; ".join(detail)))

    # 7. graph vs eager speculative decoding, token by token
    dg, de = g.draft_runner("greedy"), e.draft_runner("greedy")
    bad = []
    for i, q in enumerate(prompts):
        r = GenerationRequest(max_new_tokens=max_new, eos_ids=frozenset(), proposer="dflash2", guard=False)
        g_tok = speculative_generate(tg, dg, q, r).tokens
        e_tok = speculative_generate(te, de, q, r).tokens
        k = first_divergence(g_tok, e_tok)
        if k is not None:
            bad.append(f"prompt {i} at token {k}")
    row("graph vs eager decoding", not bad, "identical" if not bad else ", ".join(bad))

    # 8. verify-step timing
    ids = list(range(10, 10 + bs))

    def per_step(t: Any, n: int = 50) -> float:
        t.reset()
        t.forward(p)
        t.forward(ids)
        t0 = time.perf_counter()
        for _ in range(n):
            t.crop(len(p))
            t.forward(ids)
        return (time.perf_counter() - t0) / n * 1e3

    eager_ms, replay_ms = per_step(te), per_step(tg)
    row("verify step timing", None, f"{bs} rows: eager {eager_ms:.3f} ms, graph replay {replay_ms:.3f} ms")
    g.close()
    e.close()
    o.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trt_gpu_check", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--plugin", type=Path, default=None, help="libdflash2_plugins.so the engines were built with")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from dflash2_trt.errors import DFlash2Error

    try:
        rows = check(a.dir, a.plugin, a.prompts, a.max_new_tokens)
    except DFlash2Error as e:
        print(f"trt_gpu_check: error: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        print("| check | result | detail |\n|---|---|---|")
        for r in rows:
            print(f"| {r['check']} | {'PASS' if r['ok'] else ('-' if r['ok'] is None else 'FAIL')} | {r['detail']} |")
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
