"""The TensorRT engine build and backend on a sliding-window (gpt-oss) export and a Gemma 4 one, against the fakes of
tests/trt_fakes.py: the profiles fix the rings' size, the rings are bound in place (and the steps captured), engines
that compute (``FakeTrt(compute=True)`` runs the real target graph) decode like ONNX Runtime token for token with drafts
accepted and rolled back while the rings wrap, and a planted ring bug is caught. Real TensorRT engines never ran."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from dflash2_trt.export import engines as E
from dflash2_trt.manifest import read_manifest
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.trt.backend import TrtBackend
from dflash2_trt.runtime.trt.device_buffers import DeviceWindowRing
from helpers import assert_accepts, make_pair, req
from trt_fakes import FakeCuda, FakeTrt

BLOCK = 8


@pytest.fixture(scope="module", params=["gpt_oss", "gemma4"])
def sw_engines(request, tmp_path_factory):
    """make-tiny's accepting gpt-oss pair (sliding and full layers alternating, windows of 8) and Gemma 4 pair (the
    same interface: every layer's KV in one buffer shape, shared layers with copies) exported at block size 8, with
    FakeTrt engines (decomposed heads) recorded in its manifest."""
    from dflash2_trt.export.exporter import export_model

    if request.param == "gemma4":  # conftest's, shared with the batched-loop tests
        out = request.getfixturevalue("gemma4_exports")(BLOCK)
    else:
        pair = make_pair(tmp_path_factory, f"trt_sw_{request.param}", accepting=True, arch=request.param)
        out = tmp_path_factory.mktemp("export") / "trt_sw"
        export_model(pair / "target", pair / "drafter", out, progress=False, max_seq_len=256, block_size=BLOCK)
    d = tmp_path_factory.mktemp("trt_sw") / "exp"
    shutil.copytree(out, d)
    cuda = FakeCuda()
    E.build_engines(d, selector="decomposed", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    return d


def test_profiles_fix_the_rings(sw_engines):
    """Both target profiles hold every sliding layer's past K/V and window_positions at the ring's size."""
    m = read_manifest(sw_engines)
    sw, t = m.target.sliding_window, m.target
    assert (sw.window, sw.ring_slots) == (8, 24)
    for p in E.profiles_for(m, "target", 256):
        shapes = E.input_shapes(m.graphs["target"], p.dims)
        assert shapes["window_positions"] == (((1, 24),) * 2 + ((p.dims["batch"][2], 24),))
        for i, kind in enumerate(t.layer_kinds):
            if kind == "sliding":
                assert shapes[f"past_key_values.{i}.key"][2][2] == 24


def _decode(be, tgt, ort_be, prompts):  # noqa: ANN001
    """(prompts whose TensorRT speculative output, through ``tgt``, differs from ONNX Runtime's autoregressive
    output, accepted drafts per cycle)."""
    ort_tgt = ort_be.target_runner()
    bad, accepted = 0, []
    for p in prompts:
        want = D.target_generate(ort_tgt, p, req(40, eos_ids=set())).tokens
        got = D.speculative_generate(tgt, be.draft_runner("greedy"), p, req(40, eos_ids=set()))
        bad += got.tokens != want
        accepted += got.accepted
    return bad, accepted


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_decodes_like_ort_while_the_rings_wrap(sw_engines, cuda_graphs):
    """Greedy speculative decoding through the TensorRT backend (engines that compute; CUDA graphs replayed or not)
    equals ONNX Runtime's autoregressive output token for token on 6 prompts of up to 30 tokens + 40 new (rings of
    24 wrapping), with drafts accepted and partial blocks rolled back; the rings' buffers never move."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    cuda = FakeCuda()
    be = TrtBackend(sw_engines, trt_module=FakeTrt(cuda, compute=True), api=cuda, cuda_graphs=cuda_graphs)
    ort_be = OrtBackend(sw_engines)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(4, be.manifest.target.vocab_size, int(rng.integers(5, 30))).tolist() for _ in range(6)]
    tgt = be.target_runner()
    ptrs = list(tgt.ring.ptrs)
    bad, accepted = _decode(be, tgt, ort_be, prompts)
    assert bad == 0
    assert_accepts(accepted, BLOCK - 1, "TensorRT backend, sliding-window target")
    assert any(0 < a < BLOCK - 1 for a in accepted), accepted
    assert tgt.ring.positions.max() >= 2 * tgt.ring.ring.spec.ring_slots  # wrapped
    assert (be.graphs.stats.replays > 0) == cuda_graphs and tgt.ring.ptrs == ptrs
    be.close()
    ort_be.close()


def test_a_crop_that_keeps_the_cut_slots_is_caught(sw_engines, monkeypatch):
    """Planted bug: the device ring's crop leaves the cut rows' keys valid -> TensorRT's output differs from ONNX
    Runtime's."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    monkeypatch.setattr(DeviceWindowRing, "crop", lambda self, length: None)
    cuda = FakeCuda()
    be = TrtBackend(sw_engines, trt_module=FakeTrt(cuda, compute=True), api=cuda)
    ort_be = OrtBackend(sw_engines)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(4, be.manifest.target.vocab_size, int(rng.integers(5, 30))).tolist() for _ in range(6)]
    assert _decode(be, be.target_runner(), ort_be, prompts)[0] > 0
    be.close()
    ort_be.close()


def test_prefix_cache_restores_the_rings_exactly(sw_engines, monkeypatch):
    """The prefix cache on the TensorRT backend, sliding-window target (a 40-token prompt wraps the rings of 24): a
    hit restores the device rings with their window positions, and each decode equals ONNX Runtime's from an empty
    cache, cycle for cycle. Planted bug: rings restored without their positions is caught."""
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.trt.device_buffers import DeviceWindowRing
    from helpers import prefix_cache_equals_uncached

    cuda = FakeCuda()
    be = TrtBackend(sw_engines, trt_module=FakeTrt(cuda, compute=True), api=cuda)
    ort_be = OrtBackend(sw_engines)
    prefix_cache_equals_uncached(be, ort_be)
    real = DeviceWindowRing.restore
    monkeypatch.setattr(DeviceWindowRing, "restore",
                        lambda self, snap, st: real(self, (snap[0], np.full_like(snap[1], -1), 0), st))
    with pytest.raises(AssertionError):
        prefix_cache_equals_uncached(be, ort_be)
    be.close()
    ort_be.close()
