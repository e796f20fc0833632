"""Shared fixtures: one tiny target/drafter pair per session (made by the project's own make-tiny), the
accepting pair (``make-tiny --accepting``: drafts accepted on most cycles) and one export of each. Helpers that
are not fixtures live in tests/helpers.py."""

from __future__ import annotations

import os
import sys

import pytest

from helpers import bound_drafter, export_pair, make_pair

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# tests check numbers, not speed, on machines shared with other work: no ORT session spins (tests/test_ort_pool.py
# sets the variable itself to cover the runtime's default, the target session spinning)
os.environ.setdefault("DFLASH2_ORT_SPINNING", "0")
# the suite run by a virtual environment's interpreter without activating it (.venv/bin/python -m pytest) is run as
# if activated: libdflash2 and its examples find the onnxruntime wheel's library through $VIRTUAL_ENV
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("VIRTUAL_ENV", sys.prefix)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_pair(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    from dflash2_trt.targets.adapter import TargetModel

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
    from dflash2_trt.targets.adapter import TargetModel

    return TargetModel.load(acc_dir / "target")


@pytest.fixture(scope="session")
def acc_drafter(acc_dir, acc_target):
    return bound_drafter(acc_dir, acc_target)


@pytest.fixture(scope="session")
def acc_export(acc_dir, tmp_path_factory):
    """The accepting pair exported once."""
    return export_pair(acc_dir, tmp_path_factory, "accepting")


@pytest.fixture(scope="session")
def identity_export():
    """SmolLM2-135M-Instruct exported with an identity-initialised DFlash 2 drafter (block size 8, seed 0), max 1024
    positions, made once into the cache (``bench.exports.identity_export``): the real-model runtime tests."""
    from dflash2_trt.bench.exports import identity_export

    return identity_export()
