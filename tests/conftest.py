"""Shared fixtures: one tiny target/drafter pair per session (made by the project's own make-tiny), the
accepting pair (``make-tiny --accepting``: drafts accepted on most cycles) and one export of each. Helpers that
are not fixtures live in tests/helpers.py."""

from __future__ import annotations

import os

import pytest

from helpers import bound_drafter, export_pair, make_pair

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# tests check numbers, not speed, on machines shared with other work: no ORT session spins (tests/test_ort_pool.py
# sets the variable itself to cover the runtime's default, the target session spinning)
os.environ.setdefault("DFLASH2_ORT_SPINNING", "0")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_pair(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    from dflash2_trt.target import TargetModel

    return TargetModel.load(tiny_dir / "target")


@pytest.fixture(scope="session")
def tiny_drafter(tiny_dir, tiny_target):
    return bound_drafter(tiny_dir, tiny_target)


@pytest.fixture(scope="session")
def tiny_export(tiny_dir, tmp_path_factory):
    """The tiny pair exported once, shared by the export / runtime / bench tests."""
    return export_pair(tiny_dir, tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def acc_dir(tmp_path_factory):
    """``make-tiny --accepting`` (block size 16): a copying target and a drafter whose drafts it accepts."""
    return make_pair(tmp_path_factory, "accepting", accepting=True)


@pytest.fixture(scope="session")
def acc_target(acc_dir):
    from dflash2_trt.target import TargetModel

    return TargetModel.load(acc_dir / "target")


@pytest.fixture(scope="session")
def acc_drafter(acc_dir, acc_target):
    return bound_drafter(acc_dir, acc_target)


@pytest.fixture(scope="session")
def acc_export(acc_dir, tmp_path_factory):
    """The accepting pair exported once."""
    return export_pair(acc_dir, tmp_path_factory, "accepting")


@pytest.fixture(scope="session")
def smol_export():
    """SmolLM2-135M-Instruct exported with an identity-initialised DFlash 2 drafter (bs 8, seed 0; made once
    into the cache by benchmarks/make_smollm2_drafter.py), max 1024 positions: the real-model runtime tests."""
    import sys
    from pathlib import Path

    from dflash2_trt.export.cache import cached_export
    from dflash2_trt.paths import cache_dir
    from dflash2_trt.target import smollm2_path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from make_smollm2_drafter import make_drafter

    drafter = cache_dir() / "drafters" / "smollm2-identity-bs8-seed0"
    if not (drafter / "config.json").is_file():
        make_drafter(drafter, seed=0, block_size=8)
    return cached_export(smollm2_path(), drafter, progress=False, max_seq_len=1024)
