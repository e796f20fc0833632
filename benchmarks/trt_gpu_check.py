"""GPU check of the TensorRT backend (needs an NVIDIA GPU, TensorRT >= 10.3 and cuda-python).

    python benchmarks/trt_gpu_check.py DIR [DIR ...] [--prompts 8] [--max-new-tokens 64] [--json]

For every export folder DIR (engines built with ``dflash2 build-engines DIR``):

1. **tokens**: greedy speculative and autoregressive decoding with TensorRT must equal ONNX Runtime token
   for token on the same prompts (fp32 exports; TF32 is off in the engines);
2. **graphs**: the same decoding with CUDA graphs on and off must give identical tokens, and the verify
   step's logits must be bitwise equal between replay and eager;
3. **speed**: speculative vs autoregressive tokens/s on TensorRT (same prompts, side by side; SPEC §4),
   τ, and the speedup (target: >= 2.7x at τ >= 5 — only meaningful with a trained drafter);
4. **selector share**: per-layer TensorRT profile of one eager cycle (drafter block + head + verify);
   share of layers named like the path selector / the convolutions (target: <= 2%);
5. **launch gaps**: wall time of the eager verify step vs its graph replay vs the summed layer time
   (gap = wall - layer time; target: replay removes >= 90% of the eager gap).

Prints a table (``--json`` for machine-readable output); exit 1 when a check of 1-2 fails. The targets of
3-5 are printed, not asserted. Status: **never run** (written without a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(8, 48))).tolist() for _ in range(n)]


class _LayerTimes:
    """A TensorRT IProfiler accumulating per-layer milliseconds."""

    def __new__(cls, trt: Any) -> Any:
        class P(trt.IProfiler):  # type: ignore[misc, name-defined]
            def __init__(self) -> None:
                trt.IProfiler.__init__(self)
                self.ms: dict[str, float] = {}

            def report_layer_time(self, layer_name: str, ms: float) -> None:
                self.ms[layer_name] = self.ms.get(layer_name, 0.0) + ms

        return P()


def check_dir(d: Path, n_prompts: int, max_new: int) -> dict[str, Any]:
    from dflash2_trt.runtime.decoder import speculative_generate, target_generate
    from dflash2_trt.runtime.ort_backend import OrtBackend
    from dflash2_trt.runtime.trt_backend import TrtBackend

    out: dict[str, Any] = {"dir": str(d)}
    trt_g = TrtBackend(d, cuda_graphs=True)
    trt_e = TrtBackend(d, cuda_graphs=False, verify_checksums=False)
    ort = OrtBackend(d, verify_checksums=False)
    out["backend"] = trt_g.description
    out["ort"] = ort.description
    prompts = _prompts(trt_g.vocab_size, n_prompts)
    eos: set[int] = set()
    runners = {name: (be.target_runner(), be.draft_runner("greedy")) for name, be in
               (("trt_graph", trt_g), ("trt_eager", trt_e), ("ort", ort))}

    # 1-2: token equality (speculative and autoregressive), graphs vs eager
    mism: dict[str, int] = {"spec_trt_vs_ort": 0, "ar_trt_vs_ort": 0, "spec_graph_vs_eager": 0}
    for p in prompts:
        toks = {k: speculative_generate(t, dr, p, max_new, eos_ids=eos).tokens
                for k, (t, dr) in runners.items()}
        mism["spec_trt_vs_ort"] += toks["trt_graph"] != toks["ort"]
        mism["spec_graph_vs_eager"] += toks["trt_graph"] != toks["trt_eager"]
        ar = {k: target_generate(runners[k][0], p, max_new, eos_ids=eos).tokens for k in ("trt_graph", "ort")}
        mism["ar_trt_vs_ort"] += ar["trt_graph"] != ar["ort"]
    out["mismatched_prompts"] = mism
    # verify-step logits, replay vs eager, bitwise
    tg, te = runners["trt_graph"][0], runners["trt_eager"][0]
    p = prompts[0]
    bs = trt_g.block_size
    for t in (tg, te):
        t.reset()
        t.forward(p)
    ids = list(range(10, 10 + bs))
    tg.forward(ids)
    tg.crop(len(p))  # first call captured; the second replays
    lg, _ = tg.forward(ids)
    le, _ = te.forward(ids)
    out["verify_replay_path"] = tg.last_path
    out["verify_logits_bitwise_equal"] = bool(np.array_equal(lg, le))

    # 3: speed on TensorRT (graphs on), side by side
    t, dr = runners["trt_graph"]
    speculative_generate(t, dr, prompts[0], 16, eos_ids=eos)  # warm up graphs
    spec_tok = spec_s = ar_tok = ar_s = 0.0
    taus = []
    for p in prompts:
        r = speculative_generate(t, dr, p, max_new, eos_ids=eos)
        spec_tok, spec_s = spec_tok + len(r.tokens), spec_s + r.elapsed_s
        taus.append(r.stats().get("tau"))
        a = target_generate(t, p, max_new, eos_ids=eos)
        ar_tok, ar_s = ar_tok + len(a.tokens), ar_s + a.elapsed_s
    out["spec_tok_s"] = spec_tok / spec_s
    out["ar_tok_s"] = ar_tok / ar_s
    out["speedup"] = out["spec_tok_s"] / out["ar_tok_s"]
    out["tau"] = float(np.mean([x for x in taus if x is not None])) if taus else None

    # 4-5: per-layer profile of one eager cycle; launch gaps of the verify step
    import tensorrt as trt

    prof = TrtBackend(d, cuda_graphs=False, verify_checksums=False)
    prof.profiler = _LayerTimes(trt)
    pt, pd = prof.target_runner(), prof.draft_runner("greedy")
    pt.forward(p)
    _, feats = pt.forward(p[-1:])  # context for the drafter
    pd.add_context(np.zeros((len(p), feats.shape[1]), feats.dtype), 0)
    prof.profiler.ms.clear()
    pd.propose(1, len(p), 0.0, None)
    pt.crop(len(p))
    pt.forward(ids)
    ms = prof.profiler.ms
    total = sum(ms.values())
    sel = sum(v for k, v in ms.items() if "selector" in k.lower() or "pathselector" in k.lower())
    conv = sum(v for k, v in ms.items() if "conv" in k.lower())
    out["cycle_layer_ms"] = total
    out["selector_share"] = sel / total if total else None
    out["selector_plus_conv_share"] = (sel + conv) / total if total else None
    prof.profiler.ms.clear()
    pt.crop(len(p))
    pt.forward(ids)
    verify_gpu_ms = sum(prof.profiler.ms.values())

    def wall(tr: Any, n: int = 50) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            tr.crop(len(p))
            tr.forward(ids)
        return (time.perf_counter() - t0) / n * 1e3

    eager_ms, replay_ms = wall(te), wall(tg)
    out["verify_eager_ms"], out["verify_replay_ms"], out["verify_layer_ms"] = eager_ms, replay_ms, verify_gpu_ms
    gap_e, gap_r = eager_ms - verify_gpu_ms, replay_ms - verify_gpu_ms
    out["launch_gap_removed"] = 1 - gap_r / gap_e if gap_e > 0 else None
    out["graph_stats"] = vars(trt_g.graphs.stats)
    for be in (trt_g, trt_e, prof):
        be.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trt_gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from dflash2_trt.errors import DFlash2Error

    results, ok = [], True
    for d in a.dirs:
        try:
            r = check_dir(d, a.prompts, a.max_new_tokens)
        except DFlash2Error as e:
            print(f"trt_gpu_check: error: {d}: {e}", file=sys.stderr)
            return 1
        ok &= not any(r["mismatched_prompts"].values()) and r["verify_logits_bitwise_equal"]
        results.append(r)
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        def f(x: Any, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        print("| export | backend | TRT=ORT spec/AR | graph=eager | spec tok/s | AR tok/s | speedup | τ | "
              "selector (+conv) share | verify eager/replay/layers ms | gap removed |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            m = r["mismatched_prompts"]
            print(f"| {Path(r['dir']).name} | {r['backend']} | "
                  f"{'yes' if not m['spec_trt_vs_ort'] else 'NO'}/{'yes' if not m['ar_trt_vs_ort'] else 'NO'} | "
                  f"{'yes' if not m['spec_graph_vs_eager'] and r['verify_logits_bitwise_equal'] else 'NO'} | "
                  f"{r['spec_tok_s']:.1f} | {r['ar_tok_s']:.1f} | {r['speedup']:.2f}x | {f(r['tau'], '.2f')} | "
                  f"{f(r['selector_share'], '.2%')} ({f(r['selector_plus_conv_share'], '.2%')}) | "
                  f"{r['verify_eager_ms']:.2f}/{r['verify_replay_ms']:.2f}/{r['verify_layer_ms']:.2f} | "
                  f"{f(r['launch_gap_removed'], '.0%')} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
