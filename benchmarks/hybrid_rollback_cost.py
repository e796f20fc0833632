"""What keeping rollback possible costs a hybrid target's linear layer: a k-row verify of one Gated DeltaNet layer
(transformers' ``Qwen3_5GatedDeltaNet``, the PyTorch reference the target adapter runs) with the states of every
row recorded (``activate_past_recording``: the last k rows by the recurrent rule, row by row, and the convolution's
inputs of the whole call kept) against the same verify without (transformers' chunked kernel, only the last state
kept), at k = 4 and 8, after a prompt of ``--cached`` rows; time (median of ``--repeats``, one thread) and the bytes
the recording keeps. Shapes: ``tiny`` (make-tiny's hybrid target) and ``4b`` (a Qwen3.5-4B-sized layer: hidden
2560, 16 key / 32 value heads of 128, a 4-tap convolution). Second table: the same k-row call in the exported
graph's form (``dflash2_trt.targets.hybrid.TargetGraph``: the call's rows in closed form) returning the recurrent
state after every row (what the runtime keeps for a rollback) against after the last row only, and the bytes the
call returns for the rollback (per-row states and the convolution's inputs); with ``--ort``, the same layer exported
to ONNX and run by ONNX Runtime (one intra-op thread): what the ONNX Runtime backend runs.

    python benchmarks/hybrid_rollback_cost.py [--shapes tiny 4b] [--rows 4 8] [--cached 256] [--repeats 9] [--ort]
                                              [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPES = {
    "tiny": dict(hidden_size=64, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                 linear_value_head_dim=16),
    "4b": dict(hidden_size=2560, linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128),
}


def _layer(shape: str):  # noqa: ANN202
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"], linear_conv_kernel_dim=4,
                            **SHAPES[shape])
    return cfg, Qwen3_5GatedDeltaNet(cfg, 0).eval()


def _verify(cfg, layer, prompt, rows, record: bool) -> tuple[float, int]:  # noqa: ANN001
    """Seconds of one k-row call after the prompt, and the bytes of state kept for its rollback."""
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    if record:
        cache.activate_past_recording(recurrent_states_to_keep=0)
    with torch.no_grad():
        layer(prompt, cache=cache)
        if record:
            cache.crop(0)
            cache.layers[0].recurrent_states_to_keep = rows.shape[1]
        t = time.perf_counter()
        layer(rows, cache=cache)
        dt = time.perf_counter() - t
    lay = cache.layers[0]
    kept = 0
    if record:
        kept = sum(s.numel() * s.element_size() for s in lay.recurrent_states_history[0])
        kept += (lay.conv_states[0].shape[-1] - lay.conv_kernel_size[0]) * lay.conv_states[0].shape[1] * 4
    return dt, kept


def _linear_self(cfg):  # noqa: ANN001, ANN202
    """What ``TargetGraph._linear`` reads of its ``self``, for calling it on one layer."""
    from types import SimpleNamespace

    from dflash2_trt.targets.hybrid import TargetGraph, linear_state_shapes

    st = linear_state_shapes(cfg)
    me = SimpleNamespace(hk=int(cfg.linear_num_key_heads), hv=st["num_heads"], dk=st["key_dim"], dv=st["value_dim"])
    me._projections = lambda la, x: TargetGraph._projections(me, la, x)
    return me


def _graph_verify(cfg, layer, rows, every: bool) -> tuple[float, int]:  # noqa: ANN001
    """Seconds of one k-row call of the exported graph's linear layer, and the bytes of what it returns for a
    rollback (the asked rows' recurrent states and the convolution's inputs)."""
    from dflash2_trt.targets.hybrid import TargetGraph, linear_state_shapes

    st = linear_state_shapes(cfg)
    me = _linear_self(cfg)
    conv = torch.randn(1, st["conv_dim"], st["conv_kernel"] - 1)
    s0 = 0.1 * torch.randn(1, st["num_heads"], st["key_dim"], st["value_dim"])
    k = rows.shape[1]
    asked = torch.arange(k) if every else torch.tensor([k - 1])
    with torch.no_grad():
        t = time.perf_counter()
        _, (mixed, states) = TargetGraph._linear(me, layer, rows, conv, s0, asked)
        dt = time.perf_counter() - t
    return dt, (states.numel() + mixed.numel()) * 4


class _LinearLayer(torch.nn.Module):
    """One Gated DeltaNet layer in the exported graph's form, for ONNX export: (x, conv, s0, rows) -> (out, conv
    inputs, states of the asked rows)."""

    def __init__(self, cfg, layer) -> None:  # noqa: ANN001
        super().__init__()
        self.layer = layer
        self.me = _linear_self(cfg)

    def forward(self, x, conv, s0, rows):  # noqa: ANN001, ANN201
        from dflash2_trt.targets.hybrid import TargetGraph

        out, (mixed, states) = TargetGraph._linear(self.me, self.layer, x, conv, s0, rows)
        return out, mixed, states


def _ort_session(cfg, layer):  # noqa: ANN001, ANN202
    import onnxruntime as ort

    from dflash2_trt.export.onnx_utils import trace
    from dflash2_trt.targets.hybrid import linear_state_shapes

    st = linear_state_shapes(cfg)
    args = (torch.randn(1, 3, cfg.hidden_size), torch.zeros(1, st["conv_dim"], st["conv_kernel"] - 1),
            torch.zeros(1, st["num_heads"], st["key_dim"], st["value_dim"]), torch.tensor([0, 2]))
    names = ["x", "conv", "s0", "rows"]
    model = trace(_LinearLayer(cfg, layer).eval(), args, names, ["out", "mixed", "states"],
                  {"x": {1: "S"}, "rows": {0: "R"}, "out": {1: "S"}, "mixed": {2: "S"}, "states": {1: "R"}}, 17)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]), st


def _ort_verify(sess, st, rows, every: bool) -> tuple[float, int]:  # noqa: ANN001
    import numpy as np

    k = rows.shape[1]
    feed = {"x": rows.numpy(), "conv": np.zeros((1, st["conv_dim"], st["conv_kernel"] - 1), np.float32),
            "s0": np.full((1, st["num_heads"], st["key_dim"], st["value_dim"]), 0.01, np.float32),
            "rows": np.arange(k) if every else np.array([k - 1])}
    t = time.perf_counter()
    out = sess.run(None, feed)
    return time.perf_counter() - t, int(out[1].nbytes + out[2].nbytes)


def _paired(run, repeats: int) -> tuple[float, float, int]:  # noqa: ANN001
    """Median ms of ``run(False)`` and ``run(True)`` (each -> (seconds, bytes)), interleaved so that drift hits both
    alike, and the bytes of the last ``run(True)``."""
    a, b, kept = [], [], 0
    for _ in range(repeats):
        a.append(run(False)[0])
        dt, kept = run(True)
        b.append(dt)
    return 1e3 * statistics.median(a), 1e3 * statistics.median(b), kept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[4, 8])
    p.add_argument("--cached", type=int, default=256)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--ort", action="store_true", help="also time the layer's ONNX graph on ONNX Runtime")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = []
    print(f"{'shape':>5} {'k':>3} {'plain ms':>9} {'recorded ms':>12} {'ratio':>6} {'kept KiB':>9}")
    for shape in a.shapes:
        cfg, layer = _layer(shape)
        H = cfg.hidden_size
        prompt = torch.randn(1, a.cached, H)
        for k in a.rows:
            rows = torch.randn(1, k, H)
            plain, recorded, kept = _paired(lambda rec: _verify(cfg, layer, prompt, rows, rec), a.repeats)
            r = {"shape": shape, "rows": k, "cached": a.cached, "plain_ms": plain, "recorded_ms": recorded,
                 "kept_bytes": kept}
            r["ratio"] = r["recorded_ms"] / r["plain_ms"]
            out.append(r)
            print(f"{shape:>5} {k:>3} {r['plain_ms']:9.2f} {r['recorded_ms']:12.2f} {r['ratio']:6.2f} "
                  f"{kept / 1024:9.1f}")
    graph = []
    print(f"\nexported graph's form: {'shape':>5} {'k':>3} {'last row ms':>12} {'every row ms':>13} {'ratio':>6} "
          f"{'returned KiB':>13}")
    for shape in a.shapes:
        cfg, layer = _layer(shape)
        for k in a.rows:
            rows = torch.randn(1, k, cfg.hidden_size)
            last, every, kept = _paired(lambda e: _graph_verify(cfg, layer, rows, e), a.repeats)
            r = {"shape": shape, "rows": k, "last_row_ms": last, "every_row_ms": every, "returned_bytes": kept}
            r["ratio"] = r["every_row_ms"] / r["last_row_ms"]
            graph.append(r)
            print(f"{'':>22} {shape:>5} {k:>3} {r['last_row_ms']:12.2f} {r['every_row_ms']:13.2f} {r['ratio']:6.2f} "
                  f"{kept / 1024:13.1f}")
    onnx_rt = []
    if a.ort:
        print(f"\nONNX Runtime:          {'shape':>5} {'k':>3} {'last row ms':>12} {'every row ms':>13} {'ratio':>6}")
    for shape in a.shapes if a.ort else []:
        cfg, layer = _layer(shape)
        sess, st = _ort_session(cfg, layer)
        for k in a.rows:
            rows = torch.randn(1, k, cfg.hidden_size)
            _ort_verify(sess, st, rows, True)  # warm-up
            last, every, _ = _paired(lambda e: _ort_verify(sess, st, rows, e), a.repeats)
            r = {"shape": shape, "rows": k, "last_row_ms": last, "every_row_ms": every}
            r["ratio"] = r["every_row_ms"] / r["last_row_ms"]
            onnx_rt.append(r)
            print(f"{'':>22} {shape:>5} {k:>3} {r['last_row_ms']:12.2f} {r['every_row_ms']:13.2f} {r['ratio']:6.2f}")
    if a.json:
        from dflash2_trt.bench.machine import describe

        with open(a.json, "w") as f:
            json.dump({"machine": describe(), "command": "python benchmarks/hybrid_rollback_cost.py "
                       + " ".join(sys.argv[1:] if argv is None else argv), "threads": 1, "results": out,
                       "graph": graph, "onnxruntime": onnx_rt}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
