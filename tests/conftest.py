"""Shared fixtures: one tiny target/drafter pair per session (made by the project's own make-tiny)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from dflash2_trt.tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny")
    make_tiny(out, seed=0, block_size=16)
    return out


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    from dflash2_trt.target import TargetModel

    return TargetModel.load(tiny_dir / "target")


@pytest.fixture(scope="session")
def tiny_drafter(tiny_dir, tiny_target):
    from dflash2_trt.model import load_drafter

    d = load_drafter(tiny_dir / "drafter")
    d.bind_target(tiny_target.embed_weight, tiny_target.lm_head_weight)
    return d


def with_block_size(drafter, bs: int, use_conv: bool = True):
    """The same weights under another block size / convolutions-off ablation (weights do not depend on bs)."""
    from dflash2_trt.model import DFlash2Drafter

    d = DFlash2Drafter(drafter.config.replace(block_size=bs))
    d.load_state_dict(drafter.state_dict(), strict=True)
    d.bind_target(drafter.embed_weight, drafter.lm_head_weight)
    d.set_ablation(use_conv=use_conv)
    return d.eval()


@pytest.fixture(scope="session")
def tiny_export(tiny_dir, tmp_path_factory):
    """The tiny pair exported by dflash2-export (block size 16, max 512 positions), shared by the
    export / runtime / bench tests."""
    from dflash2_trt.export.exporter import export_model

    out = tmp_path_factory.mktemp("export") / "tiny"
    export_model(tiny_dir / "target", tiny_dir / "drafter", out, progress=False, max_seq_len=512)
    return out
