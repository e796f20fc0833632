"""The export check (dflash2_trt.export.verify) has teeth: a graph output about 1 % off fails it (a negative
control: loosening the fp32 bound to 0.5 would let it pass), and the bounds themselves are pinned."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.export import verify as V
from dflash2_trt.manifest import read_manifest


def test_tolerances_are_pinned():
    """Changing a bound is a decision to state in review, not a drive-by edit to make a test pass."""
    assert V.TOL == {"fp32": 2e-3, "fp16": 5e-2}
    assert V.MIN_MATCH == {"fp32": (1.0, 1.0), "fp16": (0.75, 0.8)}


class _Skewed:
    """An ORT session whose output ``name`` comes back scaled by 1 + ``rel`` (the rest as computed)."""

    def __init__(self, sess, name: str, rel: float) -> None:  # noqa: ANN001
        self.sess, self.name, self.rel = sess, name, rel

    def run(self, names, feed):  # noqa: ANN001, ANN201
        out = self.sess.run(names, feed)
        order = names or [o.name for o in self.sess.get_outputs()]
        if self.name in order:
            i = order.index(self.name)
            out[i] = (out[i] * (1 + self.rel)).astype(out[i].dtype)
        return out

    def __getattr__(self, attr: str):  # noqa: ANN204
        return getattr(self.sess, attr)


@pytest.fixture
def skew(monkeypatch):
    real = V.session

    def apply(name: str, rel: float = 0.01) -> None:
        monkeypatch.setattr(V, "session", lambda path: _Skewed(real(path), name, rel))

    return apply


def _check_target(export, target) -> dict:  # noqa: ANN001
    m = read_manifest(export, verify_checksums=False)
    return V.verify_target(export / "target.onnx", target, list(m.target.layer_ids), "fp32", np.float32)


def _check_drafter(export, drafter) -> dict:  # noqa: ANN001
    m = read_manifest(export, verify_checksums=False)
    return V.verify_drafter({k: export / g.file for k, g in m.graphs.items()}, drafter, "fp32", np.float32)


@pytest.mark.parametrize("output", ["logits", "context_features"])
def test_one_percent_off_on_a_target_output_fails(tiny_export, tiny_target, skew, output):
    report = _check_target(tiny_export, tiny_target)  # the control: the true graph passes
    assert max(v for k, v in report.items() if not k.endswith("_match")) < V.TOL["fp32"]
    skew(output)
    with pytest.raises(DFlash2Error, match=f"{output} differs from PyTorch"):
        _check_target(tiny_export, tiny_target)


def test_one_percent_off_on_a_drafter_output_fails(tiny_export, tiny_drafter, skew):
    _check_drafter(tiny_export, tiny_drafter)
    skew("hidden")
    with pytest.raises(DFlash2Error, match="differs from PyTorch"):
        _check_drafter(tiny_export, tiny_drafter)
