"""Write a random DFlash 2 drafter for SmolLM2-135M-Instruct (identity-initialised convolutions,
1 layer, block size 8, mask token 16, selector rank 64) — a stand-in until a trained drafter exists.

    python benchmarks/make_smollm2_drafter.py --out DIR [--seed 0] [--block-size 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def smollm2_drafter_config(block_size: int = 8):  # noqa: ANN201
    from dflash2_trt.config import DFlash2Config

    return DFlash2Config(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, num_target_layers=30,
                         block_size=block_size, mask_token_id=16, selector_rank=64, rms_norm_eps=1e-5,
                         rope_theta=100000.0)


def make_drafter(out: Path, seed: int = 0, block_size: int = 8) -> Path:
    import torch

    from dflash2_trt.model import DFlash2Drafter, save_drafter

    torch.manual_seed(seed)
    save_drafter(DFlash2Drafter(smollm2_drafter_config(block_size)).eval(), out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=8)
    a = p.parse_args(argv)
    print(make_drafter(a.out, a.seed, a.block_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
