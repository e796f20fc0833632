"""CPU cost of one training step against the head rows it computes (docs/training.md): the LM-head product as one
2-D GEMM (what :func:`dflash2_trt.train.trainer.compute_loss` does) against a strided 3-D view (``h[:, 1:] @ w.t()``,
which PyTorch runs as a batched matmul that re-streams the head slice per block).

    python benchmarks/train_step_cost.py [--threads 1] [--batch-seqs 4 8] [--block-size 4 8] [--repeat 3]
        [--drafter DIR] [--json]

Synthetic inputs of the packaged drafter's shapes (random tap features, random token ids, a random
49152 x 576 head; the cost does not depend on the values), the stage-3 recipe otherwise: 32 anchors per
row, rows of 320 tokens, sampled softmax over 8192 + batch ids + 1024 random ids, selector on, AdamW.
Both paths run interleaved in one process (so machine load hits both alike); each line reports the median
CPU seconds (``time.process_time``) of forward + backward + optimizer step, and the head rows (blocks x
(block size - 1)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflash2_trt.train import data as D
from dflash2_trt.train.trainer import Batch, compute_loss

DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "dflash2_trt" / "drafters" / "smollm2-135m-instruct-dflash2"


def strided_3d_logits(d):  # noqa: ANN001, ANN201
    """The old head product: ``d.logits`` fed a strided [nb, L, H] view (``h[:, 1:]``); returns a drop-in
    for the 2-D call ``logits(rows2 [nb*L, H]) -> [nb*L, V']`` (set ``nb_L`` before each call)."""
    orig = d.logits
    shape = {}

    def logits(h, rows_of_head=None):  # noqa: ANN001, ANN202
        nb, L = shape["nb_L"]
        H = h.shape[-1]
        full = torch.cat([h.new_zeros(nb, 1, H), h.reshape(nb, L, H)], 1)  # [nb, L + 1, H]
        return orig(full[:, 1:], rows_of_head).reshape(nb * L, -1)  # the strided view, as before

    return logits, shape


def synthetic_batch(rng: np.random.Generator, S: int, T: int, n_feat: int, V: int, bs: int, anchors: int) -> Batch:
    tokens = rng.integers(0, V, size=(S, T)).astype(np.int64)  # [S, T]
    feats = rng.standard_normal((S, T, n_feat)).astype(np.float32)  # [S, T, nH]
    prompt = T // 4
    anc = [np.sort(rng.choice(np.arange(prompt, T - 1), anchors, replace=False)).astype(np.int64) for _ in range(S)]
    labels = np.concatenate([D.block_labels(tokens[j], a, bs) for j, a in enumerate(anc)])  # [nb, bs]
    nb = labels.shape[0]
    return Batch(tokens, feats, np.repeat(np.arange(S), anchors), np.concatenate(anc), labels,
                 np.zeros((nb, bs, 8), np.int64), np.zeros((nb, bs, 8), np.float32))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-seqs", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--block-size", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--anchors-per-seq", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from dflash2_trt.model import load_drafter

    rng = np.random.default_rng(0)
    base = load_drafter(a.drafter)
    V, H = base.config.vocab_size, base.config.hidden_size
    emb = torch.randn(V, H) * 0.02  # [V, H] stands in for the frozen target embedding / head
    n_feat = H * len(base.config.target_layer_ids)
    results = []
    for bs in a.block_size:
        d = base.at_block_size(bs)
        d.bind_target(emb, emb)
        d.train()
        opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-5)
        w = torch.from_numpy(D.slot_weights(bs)).float()
        old_logits, shape = strided_3d_logits(d)
        for S in a.batch_seqs:
            b = synthetic_batch(rng, S, a.seq_len, n_feat, V, bs, a.anchors_per_seq)
            vocab = np.union1d(rng.choice(V, 8192 + 1024, replace=False), b.labels[b.labels >= 0]).astype(np.int64)
            shape["nb_L"] = (b.labels.shape[0], bs - 1)
            cost: dict[str, list[float]] = {"3d": [], "2d": []}
            losses = {}
            for rep in range(a.repeat + 1):  # the first round warms up
                for path in ("3d", "2d"):
                    if path == "3d":
                        d.logits = old_logits  # instance attribute shadows the method
                    else:
                        d.__dict__.pop("logits", None)
                    t = time.process_time()
                    loss, _ = compute_loss(d, b, w, vocab)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    if rep:
                        cost[path].append(time.process_time() - t)
                    losses[path] = float(loss.detach())
            d.__dict__.pop("logits", None)
            r = {"block_size": bs, "batch_seqs": S, "head_rows": int(b.labels.shape[0] * (bs - 1)),
                 "softmax_ids": int(vocab.size), "cpu_s_3d": round(statistics.median(cost["3d"]), 3),
                 "cpu_s_2d": round(statistics.median(cost["2d"]), 3), "threads": a.threads}
            r["speedup"] = round(r["cpu_s_3d"] / r["cpu_s_2d"], 2)
            results.append(r)
            if not a.json:
                print(f"bs {bs}  batch-seqs {S:2d}  head rows {r['head_rows']:5d}  CPU-s/step 3-D {r['cpu_s_3d']:.3f}"
                      f"  2-D {r['cpu_s_2d']:.3f}  ({r['speedup']:.2f}x)", flush=True)
    if a.json:
        json.dump(results, sys.stdout)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
