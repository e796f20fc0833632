"""What keeping rollback possible costs a Nemotron-H target's Mamba-2 layer, in the exported graph's form
(``dflash2_trt.targets.nemotron_h.TargetGraph``: the call's rows in closed form), exported to ONNX and run by ONNX
Runtime (one intra-op thread): a k-row verify returning the SSM state after every row (what the runtime keeps, so a
rollback is a slice) against the same call returning the last row's state only, and against that call plus the
recomputation a partial acceptance would then need (a second call over the accepted rows from the state before the
verify: its cost at j = k / 2 rows); median ms of ``--repeats`` interleaved runs, and the bytes the verify returns for
the rollback (the convolution's k inputs and the k states). Shapes: ``tiny`` (make-tiny's layer: hidden 64, 8 heads
of 8, state 8 in 2 groups) and ``30b`` (a Nemotron-3.5-30B-A3B-sized layer: hidden 2688, 64 heads of 64, state 128 in
8 groups, a 4-tap convolution).

    python benchmarks/mamba2_rollback_cost.py [--shapes tiny 30b] [--rows 4 8] [--repeats 15] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPES = {
    "tiny": dict(hidden_size=64, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2),
    "30b": dict(hidden_size=2688, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8),
}


def _layer(shape: str):  # noqa: ANN202
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = NemotronHConfig(layers_block_type=["linear_attention", "full_attention"], conv_kernel=4, vocab_size=128,
                          **SHAPES[shape])
    return cfg, NemotronHMamba2Mixer(cfg, 0).eval()


class _MambaLayer(torch.nn.Module):
    """One Mamba-2 layer in the exported graph's form, for ONNX export: (x, conv, s0, rows) -> (out, conv inputs,
    states of the asked rows)."""

    def __init__(self, cfg, layer) -> None:  # noqa: ANN001
        super().__init__()
        from types import SimpleNamespace

        from dflash2_trt.targets.nemotron_h import linear_state_shapes

        st = linear_state_shapes(cfg)
        self.layer = layer
        self.me = SimpleNamespace(heads=st["num_heads"], hd=st["key_dim"], n=st["value_dim"],
                                  groups=int(cfg.n_groups), inter=st["num_heads"] * st["key_dim"])

    def forward(self, x, conv, s0, rows):  # noqa: ANN001, ANN201
        from dflash2_trt.targets.nemotron_h import TargetGraph

        out, (xbc, states) = TargetGraph._mamba(self.me, self.layer, x, conv, s0, rows)
        return out, xbc, states


def _ort_session(cfg, layer):  # noqa: ANN001, ANN202
    import onnxruntime as ort

    from dflash2_trt.export.onnx_utils import trace
    from dflash2_trt.targets.nemotron_h import linear_state_shapes

    st = linear_state_shapes(cfg)
    args = (torch.randn(1, 3, cfg.hidden_size), torch.zeros(1, st["conv_dim"], st["conv_kernel"] - 1),
            torch.zeros(1, st["num_heads"], st["key_dim"], st["value_dim"]), torch.tensor([0, 2]))
    model = trace(_MambaLayer(cfg, layer).eval(), args, ["x", "conv", "s0", "rows"], ["out", "xbc", "states"],
                  {"x": {1: "S"}, "rows": {0: "R"}, "out": {1: "S"}, "xbc": {2: "S"}, "states": {1: "R"}}, 17)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]), st


def _run(sess, st, x, every: bool) -> tuple[float, int]:  # noqa: ANN001
    """Seconds of one call over x's rows (every row's state asked, or the last's), and the bytes it returns for a
    rollback."""
    import numpy as np

    k = x.shape[1]
    feed = {"x": x, "conv": np.zeros((1, st["conv_dim"], st["conv_kernel"] - 1), np.float32),
            "s0": np.full((1, st["num_heads"], st["key_dim"], st["value_dim"]), 0.01, np.float32),
            "rows": np.arange(k) if every else np.array([k - 1])}
    t = time.perf_counter()
    out = sess.run(None, feed)
    return time.perf_counter() - t, int(out[1].nbytes + out[2].nbytes)


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.bench.machine import describe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[4, 8])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = []
    print(f"{'shape':>5} {'k':>3} {'last ms':>8} {'every ms':>9} {'+recompute ms':>14} {'every/last':>11} "
          f"{'rollback bytes':>15} {'state bytes':>12}")
    for shape in a.shapes:
        cfg, layer = _layer(shape)
        sess, st = _ort_session(cfg, layer)
        state_bytes = 4 * st["num_heads"] * st["key_dim"] * st["value_dim"]
        for k in a.rows:
            x = torch.randn(1, k, cfg.hidden_size).numpy()
            half = x[:, : max(1, k // 2)]
            for every in (False, True):
                _run(sess, st, x, every)  # warm-up
            _run(sess, st, half, False)
            last, every_t, again, kept = [], [], [], 0
            for _ in range(a.repeats):
                last.append(_run(sess, st, x, False)[0])
                dt, kept = _run(sess, st, x, True)
                every_t.append(dt)
                again.append(_run(sess, st, half, False)[0])
            r = {"shape": shape, "rows": k, "last_ms": 1e3 * statistics.median(last),
                 "every_ms": 1e3 * statistics.median(every_t), "recompute_ms": 1e3 * statistics.median(again),
                 "rollback_bytes": kept, "state_bytes": state_bytes}
            r["every_over_last"] = r["every_ms"] / r["last_ms"]
            out.append(r)
            print(f"{shape:>5} {k:>3} {r['last_ms']:8.3f} {r['every_ms']:9.3f} {r['recompute_ms']:14.3f} "
                  f"{r['every_over_last']:11.2f} {kept:15,d} {state_bytes:12,d}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": describe(), "command": "python benchmarks/mamba2_rollback_cost.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]), "repeats": a.repeats, "results": out},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
