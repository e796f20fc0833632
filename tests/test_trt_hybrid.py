"""The TensorRT engine build and backend on a hybrid (Gated DeltaNet) export and a Nemotron-H (Mamba-2, MoE and
attention) export, against the fakes of tests/trt_fakes.py:
the profiles that cover the linear layers' state inputs, the device state bound in place and committed by device
copies after a verify (which rows, which addresses), its twin check against the host
:class:`~dflash2_trt.runtime.linear_state.LinearStates` of the ONNX Runtime runner on engines that compute
(``FakeTrt(compute=True)`` runs the real target graph), lossless decoding equal to ONNX Runtime token for token with
and without CUDA graphs, and three planted rollback bugs that these checks catch (both families); a Nemotron-H
MoE layer has no state tensors in the profiles or the bindings. Real TensorRT engines never ran."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.export import engines as E
from dflash2_trt.manifest import read_manifest
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.trt.backend import TrtBackend
from dflash2_trt.runtime.trt.device_buffers import DeviceLinearState
from helpers import assert_accepts, req
from trt_fakes import FakeCuda, FakeTrt

BLOCK = 8


@pytest.fixture(scope="module")
def hy_export(hybrid_exports):
    """conftest's accepting tiny qwen3_5 export (layers attention, linear, linear, attention) at block size 8."""
    return hybrid_exports(BLOCK)


@pytest.fixture(scope="module")
def hy_engines(hy_export, tmp_path_factory):
    """A copy of the hybrid export with FakeTrt engines (decomposed heads) recorded in its manifest."""
    d = tmp_path_factory.mktemp("trt_hy") / "exp"
    shutil.copytree(hy_export, d)
    cuda = FakeCuda()
    E.build_engines(d, selector="decomposed", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    return d


@pytest.fixture(scope="module")
def nh_engines(nh_exports, tmp_path_factory):
    """A copy of conftest's accepting Nemotron-H export (block size 8; layers Mamba-2, MoE, attention, Mamba-2) with
    FakeTrt engines recorded in its manifest."""
    d = tmp_path_factory.mktemp("trt_nh") / "exp"
    shutil.copytree(nh_exports(BLOCK), d)
    cuda = FakeCuda()
    E.build_engines(d, selector="decomposed", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    return d


@pytest.fixture
def linear_engines(request):
    """The hybrid or the Nemotron-H engines (parametrized indirectly by family): the checks of the linear layers'
    device state run on both."""
    return request.getfixturevalue({"qwen3_5": "hy_engines", "nemotron_h": "nh_engines"}[request.param])


def _open(d, compute: bool = False, **kw):
    cuda = FakeCuda()
    trt = FakeTrt(cuda, compute=compute)
    return TrtBackend(d, trt_module=trt, api=cuda, **kw), trt, cuda


def _linear_layers(m) -> list[int]:
    return [i for i, k in enumerate(m.layer_kinds) if k == "linear"]


# ----------------------------------------------------------------------------------------------------
# build-engines
# ----------------------------------------------------------------------------------------------------


def test_profiles_cover_the_state_inputs(hy_export, tmp_path):
    """The target engine's profiles: rows within the graph's 64-row limit (prefill), every linear layer's state at
    the manifest's linear_state shapes, state_rows R = 1 on the prefill profile and 1..bs on the step profile; the
    fake builder receives exactly these, and the engines' manifest entry is written as for a dense target."""
    m = read_manifest(hy_export)
    ls = m.target.linear_state
    assert m.block_size == BLOCK and ls.max_rows_per_call == 64 and _linear_layers(m) == [1, 2]
    prefill, step = E.profiles_for(m, "target", 256)
    assert prefill.dims["sequence"] == (1, 32, 64) and prefill.dims["state_rows"] == (1, 1, 1)
    assert step.dims["sequence"] == (1, BLOCK, BLOCK) and step.dims["state_rows"] == (1, BLOCK, BLOCK)
    conv = (1, ls.conv_dim, ls.conv_kernel - 1)
    rec = (1, ls.num_heads, ls.key_dim, ls.value_dim)
    for p in (prefill, step):
        shapes = E.input_shapes(m.graphs["target"], p.dims)
        for i in _linear_layers(m):
            assert shapes[f"past_conv.{i}"] == (conv,) * 3 and shapes[f"past_recurrent.{i}"] == (rec,) * 3
        lo, opt, hi = p.dims["state_rows"]
        assert shapes["state_rows"] == ((lo,), (opt,), (hi,))
        assert shapes["past_key_values.0.key"][2][2] == m.max_capacity
    assert E.input_shapes(m.graphs["target"], E.profiles_for(m, "target", 256, max_batch=2)[1].dims)[
        "past_recurrent.1"] == ((1, *rec[1:]), (2, *rec[1:]), (2, *rec[1:]))

    d = tmp_path / "exp"
    shutil.copytree(hy_export, d)
    cuda = FakeCuda()
    trt = FakeTrt(cuda)
    entry = E.build_engines(d, selector="decomposed", progress=False, trt_module=trt, api=cuda)
    built = trt.builds[0]
    assert built["file"].endswith("/target.onnx") and built["set"] == [] and built["cleared"] == ["TF32"]
    assert all(set(p) == set(built["inputs"]) for p in built["profiles"])
    pre, stp = built["profiles"]
    assert pre["state_rows"] == [[1], [1], [1]] and stp["state_rows"] == [[1], [BLOCK], [BLOCK]]
    assert pre["input_ids"] == [[1, 1], [1, 32], [1, 64]] and stp["input_ids"] == [[1, 1], [1, BLOCK], [1, BLOCK]]
    assert stp["past_conv.1"] == [list(conv)] * 3 and pre["past_recurrent.2"] == [list(rec)] * 3
    assert entry.plans["target"].profiles == (prefill, step) and read_manifest(d).engines == entry
    assert set(entry.plans) == {"target", "drafter_context", "drafter_block", "drafter_head_greedy",
                                "drafter_head_viterbi"}


def test_what_the_export_refuses_the_build_refuses(hy_export):
    """bf16 and quantized hybrid exports (refused by the export) and a block size past the graph's rows per call:
    each refused in one line."""
    m = read_manifest(hy_export)
    E.check_precision(m)
    with pytest.raises(DFlash2Error, match="linear layers builds from fp32 or fp16 exports without quantization"):
        E.check_precision(dataclasses.replace(m, dtype="bf16"))
    with pytest.raises(DFlash2Error, match="quantization 'int8'"):
        E.check_precision(dataclasses.replace(m, quantization=dataclasses.replace(m.quantization, kind="int8")))
    short = dataclasses.replace(m, target=dataclasses.replace(
        m.target, linear_state=dataclasses.replace(m.target.linear_state, max_rows_per_call=4)))
    with pytest.raises(DFlash2Error, match="block size 8 exceeds the target graph's 4 rows per call"):
        E.profiles_for(short, "target", 256)


# ----------------------------------------------------------------------------------------------------
# The backend's device state: bindings and copies (plain fakes: engines write zeros)
# ----------------------------------------------------------------------------------------------------


def _executes(ops):
    return [op for op in ops if op[0] == "execute"]


def _on_device(cuda: FakeCuda, ptr: int) -> bool:
    return any(base <= ptr < base + arr.size for base, arr in cuda.dev.items())


def test_state_buffers_are_bound_in_place_and_verify_is_captured(hy_engines):
    """The state buffers (allocated once) are the engine's past_conv / past_recurrent addresses; a prompt chunk asks
    for its last row, a verify for every row; after a crop that keeps j rows the recurrent state is row j - 1's and the
    conv window is composed from the old window and the call's inputs, all by device-to-device copies outside the
    captured graph, which then replays with the same buffers."""
    be, trt, cuda = _open(hy_engines)
    tgt = be.target_runner()
    lin = tgt.linear
    assert isinstance(lin, DeviceLinearState) and tgt.chunk == 64 and tgt.step_rows == BLOCK
    assert tgt.linear_names == ["past_conv.1", "past_recurrent.1", "past_conv.2", "past_recurrent.2"]
    tgt.forward(list(range(1, 21)))  # a prompt: prefill profile, eager, its last row's state only
    ex = _executes(cuda.log)[-1]
    shapes, addrs = dict(ex[4]), dict(ex[5])
    assert ex[3] == 0 and shapes["state_rows"] == (1,) and tgt.io["state_rows"].host_view((1,)).tolist() == [19]
    assert [addrs[n] for n in tgt.linear_names] == lin.ptrs
    assert [addrs[n] for n in tgt.linear_present] == [p for pair in zip(lin.conv_inputs, lin.row_states)
                                                      for p in pair]
    assert lin.pending == (20, False)
    mallocs = cuda.count("malloc")
    tgt.forward(list(range(BLOCK)))  # a verify: the prompt's state committed first, every row asked, captured
    assert tgt.last_path == "captured" and lin.pending == (BLOCK, True)
    ex = _executes(cuda.log)[-1]
    assert ex[3] == 1 and dict(ex[4])["state_rows"] == (BLOCK,)
    assert [dict(ex[5])[n] for n in tgt.linear_names] == lin.ptrs
    assert tgt.io["state_rows"].host_view((BLOCK,)).tolist() == list(range(BLOCK))

    spec, it = lin.spec, 4  # fp32 export
    k1, c = spec.conv_kernel - 1, spec.conv_dim
    for keep, verify_start in ((3, 20), (1, 23)):  # keep >= K - 1: inputs only; keep < K - 1: through scratch
        start = len(cuda.log)
        tgt.crop(verify_start + keep)
        ops = cuda.log[start:]
        want = []
        for conv, rec, inputs, states in zip(lin.conv, lin.recurrent, lin.conv_inputs, lin.row_states):
            want.append(("copy", rec, states + (keep - 1) * lin.state_bytes, lin.state_bytes))
            new = min(keep, k1)
            if new == k1:
                want.append(("copy2d", conv, k1 * it, inputs + (keep - new) * it, BLOCK * it, new * it, c))
            else:
                want += [("copy2d", lin.scratch, k1 * it, conv + new * it, k1 * it, (k1 - new) * it, c),
                         ("copy2d", lin.scratch + (k1 - new) * it, k1 * it, inputs, BLOCK * it, new * it, c),
                         ("copy", conv, lin.scratch, lin.conv_bytes)]
        assert ops == want, keep
        ends = [(op[1], op[3]) if op[0] == "copy2d" else (op[1], op[2]) for op in ops]  # (destination, source)
        assert all(_on_device(cuda, p) for pair in ends for p in pair)  # device to device: no host round trip
        assert tgt.cache_length == verify_start + keep and lin.pending is None
        start = len(cuda.log)
        tgt.forward(list(range(BLOCK)))  # same rows, capacity and buffers: a replay
        assert tgt.last_path == "replay", keep
        kinds = [op[0] for op in cuda.log[start:]]
        assert kinds == ["copy"] * 4 + ["execute"] + ["copy"] * 2 + ["copy2d"] * 4  # in: ids, pos, mask, rows
    assert cuda.count("malloc") == mallocs  # the state buffers never move
    with pytest.raises(DFlash2Error, match="cannot keep"):
        tgt.crop(2)  # before the last call
    be.close()


def test_reset_zeroes_the_state_and_a_prompt_cannot_be_rolled_back(hy_engines):
    """A new sequence starts from zero state (cudaMalloc garbage never reaches the engine); a long prompt runs in
    64-row chunks that record their last row only, so a crop into it is refused as on ONNX Runtime."""
    be, trt, cuda = _open(hy_engines)
    tgt = be.target_runner()
    lin = tgt.linear
    for p in (*lin.conv, *lin.recurrent):
        assert not cuda.dev[p].any()  # zeroed when allocated
    tgt.forward(list(range(1, 151)))
    assert [dict(e[4])["input_ids"] for e in _executes(cuda.log)] == [(1, 64), (1, 64), (1, 22)]
    with pytest.raises(DFlash2Error, match="rolled back only into the last call"):
        tgt.crop(100)
    for p in (*lin.conv, *lin.recurrent):
        cuda.dev[p][:] = 0xFF
    tgt.reset()
    assert lin.pending is None and tgt.cache_length == 0
    for p in (*lin.conv, *lin.recurrent):
        assert not cuda.dev[p].any()
    be.close()


def test_auto_picks_tensorrt_for_a_hybrid_export(hy_engines, monkeypatch):
    import dflash2_trt.runtime.trt.backend as tb
    from dflash2_trt.runtime.backends import open_backend

    cuda = FakeCuda()
    monkeypatch.setattr(tb, "import_tensorrt", lambda: FakeTrt(cuda))
    monkeypatch.setattr(tb, "CudaRuntime", lambda: cuda)
    be, note = open_backend(hy_engines, "auto")
    assert be.name == "trt" and note == "using TensorRT 10.13.0.35 on FakeGPU H0"
    be.close()


def test_nemotron_h_mlp_layer_has_no_state_in_profiles_or_bindings(nh_engines):
    """A Nemotron-H export: the engines' profiles cover exactly the graph's inputs (the Mamba-2 layers' states and the
    attention layer's KV; none for the MoE layer 1), and the backend binds the Mamba-2 states in place, layer 1 never
    named, the attention layer's KV the only KV buffer."""
    m = read_manifest(nh_engines)
    assert m.target.layer_kinds == ("linear", "mlp", "attention", "linear")
    inputs = {x.name for x in m.graphs["target"].inputs}
    assert {n for n in inputs if n.startswith("past")} == {
        "past_conv.0", "past_recurrent.0", "past_key_values.2.key", "past_key_values.2.value", "past_conv.3",
        "past_recurrent.3"}
    for p in m.engines.plans["target"].profiles:
        assert set(E.input_shapes(m.graphs["target"], p.dims)) == inputs
    be, _, cuda = _open(nh_engines)
    tgt = be.target_runner()
    assert tgt.linear_names == ["past_conv.0", "past_recurrent.0", "past_conv.3", "past_recurrent.3"]
    assert tgt.kv_names == ["past_key_values.2.key", "past_key_values.2.value"] and tgt.ring_names == []
    tgt.forward(list(range(1, 21)))
    bound = dict(_executes(cuda.log)[-1][5])
    assert inputs <= set(bound) and not any(n.endswith(".1") or ".1." in n for n in bound)
    assert [bound[n] for n in tgt.linear_names] == tgt.linear.ptrs
    be.close()


# ----------------------------------------------------------------------------------------------------
# Engines that compute: the device state against its host twin, decoding against ONNX Runtime
# ----------------------------------------------------------------------------------------------------


def _device_state(cuda: FakeCuda, lin: DeviceLinearState) -> list[np.ndarray]:
    """conv [conv_dim, K - 1] then recurrent [heads, dk, dv] of each linear layer, read from the fake device."""
    s = lin.spec
    conv = [cuda._mem(p, lin.conv_bytes).view(np.float32).reshape(s.conv_dim, s.conv_kernel - 1) for p in lin.conv]
    rec = [cuda._mem(p, lin.state_bytes).view(np.float32).reshape(s.num_heads, s.key_dim, s.value_dim)
           for p in lin.recurrent]
    return [a.copy() for a in conv + rec]


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-5 * max(1.0, float(np.abs(b).max()))


def _twin_mismatches(trt_tgt, ort_tgt, cuda: FakeCuda, seed: int) -> list[tuple[str, int]]:  # noqa: ANN001
    """A prompt, then verifies of bs rows each cropped to another kept length 0..bs (the last one keeping all): the
    TensorRT runner's logits and device state against the ONNX Runtime runner's (its LinearStates) after each step
    -> the (what, kept rows) that differ."""
    rng = np.random.default_rng(seed)
    vocab = trt_tgt.vocab_size
    bad: list[tuple[str, int]] = []
    for r in (trt_tgt, ort_tgt):
        r.reset()
    prompt = rng.integers(4, vocab, 20).tolist()
    if not _close(trt_tgt.forward(prompt)[0], ort_tgt.forward(prompt)[0]):
        bad.append(("prompt logits", -1))
    for keep in [0, 3, 1, BLOCK, 5, 2, BLOCK - 1, 4, 6]:
        rows = rng.integers(4, vocab, BLOCK).tolist()
        n = trt_tgt.cache_length
        if not _close(trt_tgt.forward(rows)[0], ort_tgt.forward(rows)[0]):
            bad.append(("logits", keep))
        trt_tgt.crop(n + keep)
        ort_tgt.crop(n + keep)
        trt_tgt.linear.commit()  # all rows kept: the state after them (a no-op after a rollback)
        host = [c[0] for c in ort_tgt.linear.conv] + [r[0] for r in ort_tgt.linear.recurrent]
        if not all(_close(a, b) for a, b in zip(_device_state(cuda, trt_tgt.linear), host)):
            bad.append(("state", keep))
    return bad


@pytest.mark.parametrize("linear_engines", ["qwen3_5", "nemotron_h"], indirect=True)
def test_device_state_equals_its_host_twin_after_every_rollback(linear_engines):
    """After a prompt and verifies cropped to every kept length 0..bs, the device state (conv window, recurrent
    state of each linear layer) equals the ONNX Runtime runner's LinearStates, and every call's logits equal."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be, trt, cuda = _open(linear_engines, compute=True)
    ort_be = OrtBackend(linear_engines)
    assert _twin_mismatches(be.target_runner(), ort_be.target_runner(), cuda, seed=3) == []
    assert cuda.executor.runs["target.onnx"] == 10
    be.close()
    ort_be.close()


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(1, 24))).tolist() for _ in range(n)]


def _decode_mismatches(be, ort_be, prompts) -> tuple[int, list[int]]:  # noqa: ANN001
    """(prompts whose TensorRT speculative output differs from ONNX Runtime's autoregressive output, accepted drafts
    per cycle)."""
    tgt, ort_tgt = be.target_runner(), ort_be.target_runner()
    bad, accepted = 0, []
    for p in prompts:
        want = D.target_generate(ort_tgt, p, req(24, eos_ids=set())).tokens
        got = D.speculative_generate(tgt, be.draft_runner("greedy"), p, req(24, eos_ids=set()))
        bad += got.tokens != want
        accepted += got.accepted
    return bad, accepted


@pytest.mark.parametrize(("linear_engines", "cuda_graphs"),
                         [("qwen3_5", True), ("qwen3_5", False), ("nemotron_h", True)], indirect=["linear_engines"])
def test_decodes_like_ort_with_drafts_accepted_and_rolled_back(linear_engines, cuda_graphs):
    """Greedy speculative decoding through the TensorRT backend (engines that compute, CUDA graphs replayed or not)
    equals ONNX Runtime's speculative and autoregressive output token for token, cycle for cycle, with drafts
    accepted and partial blocks rolled back on the device; a long prompt (64-row chunks) too."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be, trt, cuda = _open(linear_engines, compute=True, cuda_graphs=cuda_graphs)
    ort_be = OrtBackend(linear_engines)
    vocab = be.manifest.target.vocab_size
    prompts = _prompts(vocab, 8, 7) + [np.random.default_rng(8).integers(4, vocab, 90).tolist()]
    bad, accepted = _decode_mismatches(be, ort_be, prompts)
    assert bad == 0
    assert_accepts(accepted, BLOCK - 1, f"TensorRT backend, {be.manifest.target.model_type} target")
    assert any(0 < a < BLOCK - 1 for a in accepted), accepted
    tgt, ort_tgt = be.target_runner(), ort_be.target_runner()
    for p in prompts[:3]:  # cycle for cycle: the accepted counts equal ORT's
        got = D.speculative_generate(tgt, be.draft_runner("greedy"), p, req(24, eos_ids=set()))
        want = D.speculative_generate(ort_tgt, ort_be.draft_runner("greedy"), p, req(24, eos_ids=set()))
        assert (got.tokens, got.accepted) == (want.tokens, want.accepted)
    assert (be.graphs.stats.replays > 0) == cuda_graphs
    be.close()
    ort_be.close()


def _keep_all_rows(self, keep):  # noqa: ANN001, ANN202
    """Planted bug: a rollback keeps the state after all k rows of the verify."""
    self.commit()


def _conv_after_all_rows(self, conv, inputs, rows, keep):  # noqa: ANN001, ANN202
    """Planted bug: the recurrent state is rolled back, the convolution window stays the one after all k rows."""
    DeviceLinearState._real_shift_conv(self, conv, inputs, rows, rows)


def _recurrent_after_all_rows(self, keep=None):  # noqa: ANN001, ANN202
    """Planted bug: the convolution window is rolled back, the recurrent (Mamba-2: SSM) state stays the one after all
    k rows."""
    rows = self.pending[0] if self.pending is not None else 0
    DeviceLinearState._real_commit(self, keep)
    if keep is not None and keep < rows:
        for rec, states in zip(self.recurrent, self.row_states):
            self.api.memcpy_dtod_async(rec, states + (rows - 1) * self.state_bytes, self.state_bytes, self.stream)


@pytest.mark.parametrize(("linear_engines", "bug"), [("qwen3_5", ("rollback", _keep_all_rows)),
                                                     ("qwen3_5", ("_shift_conv", _conv_after_all_rows)),
                                                     ("nemotron_h", ("commit", _recurrent_after_all_rows))],
                         ids=["qwen3_5-no_state_rollback", "qwen3_5-no_conv_rollback", "nemotron_h-no_ssm_rollback"],
                         indirect=["linear_engines"])
def test_planted_rollback_bugs_are_caught(linear_engines, bug, monkeypatch):
    """Each planted bug fails the twin check above and makes the decoding differ from the target's own (a Mamba-2
    SSM state not rolled back: on the Nemotron-H engines)."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    monkeypatch.setattr(DeviceLinearState, "_real_shift_conv", DeviceLinearState._shift_conv, raising=False)
    monkeypatch.setattr(DeviceLinearState, "_real_commit", DeviceLinearState.commit, raising=False)
    monkeypatch.setattr(DeviceLinearState, bug[0], bug[1])
    be, trt, cuda = _open(linear_engines, compute=True)
    ort_be = OrtBackend(linear_engines)
    assert _twin_mismatches(be.target_runner(), ort_be.target_runner(), cuda, seed=3) != []
    bad, _ = _decode_mismatches(be, ort_be, _prompts(be.manifest.target.vocab_size, 8, 7))
    assert bad > 0
    be.close()
    ort_be.close()


def test_prefix_cache_restores_the_device_state_exactly(hy_engines, monkeypatch):
    """The prefix cache on the TensorRT backend, hybrid target: a hit restores the device linear states from a
    snapshot (hits at the stored sequence's end and at its prompt's snapshot), and each decode equals ONNX Runtime's
    from an empty cache, cycle for cycle. Planted bug: a restore that leaves the recurrent state as it was is
    caught."""
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from helpers import prefix_cache_equals_uncached

    be, _, _ = _open(hy_engines, compute=True)
    ort_be = OrtBackend(hy_engines)
    prefix_cache_equals_uncached(be, ort_be)
    real = DeviceLinearState.restore
    monkeypatch.setattr(DeviceLinearState, "restore", lambda self, snap, st: real(self, (snap[0], []), st))
    with pytest.raises(AssertionError):
        prefix_cache_equals_uncached(be, ort_be)
    be.close()
    ort_be.close()
