"""Every speed figure that README.md, docs/*.md and runtime/README.md quote comes from a result file under
benchmarks/results/: each quoted passage below is a template whose numbers are read from its file here and
formatted as the document writes them, and the passage must stand in the document exactly so. Figures the
documents hold outside these passages (a number with tok/s, ms, s, × or %; a row of a table timed in tok/s or ms) fail
the coverage check; each passage's section names the CPU, and each result file says where it ran. Seconds; no model
runs (one bound reads the demo target's config)."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DOCS = ("README.md", "runtime/README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))
CPU = "AMD EPYC"  # the CPU every result file was measured on (their machine blocks / the results index say so)
# Result files written before the benchmarks recorded their machine (date, commit, CPU flags, ONNX Runtime version);
# benchmarks/results/README.md states their CPU. benchmarks/rerun_quoted.sh writes each again with its machine
# block, and the file leaves this list.
NO_MACHINE_BLOCK: frozenset[str] = frozenset()
MACHINE_KEYS = ("date", "commit", "cpu", "simd", "onnxruntime")


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def f0(x: float) -> str:
    return f"{x:.0f}"


def f1(x: float) -> str:
    return f"{x:.1f}"


def f2(x: float) -> str:
    return f"{x:.2f}"


def span(xs, fmt: Callable[[float], str] = f2) -> str:  # noqa: ANN001
    """A range as the documents write it: ``lo–hi``, or one figure where both round alike."""
    lo, hi = fmt(min(xs)), fmt(max(xs))
    return lo if lo == hi else f"{lo}–{hi}"


def slashes(xs, fmt: Callable[[float], str] = f2, unit: str = "") -> str:  # noqa: ANN001
    """Figures side by side as the documents write them: ``a / b / c`` (``unit`` after each)."""
    return " / ".join(fmt(x) + unit for x in xs)


@dataclass(frozen=True)
class Figure:
    doc: str
    template: str  # the passage, whitespace as in prose; {} stand for the figures
    files: tuple[str, ...]
    values: Callable[..., tuple[str, ...]]  # the files' JSON objects -> the figures, formatted

    def text(self) -> str:
        return self.template.format(*self.values(*(load(f) for f in self.files)))


# -- the side-by-side run against onnxruntime-genai and llama.cpp -------------------------------------------------------

SETS = ("humaneval", "mtbench", "benchmarks/prompts/long_code.jsonl")


def per_set(d: dict, row: str, key: str = "tokens_per_s") -> list[float]:
    return [d["summary"][s][row][key] for s in SETS]


def tps_tau(row: str) -> Callable[[dict], tuple[str, ...]]:
    return lambda d: tuple(f"{f1(t)} ({f2(u)})" for t, u in zip(per_set(d, row), per_set(d, row, "tau")))


def tps(row: str) -> Callable[[dict], tuple[str, ...]]:
    return lambda d: tuple(f1(t) for t in per_set(d, row))


SBS = ("side_by_side_codes.json",)
SIDE_BY_SIDE = [
    Figure("README.md", "| ours, fp32 autoregressive | {} | {} | {} |", SBS, tps("ours fp32 AR")),
    Figure("README.md", "| ours, fp32 DFlash 2 drafter, guard on (τ) | {} | {} | {} |", SBS,
           tps_tau("ours fp32 DFlash2 bs3")),
    Figure("README.md", "| **ours, fp32 `auto` (drafter + prompt lookup; τ)** | **{}** | **{}** | **{}** |", SBS,
           tps_tau("ours fp32 auto bs3")),
    Figure("README.md", "| onnxruntime-genai, fp32 autoregressive | {} | {} | {} |", SBS, tps("genai fp32 AR")),
    Figure("README.md", "| onnxruntime-genai, fp32 n-gram speculation | {} | {} | {} |", SBS,
           tps("genai fp32 n-gram")),
    Figure("README.md", "| llama.cpp Q4_1 autoregressive (int4 weights: not exact) | {} | {} | {} |", SBS,
           tps("llama.cpp Q4_1 AR")),
    Figure("docs/benchmarks.md", "| ours fp32 autoregressive (× genai's) | **{}** | **{}** | **{}** |", SBS,
           lambda d: tuple(f"{f1(t)} ({f2(r)}×)" for t, r in zip(per_set(d, "ours fp32 AR"),
                                                                  per_set(d, "ours fp32 AR", "vs_genai_ar_same_precision")))),
    Figure("docs/benchmarks.md", "| ours fp32 DFlash 2 drafter alone, guard on (τ) | {} | {} | {} |", SBS,
           tps_tau("ours fp32 DFlash2 bs3")),
    Figure("docs/benchmarks.md", "| **ours fp32 `auto`** (× genai AR; τ) | **{}** | **{}** | **{}** |", SBS,
           lambda d: tuple(f"{f1(t)} ({f2(r)}×; {f2(u)})" for t, r, u in zip(
               per_set(d, "ours fp32 auto bs3"), per_set(d, "ours fp32 auto bs3", "vs_genai_ar_same_precision"),
               per_set(d, "ours fp32 auto bs3", "tau")))),
    Figure("docs/benchmarks.md", "| onnxruntime-genai fp32 autoregressive | {} | {} | {} |", SBS,
           tps("genai fp32 AR")),
    Figure("docs/benchmarks.md", "| onnxruntime-genai fp32 n-gram speculation | {} | {} | {} |", SBS,
           tps("genai fp32 n-gram")),
    Figure("docs/benchmarks.md", "| llama.cpp Q4_1 autoregressive (int4 weights, int8 dot products: not exact) | {} | "
           "{} | {} |", SBS, tps("llama.cpp Q4_1 AR")),
    Figure("docs/benchmarks.md", "In the side-by-side run above (EOS ignored; `side_by_side_codes.json`): {} on "
           "HumanEval / MT-Bench / long code.", SBS,
           lambda d: (slashes(per_set(d, "ours fp32 auto bs3", "vs_ours_fp32_ar"), unit="×"),)),
    Figure("docs/benchmarks.md", "with prompt lookup (`auto`) {} (`side_by_side_codes.json`)", SBS,
           lambda d: (slashes(per_set(d, "ours fp32 auto bs3", "tau")[:2]),)),
    Figure("docs/benchmarks.md", "makes {} tok/s — {} onnxruntime-genai's int4 autoregressive decoding, {}× "
           "llama.cpp's Q4_1.", ("side_by_side_int4_panels.json",),
           lambda d: (slashes(per_set(d, "ours int4 auto bs3"), f0),
                      slashes(per_set(d, "ours int4 auto bs3", "vs_genai_ar_same_precision"), unit="×"),
                      span(per_set(d, "ours int4 auto bs3", "vs_llama_cpp"), f1))),
]

# -- the demo --------------------------------------------------------------------------------------------------------


def demo_runs(d: dict, kind: str, key: str) -> list[float]:
    rs = d["runs"][kind]
    assert len(rs) == 3 and all(r["lossless"] for r in rs), "three lossless runs of each kind"
    return [r[key] for r in rs]


DEMO = ("demo_runs.json",)
DEMO_FIGURES = [
    Figure("docs/benchmarks.md", "τ {}, oracle top-K τ {}, lossless, {} against {} tok/s autoregressive — **{}**.",
           DEMO, lambda d: (span(demo_runs(d, "default", "tau")), span(demo_runs(d, "default", "oracle_tau")),
                            slashes(demo_runs(d, "default", "spec_tokens_per_s"), f1),
                            slashes(demo_runs(d, "default", "ar_tokens_per_s"), f1),
                            slashes(demo_runs(d, "default", "speedup"), unit="×"))),
    Figure("docs/benchmarks.md", "the demo gives {}× ({} against {} tok/s)", DEMO,
           lambda d: (span(demo_runs(d, "avx2_path", "speedup")), span(demo_runs(d, "avx2_path", "spec_tokens_per_s"), f0),
                      span(demo_runs(d, "avx2_path", "ar_tokens_per_s"), f0))),
    Figure("docs/benchmarks.md", "which makes a 1-row plain step {}× cheaper", ("verify_rows_codes.json",
                                                                               "verify_rows_codes_off.json"),
           lambda on, off: (f1(verify_ms(off, 2, 256, 1) / verify_ms(on, 2, 256, 1)),)),
]

# -- our own loop: block size, τ, sampling, verify cost -----------------------------------------------------------------


def bench_set(d: dict, s: str, name: str) -> dict:
    return d["sets"][s][name]


def verify_table(d: dict, threads: int) -> list[dict]:
    return next(r for r in d["runs"] if r["threads"] == threads)["tables"]["decode"]


def verify_ms(d: dict, threads: int, cached: int, rows: int, key: str = "ms") -> float:
    return next(c[key] for c in verify_table(d, threads) if c["cached"] == cached and c["rows"] == rows)


def longer_or_one_thread(d: dict, rows: int) -> list[float]:
    return [c["ratio"] for t in (2, 1) for c in verify_table(d, t) if c["rows"] == rows and (t, c["cached"]) != (2, 256)]


def block_sizes(d: dict) -> tuple[str, ...]:
    for s in ("humaneval", "mtbench"):  # the page says 4 and 6 are no faster
        bs3 = bench_set(d, s, "bs 3, vocab 4096: guard on")["speedup"]
        assert all(bench_set(d, s, f"bs {b}, vocab 4096: guard on")["speedup"] <= bs3 for b in (4, 6)), s
    return tuple(f2(bench_set(d, s, "bs 3, vocab 4096: guard on")["speedup"]) for s in ("humaneval", "mtbench"))


def q8(d: dict) -> tuple[str, ...]:
    sp = lambda name: [f2(bench_set(d, s, name)["speedup"]) for s in ("humaneval", "mtbench")]  # noqa: E731
    return (*sp("vocab 4096, drafter q8_0: guard on"), *sp("vocab 4096: guard on"))


LOOP_FIGURES = [
    Figure("docs/benchmarks.md", "**{}× HumanEval, {}× MT-Bench** at block size 3", ("cpu_options_codes_bs346.json",),
           block_sizes),
    Figure("docs/benchmarks.md", "Pooled τ of the drafter alone: {} HumanEval, {} MT-Bench",
           ("tau_pooled_humaneval.json", "tau_pooled_mtbench.json"), lambda h, m: (f2(h["tau"]), f2(m["tau"]))),
    Figure("docs/benchmarks.md", "**{}× HumanEval (τ {}), {}× MT-Bench (τ {})**", ("sampling_t08_panels.json",),
           lambda d: (f2(d["humaneval"]["speedup"]), f2(d["humaneval"]["tau"]), f2(d["mtbench"]["speedup"]),
                      f2(d["mtbench"]["tau"]))),
    Figure("docs/benchmarks.md", "(1-row step {} ms at 256 cached positions, 2 threads). verify(3) ÷ verify(1) = {} and "
           "verify(4) ÷ verify(1) = {} at 256 cached on 2 threads; {} and {} at longer contexts and on one thread.",
           ("verify_rows_codes.json",),
           lambda d: (f1(verify_ms(d, 2, 256, 1)), f2(verify_ms(d, 2, 256, 3, "ratio")),
                      f2(verify_ms(d, 2, 256, 4, "ratio")), span(longer_or_one_thread(d, 3)),
                      span(longer_or_one_thread(d, 4)))),
    Figure("docs/benchmarks.md", "(no gain within noise: {}× / {}× against {}× / {}×; `cpu_options_q8_0.json`)",
           ("cpu_options_q8_0.json",), q8),
]

# -- batching and serving --------------------------------------------------------------------------------------------

STREAMS = (1, 2, 4, 8, 16)


def best(d: dict, cell: str) -> float:
    return max(d["tokens_per_s"][cell])


def adaptive_over_single(d: dict) -> str:
    return slashes([best(d, f"spec{n}") / best(d, "single") for n in STREAMS])


def better_of_batched_and_single_spec(d: dict) -> str:
    return slashes([max(best(d, f"batch{n}"), best(d, "single_spec")) / best(d, "single") for n in STREAMS])


def step_cost(d: dict) -> str:
    wall = {(r["threads"], r["batch"]): r["wall_ms"] for r in d["results"]}
    return span([wall[t, 8] / wall[t, 1] for t in (2, 1)], f1)


def triton_medians(d: dict) -> str:
    return slashes([statistics.median(v) for v in d["adaptive_over_batched_ar_per_repeat"].values()])


def triton_best(d: dict, server: str) -> str:
    return slashes([c["tokens_per_s"] for c in d["cells"][server]], f1)


def serve_cell(d: dict, kind: str, n: int) -> dict:
    return d["cells"][f"{kind}/{n}"]


def serve_row(kind: str, n: int) -> Callable[[dict], tuple[str, ...]]:
    def values(d: dict) -> tuple[str, ...]:
        c = serve_cell(d, kind, n)
        tau = "–" if c["tau"] is None else f2(c["tau"])
        return (f1(c["tokens_per_s"]), f1(c["tpot_p50_ms"]), f1(c["tpot_p95_ms"]), f0(c["ttft_p50_ms"]), tau)
    return values


def serve_ratios(d: dict) -> str:
    return slashes([serve_cell(d, "adaptive", n)["tokens_per_s"] / serve_cell(d, "off", n)["tokens_per_s"]
                    for n in (1, 4, 8, 16)])


def serve_spreads(d: dict) -> list[float]:
    """How far a cell's repeats differ, per stream count: the larger of the two servers' (max − min) ÷ max, in %."""
    rep = d["repeats_tokens_per_s"]
    return [max(100 * (max(rep[f"{k}/{n}"]) - min(rep[f"{k}/{n}"])) / max(rep[f"{k}/{n}"]) for k in ("adaptive", "off"))
            for n in (1, 4, 8, 16)]


def one_stream(d: dict) -> tuple[str, ...]:
    wall, cpu = d["single_stream_tokens_per_s"], d["single_stream_tokens_per_cpu_s"]
    return (f1(wall["http"]), f1(wall["stream"]), f2(wall["http"] / wall["stream"]), f1(wall["submit"]),
            f2(wall["http"] / wall["submit"]), f1(cpu["http"]), f1(cpu["stream"]), f2(cpu["http"] / cpu["stream"]),
            f1(cpu["submit"]), f2(cpu["http"] / cpu["submit"]), f0(100 * (1 - cpu["http"] / cpu["stream"])))


SERVE = ("serve_concurrency.json",)
SERVING_FIGURES = [
    Figure("docs/benchmarks.md", "Batched autoregressive decoding at 8 streams makes {}× the single stream's tokens per "
           "second.", ("batch_throughput_128.json",), lambda d: (f2(best(d, "batch8") / best(d, "single")),)),
    Figure("docs/benchmarks.md", "Batched + load-adaptive drafting at 1 / 2 / 4 / 8 / 16 streams: {}× single-stream AR, "
           "against the better of batched AR and single-stream speculative decoding at {}×",
           ("batch_throughput_128.json",), lambda d: (adaptive_over_single(d), better_of_batched_and_single_spec(d))),
    Figure("docs/benchmarks.md", "An 8-row plain step costs {}× a 1-row step", ("batch_step_profile.json",),
           lambda d: (step_cost(d),)),
    Figure("docs/benchmarks.md", "single-stream AR {} tok/s, batched AR {} tok/s at 8 streams, {} at 16.",
           ("batch_throughput_codes.json",), lambda d: (f1(best(d, "single")), f1(best(d, "batch8")),
                                                        f1(best(d, "batch16")))),
    Figure("docs/benchmarks.md", "medians of four repeats: **{}** at 1 / 2 / 4 / 8 / 16 streams",
           ("triton_throughput_adaptive_vs_ar.json",), lambda d: (triton_medians(d),)),
    Figure("docs/benchmarks.md", "batched AR {} tok/s, adaptive {}.", ("triton_throughput_codes.json",),
           lambda d: (triton_best(d, "batched_ar"), triton_best(d, "adaptive"))),
    Figure("docs/benchmarks.md", "adaptive ÷ off {} (repeats within {} %), one stream over HTTP {}× `Generator.stream` "
           "per wall second, {}× per CPU second", SERVE,
           lambda d: (serve_ratios(d), span(serve_spreads(d), f0), one_stream(d)[2], one_stream(d)[7])),
    *(Figure("docs/serve.md", f"| {label} | {n} | {{}} | {{}} / {{}} | {{}} | {{}} |", SERVE, serve_row(kind, n))
      for kind, label0 in (("adaptive", "adaptive"), ("off", "off")) for n in (1, 4, 8, 16)
      for label in [label0 if (kind, n) != ("off", 1) else "off (batched plain)"]),
    Figure("docs/serve.md", "Adaptive ÷ off: {} at 1 / 4 / 8 / 16 streams, where the three repeats of a cell differ by "
           "up to {} %", SERVE, lambda d: (serve_ratios(d), slashes(serve_spreads(d), f0))),
    Figure("docs/serve.md", "HTTP {} tok/s against `Generator.stream` {} ({}×) and `Generator.submit` {} ({}×) per wall "
           "second; per CPU second (the server's and the client's against the in-process decode's) {} against {} ({}×) "
           "and {} ({}×): the HTTP side (event loop, JSON, the client's parsing) costs about {} % of the CPU the "
           "decoding takes.", SERVE, one_stream),
]

# -- the prefix cache and chunked prefill ------------------------------------------------------------------------------


def turn(d: dict, n: int) -> dict:
    return next(t for t in d["turns"] if t["turn"] == n)


def prefix_turns(d: dict) -> tuple[str, ...]:
    assert all(t["equal"] for t in d["turns"] + d["repeated"])
    t6 = turn(d, 6)
    geo = math.exp(statistics.mean(math.log(turn(d, n)["ratio"]) for n in range(2, 7)))
    assert math.isclose(geo, d["turns_2_6_geomean"])
    return (f1(turn(d, 2)["ratio"]), f1(t6["ratio"]), f1(t6["prompt_tokens"] / 1000), f0(t6["on_ms"]),
            f1(t6["off_ms"] / 1000), f1(turn(d, 8)["ratio"]), f1(geo))


def prefix_bound(d: dict) -> tuple[str, ...]:
    """What an exact cache could save at most, attention free: each turn's prompt tokens over its new (uncached) ones,
    turns 2-6, and their geometric mean."""
    bound = [turn(d, n)["prompt_tokens"] / (turn(d, n)["prompt_tokens"] - turn(d, n)["cached_tokens"])
             for n in range(2, 7)]
    return slashes(bound, f1), f1(math.exp(statistics.mean(math.log(b) for b in bound)))


def prefix_macs_bound(d: dict) -> tuple[str, ...]:
    """The same bound counting multiply-adds, from the demo target's config (SmolLM2-135M, llama): each computed row
    costs its layers' matrices and its attention over the positions up to it (QK and PV: query heads x head size per
    position), so a cached turn's rows attend the whole history and an uncached prompt's half of it on average."""
    from dflash2_trt.targets.adapter import smollm2_path

    c = json.loads((smollm2_path() / "config.json").read_text(encoding="utf-8"))
    h, d_h, q, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    row = c["num_hidden_layers"] * (2 * h * q * d_h + 2 * h * kv * d_h + 3 * h * c["intermediate_size"])
    per_position = c["num_hidden_layers"] * 2 * q * d_h
    cost = lambda first, last: (last - first) * row + per_position * sum(range(first + 1, last + 1))  # noqa: E731
    bound = [cost(0, t["prompt_tokens"]) / cost(t["cached_tokens"], t["prompt_tokens"])
             for t in (turn(d, n) for n in range(2, 7))]
    return slashes(bound, f1), f1(math.exp(statistics.mean(math.log(b) for b in bound)))


def prefix_repeated(d: dict) -> tuple[str, ...]:
    again = [r for r in d["repeated"] if r["cached_tokens"]]
    return (span([r["ratio"] for r in again], f0), span([r["on_ms"] for r in again], f0),
            span([r["off_ms"] / 1000 for r in again], f1))


def prefix_peer(d: dict) -> tuple[str, ...]:
    geo = math.exp(statistics.mean(math.log(r["ratio"]) for r in d["peer"] if 2 <= r["turn"] <= 6))
    assert math.isclose(geo, d["peer_turns_2_6_geomean"])
    return f1(geo), span([o["on_ms"] / p["on_ms"] for o, p in zip(d["turns"], d["peer"], strict=True)])


def join_gaps(d: dict) -> tuple[str, ...]:
    """benchmarks.md's join-gap list: per setting the worst gap's span (ms; whole prompts in s) and its ratio to the
    median's over the repeats; the long prompt's time to first token whole and under the default budget."""
    runs: dict[str, list[dict]] = {}
    for r in d["runs"]:
        runs.setdefault(r["chunk"], []).append(r)
    gap = lambda c, k=1.0, fmt=f0: span([r["worst_gap_ms"] / k for r in runs[c]], fmt)  # noqa: E731
    ratio = lambda c, fmt=f1: span([r["worst_over_median"] for r in runs[c]], fmt)  # noqa: E731
    ttft = lambda c: span([r["long_ttft_ms"] / 1000 for r in runs[c]], f1)  # noqa: E731
    return (gap("none", 1000, f1), ratio("none", f0), gap("32"), ratio("32", f0), gap("16"), ratio("16"),
            gap("share=1.5"), ratio("share=1.5"), gap("share=2"), ratio("share=2"), ttft("none"), ttft("share=1.5"))


PREFIX_FIGURES = [
    Figure("docs/benchmarks.md", "cache ÷ none {}× at turn 2, {}× at turn 6 ({}k tokens: {} ms against {} s), {}× at turn "
           "8, {}× the geometric mean of turns 2–6", ("prefix_cache_turns.json",), prefix_turns),
    Figure("docs/benchmarks.md", "cache ÷ none {}× the geometric mean of turns 2–6; our cached time to first token {} of "
           "its", ("prefix_cache_turns.json",), prefix_peer),
    Figure("docs/benchmarks.md", "bounds what an exact cache can save: a turn's prompt ÷ its new tokens is {} at turns "
           "2–6, geometric mean {}×, what it would save if attention cost nothing", ("prefix_cache_turns.json",),
           prefix_bound),
    Figure("docs/benchmarks.md", "attend the whole history, an uncached prompt's half of it on average), {}, geometric "
           "mean {}×;", ("prefix_cache_turns.json",), prefix_macs_bound),
    Figure("docs/benchmarks.md", "the same 1.6k-token prompt sent again: {}× ({} ms against {} s).",
           ("prefix_cache_turns.json",), prefix_repeated),
    Figure("docs/benchmarks.md", "whole prompts: {} s ({}×); - fixed chunks: 32 rows {} ms ({}×), 16 rows {} ms ({}×); "
           "- the default time budget (`prefill_share` 1.5): {} ms ({}×); share 2: {} ms ({}×); - the long prompt's "
           "own time to first token: {} s whole, {} s under the default budget.", ("prefill_join_gap.json",), join_gaps),
    Figure("docs/benchmarks.md", "whole prompts: {} s ({}×); - fixed chunks: 32 rows {} ms ({}×), 16 rows {} ms ({}×); "
           "- the default time budget (`prefill_share` 1.5): {} ms ({}×); share 2: {} ms ({}×); - the long prompt's "
           "own time to first token: {} s whole, {} s under the default budget.", ("capi_join_gap.json",), join_gaps),
]

# -- hybrid targets' linear layers, grammar cost -----------------------------------------------------------------------


def delta_rule(d: dict) -> tuple[str, ...]:
    big = [r for r in d["results"] if r["shape"] == "4b"]
    tiny = [r["ratio"] for r in d["results"] if r["shape"] == "tiny"]
    verify = [r for r in big if r["call"] == "verify"]
    return (slashes([r["ratio"] for r in verify]), " / ".join(str(r["rows"]) for r in verify),
            f2(next(r["ratio"] for r in big if r["call"] == "prompt")), span(tiny))


def mamba2_rollback(d: dict) -> tuple[str, ...]:
    """targets.md's Nemotron-H passage: the 30b layer's k = 4 / 8 verifies, every row's state against the last's, the
    bytes returned, and a recomputing call over half the rows."""
    big = {r["rows"]: r for r in d["results"] if r["shape"] == "30b"}
    pct = lambda r: f0(100 * (r["every_over_last"] - 1))  # noqa: E731
    return (f1(big[4]["every_ms"]), f1(big[4]["last_ms"]), pct(big[4]), f1(big[8]["every_ms"]), f1(big[8]["last_ms"]),
            pct(big[8]), f1(big[4]["rollback_bytes"] / 1e6), f1(big[8]["rollback_bytes"] / 1e6),
            f1(big[4]["recompute_ms"]), f1(big[8]["recompute_ms"]))


GRAMMAR = ("grammar_cost.json",)


def grammar_rows(d: dict) -> tuple[str, ...]:
    """python-api.md's grammar table: τ free and under the schema (speculative), the grammar's share of each way."""
    row = {(r["decoding"], r["grammar"]): r for r in d["rows"]}
    share = lambda way: f"{f1(100 * row[way, 'json_schema']['grammar_share'])} %"  # noqa: E731
    return (f2(row["speculative", "none"]["tau"]), f2(row["speculative", "json_schema"]["tau"]), share("speculative"),
            share("plain"))


OTHER_FIGURES = [
    Figure("docs/targets.md", "stable ÷ old {} for {}-row verifies and {} for a 64-row prompt chunk of a "
           "Qwen3.5-4B-sized layer (no slower: a few small matmuls beside the projections), {} on make-tiny's layer",
           ("hybrid_delta_rule_cost.json",), delta_rule),
    Figure("docs/python-api.md", "| speculative | {} | {} | {} | | plain | — | — | {} |", GRAMMAR, grammar_rows),
    Figure("docs/targets.md", "a k-row verify returning every row's state costs {} ms against {} ms for the last row's "
           "alone at k = 4 (+{} %) and {} against {} ms at k = 8 (+{} %), and returns {} / {} MB per layer for the "
           "rollback; recomputing instead (the last state only, then a second call over the accepted rows after a "
           "partial acceptance) costs a whole call: {} ms for 2 rows, {} ms for 4", ("mamba2_rollback_cost.json",),
           mamba2_rollback),
]

FIGURES = SIDE_BY_SIDE + DEMO_FIGURES + LOOP_FIGURES + SERVING_FIGURES + PREFIX_FIGURES + OTHER_FIGURES

# -- the checks --------------------------------------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# A measured figure in prose: a number (or a range) with a time, a rate, a ratio or a share.
NUMBER = r"\d+(?:\.\d+)?(?:\s?[–-]\s?\d+(?:\.\d+)?)?"
SPEED = re.compile(NUMBER + r"(?:×|x\b|\s?tok/s|\s?tokens/s|\s?ms\b|\s?s\b|\s?%)")
# Numbers with those units that are not measurements: arithmetic of sizes, shares of tokens, test run times.
NOT_MEASURED = {
    "docs/support.md": ("≈ 15% of tokens", "over 4× the ring"),
    "docs/zlab-compatibility.md": ("0.81% of the time",),
    "docs/serve.md": ("(500s too)", "About 100 s on a 2-core", "About 35 s."),
    "docs/environment.md": ("| 57 |",),  # the test suite's own time, not the product's speed
}


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def doc_text(doc: str) -> str:
    return flat((REPO / doc).read_text(encoding="utf-8"))


def sections(doc: str) -> list[str]:
    """The document cut at its headings; the first piece is the text before the first ``## `` heading."""
    return re.split(r"(?m)^#{2,3} ", (REPO / doc).read_text(encoding="utf-8"))


@pytest.mark.parametrize("fig", FIGURES, ids=lambda f: f"{f.doc}:{f.template[:40]}")
def test_each_quoted_figure_equals_its_result_file(fig: Figure):
    assert fig.text() in doc_text(fig.doc), f"{fig.doc} should read: {fig.text()!r}"


@pytest.mark.parametrize("fig", FIGURES, ids=lambda f: f"{f.doc}:{f.template[:40]}")
def test_each_quoted_figure_names_its_cpu_and_its_file(fig: Figure):
    """The figure's section (or the page's opening, for docs/benchmarks.md whose every figure shares one machine)
    names the CPU and the result file the figure comes from."""
    parts = sections(fig.doc)
    home = next(p for p in parts if fig.text() in flat(p))
    for f in fig.files:
        assert f.removesuffix(".json") in home, f"{fig.doc}: the section quoting {fig.template[:40]!r} names no {f}"
    assert CPU in home or (fig.doc == "docs/benchmarks.md" and CPU in parts[0]), (fig.doc, fig.template[:40])


@pytest.mark.parametrize("name", sorted({f for fig in FIGURES for f in fig.files}))
def test_each_quoted_result_file_says_where_it_ran(name: str):
    d = load(name)
    machine = d.get("machine")
    block = isinstance(machine, dict) and all(machine.get(k) for k in MACHINE_KEYS)
    if name in NO_MACHINE_BLOCK:
        assert not block, f"{name} records its machine now: take it out of NO_MACHINE_BLOCK"
        index = (RESULTS / "README.md").read_text(encoding="utf-8")
        assert f"`{name}`" in index and CPU in index
    else:
        assert block, (name, machine)
        assert CPU in machine["cpu"], machine["cpu"]


def rerun_files() -> set[str]:
    """The result files benchmarks/rerun_quoted.sh writes (its ``--list``: runs nothing)."""
    out = subprocess.run(["bash", str(REPO / "benchmarks" / "rerun_quoted.sh"), "--list"], capture_output=True,
                         text=True, check=True).stdout
    return set(out.split())


def test_every_file_without_a_machine_block_is_quoted_and_rerun():
    """A quoted result file may lack its machine block only while benchmarks/rerun_quoted.sh writes it again; the
    rerun writes only quoted files. Negative control: an exemption the rerun does not refresh is found."""
    quoted, rerun = {f for fig in FIGURES for f in fig.files}, rerun_files()
    assert NO_MACHINE_BLOCK <= rerun, sorted(NO_MACHINE_BLOCK - rerun)
    assert rerun <= quoted, sorted(rerun - quoted)
    assert not NO_MACHINE_BLOCK | {"ort_op_profile.json"} <= rerun


TIMED = re.compile(r"tok/s|tokens/s|\bms\b")


def unquoted_figures(doc: str, figures: list[Figure]) -> list[str]:
    """Measured figures left in ``doc`` outside its registered passages and the not-measured phrases: rows of tables
    timed in tok/s or ms (by their header or their own first cell), and prose numbers with a unit."""
    text = FENCE.sub("", (REPO / doc).read_text(encoding="utf-8"))
    quoted = [fig.text() for fig in figures if fig.doc == doc]
    found, header, prose = [], None, []
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            prose.append(line)
            continue
        if header is None:  # a table's header names its columns: no figure
            header = line
            continue
        prose.append(line)
        row = flat(line)
        if (TIMED.search(header) or TIMED.search(row.split("|")[1])) and re.search(r"\d", row) \
                and not line.startswith("|-") and not any(row in q for q in quoted):
            found.append(row)
    body = flat("\n".join(prose))
    for q in quoted:
        body = body.replace(q, " ")
    for phrase in NOT_MEASURED.get(doc, ()):
        body = body.replace(phrase, " ")
    return found + SPEED.findall(CODE_SPAN.sub("", body))


@pytest.mark.parametrize("doc", DOCS)
def test_no_speed_figure_outside_a_registered_passage(doc: str):
    """A figure written into a document without its result file fails here."""
    assert unquoted_figures(doc, FIGURES) == []


def test_the_checks_see_a_changed_figure_and_an_unregistered_one(monkeypatch):
    """Negative controls: a result file whose figure moved makes its passage wrong; a passage taken out of the
    registry leaves its figures unquoted; a table row timed in ms is found."""
    fig = SIDE_BY_SIDE[0]
    real = load

    def moved(name: str) -> dict:
        d = real(name)
        if name == fig.files[0]:
            d["summary"]["humaneval"]["ours fp32 AR"]["tokens_per_s"] += 1.0
        return d

    monkeypatch.setattr(sys.modules[__name__], "load", moved)
    assert fig.text() not in doc_text(fig.doc)
    monkeypatch.setattr(sys.modules[__name__], "load", real)
    assert fig.text() in doc_text(fig.doc)
    assert unquoted_figures(fig.doc, [f for f in FIGURES if f is not fig])
    assert SPEED.findall("decodes at 80 tok/s, 1.2× faster, 3 ms a step, 4 % of it") == ["80 tok/s", "1.2×", "3 ms",
                                                                                       "4 %"]
