"""What the stable delta rule costs: one Gated DeltaNet layer of the exported target graph
(``dflash2_trt.targets.hybrid.TargetGraph``, its rows' triangular solve by blocked inversion) against the same layer
with the Neumann-series solve it replaced (``dflash2_trt.bench.unstable_delta_rule``), both exported to ONNX and run
by ONNX Runtime (one intra-op thread), for verify calls (every row's state returned) and prompt chunks (64 rows,
the last row's state): median ms of ``--repeats`` interleaved runs and the ratio stable / unstable. Shapes as
``hybrid_rollback_cost.py`` (``4b``: a Qwen3.5-4B-sized layer).

    python benchmarks/hybrid_delta_rule_cost.py [--shapes tiny 4b] [--rows 4 8 16 64] [--repeats 21] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hybrid_rollback_cost import SHAPES, _layer, _ort_session


def _run(sess, st, x, every: bool) -> float:  # noqa: ANN001
    import numpy as np

    k = x.shape[1]
    feed = {"x": x.numpy(), "conv": np.zeros((1, st["conv_dim"], st["conv_kernel"] - 1), np.float32),
            "s0": np.full((1, st["num_heads"], st["key_dim"], st["value_dim"]), 0.01, np.float32),
            "rows": np.arange(k) if every else np.array([k - 1])}
    t = time.perf_counter()
    sess.run(None, feed)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.bench.machine import describe
    from dflash2_trt.bench.unstable_delta_rule import doubling_delta_rule
    from dflash2_trt.targets import hybrid

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[4, 8, 16, 64])
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    stable_rule, out = hybrid._delta_rule, []
    print(f"{'shape':>5} {'rows':>4} {'call':>7} {'stable ms':>10} {'unstable ms':>12} {'ratio':>6}")
    for shape in a.shapes:
        cfg, layer = _layer(shape)
        sess = {}
        for name, rule in (("stable", stable_rule), ("unstable", doubling_delta_rule)):
            hybrid._delta_rule = rule
            sess[name] = _ort_session(cfg, layer)
        hybrid._delta_rule = stable_rule
        for k in a.rows:
            x = torch.randn(1, k, cfg.hidden_size)
            every = k < hybrid.MAX_CALL_ROWS  # a verify asks every row's state, a full prompt chunk its last
            times: dict[str, list[float]] = {"stable": [], "unstable": []}
            for name in times:
                _run(*sess[name], x, every)  # warm-up
            for _ in range(a.repeats):
                for name in times:
                    times[name].append(_run(*sess[name], x, every))
            r = {"shape": shape, "rows": k, "call": "verify" if every else "prompt",
                 **{f"{n}_ms": 1e3 * statistics.median(t) for n, t in times.items()}}
            r["ratio"] = r["stable_ms"] / r["unstable_ms"]
            out.append(r)
            print(f"{shape:>5} {k:>4} {r['call']:>7} {r['stable_ms']:10.3f} {r['unstable_ms']:12.3f} {r['ratio']:6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": describe(), "command": "python benchmarks/hybrid_delta_rule_cost.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]), "repeats": a.repeats, "results": out},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
