"""The README's trained-drafter table: `dflash2 bench` (ONNX Runtime, CPU) on SmolLM2-135M-Instruct for
MT-Bench and HumanEval at T = 0 and T = 1, rows DFlash v1 / DFlash 2 selector off / greedy / Viterbi.

    python benchmarks/smollm2_table.py --v1 DRAFTER_V1 [--v2 DRAFTER_V2] [--limit 4] [--max-new-tokens 64]
        [--out benchmarks/results/smollm2_table.json]

--v2 defaults to the packaged demo drafter. Each cell is one `dflash2 bench --json` run (speculative and
autoregressive decoding of the same prompts, side by side, in one process). Writes the raw JSON of every
run, a markdown table on stdout, and the per-position acceptance plot (MT-Bench, T = 0) next to the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from dflash2_trt.bench.machine import describe

ROWS = [("DFlash v1", "v1", ["--no-selector"]),
        ("DFlash 2, selector off", "v2", ["--no-selector"]),
        ("DFlash 2, greedy selector", "v2", ["--selector", "greedy"]),
        ("DFlash 2, Viterbi selector", "v2", ["--selector", "viterbi"])]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--v1", required=True, help="DFlash v1 drafter folder")
    ap.add_argument("--v2", default=None, help="DFlash 2 drafter folder (default: the packaged demo drafter)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sets", default="mtbench,humaneval")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--out", default="benchmarks/results/smollm2_table.json")
    a = ap.parse_args()

    from dflash2_trt.bench.demo import DEMO_MAX_SEQ_LEN, demo_drafter_path
    from dflash2_trt.export.cache import cached_export

    drafters = {"v1": Path(a.v1), "v2": Path(a.v2) if a.v2 else demo_drafter_path()}
    exports = {k: cached_export("smollm2", p, max_seq_len=DEMO_MAX_SEQ_LEN) for k, p in drafters.items()}
    results = []
    for pset in a.sets.split(","):
        for temp in a.temperatures.split(","):
            for name, which, flags in ROWS:
                cmd = [sys.executable, "-m", "dflash2_trt.cli", "bench", "--model-dir", str(exports[which]), "--backend", "ort", "--prompts", pset,
                       "--limit", str(a.limit), "--max-new-tokens", str(a.max_new_tokens), "--temperature", temp,
                       "--json", *flags]
                print("+ dflash2", " ".join(cmd[3:]), file=sys.stderr, flush=True)
                r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                r.update(row=name, prompts=pset)
                results.append(r)
                print(f"  tau {r['tau']:.2f}  oracle {r['oracle_tau']}  speedup {r['speedup']:.2f}", file=sys.stderr,
                      flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": describe(),
        "drafters": {k: str(v) for k, v in drafters.items()}, "limit": a.limit,
                               "max_new_tokens": a.max_new_tokens, "runs": results}, indent=1))
    print(table(results))
    plot(results, out.with_suffix(".png"))
    return 0


def table(results: list[dict]) -> str:
    lines = ["| prompts | T | drafter | τ | oracle top-K τ | τ / oracle | cumulative acceptance r1..r7 | spec tok/s "
             "| AR tok/s | speedup | lossless |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        o = r["oracle_tau"]
        cum = " ".join(f"{x:.2f}" for x in r["per_position_cumulative"])
        lossless = "n/a" if r["lossless"] is None else str(r["lossless"]).lower()
        oracle = "-" if o is None else f"{o:.2f}"
        eff = "-" if not o else f"{r['tau'] / o:.2f}"
        lines.append(f"| {r['prompts']} | {r['temperature']:g} | {r['row']} | {r['tau']:.2f} | {oracle} | {eff} | {cum} | "
                     f"{r['spec_tokens_per_s']:.2f} | {r['ar_tokens_per_s']:.2f} | {r['speedup']:.2f}× | {lossless} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, pset in zip(axes, ("mtbench", "humaneval")):
        for r in results:
            if r["prompts"] == pset and r["temperature"] == 0:
                xs = range(1, len(r["per_position_cumulative"]) + 1)
                ax.plot(xs, r["per_position_cumulative"], marker="o", label=f"{r['row']} (τ {r['tau']:.2f})")
        ax.set_title(f"{pset}, T = 0: cumulative acceptance")
        ax.set_xlabel("draft position i")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("r_i")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
