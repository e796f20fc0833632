"""The CPU decoding options side by side (the README's "CPU options" table): for every prompt, in one process
and interleaved (so machine load hits every variant alike), plain autoregressive decoding and speculative
decoding with the guard off / on, with confidence-adapted verify lengths, and — one export each — at other
block sizes, with the drafter's LM head restricted to its most frequent ids (``export --draft-vocab``) and with the
drafter's weights quantized (``export --drafter-quantize``).

    python benchmarks/cpu_options.py [--prompts humaneval mtbench] [--limit 20] [--max-new-tokens 128]
        [--model-dir DIR | --exports BS:VOCAB[:DRAFTER_QUANT] ...] [--guard off on] [--min-confidence 0.3 0.6]
        [--selector greedy|independent] [--temperature 0] [--out benchmarks/results/cpu_options.json]

--model-dir defaults to the demo export (SmolLM2-135M-Instruct + the packaged drafter at its block size, the
drafter's LM head restricted to 4096 ids as the demo's, ONNX Runtime CPU);
``--exports 8:0 4:0 4:4096 3:4096:int8`` instead exports the demo pair (or SmolLM2 + ``--drafter``) at each block size :
draft vocabulary (0 = full) [: the drafter's quantization]
once into the cache and runs every variant on each. Autoregressive decoding runs on the first export's target.
Prints one line per (set, variant): tok/s, speedup over autoregressive, τ, cycles / plain steps, lossless.
--out is rewritten after every prompt (the prompts done so far), so a long run can be stopped early.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dflash2_trt.bench.machine import describe


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--exports", nargs="+", default=[], metavar="BS:VOCAB[:DQ]",
                    help="demo-pair exports at these block sizes / draft vocabularies (0: full) "
                         "[/ drafter quantization]")
    ap.add_argument("--drafter", default=None, help="drafter folder for --exports (default: the packaged one)")
    ap.add_argument("--guard", nargs="+", choices=["off", "on"], default=["off", "on"])
    ap.add_argument("--selector", default="greedy")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--min-confidence", type=float, nargs="*", default=[])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import dflash2_trt
    from dflash2_trt.bench.demo import DEMO_DRAFT_VOCAB, DEMO_MAX_SEQ_LEN, demo_drafter_path
    from dflash2_trt.bench.prompts import encode_items, load_prompts

    dirs = {}
    if a.model_dir and a.exports:
        ap.error("--model-dir and --exports exclude each other")
    if a.model_dir:
        dirs[""] = a.model_dir
    else:
        from dflash2_trt.export.cache import cached_export

        for spec in a.exports or [f"0:{DEMO_DRAFT_VOCAB}"]:  # the demo's own export by default
            bs_, vocab_, *dq = spec.split(":")
            bs, vocab, dq = int(bs_), int(vocab_), (dq or ["none"])[0]
            opts = {k: v for k, v in {"block_size": bs, "draft_vocab": vocab,
                                      "drafter_quantization": None if dq == "none" else dq}.items() if v}
            label = ", ".join([f"bs {bs}"] * bool(bs) + [f"vocab {vocab}"] * bool(vocab) +
                              [f"drafter {dq}"] * (dq != "none")) if a.exports else ""
            dirs[label] = str(cached_export("smollm2", a.drafter or demo_drafter_path(), max_seq_len=DEMO_MAX_SEQ_LEN, **opts))
    modes = [(f"guard {g}", g == "on", 0.0) for g in a.guard]
    modes += [(f"guard {g}, conf {c}", g == "on", c) for c in a.min_confidence for g in a.guard]
    variants = [(f"{e}: {m}" if e else m, e, guard, conf) for e in dirs for m, guard, conf in modes]
    gens = {e: dflash2_trt.load(d, "ort", threads=a.threads) for e, d in dirs.items()}
    first = next(iter(gens.values()))
    results = {"machine": describe(), "model_dirs": dirs, "backend": first.backend, "max_new_tokens": a.max_new_tokens,
               "selector": a.selector, "temperature": a.temperature, "sets": {}}
    for name in a.prompts:
        prompts = encode_items(load_prompts(name, a.limit), lambda t: first.encode(t, chat=False), first.encode)
        runs: dict[str, list] = {v[0]: [] for v in variants}
        ars = []
        t0 = time.time()
        for i, p in enumerate(prompts):
            ars.append(first.generate(p, a.max_new_tokens, a.temperature, seed=i, speculative=False))
            for label, e, guard, conf in variants:
                runs[label].append(gens[e].generate(p, a.max_new_tokens, a.temperature, seed=i, selector=a.selector,
                                                    guard=guard, min_confidence=conf))
            print(f"{name} {i + 1}/{len(prompts)} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
            results["sets"][name] = {v[0]: _summary(runs[v[0]], ars, a.temperature) for v in variants}
            _write(results, a.out)
        for label, *_ in variants:
            r = results["sets"][name][label]
            print(f"{name:10} {label:30} spec {r['spec_tokens_per_s']:6.2f} tok/s  ar {r['ar_tokens_per_s']:6.2f}"
                  f"  speedup {r['speedup']:.2f}x  tau {r['tau']:.2f}  cycles {r['spec_cycles']}"
                  f"  plain {r['plain_steps']}  switches {r['guard_switches']}  probes {r['guard_probes']}"
                  f"  lossless {r['lossless']}", flush=True)
    for gen in gens.values():
        gen.close()
    return 0


def _summary(specs: list, ars: list, temperature: float) -> dict:
    from dflash2_trt.bench.harness import summarize

    r = summarize(specs, ars, temperature)
    r["per_prompt_speedup"] = [s.stats.tokens_per_s / max(1e-9, x.stats.tokens_per_s) for s, x in zip(specs, ars)]
    return r


def _write(results: dict, out: str | None) -> None:
    if out:
        tmp = Path(out).with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
