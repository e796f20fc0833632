"""Shared fixtures: one tiny target/drafter pair per session (made by the project's own make-tiny), the
accepting pair (``make-tiny --accepting``: drafts accepted on most cycles) and one export of each; the shared
acceptance check of the lossless / equivalence tests."""

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


@pytest.fixture(scope="session")
def acc_dir(tmp_path_factory):
    """``make-tiny --accepting`` (block size 16): a copying target and a drafter whose drafts it accepts."""
    from dflash2_trt.tiny import make_tiny

    out = tmp_path_factory.mktemp("accepting")
    make_tiny(out, seed=0, block_size=16, accepting=True)
    return out


@pytest.fixture(scope="session")
def acc_target(acc_dir):
    from dflash2_trt.target import TargetModel

    return TargetModel.load(acc_dir / "target")


@pytest.fixture(scope="session")
def acc_drafter(acc_dir, acc_target):
    from dflash2_trt.model import load_drafter

    d = load_drafter(acc_dir / "drafter")
    d.bind_target(acc_target.embed_weight, acc_target.lm_head_weight)
    return d.eval()


@pytest.fixture(scope="session")
def acc_export(acc_dir, tmp_path_factory):
    """The accepting pair exported once (block size 16, max 512 positions)."""
    from dflash2_trt.export.exporter import export_model

    out = tmp_path_factory.mktemp("export") / "accepting"
    export_model(acc_dir / "target", acc_dir / "drafter", out, progress=False, max_seq_len=512)
    return out


def assert_accepts(accepted: list[int], draft_rows: int, what: object = "") -> None:
    """The path under test really committed drafts: at least half of the cycles accepted >= 1 draft and some
    cycle accepted >= 3 (or every row, when a block has fewer than 3). ``accepted``: per-cycle counts, pooled
    over the requests of one configuration; ``draft_rows``: L = block size - 1."""
    assert accepted, f"no cycles ran {what}"
    frac = sum(a >= 1 for a in accepted) / len(accepted)
    assert frac >= 0.5, f"only {frac:.0%} of {len(accepted)} cycles accepted a draft {what}"
    assert max(accepted) >= min(3, draft_rows), f"no cycle accepted {min(3, draft_rows)} drafts {what}: {accepted}"
