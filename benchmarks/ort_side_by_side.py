"""Side-by-side CPU benchmark, one sitting, same prompts, same chat template, greedy, exactly N new tokens:

* ours: ONNX Runtime fused graphs (``target_ort``) at fp32 / int8 / int4 — autoregressive and DFlash 2
  speculative decoding (the packaged SmolLM2 drafter, exported with ``--block-size`` / ``--draft-vocab``; the
  acceptance guard on, as the runtime's default, unless ``--no-guard``);
* onnxruntime-genai: its model builder's fp32 / int4 graphs, autoregressive and its n-gram speculation;
* llama.cpp (llama-cpp-python) on the PyPI GGUF (Q4_1), autoregressive, when importable.

Systems run interleaved prompt by prompt, so a load change on a shared machine hits all of them alike; still,
on a shared 2-core box the absolute figures are noisy: read the ratios. Prints a markdown table, writes JSON
(+ a bar plot with ``--plot``)::

    python benchmarks/ort_side_by_side.py --limit 20 --max-new-tokens 128 --out benchmarks/results/ort_side_by_side.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from dflash2_trt.runtime.request import GenerationRequest
from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash2_trt.export.quantize import QuantSpec  # noqa: E402
from dflash2_trt.runtime import decoder as D  # noqa: E402
from dflash2_trt.runtime.guard import AcceptanceGuard  # noqa: E402

DRAFTER = ROOT / "dflash2_trt" / "drafters" / "smollm2-135m-instruct-dflash2"
NGRAM_ROWS = 4  # most prompt-lookup drafts per cycle (genai's max_draft_tokens below)


def _prompts(tok, sets: list[str], limit: int) -> dict[str, list[list[int]]]:
    from dflash2_trt.bench.prompts import encode_items, load_prompts

    return {s: encode_items(load_prompts(s, limit), tok.encode, tok.apply_chat_template) for s in sets}


class Ours:
    def __init__(self, kind: str, block_size: int, threads: int, draft_vocab: int, guard: bool,
                 attention: str = "auto", folder: str | None = None, drafter: Path = DRAFTER) -> None:
        from dflash2_trt.export.cache import cached_export
        from dflash2_trt.runtime.ort.backend import OrtBackend

        q = QuantSpec(kind)
        opts = {"draft_vocab": draft_vocab} if draft_vocab else {}
        if folder is None:
            folder = cached_export("smollm2", drafter, progress=True, block_size=block_size, max_seq_len=2048,
                                   quantization=q, **opts)
        self.guard = guard
        self.folder = folder
        self.be = OrtBackend(folder, threads=threads, attention=attention)
        self.target = self.be.target_runner()
        self.drafter = self.be.draft_runner("greedy")

    def ar(self, p: list[int], n: int) -> dict:
        t0 = time.perf_counter()
        first = []
        res = D.target_generate(self.target, p, GenerationRequest(max_new_tokens=n, eos_ids=set()),
                                on_tokens=lambda t: first.append(time.perf_counter() - t0) if not first else None)
        return {"tokens": res.tokens, "s": res.elapsed_s, "ttft": first[0]}

    def spec(self, p: list[int], n: int, proposer: str = "dflash2") -> dict:
        t0 = time.perf_counter()
        first = []
        hooks = D.DecodeHooks(on_tokens=lambda t: first.append(time.perf_counter() - t0) if not first else None,
                              guard=AcceptanceGuard() if self.guard else None)
        res = D.speculative_generate(self.target, self.drafter, p,
                                     GenerationRequest(max_new_tokens=n, eos_ids=set(), proposer=proposer,
                                                       ngram_rows=NGRAM_ROWS, guard=False), hooks)
        return {"tokens": res.tokens, "s": res.elapsed_s, "ttft": first[0], "tau": res.stats()["tau"],
                "cycles": len(res.accepted)}


def genai_model(precision: str, threads: int) -> Path:
    from dflash2_trt.targets.adapter import cache_dir, resolve_target_path

    out = cache_dir() / "genai" / f"smollm2-{precision}"
    if not (out / "genai_config.json").is_file():
        src = resolve_target_path("smollm2")
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out),
                        "-p", precision, "-e", "cpu", "-c", str(out.parent / "hf_cache")], check=True,
                       stdout=subprocess.DEVNULL)
    cfg_path = out / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    cfg_path.write_text(json.dumps(cfg, indent=4))
    return out


class Genai:
    def __init__(self, precision: str, threads: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(str(genai_model(precision, threads)))

    def _run(self, p: list[int], n: int, ngram: bool) -> dict:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(p) + n, min_length=len(p) + n, do_sample=False)
        if ngram:
            params.set_speculative_options(ngram_size=3, max_draft_tokens=4)
        g = og.Generator(self.model, params)
        out: list[int] = []
        t0 = time.perf_counter()
        ttft = 0.0
        g.append_tokens(p)
        while not g.is_done() and len(out) < n:
            g.generate_next_token()
            if not out:
                ttft = time.perf_counter() - t0
            out.extend(int(t) for t in g.get_next_tokens())
        s = time.perf_counter() - t0
        seq = [int(t) for t in g.get_sequence(0)][len(p):len(p) + n]
        return {"tokens": seq or out[:n], "s": s, "ttft": ttft}

    def ar(self, p: list[int], n: int) -> dict:
        return self._run(p, n, False)

    def ngram(self, p: list[int], n: int) -> dict:
        return self._run(p, n, True)


class LlamaCpp:
    def __init__(self, threads: int) -> None:
        from llama_cpp import Llama

        from dflash2_trt.targets.adapter import smollm2_gguf

        self.llm = Llama(model_path=str(smollm2_gguf()), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)

    def ar(self, p: list[int], n: int) -> dict:
        self.llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        ttft = 0.0
        for t in self.llm.generate(p, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if not out:
                ttft = time.perf_counter() - t0
            out.append(int(t))
            if len(out) >= n:
                break
        return {"tokens": out, "s": time.perf_counter() - t0, "ttft": ttft}


def own_ar(name: str) -> str:
    """The autoregressive row of the same system and precision ("ours int4 DFlash2 bs3" -> "ours int4 AR")."""
    return " ".join(name.split(" ")[:2]) + " AR" if name.startswith("ours") else name.rsplit(" ", 1)[0] + " AR"


def summarize(runs_by_system: dict[str, list[dict]]) -> dict[str, dict]:
    """One set's rows: tok/s (all tokens ÷ all time), TTFT, τ pooled over cycles (``tau``; the per-prompt mean as
    ``tau_prompt_mean``) and ``agreement_own_greedy``: the fraction of prompts whose tokens equal the same system's
    AR row — None on the AR rows themselves (1.00 by construction, not a measurement)."""
    out: dict[str, dict] = {}
    for name, runs in runs_by_system.items():
        ref = own_ar(name)
        spec = "tau" in runs[0]
        cycles = sum(r["cycles"] for r in runs) if spec else 0
        out[name] = {
            "tokens_per_s": sum(len(r["tokens"]) for r in runs) / sum(r["s"] for r in runs),
            "ttft_ms": 1e3 * float(np.mean([r["ttft"] for r in runs])),
            "tau": sum(r["tau"] * r["cycles"] for r in runs) / cycles if cycles else None,
            "tau_prompt_mean": float(np.mean([r["tau"] for r in runs])) if spec else None,
            "agreement_own_greedy": None if ref == name or ref not in runs_by_system else float(np.mean(
                [r["tokens"] == q["tokens"] for r, q in zip(runs, runs_by_system[ref])])),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", nargs="+", default=["mtbench", "humaneval"])
    ap.add_argument("--limit", type=int, default=20, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=4, help="block size of our speculative exports")
    ap.add_argument("--draft-vocab", type=int, default=0, help="export --draft-vocab of our speculative exports")
    ap.add_argument("--guard", action=argparse.BooleanOptionalAction, default=True,
                    help="our speculative decoding with the acceptance guard (the runtime's default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--model-dir", default=None, help="our fp32 export folder (default: a cached export from the "
                    "options above)")
    ap.add_argument("--proposers", nargs="+", default=["dflash2"], help="our speculative systems' proposers "
                    "(dflash2 | ngram | auto), each its own system")
    ap.add_argument("--before", action="store_true", help="also our fp32 AR and DFlash2 with ORT's "
                    "GroupQueryAttention (the target before dflash2.DecodeAttention)")
    ap.add_argument("--other-drafter", default=None, help="another drafter folder: its fp32 DFlash2 row beside the "
                    "packaged drafter's (same export options)")
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--genai-precisions", nargs="+", default=["fp32", "int4"])
    ap.add_argument("--spinning", choices=["0", "1"], default="1", help="DFLASH2_ORT_SPINNING: 1 (the runtime's "
                    "default) our target session's ORT workers spin between ops, 0 no session spins (loaded machines)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--plot", default=None, help="PNG bar plot of tokens/s")
    a = ap.parse_args(argv)

    from dflash2_trt.runtime.ort.backend import SPINNING_ENV
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    os.environ[SPINNING_ENV] = a.spinning
    systems: dict[str, object] = {}
    quant: dict[str, dict] = {}
    for kind in a.precisions:
        folder = a.model_dir if kind == "none" else None
        o = Ours(kind, a.block_size, a.threads, a.draft_vocab, a.guard, folder=folder)
        label = "fp32" if kind == "none" else kind
        quant[label] = o.be.manifest.to_json()["quantization"]
        systems[f"ours {label} AR"] = o.ar
        for prop in a.proposers:
            name = {"dflash2": f"DFlash2 bs{a.block_size}", "ngram": "n-gram", "auto": f"auto bs{a.block_size}"}[prop]
            systems[f"ours {label} {name}"] = (lambda o, prop: lambda p, n: o.spec(p, n, prop))(o, prop)
        if a.before and kind == "none":
            b = Ours(kind, a.block_size, a.threads, a.draft_vocab, a.guard, attention="gqa", folder=str(o.folder))
            systems["ours(gqa) fp32 AR"] = b.ar
            systems[f"ours(gqa) fp32 DFlash2 bs{a.block_size}"] = b.spec
        if a.other_drafter and kind == "none":
            d = Ours(kind, a.block_size, a.threads, a.draft_vocab, a.guard, drafter=Path(a.other_drafter))
            systems[f"ours fp32 DFlash2 bs{a.block_size} ({Path(a.other_drafter).name})"] = d.spec
        tok = TextTokenizer(o.folder)
    if not a.no_genai:
        for prec in a.genai_precisions:
            g = Genai(prec, a.threads)
            systems[f"genai {prec} AR"] = g.ar
            systems[f"genai {prec} n-gram"] = g.ngram
    if not a.no_llama:
        try:
            systems["llama.cpp Q4_1 AR"] = LlamaCpp(a.threads).ar
        except ImportError as e:
            print(f"llama.cpp skipped: {e}", file=sys.stderr)
    prompts = _prompts(tok, a.sets, a.limit)
    raw: dict[str, dict[str, list[dict]]] = {s: {k: [] for k in systems} for s in a.sets}
    for s, plist in prompts.items():
        for i, p in enumerate(plist):
            for name, fn in systems.items():
                raw[s][name].append(fn(p, a.max_new_tokens))
            print(f"{s} {i + 1}/{len(plist)}", file=sys.stderr)
    summary: dict[str, dict[str, dict]] = {s: summarize(raw[s]) for s in a.sets}
    for s in a.sets:
        for name, row in summary[s].items():
            base = [k for k in summary[s] if k.startswith("genai") and k.endswith(" AR")
                    and k.split()[1] == ("fp32" if "fp32" in name else "int4")]
            row["vs_genai_ar_same_precision"] = row["tokens_per_s"] / summary[s][base[0]]["tokens_per_s"] if base else None
            row["vs_ours_fp32_ar"] = row["tokens_per_s"] / summary[s]["ours fp32 AR"]["tokens_per_s"] \
                if "ours fp32 AR" in summary[s] else None
            ll = summary[s].get("llama.cpp Q4_1 AR")
            row["vs_llama_cpp"] = row["tokens_per_s"] / ll["tokens_per_s"] if ll else None
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"\n{a.limit} prompts per set, {a.max_new_tokens} new tokens (EOS ignored), greedy, {a.threads} threads, "
          f"systems interleaved per prompt")
    print("| set | system | tok/s | TTFT ms | τ | vs genai AR (same precision) | vs llama.cpp | "
          "same tokens as its AR |")
    print("|---|---|---|---|---|---|---|---|")
    for s in a.sets:
        for name, r in summary[s].items():
            print(f"| {s} | {name} | {r['tokens_per_s']:.1f} | {r['ttft_ms']:.0f} | {f(r['tau'])} | "
                  f"{f(r['vs_genai_ar_same_precision'])} | {f(r['vs_llama_cpp'])} | {f(r['agreement_own_greedy'])} |")
    print("τ: pooled over all cycles (tokens ÷ cycles); 'same tokens as its AR': the fraction of prompts whose "
          "output equals the same system's autoregressive output ('-' on AR rows: they are the reference)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "machine": describe(),
            "args": vars(a), "ours_quantization": quant, "summary": summary}, indent=2) + "\n")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(systems)
        fig, ax = plt.subplots(figsize=(11, 4))
        w = 0.8 / len(a.sets)
        for j, s in enumerate(a.sets):
            ax.bar(np.arange(len(names)) + j * w, [summary[s][n]["tokens_per_s"] for n in names], w, label=s)
        ax.set_xticks(np.arange(len(names)) + w * (len(a.sets) - 1) / 2, names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s (2 CPU threads)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
