"""``dflash2 bench``: speculative vs plain autoregressive decoding of the same target on the same backend,
side by side, prompt by prompt (no torch on the ORT path).

Aggregation (docs/design.md): τ is pooled — tokens committed by speculative cycles ÷ those cycles, over every cycle of
every request (what a reader expects of "tokens per cycle"); ``tau_prompt_mean``, the mean of the requests' own
τ, is kept as a second, named figure (short requests weigh as much as long ones in it). Oracle τ and the
per-position cumulative acceptance r_i are pooled over cycles the same way (so τ = 1 + Σ r_i holds for full
blocks) and the conditional c_i = r_i / r_{i-1} is derived from it. Tokens/s = all generated tokens ÷ all decode
time (oracle passes excluded). ``lossless`` (greedy only): every speculative output equals the
autoregressive one; null at T > 0. ``guard``: the acceptance guard on (default :class:`~dflash2_trt.runtime.guard.GuardConfig`, a fresh
guard per prompt; ``spec_cycles`` / ``plain_steps`` / ``guard_switches`` / ``guard_probes`` are totals over
the prompts); ``min_confidence``: the confidence-adapted verify length (0: every row).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from dflash2_trt.bench.oracle import oracle_count
from dflash2_trt.acceptance import acceptance_stats
from dflash2_trt.vocabulary import DEFAULT_PROPOSER


def run_bench(gen, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,  # noqa: ANN001
              seed: int = 0, measure_oracle: bool = True, eos_ids: set[int] | None = None,
              progress: bool = True, texts: bool = False, guard: bool = False, selector: str = "greedy",
              min_confidence: float = 0.0, proposer: str = DEFAULT_PROPOSER, repeats: int = 1) -> dict:
    """Each prompt decoded speculatively and autoregressively, in turn, by ``gen`` (a
    :class:`dflash2_trt.api.Generator`), ``repeats`` times each, interleaved; the fastest run of each way counts
    (the same tokens at T = 0; one short prompt's timing varies by tens of percent between runs on a quiet
    machine); ``texts``: the result also holds ``texts`` (speculative outputs)."""
    from tqdm import tqdm

    def fastest(old: Any, new: Any) -> Any:
        return new if old is None or new.stats.elapsed_s < old.stats.elapsed_s else old

    specs, ars = [], []
    for i, p in enumerate(tqdm(prompts, desc="dflash2 bench", unit="prompt", file=sys.stderr, disable=not progress)):
        spec = ar = None
        for _ in range(repeats):
            spec = fastest(spec, gen.generate(p, max_new_tokens, temperature, seed + i, selector, guard,
                                              eos_ids=eos_ids, min_confidence=min_confidence, proposer=proposer,
                                              oracle=oracle_count if measure_oracle else None))
            ar = fastest(ar, gen.generate(p, max_new_tokens, temperature, seed + i, eos_ids=eos_ids,
                                          speculative=False))
        specs.append(spec)
        ars.append(ar)
    r = summarize(specs, ars, temperature)
    if texts:
        r["texts"] = [s.text for s in specs]
    return r


def summarize(specs: list, ars: list, temperature: float) -> dict:  # noqa: ANN001 - api.Result lists
    pooled = acceptance_stats([a for s in specs for a in s.stats.accepted],
                              [n for s in specs for n in s.stats.verified])
    per_prompt = [s.stats.tau for s in specs if s.stats.cycles]
    oracle = [o for s in specs for o in s.stats.oracle_accepted]
    spec_tps = sum(len(s.tokens) for s in specs) / max(1e-9, sum(s.stats.elapsed_s for s in specs))
    ar_tps = sum(len(a.tokens) for a in ars) / max(1e-9, sum(a.stats.elapsed_s for a in ars))
    return {
        "n_prompts": len(specs),
        "tau": pooled["tau"],
        "tau_prompt_mean": float(np.mean(per_prompt)) if per_prompt else 0.0,
        "per_position_cumulative": pooled["per_position_cumulative"],
        "per_position_conditional": pooled["per_position_conditional"],
        "oracle_tau": float(np.mean(np.asarray(oracle) + 1)) if oracle else None,
        "spec_tokens_per_s": spec_tps,
        "ar_tokens_per_s": ar_tps,
        "speedup": spec_tps / ar_tps if ar_tps > 0 else 0.0,
        "lossless": all(s.tokens == a.tokens for s, a in zip(specs, ars)) if temperature <= 0 else None,
        "spec_tokens": sum(len(s.tokens) for s in specs),
        "ar_tokens": sum(len(a.tokens) for a in ars),
        "spec_cycles": sum(s.stats.cycles for s in specs),
        "plain_steps": sum(s.stats.plain_steps for s in specs),
        "guard_switches": sum(s.stats.guard_switches for s in specs),
        "guard_probes": sum(s.stats.guard_probes for s in specs),
        # each proposer's own pooled τ and cycles (the drafter alone unless --proposer ngram / auto)
        "proposer_tau": {who: acceptance_stats(*zip(*rows))["tau"] for who, rows in _by_proposer(specs).items()},
        "proposer_cycles": {who: len(rows) for who, rows in _by_proposer(specs).items()},
    }


def _by_proposer(specs: list) -> dict[str, list[tuple[int, int]]]:  # noqa: ANN001 - api.Result list
    """{proposer: [(accepted, verified) of each of its cycles]} over every prompt."""
    out: dict[str, list[tuple[int, int]]] = {}
    for s in specs:
        for who, a, n in zip(s.stats.proposers, s.stats.accepted, s.stats.verified):
            out.setdefault(who, []).append((a, n))
    return out


def format_table(r: dict) -> str:
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [
        f"backend: {r['backend']}   prompts: {r['n_prompts']}   selector: {r.get('selector')}   "
        f"T: {r.get('temperature')}   max new tokens: {r.get('max_new_tokens')}",
        f"{'':16}{'tokens':>8}{'tok/s':>9}",
        f"{'speculative':16}{r['spec_tokens']:>8}{r['spec_tokens_per_s']:>9.2f}",
        f"{'autoregressive':16}{r['ar_tokens']:>8}{r['ar_tokens_per_s']:>9.2f}",
        f"speedup {r['speedup']:.2f}x   tau {f(r['tau'])} (per-prompt mean {f(r.get('tau_prompt_mean'))})   "
        f"oracle tau {f(r['oracle_tau'])}   "
        f"lossless {r['lossless'] if r['lossless'] is not None else 'n/a (T > 0)'}",
        "position     " + "".join(f"{i + 1:>6}" for i in range(len(r["per_position_cumulative"]))),
        "cumulative   " + "".join(f"{x:>6.2f}" for x in r["per_position_cumulative"]),
        "conditional  " + "".join(f"{x:>6.2f}" for x in r["per_position_conditional"]),
        f"guard {r.get('guard', 'off')}   min confidence {r.get('min_confidence', 0.0)}   "
        f"cycles {r['spec_cycles']}   plain steps {r['plain_steps']}   switches {r['guard_switches']}   "
        f"probes {r['guard_probes']}",
    ]
    codes = {k: v for k, v in (r.get("weight_codes") or {}).items() if v}
    if set(codes) - {"none"}:  # matrices whose fp32 weights are read as an exact narrower code
        lines.append("weights read as exact codes (matrices): "
                     + ", ".join(f"{k} {v}" for k, v in codes.items() if k != "none")
                     + f"; fp32 {codes.get('none', 0)}")
    return "\n".join(lines)


PLOT_FORMATS = (".png", ".pdf", ".svg")


def check_plot(path: str) -> None:
    """Before any work: ``--plot PATH`` can be written (a known format, an existing writable folder, not a
    folder itself) and matplotlib is there; DFlash2Error otherwise."""
    import os

    from dflash2_trt.errors import DFlash2Error

    p = Path(path)
    if p.suffix.lower() not in PLOT_FORMATS:
        raise DFlash2Error(f"--plot {path}: the file name must end in one of {', '.join(PLOT_FORMATS)}")
    if p.is_dir():
        raise DFlash2Error(f"--plot {path} is a folder")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise DFlash2Error(f"--plot {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise DFlash2Error(f"--plot {path}: not writable")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DFlash2Error("--plot needs matplotlib: pip install matplotlib") from None


def plot(r: dict, path: str) -> None:
    from dflash2_trt.errors import DFlash2Error

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlash2Error("--plot needs matplotlib: pip install matplotlib") from None
    xs = list(range(1, len(r["per_position_cumulative"]) + 1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, r["per_position_cumulative"], marker="o", label="cumulative r_i")
    ax.plot(xs, r["per_position_conditional"], marker="s", label="conditional c_i")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{r['backend']}: tau {r['tau']:.2f}, {r['n_prompts']} prompts")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise DFlash2Error(f"cannot write --plot {path}: {e}") from None
    finally:
        plt.close(fig)
