"""Shared fixtures: one tiny target/drafter pair per session (made by the project's own make-tiny), the
accepting pair (``make-tiny --accepting``: drafts accepted on most cycles) and one export of each. Helpers that
are not fixtures live in tests/helpers.py."""

from __future__ import annotations

import os

import pytest

from helpers import assert_accepts, bound_drafter, export_pair, make_pair, with_block_size  # noqa: F401 - re-exported

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
