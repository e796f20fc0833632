"""Helpers shared by the tests (fixtures live in conftest.py and use these): the tiny pairs made by the
project's own make-tiny and exported once, the same weights at another block size, and the acceptance check
of the lossless / equivalence tests."""

from __future__ import annotations


def make_pair(tmp_path_factory, name: str, accepting: bool = False):
    from dflash2_trt.tiny import make_tiny

    out = tmp_path_factory.mktemp(name)
    make_tiny(out, seed=0, block_size=16, accepting=accepting)
    return out


def bound_drafter(pair_dir, target):
    from dflash2_trt.model import load_drafter

    d = load_drafter(pair_dir / "drafter")
    d.bind_target(target.embed_weight, target.lm_head_weight)
    return d


def export_pair(pair_dir, tmp_path_factory, name: str):
    """The pair exported by dflash2-export (its block size 16, max 512 positions)."""
    from dflash2_trt.export.exporter import export_model

    out = tmp_path_factory.mktemp("export") / name
    export_model(pair_dir / "target", pair_dir / "drafter", out, progress=False, max_seq_len=512)
    return out


def with_block_size(drafter, bs: int, use_conv: bool = True):
    """The same weights under another block size / convolutions-off ablation (weights do not depend on bs)."""
    d = drafter.at_block_size(bs)
    d.set_ablation(use_conv=use_conv)
    return d


def assert_accepts(accepted: list[int], draft_rows: int, what: object = "") -> None:
    """The path under test really committed drafts: at least half of the cycles accepted >= 1 draft and some
    cycle accepted >= 3 (or every row, when a block has fewer than 3). ``accepted``: per-cycle counts, pooled
    over the requests of one configuration; ``draft_rows``: L = block size - 1."""
    assert accepted, f"no cycles ran {what}"
    frac = sum(a >= 1 for a in accepted) / len(accepted)
    assert frac >= 0.5, f"only {frac:.0%} of {len(accepted)} cycles accepted a draft {what}"
    assert max(accepted) >= min(3, draft_rows), f"no cycle accepted {min(3, draft_rows)} drafts {what}: {accepted}"
