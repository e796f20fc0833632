"""The target families beside dense and hybrid -- Qwen3-MoE (``moe``), gpt-oss and Muse Glimmer (``sliding``), and
for the PyTorch checks Gemma 4 (``gemma``: its own file, tests/test_gemma_target.py, holds what is Gemma's alone) --
on tiny random configurations of transformers' own models: the PyTorch adapter against transformers (logits, a
verify's rows = one-row steps), rollback to every accepted length (sliding windows shorter than the sequence, so the
recorded past is what a rollback restores), lossless greedy decoding with a drafter that gets drafts accepted and
rejected at every length, a planted bug (a sliding window cropped without its recorded past) caught; all three
exported and decoded on ONNX Runtime (a graph without its window caught), the sliding layers' rings bounded, wrapping
and rolled back (two planted ring bugs caught), the batched loop's slots equal to single runs, and each family's
``make-tiny --accepting`` pair (drafts accepted, lossless on PyTorch and ONNX Runtime). For Gemma 4 and Nemotron-H:
``make-data`` / ``train`` / ``eval-tau`` end to end on their accepting pairs, and the sampling law at T = 1 (three
tokens' joint law, chi-square, with rollbacks between them) with a wrong residual and an SSM state not rolled back
caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.ngram import lookup_draft
from dflash2_trt.runtime.torch.backend import TorchTargetRunner
from dflash2_trt.targets import dense, gemma, moe, sliding
from helpers import GEMMA4_TEXT, NoisyOracle, oracle_spec_vs_ar, planted_no_ssm_rollback, req

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
ARCHS = ("qwen3_moe", "gpt_oss", "muse_glimmer")


def _build(arch: str):  # noqa: ANN202
    import transformers

    torch.manual_seed(0)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **_COMMON))
    if arch == "gemma4":
        return transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**GEMMA4_TEXT))
    if arch == "gpt_oss":
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_COMMON))
    return transformers.MuseGlimmerForConditionalGeneration(transformers.MuseGlimmerConfig(
        text_config=dict(sliding_window=8, bos_token_id=1, eos_token_id=0, **_COMMON),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))


@pytest.fixture(scope="module", params=ARCHS + ("gemma4",))
def target(request, tmp_path_factory):
    from dflash2_trt.targets.adapter import TargetModel

    folder = tmp_path_factory.mktemp(request.param)
    _build(request.param).eval().save_pretrained(str(folder))
    return TargetModel.load(folder)


def test_family_and_layer_kinds(target):
    mt = target.model.config.model_type
    fam = {"qwen3_moe": moe, "gpt_oss": sliding, "muse_glimmer": sliding, "gemma4_text": gemma}[mt]
    assert target.family is fam and target.num_layers == (6 if fam is gemma else 4)
    assert fam.layer_kinds(target.model.config) == {
        "qwen3_moe": ["attention"] * 4, "gpt_oss": ["sliding", "attention"] * 2,
        "muse_glimmer": ["sliding", "sliding", "sliding", "attention"],
        "gemma4_text": ["sliding", "sliding", "attention"] * 2}[mt]


def test_adapter_equals_transformers_and_rolls_back(target):
    """40 tokens (five times the sliding window): prefill + one-row steps = transformers' whole-sequence forward;
    an 8-row verify's rows = the one-row steps; after rolling it back to every j + 1 rows the next row's logits are
    the one-row run's."""
    ids = np.random.default_rng(0).integers(2, 512, 40).tolist()
    with torch.no_grad():
        full = target.model(input_ids=torch.tensor([ids])).logits[0].float()
    target.reset([0, 2])
    got = [target.forward(torch.tensor(ids[:20]))[0]] + [target.forward(torch.tensor([ids[20 + i]]))[0] for i in range(20)]
    steps = got[1:]
    torch.testing.assert_close(torch.cat(got), full, rtol=1e-4, atol=1e-4 * float(full.abs().max()))
    for j in range(8):
        target.reset([0, 2])
        target.forward(torch.tensor(ids[:20]))
        rows = target.forward(torch.tensor(ids[20:28]))[0]
        torch.testing.assert_close(rows, torch.cat(steps[:8]), rtol=1e-4, atol=3e-5 * float(rows.abs().max()))
        target.crop(20 + j + 1)
        nxt = target.forward(torch.tensor([ids[21 + j]]))[0]
        torch.testing.assert_close(nxt, steps[j + 1], rtol=1e-4, atol=1e-4 * float(nxt.abs().max()))


def _spec_vs_ar(target, n_prompts: int = 6) -> tuple[int, list[int]]:  # noqa: ANN001
    """:func:`helpers.oracle_spec_vs_ar`, 30 new tokens (Gemma 4's six layers: 4 prompts of 24, its file's budget)."""
    return oracle_spec_vs_ar(target, 4, 24) if target.family is gemma else oracle_spec_vs_ar(target, n_prompts, 30)


def test_lossless_with_drafts_accepted_and_rolled_back(target):
    bad, accepted = _spec_vs_ar(target)
    assert bad == 0
    assert {0, 7} <= set(accepted) and len(set(accepted)) >= 5, sorted(set(accepted))  # every kind of cycle ran


def test_a_sliding_window_cropped_without_its_past_is_caught(target, monkeypatch):
    """Negative control: the dense family's cache (no recorded past) on a sliding-window target fails the decoding
    (transformers refuses to crop a full window it did not record) instead of passing."""
    if target.family is moe:  # a KV cache of positions, cropped as the dense family's: nothing to record
        assert (moe.new_cache, moe.rollback) == (dense.new_cache, dense.rollback)
        return
    for name in ("new_cache", "before_forward", "rollback"):  # gemma's are the sliding family's, imported by name
        monkeypatch.setattr(target.family, name, getattr(dense, name))
    with pytest.raises(RuntimeError, match="does not track past states"):
        _spec_vs_ar(target, 2)


def _family_pair(arch: str, tmp_path):  # noqa: ANN202
    """(target folder, drafter folder): a tiny random ``arch`` target with make-tiny's tokenizer, make-tiny's drafter."""
    import shutil

    from dflash2_trt.tiny import make_tiny

    make_tiny(tmp_path / "pair", seed=0, block_size=4)
    folder = tmp_path / arch
    _build(arch).eval().save_pretrained(str(folder))
    for f in (tmp_path / "pair" / "target").iterdir():  # the tokenizer and its chat template
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return folder, tmp_path / "pair" / "drafter"


def _export_family(arch: str, tmp_path):  # noqa: ANN202
    """A tiny random ``arch`` target exported with make-tiny's drafter."""
    from dflash2_trt.export.exporter import export_model

    target, drafter = _family_pair(arch, tmp_path)
    return export_model(target, drafter, tmp_path / "e", progress=False, max_seq_len=256)


@pytest.mark.parametrize("arch", ARCHS)
def test_training_on_the_family(arch, tmp_path):
    """make-data, train and the offline τ on each family: left-padded batched generation (prompts longer than the
    windows, MoE routing per row) gives every row the greedy chain of one unpadded forward; a few training steps from
    make-tiny's drafter run, and the offline τ is computed."""
    from dflash2_trt.targets.adapter import TargetModel
    from dflash2_trt.train.data import GeneratedData
    from dflash2_trt.train.make_data import MakeDataConfig, make_data
    from dflash2_trt.train.trainer import TrainConfig, offline_tau, train

    target_dir, drafter_dir = _family_pair(arch, tmp_path)
    target = TargetModel.load(target_dir)
    rng = np.random.default_rng(5)
    prompts = [{"src": "t", "chat": False, "text": " ".join(["ab cd", "ef gh", "ij"][int(i) % 3] for i in
                                                          rng.integers(0, 3, int(n)))} for n in rng.integers(2, 12, 6)]
    make_data(MakeDataConfig(target=str(target_dir), out=str(tmp_path / "d"), max_new_tokens=12, batch=3, shard_size=3,
                             sample_every=0, n_self=0, target_layer_ids=[0, 2], topk=4), progress=False, prompts=prompts)
    data = GeneratedData(tmp_path / "d")
    assert len(data) == len(prompts)
    for i in range(len(data)):
        r = data.row(i)
        with torch.no_grad():
            o = target.model(input_ids=torch.from_numpy(r.tokens.astype(np.int64))[None])
        P, n = r.prompt_len, r.tokens.shape[0]
        assert np.array_equal(r.tokens[P:], o.logits[0].argmax(-1).numpy()[P - 1: n - 1])
    d = train(TrainConfig(target=str(target_dir), data=str(tmp_path / "d"), out=str(tmp_path / "run"), block_size=4,
                          layers=2, selector_rank=24, steps=3, batch_seqs=3, anchors_per_seq=4, lr=1e-4,
                          checkpoint_every=3, log_every=1, init=str(drafter_dir), sampled_softmax=0, eval_rows=2,
                          heldout_shards=1), progress=False).eval()
    assert (tmp_path / "run" / "model.safetensors").is_file()
    rows = [i for i in range(len(data)) if data.row(i).tokens.shape[0] - data.row(i).prompt_len >= 2]
    assert offline_tau(d, data, np.asarray(rows))["tau"] >= 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_export_and_decode_on_ort(arch, tmp_path):
    """Tiny random Qwen3-MoE (4 experts, 2 per token), gpt-oss and Muse Glimmer (windows of 8 over 40 tokens, so the
    window matters) targets with make-tiny's drafter: exported (manifest version 2 for Qwen3-MoE, whose every layer
    keeps a KV cache; 3 for the sliding ones, whose sliding layers keep rings), the
    graph's logits within 1e-4 (relative) of transformers' over a prompt and steps, a k-row call's rows = one-row
    calls, every node in TensorRT's parser table; speculative greedy decoding on ONNX Runtime = its autoregressive
    output, with the exported (random) drafter and with the noisy oracle at block sizes 2, 4, 8 (drafts accepted and
    rejected at every length, so the KV crop of every layer kind ran)."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    m = _export_family(arch, tmp_path)
    assert m.manifest_version == (2 if arch == "qwen3_moe" else 3) and m.target.layer_kinds == {
        "qwen3_moe": (), "gpt_oss": ("sliding", "attention") * 2,
        "muse_glimmer": ("sliding", "sliding", "sliding", "attention")}[arch]
    be = OrtBackend(tmp_path / "e")
    assert be.manifest.target.model_type == arch
    import onnx

    from dflash2_trt.export.onnx_utils import trt_parser_refusals

    assert trt_parser_refusals(onnx.load(str(tmp_path / "e" / "target.onnx"), load_external_data=False)) == []
    hf = _build(arch).eval()
    rng = np.random.default_rng(2)
    ids = rng.integers(2, 512, 40).tolist()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    r = be.target_runner()
    got = np.concatenate([r.forward(ids[:30])[0]] + [r.forward([x])[0] for x in ids[30:]])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    r.reset()
    r.forward(ids[:30])
    rows = r.forward(ids[30:38])[0]
    assert (rows.argmax(-1) == want[30:38].argmax(-1)).all()
    assert np.abs(rows - got[30:38]).max() <= 1e-5 * np.abs(want).max()
    for p in [rng.integers(4, 512, int(rng.integers(1, 20))).tolist() for _ in range(3)]:
        ar = D.target_generate(be.target_runner(), p, req(16, eos_ids=set())).tokens
        assert D.speculative_generate(be.target_runner(), be.draft_runner("greedy"), p,
                                      req(16, eos_ids=set())).tokens == ar
    for bs in (2, 4, 8):  # the noisy oracle over the exported target: drafts accepted and rejected at every length
        bad, accepted = _ort_spec_vs_ar(be, bs)
        assert bad == 0 and {0, bs - 1} <= set(accepted) and (bs == 2 or len(set(accepted)) >= 3), (bs, accepted)


def _ort_spec_vs_ar(be, bs: int, n_prompts: int = 4) -> tuple[int, list[int]]:  # noqa: ANN001
    """:func:`_spec_vs_ar` on an export's ONNX Runtime target with the noisy oracle at block size ``bs``."""
    oracle = type("Oracle", (NoisyOracle,), {"block_size": bs, "num_draft_rows": bs - 1})
    rng = np.random.default_rng(3)
    bad, accepted = 0, []
    for _ in range(n_prompts):
        p = rng.integers(2, 512, int(rng.integers(3, 20))).tolist()
        want = D.target_generate(be.target_runner(), p, req(30, eos_ids=set())).tokens
        r = D.speculative_generate(be.target_runner(), oracle(p + want), p, req(30, eos_ids=set()))
        bad += r.tokens != want
        accepted += r.accepted
    return bad, accepted


def test_an_ort_target_that_does_not_crop_is_caught(window_exports, monkeypatch):
    """Negative control: Muse Glimmer's export on ONNX Runtime with the target's crop after a rejected draft skipped
    (the rejected rows' keys stay valid in the full layers' buffers and in the rings) decodes other tokens than its own
    autoregressive ones."""
    from dflash2_trt.runtime.ort.backend import OrtBackend, OrtTargetRunner

    be = OrtBackend(window_exports["muse_glimmer"])
    monkeypatch.setattr(OrtTargetRunner, "crop", lambda self, length: None)
    assert _ort_spec_vs_ar(be, 8)[0] > 0


@pytest.mark.parametrize("arch", ["gpt_oss", "muse_glimmer"])
def test_a_sliding_graph_without_its_window_fails_the_export_check(arch, tmp_path, monkeypatch):
    """Negative control: the graph with its sliding layers' window mask removed (full attention) differs from
    transformers past the window, and the export-time check refuses it."""
    monkeypatch.setattr(sliding._WindowedGraph, "__init__", _wide_window(sliding._WindowedGraph.__init__))
    with pytest.raises(DFlash2Error, match="differs from PyTorch"):
        _export_family(arch, tmp_path)


def _wide_window(init):  # noqa: ANN001, ANN202
    def planted(self, *a, **kw):  # noqa: ANN001, ANN202
        init(self, *a, **kw)
        self.window = 1 << 20

    return planted


def test_make_tiny_writes_each_family(tmp_path):
    """``make-tiny --arch qwen3_moe|gpt_oss|muse_glimmer`` writes a target of that family with a drafter that fits it;
    an architecture make-tiny does not know is refused (with or without ``--accepting``, which every one it knows
    takes)."""
    from dflash2_trt.cli import main
    from dflash2_trt.model import load_drafter
    from dflash2_trt.targets.adapter import TargetModel
    from dflash2_trt.targets import family_for
    from dflash2_trt.tiny import make_tiny

    for arch in ARCHS:
        assert main(["make-tiny", "--out", str(tmp_path / arch), "--arch", arch, "--block-size", "4"]) == 0
        t = TargetModel.load(tmp_path / arch / "target")
        assert t.model.config.model_type == arch and t.family is family_for(t.model.config)
        t.check_drafter(load_drafter(tmp_path / arch / "drafter").config)
    with pytest.raises(DFlash2Error, match="--arch must be one of"):
        make_tiny(tmp_path / "x", accepting=True, arch="mixtral")


def _decode_pair(target, draft, prompts: list[list[int]], n: int = 40) -> tuple[int, list[int]]:  # noqa: ANN001
    """(prompts whose speculative greedy output differs from the target's autoregressive one, accepted per cycle):
    ``target()`` / ``draft()`` make fresh runners of one backend."""
    bad, accepted = 0, []
    for p in prompts:
        want = D.target_generate(target(), p, req(n, eos_ids=set())).tokens
        r = D.speculative_generate(target(), draft(), p, req(n, eos_ids=set()))
        bad += r.tokens != want
        accepted += r.accepted
    return bad, accepted


def _assert_accepting(accepted: list[int], what: str) -> None:
    """Most drafts accepted (at least 3 of 7 per cycle on average), and acceptance stopping mid-block in some cycles
    (the copying target's departures)."""
    assert np.mean(accepted) >= 3 and any(0 < a < 7 for a in accepted), (what, np.bincount(accepted, minlength=8))


@pytest.mark.parametrize("arch", ARCHS)
def test_make_tiny_accepting_pair_of_each_family(arch, tmp_path, monkeypatch):
    """``make-tiny --arch ARCH --accepting --block-size 8``: its own drafter gets most drafts accepted and some
    partially, on the PyTorch reference and on ONNX Runtime after export, and speculative greedy output = the same
    backend's autoregressive output on 10 prompts, 40 new tokens each (contexts of 43-59 positions: beyond the
    windows of 8, so the sliding layers' rings of 24 slots wrap on ONNX Runtime). The sliding targets' departures
    from the copy depend on their windows: a planted ring bug (a crop leaves the cut rows' keys valid) changes the
    speculative output."""
    from dflash2_trt.runtime.kv import WindowRing
    from dflash2_trt.cli import main
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner
    from dflash2_trt.targets.adapter import TargetModel
    from helpers import bound_drafter

    pair = tmp_path / "pair"
    assert main(["make-tiny", "--out", str(pair), "--arch", arch, "--accepting", "--block-size", "8"]) == 0
    t = TargetModel.load(pair / "target")
    d = bound_drafter(pair, t)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(2, 512, int(rng.integers(3, 20))).tolist() for _ in range(10)]
    bad, accepted = _decode_pair(lambda: TorchTargetRunner(t, d.config.target_layer_ids),
                                 lambda: TorchDraftRunner(d), prompts)
    assert bad == 0
    _assert_accepting(accepted, f"{arch} on PyTorch")
    export_model(pair / "target", pair / "drafter", tmp_path / "e", progress=False, max_seq_len=128)
    be = OrtBackend(tmp_path / "e")
    sw = be.manifest.target.sliding_window
    assert (arch == "qwen3_moe") == (sw is None)
    if sw is not None:
        assert sw.ring_slots == 24 and min(len(p) for p in prompts) + 40 > sw.ring_slots
    bad, accepted = _decode_pair(be.target_runner, lambda: be.draft_runner("greedy"), prompts)
    assert bad == 0
    _assert_accepting(accepted, f"{arch} on ONNX Runtime")
    if sw is not None:
        monkeypatch.setattr(WindowRing, "crop", _crop_keeps_cut_slots)
        assert _decode_pair(be.target_runner, lambda: be.draft_runner("greedy"), prompts)[0] > 0


@pytest.fixture(scope="module")
def window_exports(tmp_path_factory):
    """gpt-oss and Muse Glimmer exports (windows of 8; make-tiny's drafter of block size 4, so rings of 8 + 16)."""
    out = {}
    for arch in ("gpt_oss", "muse_glimmer"):
        tmp = tmp_path_factory.mktemp(arch)
        _export_family(arch, tmp)
        out[arch] = tmp / "e"
    return out


@pytest.mark.parametrize("arch", ["gpt_oss", "muse_glimmer"])
def test_window_ring_is_bounded_wraps_and_rolls_back(window_exports, arch):
    """96 positions (four times the ring of 24, twelve times the window) in verifies of 8 rows, each cut back to a
    random length: every kept row's logits within 1e-4 (relative) of transformers' over the whole sequence, so the
    state after each rollback (the ring wrapped, the cut rows' slots overwritten later) is a fresh run's; the ring's
    bytes never change (the full layers' KV grows with the context)."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be = OrtBackend(window_exports[arch])
    t, sw = be.manifest.target, be.manifest.target.sliding_window
    assert (sw.window, sw.ring_slots) == (8, 24) and be.batching
    rng = np.random.default_rng(5)
    ids = rng.integers(2, 512, 4 * sw.ring_slots).tolist()
    with torch.no_grad():
        want = _build(arch).eval()(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    scale = np.abs(want).max()
    r = be.target_runner()
    ring_bytes = 2 * t.layer_kinds.count("sliding") * t.num_key_value_heads * sw.ring_slots * t.head_dim * 4
    assert r.ring.nbytes == ring_bytes + 8 * sw.ring_slots
    assert np.abs(r.forward(ids[:10])[0] - want[:10]).max() <= 1e-4 * scale
    n, kept = 10, []
    while n < len(ids):
        rows = r.forward(ids[n:n + 8])[0]
        keep = 1 + int(rng.integers(0, len(rows)))
        assert np.abs(rows[:keep] - want[n:n + keep]).max() <= 1e-4 * scale, n
        r.crop(n + keep)
        n, kept = n + keep, kept + [keep]
    assert len(set(kept)) >= 5 and r.ring.positions.max() == len(ids) - 1 and r.ring.positions.min() >= 0
    assert r.ring.nbytes == ring_bytes + 8 * sw.ring_slots and r.kv.capacity >= len(ids)


def test_a_crop_deeper_than_the_ring_can_undo_is_refused():
    """A ring without room beyond its window: after a call of 8 rows that wrapped it, a crop back into the call would
    need keys the call overwrote -- refused in one line instead of decoding without them."""
    from dflash2_trt.manifest import SlidingWindowSpec
    from dflash2_trt.runtime.kv import WindowRing

    ring = WindowRing(1, 1, 2, np.float32, SlidingWindowSpec(window=8, ring_slots=8))
    ring.write(0, 0, [np.ones((1, 1, 12, 2), np.float32)] * 2)
    ring.write(0, 12, [np.ones((1, 1, 8, 2), np.float32)] * 2)
    ring.crop(0, 19)  # the last row cut: its slot held position 11, which the window of 19 no longer needs
    with pytest.raises(DFlash2Error, match="cannot return to length 14"):
        ring.crop(0, 14)


def _ring_crops(ring, rng, calls: int) -> list[tuple[int, int, bool, bool]]:  # noqa: ANN001
    """Random calls of 1..ring_slots + 3 rows into slot 0 of ``ring``, each followed by every crop length from 0 to
    the call's end asked on a copy: (length, floor, accepted, sound) per crop, where ``sound`` is the reference's
    answer, read from the slots' positions before the crop: every key the row at that length attends to besides its
    own (positions length - window + 1 .. length - 1) is still in the ring. Then the slot's own crop, back into the
    call at most ring_slots - window + 1 rows (what a verify cuts), the next call's start."""
    import copy

    W, n, out = ring.spec.window, 0, []
    for _ in range(calls):
        rows = int(rng.integers(1, ring.spec.ring_slots + 4))
        ring.place(0, n, rows)
        n += rows
        held = set(ring.positions[0].tolist())
        for length in range(n + 1):
            trial = copy.deepcopy(ring)
            try:
                trial.crop(0, length)
                accepted = True
            except DFlash2Error:
                accepted = False
            out.append((length, int(ring.floor[0]), accepted, set(range(max(0, length - W + 1), length)) <= held))
        cut = int(rng.integers(0, min(rows, ring.spec.ring_slots - W + 1) + 1))
        ring.crop(0, n - cut)
        n -= cut
    return out


def test_the_ring_floor_is_exact():
    """WindowRing's floor against the reference (the ring's own positions): after random calls (shorter and longer
    than the ring) and crops back into them, a crop is accepted only where the ring still holds every key the next
    row needs; once the ring has lost a position (the call reached past its slots) the floor is that reference's
    lowest length: a crop exactly at it is accepted, one position below it refused. A verify's crop (into the last
    call, at most ring_slots - window + 1 rows) is always accepted. The negative control -- the floor one position
    too low -- fails it at the floor."""
    from dflash2_trt.manifest import SlidingWindowSpec
    from dflash2_trt.runtime.kv import WindowRing

    at_floor = 0
    for W, R in ((8, 24), (8, 8), (3, 10), (2, 5)):
        crops = _ring_crops(WindowRing(1, 1, 2, np.float32, SlidingWindowSpec(window=W, ring_slots=R)),
                            np.random.default_rng(W * R), 30)
        assert all(sound for _, _, accepted, sound in crops if accepted), (W, R)
        for length, floor, accepted, sound in crops:
            if floor > 0 and length in (floor - 1, floor):
                assert accepted == (length == floor), (W, R, length, floor)
                at_floor += 1
        lowest = {}  # call -> the reference's lowest sound length >= 1 of the lengths asked after it
        for length, floor, _, sound in crops:
            if length == 0:
                call = len(lowest)
            if length >= 1 and sound:
                lowest.setdefault(call, (length, floor))
        wrapped = [(low, floor) for low, floor in lowest.values() if low > 1]
        assert wrapped and all(low == floor for low, floor in wrapped), (W, R, wrapped)
    assert at_floor >= 100


def test_the_ring_floor_one_too_low_is_caught(monkeypatch):
    """Negative control of test_the_ring_floor_is_exact: a floor one position below the reference's accepts a crop
    whose next row needs a key the call overwrote."""
    from dflash2_trt.runtime.kv import WindowRing

    place = WindowRing.place

    def planted(self, slot, start, rows):  # noqa: ANN001, ANN202
        runs = place(self, slot, start, rows)
        self.floor[slot] = max(0, self.floor[slot] - 1)
        return runs

    monkeypatch.setattr(WindowRing, "place", planted)
    with pytest.raises(AssertionError):
        test_the_ring_floor_is_exact()


def _ring_without_margin(init):  # noqa: ANN001, ANN202
    """Planted bug: the ring holds the window alone and crops as if it held more (a verify overwrites window keys
    that a rollback into it needs, which nothing restores)."""
    import dataclasses

    def planted(self, n_layers, heads, head_dim, dtype, spec, slots=1):  # noqa: ANN001, ANN202
        init(self, n_layers, heads, head_dim, dtype, dataclasses.replace(spec, ring_slots=spec.window), slots)
        self.floor = np.full(self.slots, -1 << 40)
        self.write = _no_floor(self.write, self)

    return planted


def _no_floor(write, ring):  # noqa: ANN001, ANN202
    def planted(*a, **kw):  # noqa: ANN001, ANN202
        write(*a, **kw)
        ring.floor[:] = -1 << 40

    return planted


def _crop_keeps_cut_slots(self, slot, length):  # noqa: ANN001, ANN202
    """Planted bug: a crop lowers the length but leaves the cut rows' keys valid in the ring."""


@pytest.mark.parametrize("bug", ["no_margin", "cut_slots_kept"])
def test_planted_ring_bugs_are_caught(window_exports, bug, monkeypatch):
    """Each planted ring bug makes Muse Glimmer's speculative output on ONNX Runtime (the noisy oracle, block size 8:
    drafts accepted and rejected at every length, the ring wrapping) differ from its autoregressive output."""
    from dflash2_trt.runtime.kv import WindowRing
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be = OrtBackend(window_exports["muse_glimmer"])
    assert _ort_spec_vs_ar(be, 8)[0] == 0
    if bug == "no_margin":
        monkeypatch.setattr(WindowRing, "__init__", _ring_without_margin(WindowRing.__init__))
    else:
        monkeypatch.setattr(WindowRing, "crop", _crop_keeps_cut_slots)
    assert _ort_spec_vs_ar(be, 8)[0] > 0


@pytest.mark.parametrize("arch", ["gpt_oss", "muse_glimmer"])
def test_generate_batch_equals_single_requests(window_exports, arch):
    """generate_batch over 10 prompts (the batched loop over the standard graph, per-slot rings of 24 slots wrapping
    over 60+ positions, every verify cut back into its call) = each prompt's own generate, token for token."""
    import dflash2_trt

    g = dflash2_trt.load(window_exports[arch], backend="ort")
    rng = np.random.default_rng(8)
    prompts = [rng.integers(2, 512, int(rng.integers(3, 30))).tolist() for _ in range(10)]
    singles = [g.generate(p, 40, chat=False, eos_ids=set(), proposer="dflash2", guard=False) for p in prompts]
    batch = g.generate_batch(prompts, 40, chat=False, eos_ids=set(), proposer="dflash2", max_batch=4, adaptive=False)
    assert [r.tokens for r in batch] == [r.tokens for r in singles]
    assert all(len(r.stats.accepted) >= 10 for r in batch)  # speculative cycles ran (each a verify and a crop)


def test_moe_requests_are_decoded_together_as_each_alone(arch_exports):
    """Qwen3-MoE exports have no fused target: the batched loop runs their standard graph (routed experts per row),
    several requests in one target call, each = its own generate, token for token, with drafts accepted (make-tiny's
    copying pair at block size 8); T = 0.8 per seed too."""
    import dflash2_trt

    g = dflash2_trt.load(arch_exports("qwen3_moe"), backend="ort")
    assert g._backend.batching and not g._backend.fused
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 200, int(rng.integers(5, 40))).tolist() for _ in range(6)]
    with g:
        for T in (0.0, 0.8):
            singles = [g.generate(p, 24, chat=False, eos_ids=set(), guard=False, temperature=T, seed=i)
                       for i, p in enumerate(prompts)]
            g.set_batching(max_batch=4, adaptive=False)
            got = [h.result() for h in [g.submit(p, max_new_tokens=24, eos_ids=set(), temperature=T, seed=i)
                                        for i, p in enumerate(prompts)]]
            assert [r.tokens for r in got] == [r.tokens for r in singles], T
            assert sum(sum(r.stats.accepted) for r in got) > 0
    assert sum(n for size, n in g.batch_sizes.items() if size > 1) > 0  # requests shared target calls


def test_the_sliding_window_recipe_runs_on_a_tiny_gpt_oss_pair(tmp_path):
    """export/sliding-window-ort.sh on make-tiny's gpt-oss pair: exports (manifest version 3, rings for the sliding
    layers) and decodes 48 tokens past the window of 8, output the target's own."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dflash2_trt.cli import main

    assert main(["make-tiny", "--out", str(tmp_path / "pair"), "--arch", "gpt_oss", "--block-size", "4"]) == 0
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TARGET=str(tmp_path / "pair" / "target"), DRAFTER=str(tmp_path / "pair" / "drafter"),
               OUT=str(tmp_path / "e"), MAX_SEQ_LEN="256", MAX_NEW_TOKENS="48",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    r = subprocess.run(["bash", str(root / "export" / "sliding-window-ort.sh")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "lossless: True" in r.stdout
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert m["manifest_version"] == 3 and m["target"]["sliding_window"] == {"window": 8, "ring_slots": 24}


# -- Gemma 4 and Nemotron-H: training end to end, the sampling law ------------------------------------------

_TRAIN_PROMPTS = ["ab cd ef", "gh ij ab cd", "ef gh", "ij ab cd ef gh ij", "cd ef gh", "ab ab cd", "gh gh ij", "ef ab"]


@pytest.mark.parametrize("arch", ["gemma4", "nemotron_h"])
def test_training_cli_on_the_family(arch, tmp_path, capsys):
    """``dflash2 make-tiny --accepting``, ``make-data``, ``train`` (warm start from the pair's drafter) and ``eval-tau``
    on a Gemma 4 and a Nemotron-H pair: every stored row is the target's greedy chain of one unpadded forward; the
    trained drafter's config carries what the family gives it (Gemma 4: the target's embedding scale, soft cap, full
    layers' RoPE θ and sliding layers' heads; Nemotron-H, whose attention has no position embeddings: the warm-start
    drafter's RoPE, the target's layer_norm_epsilon); a cold start copies a target layer's attention and norm (a
    Nemotron-H block's mixer and norm); ``eval-tau`` walks the held-out rows. Nemotron-H trained without a warm start
    is refused in one line (no RoPE to take)."""
    import json

    from dflash2_trt.cli import main
    from dflash2_trt.model import load_drafter
    from dflash2_trt.targets.adapter import TargetModel
    from dflash2_trt.train.data import GeneratedData
    from dflash2_trt.train.trainer import init_drafter

    pair, data, run = tmp_path / "pair", tmp_path / "d", tmp_path / "run"
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"text": t, "chat": False}) + "\n" for t in _TRAIN_PROMPTS))
    assert main(["make-tiny", "--out", str(pair), "--arch", arch, "--accepting", "--block-size", "4"]) == 0
    assert main(["make-data", "--target", str(pair / "target"), "--out", str(data), "--prompt-file",
                 str(tmp_path / "p.jsonl"), "--prompts", "8", "--max-new-tokens", "12", "--batch", "4", "--shard-size",
                 "4", "--sample-every", "0", "--target-layer-ids", "0,2", "--topk", "4", "--threads", "1"]) == 0
    t = TargetModel.load(pair / "target")
    rows = GeneratedData(data)
    assert len(rows) == len(_TRAIN_PROMPTS)
    for i in range(len(rows)):
        r = rows.row(i)
        with torch.no_grad():
            o = t.model(input_ids=torch.from_numpy(r.tokens.astype(np.int64))[None])
        assert np.array_equal(r.tokens[r.prompt_len:], o.logits[0].argmax(-1).numpy()[r.prompt_len - 1: -1])
    train = ["train", "--target", str(pair / "target"), "--data", str(data), "--block-size", "4", "--steps", "3",
             "--eval-rows", "2", "--sampled-softmax", "0", "--threads", "1", "--layers", "2"]
    assert main(train + ["--out", str(run), "--init", str(pair / "drafter")]) == 0
    c = load_drafter(run).config
    warm = load_drafter(pair / "drafter").config
    if arch == "gemma4":
        from dflash2_trt.targets import gemma

        assert (c.input_embedding_scale, c.final_logit_softcapping, c.rope_theta) == (8.0, 10.0, 1e8)
        assert (c.num_key_value_heads, c.head_dim) == gemma.drafter_heads(t.model.config) == (2, 16)
    else:
        assert (c.rope_theta, c.rope_scaling) == (warm.rope_theta, warm.rope_scaling)
        assert c.rms_norm_eps == t.model.config.layer_norm_epsilon and c.final_logit_softcapping is None
        capsys.readouterr()
        assert main(train + ["--out", str(tmp_path / "cold"), "--init", "target"]) == 1
        err = capsys.readouterr().err
        assert "has no RoPE" in err and err.count("\n") == 1
    src = 0 if arch == "gemma4" else 2  # a layer whose attention has the drafter's heads (Nemotron-H: its attention)
    d, _ = init_drafter(c, t, 0, "target", init_layers=[src, src])  # a cold start copies the target layer's weights
    dec = t.model.get_decoder()
    attn = getattr(dec.layers[src], "self_attn", None) or dec.layers[src].mixer
    norm = getattr(dec.layers[src], "input_layernorm", None) or dec.layers[src].norm
    assert torch.equal(d.layers[1].self_attn.o_proj.weight, attn.o_proj.weight)
    assert torch.equal(d.layers[1].input_layernorm.weight, norm.weight)
    capsys.readouterr()
    assert main(["eval-tau", "--target", str(pair / "target"), "--drafter", str(run), "--data", str(data),
                 "--threads", "1"]) == 0
    tau = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert tau["rows"] >= 2 and tau["cycles"] > 0 and tau["tau"] >= 1.0, tau


_LAW_V = 6  # the law tests' vocabulary: three tokens' joint law has 216 cells


def _law_target(arch: str):  # noqa: ANN202
    """A tiny random target of ``arch`` with a 6-token vocabulary: Gemma 4 with sliding windows of 4 (shorter than the
    prompt), global layers with keys = values and shared layers; Nemotron-H whose Mamba-2 layers keep a long memory
    (a decay ~0.9 a row, step 0.97, no skip: the SSM state is what their output reads)."""
    import transformers

    from dflash2_trt.targets.adapter import TargetModel

    torch.manual_seed(0)
    small = dict(vocab_size=_LAW_V, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.5,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "gemma4":
        m = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
            num_hidden_layers=6, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            num_kv_shared_layers=3, sliding_window=4, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1e6}}, **small))
    else:
        m = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
            layers_block_type=["mamba", "moe", "attention", "mamba"], mamba_num_heads=4, mamba_head_dim=8,
            ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, **small))
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("mixer.dt_bias"):
                    p.fill_(0.5)
                elif name.endswith("mixer.A_log"):
                    p.fill_(float(np.log(0.1)))
                elif name.endswith("mixer.D"):
                    p.zero_()
    return TargetModel(m.eval())


class _LawOf:
    """The target's next-token law at T = 1 after a token sequence, from a fresh forward over it (memoized)."""

    def __init__(self, target) -> None:  # noqa: ANN001
        self.target, self.memo = target, {}

    def __call__(self, seq: list[int]) -> np.ndarray:
        from dflash2_trt.acceptance import softmax_t

        if tuple(seq) not in self.memo:
            self.target.reset([])
            with torch.no_grad():
                self.memo[tuple(seq)] = softmax_t(self.target.forward(torch.tensor(seq))[0][-1].numpy(), 1.0)
        return self.memo[tuple(seq)]


class _ReplayedTarget:
    """A target runner whose answers are memoized by every call since its reset (forwards and crops, in order): the
    real runner -- its own rollback included -- computes each new call sequence once (replaying it from a reset when
    it last ran another), so thousands of sampled runs cost what their distinct paths cost."""

    def __init__(self, runner) -> None:  # noqa: ANN001
        self.runner, self.vocab_size, self.max_positions, self.eos_ids = runner, runner.vocab_size, 64, set()
        self.calls: tuple = ()
        self.ran: tuple | None = None  # the calls the real runner has run since its reset
        self.memo: dict = {}
        self.length = 0

    def reset(self) -> None:
        self.calls, self.length = (), 0

    @property
    def cache_length(self) -> int:
        return self.length

    def forward(self, ids: list[int], last_logits: bool = False):  # noqa: ANN201
        key = self.calls + (("forward", *ids),)
        if key not in self.memo:
            if self.ran != self.calls:
                self.runner.reset()
                for op, *args in self.calls:
                    self.runner.forward(list(args)) if op == "forward" else self.runner.crop(args[0])
            self.memo[key] = self.runner.forward(list(ids))
            self.ran = key
        self.calls, self.length = key, self.length + len(ids)
        logits, feats = self.memo[key]
        return (logits[-1:] if last_logits else logits), feats

    def crop(self, length: int) -> None:
        if length < self.length:
            self.calls, self.length = self.calls + (("crop", length),), length


class _ModeDrafter:
    """A draft runner proposing, one row a cycle, the target's most likely next token (a one-hot proposal, as a prompt
    lookup's): accepted with probability p(mode), else the next token is drawn from the residual and the target
    rolls back the draft's row before the next cycle reads its state."""

    block_size, num_draft_rows, top_k = 2, 1, 1

    def __init__(self, law: _LawOf, prompt: list[int]) -> None:
        self.law, self.prompt = law, prompt

    def reset(self) -> None:
        self.seq = list(self.prompt)

    def add_context(self, feats, start) -> None:  # noqa: ANN001
        pass

    def propose(self, anchor, pos, rows, temperature, uniforms):  # noqa: ANN001, ANN201
        self.seq = self.seq[:pos] + [anchor]  # the drafts it proposed before pos were accepted
        d = int(np.argmax(self.law(self.seq)))
        self.seq.append(d)
        return lookup_draft([d])


def _residual_is_p(drafts, q, p, rng):  # noqa: ANN001, ANN202
    """Planted bug: a rejected row resampled from p instead of normalize(max(p - q, 0))."""
    for i, tok in enumerate(drafts):
        if not (q[i, tok] > 0 and rng.random() < min(1.0, p[i, tok] / q[i, tok])):
            return i, int(rng.choice(p.shape[1], p=p[i]))
    return len(drafts), int(rng.choice(p.shape[1], p=p[len(drafts)]))


@pytest.fixture
def one_thread():
    """torch on one thread for the test: a 6-token model's ops, where a second thread only waits (a loaded machine
    makes each wait milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch,bug", [("gemma4", None), ("gemma4", "residual_is_p"), ("nemotron_h", None),
                                      ("nemotron_h", "residual_is_p"), ("nemotron_h", "no_ssm_rollback")])
def test_sampling_keeps_the_target_law(arch, bug, monkeypatch, one_thread):
    """T = 1 on a Gemma 4 and a Nemotron-H target: the joint law of the first three tokens of 3000 sampled runs
    (block size 2: the first verify accepts the draft with probability p(d), else resamples and rolls the target
    back, and the third token is read from the rolled-back state) is the target's own -- chi-square against the exact
    law from fresh forwards, p > 1e-3; about a fifth of the drafts accepted and rejections on the paths that carry
    the mass. Negative controls, each failing the same test (p < 1e-6): a rejected row resampled from p (both
    families); the Mamba-2 SSM state not rolled back (Nemotron-H)."""
    from dflash2_trt import acceptance
    from dflash2_trt.runtime.torch.backend import TorchTargetRunner
    from dflash2_trt.targets import nemotron_h
    from helpers import two_token_p_value

    t = _law_target(arch)
    law_of, prompt = _LawOf(t), [1, 2, 3, 4, 5, 0, 1, 2]
    law = {(a, b, c): law_of(prompt)[a] * law_of(prompt + [a])[b] * pc
           for a in range(_LAW_V) for b in range(_LAW_V) for c, pc in enumerate(law_of(prompt + [a, b]))}
    if bug == "residual_is_p":
        monkeypatch.setattr(acceptance, "accept_rejection", _residual_is_p)
    elif bug == "no_ssm_rollback":
        monkeypatch.setattr(nemotron_h, "rollback", planted_no_ssm_rollback)
    target = _ReplayedTarget(TorchTargetRunner(t))
    runs = [D.speculative_generate(target, _ModeDrafter(law_of, prompt), prompt,
                                   req(3, temperature=1.0, eos_ids=set(), seed=s)) for s in range(3000)]
    accepted = [r.accepted[0] for r in runs]
    assert 0.05 < np.mean(accepted) < 0.95 and any(("crop", len(prompt) + 1) in k for k in target.memo)
    p_value = two_token_p_value(law, [tuple(r.tokens[:3]) for r in runs])  # the helper's chi-square, any tuple
    assert p_value > 1e-3 if bug is None else p_value < 1e-6, p_value
