"""``dflash2 train``: the subcommand's flags and its entry (wired into :mod:`dflash2_trt.cli`)."""

from __future__ import annotations

import argparse
import json

from dflash2_trt.train.data import SOURCES


def add_parser(sub) -> None:  # noqa: ANN001
    t = sub.add_parser("train", help="distil a DFlash 2 drafter for a target (SPEC §5)")
    t.add_argument("--target", required=True, help="HF folder, .gguf file, or 'smollm2'")
    t.add_argument("--out", required=True, help="drafter folder (also holds train_state/ for --resume)")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    t.add_argument("--selector-rank", type=int, default=64)
    t.add_argument("--no-conv", action="store_true", help="train without the dynamic convolutions")
    t.add_argument("--no-selector", action="store_true", help="train without the candidate selector")
    t.add_argument("--data", default="stdlib,sharegpt,pydocs", help=f"comma list of {', '.join(SOURCES)}")
    t.add_argument("--max-tokens", type=int, default=200_000, help="training text budget (tokens)")
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--steps", type=int, default=500)
    t.add_argument("--batch-seqs", type=int, default=4)
    t.add_argument("--anchors-per-seq", type=int, default=16)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-every", type=int, default=100)
    t.add_argument("--mask-token-id", type=int, default=None)
    t.add_argument("--no-init-from-target", action="store_true",
                   help="random drafter layers instead of copies of the target's last layers")
    t.add_argument("--cache-dir", default=None, help="target-feature cache (default ~/.cache/dflash2_trt/features)")
    t.add_argument("--sampled-softmax", type=int, default=0, metavar="N",
                   help="CE over the corpus' label ids + N random other ids per step (0 = full vocabulary)")
    t.add_argument("--gamma", type=float, default=None, help="slot-weight decay (default by block size, SPEC §5)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    t.add_argument("--resume", action="store_true", help="continue from OUT/train_state")


def run(a: argparse.Namespace) -> int:
    from pathlib import Path

    from dflash2_trt.errors import DFlash2Error
    from dflash2_trt.train.trainer import TrainConfig, train

    state = Path(a.out) / "train_state" / "state.json"
    if state.is_file() and not a.resume:
        raise DFlash2Error(f"{a.out} already holds a training run: pass --resume, or choose another --out")
    if a.resume and not state.is_file():
        raise DFlash2Error(f"--resume: no checkpoint in {Path(a.out) / 'train_state'}")
    tc = TrainConfig(target=a.target, out=a.out, block_size=a.block_size, layers=a.layers,
                     selector_rank=a.selector_rank, use_conv=not a.no_conv, use_selector=not a.no_selector,
                     sources=[s.strip() for s in a.data.split(",") if s.strip()], max_tokens=a.max_tokens,
                     seq_len=a.seq_len, steps=a.steps, batch_seqs=a.batch_seqs, anchors_per_seq=a.anchors_per_seq,
                     lr=a.lr, seed=a.seed, checkpoint_every=a.checkpoint_every, mask_token_id=a.mask_token_id,
                     init_from_target=not a.no_init_from_target, cache_dir=a.cache_dir,
                     sampled_softmax=a.sampled_softmax, gamma=a.gamma)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    train(tc)
    last = (Path(a.out) / "train_log.jsonl").read_text().strip().splitlines()[-1]
    print(json.dumps({"out": a.out, "last_log": json.loads(last)}))
    return 0
