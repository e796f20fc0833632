"""The two SmolLM2-135M-Instruct exports that tests and benchmarks share, each made once into the cache
(``export.cache.cached_export``; torch and the export extra on first use, a folder afterwards):

- ``demo_export``: the demo's export — the DFlash 2 drafter shipped in the package (``bench.demo``) at its block
  size, ``--draft-vocab 4096``, 2048 positions. What ``dflash2 demo`` runs and the README's figures measure.
- ``identity_export``: SmolLM2 with an identity-initialised, untrained DFlash 2 drafter (1 layer, block size 8,
  seed 0), 1024 positions. It accepts few drafts; the real-model runtime tests use it because its ids do not
  depend on a trained checkpoint.

``identity_drafter`` writes that drafter (``benchmarks/make_smollm2_drafter.py`` is its command line).
"""

from __future__ import annotations

from pathlib import Path

IDENTITY_BLOCK_SIZE = 8
IDENTITY_SEED = 0
IDENTITY_MAX_SEQ_LEN = 1024


def demo_export(given: str | Path | None = None, progress: bool = True) -> Path:
    """``given`` (a benchmark's ``--export``) when set, else the demo's cached export (made on first use)."""
    if given:
        return Path(given)
    from dflash2_trt.bench.demo import DEMO_DRAFT_VOCAB, DEMO_MAX_SEQ_LEN, demo_drafter_path
    from dflash2_trt.export.cache import cached_export

    return cached_export("smollm2", demo_drafter_path(), progress=progress, max_seq_len=DEMO_MAX_SEQ_LEN,
                         draft_vocab=DEMO_DRAFT_VOCAB)


def identity_drafter_config(block_size: int = IDENTITY_BLOCK_SIZE):  # noqa: ANN201
    """A 1-layer DFlash 2 drafter config fitting SmolLM2-135M-Instruct (mask token 16, selector rank 64)."""
    from dflash2_trt.config import DFlash2Config

    return DFlash2Config(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, num_target_layers=30,
                         block_size=block_size, mask_token_id=16, selector_rank=64, rms_norm_eps=1e-5,
                         rope_theta=100000.0)


def identity_drafter(out: Path, seed: int = IDENTITY_SEED, block_size: int = IDENTITY_BLOCK_SIZE) -> Path:
    """Write an identity-initialised (untrained) drafter for SmolLM2 to ``out`` (weights drawn from ``seed``)."""
    import torch

    from dflash2_trt.model import DFlash2Drafter, save_drafter

    torch.manual_seed(seed)
    save_drafter(DFlash2Drafter(identity_drafter_config(block_size)).eval(), out)
    return out


def identity_export(given: str | Path | None = None, progress: bool = False) -> Path:
    """``given`` when set, else SmolLM2 with the identity drafter (block size 8, seed 0), 1024 positions, cached."""
    if given:
        return Path(given)
    from dflash2_trt.export.cache import cached_export
    from dflash2_trt.paths import cache_dir
    from dflash2_trt.targets.adapter import smollm2_path

    drafter = cache_dir() / "drafters" / f"smollm2-identity-bs{IDENTITY_BLOCK_SIZE}-seed{IDENTITY_SEED}"
    if not (drafter / "config.json").is_file():
        identity_drafter(drafter)
    return cached_export(smollm2_path(), drafter, progress=progress, max_seq_len=IDENTITY_MAX_SEQ_LEN)
