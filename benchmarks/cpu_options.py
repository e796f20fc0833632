"""The CPU decoding options side by side (the README's "CPU options" table): for every prompt, in one process
and interleaved (so machine load hits every variant alike), plain autoregressive decoding and speculative
decoding with the guard off / on and with confidence-adapted verify lengths.

    python benchmarks/cpu_options.py [--prompts humaneval mtbench] [--limit 20] [--max-new-tokens 128]
        [--model-dir DIR] [--min-confidence 0.3 0.6] [--selector greedy|independent] [--temperature 0]
        [--out benchmarks/results/cpu_options.json]

--model-dir defaults to the demo export (SmolLM2-135M-Instruct + the packaged drafter, ONNX Runtime CPU).
Prints one line per (set, variant): tok/s, speedup over autoregressive, τ, cycles / plain steps, lossless.
--out is rewritten after every prompt (the prompts done so far), so a long run can be stopped early.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--selector", default="greedy")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--min-confidence", type=float, nargs="*", default=[])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from dflash2_trt.bench.prompts import encode_items, load_prompts
    from dflash2_trt.bench.demo import DEMO_MAX_SEQ_LEN, demo_drafter_path
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.backends import open_backend
    from dflash2_trt.runtime.guard import AcceptanceGuard
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    model_dir = a.model_dir
    if model_dir is None:
        from dflash2_trt.export.cache import cached_export

        model_dir = str(cached_export("smollm2", demo_drafter_path(), max_seq_len=DEMO_MAX_SEQ_LEN))
    variants = [("guard off", False, 0.0), ("guard on", True, 0.0)]
    variants += [(f"guard on, conf {c}", True, c) for c in a.min_confidence]
    variants += [(f"guard off, conf {c}", False, c) for c in a.min_confidence]
    be, _ = open_backend(model_dir, "ort", threads=a.threads)
    tok = TextTokenizer(model_dir)
    results = {"model_dir": model_dir, "backend": be.description, "max_new_tokens": a.max_new_tokens,
               "selector": a.selector, "temperature": a.temperature, "sets": {}}
    with be:
        target, drafter = be.target_runner(), be.draft_runner(a.selector)
        for name in a.prompts:
            prompts = encode_items(load_prompts(name, a.limit), tok.encode, tok.apply_chat_template)
            runs: dict[str, list] = {v[0]: [] for v in variants}
            ars = []
            t0 = time.time()
            for i, p in enumerate(prompts):
                ars.append(D.target_generate(target, p, a.max_new_tokens, a.temperature, seed=i))
                for label, guard, conf in variants:
                    runs[label].append(D.speculative_generate(
                        target, drafter, p, a.max_new_tokens, a.temperature, seed=i,
                        guard=AcceptanceGuard() if guard else None, min_confidence=conf))
                print(f"{name} {i + 1}/{len(prompts)} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
                results["sets"][name] = {label: _summary(runs[label], ars, a.temperature) for label, _, _ in variants}
                _write(results, a.out)
            for label, _, _ in variants:
                r = results["sets"][name][label]
                print(f"{name:10} {label:22} spec {r['spec_tokens_per_s']:6.2f} tok/s  ar {r['ar_tokens_per_s']:6.2f}"
                      f"  speedup {r['speedup']:.2f}x  tau {r['tau']:.2f}  cycles {r['spec_cycles']}"
                      f"  plain {r['plain_steps']}  switches {r['guard_switches']}  probes {r['guard_probes']}"
                      f"  lossless {r['lossless']}", flush=True)
    return 0


def _summary(specs: list, ars: list, temperature: float) -> dict:
    from dflash2_trt.bench.harness import summarize

    r = summarize(specs, ars, temperature)
    r["per_prompt_speedup"] = [s.tokens_per_s / max(1e-9, x.tokens_per_s) for s, x in zip(specs, ars)]
    return r


def _write(results: dict, out: str | None) -> None:
    if out:
        tmp = Path(out).with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
