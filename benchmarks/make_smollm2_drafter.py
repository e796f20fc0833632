"""Write a random DFlash 2 drafter for SmolLM2-135M-Instruct (identity-initialised convolutions,
1 layer, block size 8, mask token 16, selector rank 64) — a stand-in until a trained drafter exists
(``dflash2_trt.bench.exports.identity_drafter``; the tests' ``identity_export`` uses the same).

    python benchmarks/make_smollm2_drafter.py --out DIR [--seed 0] [--block-size 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.bench.exports import IDENTITY_BLOCK_SIZE, IDENTITY_SEED, identity_drafter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=IDENTITY_SEED)
    p.add_argument("--block-size", type=int, default=IDENTITY_BLOCK_SIZE)
    a = p.parse_args(argv)
    print(identity_drafter(a.out, a.seed, a.block_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
