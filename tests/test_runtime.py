"""The ONNX Runtime backend vs the PyTorch reference on make-tiny models: same tokens, same metrics;
backend selection, streaming, bad input, the CLI's generate --model-dir and bench."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from helpers import FIELD_EDITS, assert_accepts, req, with_block_size
from dflash2_trt import DFlash2Error
from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner
from torch_ref import ref_autoregressive, ref_speculative
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.backends import open_backend
from dflash2_trt.bench.oracle import oracle_count

MAX_NEW = 24


@pytest.fixture(scope="module")
def exports(acc_dir, acc_export, tmp_path_factory):
    """The accepting pair: block size -> export folder (16 is the drafter's own; 3 is an override)."""
    from dflash2_trt.export.exporter import export_model

    out = {16: acc_export}
    for bs in (3,):
        out[bs] = tmp_path_factory.mktemp("export") / f"bs{bs}"
        export_model(acc_dir / "target", acc_dir / "drafter", out[bs], progress=False, block_size=bs,
                     max_seq_len=512, verify=False)
    return out


def _prompts(n, seed=99):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 500, size=int(rng.integers(1, 30))).tolist() for _ in range(n)]


@pytest.mark.parametrize("bs", [3, 16])
def test_greedy_equals_pytorch_reference(exports, acc_target, acc_drafter, bs):
    """ORT (plugin-free decomposed selector heads) vs PyTorch on the accepting pair, both selector modes:
    same tokens and metrics, lossless, and drafts really committed (assert_accepts per mode)."""
    be, _ = open_backend(exports[bs], "ort")
    assert be.manifest.block_size == bs
    target = be.target_runner()
    d = with_block_size(acc_drafter, bs)
    accepted: dict[str, list[int]] = {"greedy": [], "viterbi": []}
    for i, p in enumerate(_prompts(6, seed=bs)):
        mode = ("greedy", "viterbi")[i % 2]
        want = ref_speculative(acc_target, TorchDraftRunner(d, mode), p, req(MAX_NEW, eos_ids=set()),
                               layer_ids=[0, 2])
        got = D.speculative_generate(target, be.draft_runner(mode), p, req(MAX_NEW, eos_ids=set()),
                                     D.DecodeHooks(oracle=oracle_count))
        assert got.tokens == want.tokens  # token for token
        assert (got.accepted, got.proposed, got.oracle_accepted) == (want.accepted, want.proposed, want.oracle_accepted)
        assert got.stats() == want.stats()  # identical docs/design.md metrics, oracle τ included
        ar = D.target_generate(target, p, req(MAX_NEW, eos_ids=set()))
        assert ar.tokens == got.tokens == ref_autoregressive(acc_target, p, MAX_NEW, eos_ids=set()).tokens  # lossless
        accepted[mode] += got.accepted
    for mode, acc in accepted.items():
        assert_accepts(acc, bs - 1, (bs, mode))


@pytest.mark.parametrize("mode", ["greedy", "viterbi"])
def test_sampling_equals_pytorch_reference(acc_export, acc_target, acc_drafter, mode):
    """Same seed, same random stream: rejection sampling reproduces the reference's samples. fp32 rounding
    differences (~1e-6) between ORT and PyTorch can move a draw that lands on a CDF boundary, so one
    divergent request of four is tolerated (the distributional test of the reference covers losslessness)."""
    be, _ = open_backend(acc_export, "ort")
    target, drafter = be.target_runner(), be.draft_runner(mode)
    same, accepted = 0, []
    for seed, p in enumerate(_prompts(4, seed=5)):
        want = D.speculative_generate(TorchTargetRunner(acc_target, [0, 2]), TorchDraftRunner(acc_drafter, mode), p,
                                      req(MAX_NEW, temperature=0.8, eos_ids=set(), seed=seed))
        got = D.speculative_generate(target, drafter, p,
                                     req(MAX_NEW, temperature=0.8, eos_ids=set(), seed=seed))
        same += got.tokens == want.tokens and got.accepted == want.accepted
        assert got.tokens[:3] == want.tokens[:3] and len(got.tokens) == MAX_NEW
        accepted += got.accepted
    assert same >= 3
    assert_accepts(accepted, 15, ("T=0.8", mode))
    p = _prompts(1, seed=8)[0]
    ar_want = ref_autoregressive(acc_target, p, MAX_NEW, temperature=0.8, eos_ids=set(), seed=1)
    assert D.target_generate(target, p, req(MAX_NEW, temperature=0.8, eos_ids=set(), seed=1)).tokens == ar_want.tokens


def test_streaming_eos_and_cache_growth(acc_export, acc_target):
    """Streamed chunks, an EOS stop and KV buffers that grow mid-request, on the accepting pair (drafts
    committed in the streamed cycles and across the growth)."""
    from helpers import assert_accepts

    be, note = open_backend(acc_export, "auto")
    assert note.startswith("TensorRT not available (TensorRT is not installed")
    assert note.endswith("using ONNX Runtime (CPUExecutionProvider)")
    target = be.target_runner()
    p = _prompts(1, seed=3)[0]
    chunks: list[list[int]] = []
    res = D.speculative_generate(target, be.draft_runner(), p, req(MAX_NEW, eos_ids=set()),
                                 D.DecodeHooks(on_tokens=chunks.append))
    assert [t for c in chunks for t in c] == res.tokens and len(chunks) == len(res.accepted) + 1
    assert_accepts(res.accepted, 15, "streaming")
    eos = {res.tokens[6]}
    stop = res.tokens.index(res.tokens[6]) + 1
    assert D.speculative_generate(target, be.draft_runner(), p,
                                  req(MAX_NEW, eos_ids=eos)).tokens == res.tokens[:stop]
    # a long request crosses the 256-slot capacity step: buffers grow, output still lossless
    long_p = np.random.default_rng(0).integers(4, 500, 250).tolist()
    got = D.speculative_generate(target, be.draft_runner("viterbi"), long_p, req(40, eos_ids=set()),
                                 D.DecodeHooks(oracle=oracle_count))
    assert target.kv.capacity == 512
    assert got.tokens == ref_autoregressive(acc_target, long_p, 40, eos_ids=set()).tokens
    assert_accepts(got.accepted, 15, "across the cache growth")


def test_runtime_bad_input(tiny_export, tmp_path):
    be, _ = open_backend(tiny_export, "ort")
    target, drafter = be.target_runner(), be.draft_runner()
    with pytest.raises(DFlash2Error, match="out of range"):
        D.speculative_generate(target, drafter, [1, 512], req(4))
    with pytest.raises(DFlash2Error, match="does not fit the 512 positions"):
        D.speculative_generate(target, drafter, [5] * 600, req(4))
    with pytest.raises(DFlash2Error, match="empty prompt"):
        D.speculative_generate(target, drafter, [], req(4))
    with pytest.raises(DFlash2Error, match="backend must be one of"):
        open_backend(tiny_export, "tensorflow")
    with pytest.raises(DFlash2Error, match="TensorRT backend unavailable"):
        open_backend(tiny_export, "trt")

    def broken(edit):
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_export, d)
        edit(d)
        return d

    def manifest_edit(fn):
        def edit(d):
            m = json.loads((d / "manifest.json").read_text())
            fn(m)
            (d / "manifest.json").write_text(json.dumps(m))
        return edit

    def flip_byte(d):
        data = bytearray((d / "weights.bin").read_bytes())
        data[5000] ^= 1
        (d / "weights.bin").write_bytes(data)

    cases = [
        (lambda d: (d / "target.onnx").unlink(), "target.onnx is missing"),
        (flip_byte, "checksum mismatch for .*weights.bin"),
        (lambda d: (d / "manifest.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "manifest.json").unlink(), "not a dflash2 export folder"),
        (manifest_edit(lambda m: m.update(manifest_version=99, project_version="9.0")), "manifest_version 99"),
        (manifest_edit(lambda m: m["drafter"].update(vocab_size=1000)), "does not fit the target"),
        (manifest_edit(lambda m: m["graphs"].pop("drafter_block")), "no 'drafter_block' graph"),
        (manifest_edit(lambda m: m["target"].update(vocab_size="512")), r"manifest\.target\.vocab_size must be an int"),
        (manifest_edit(lambda m: m["target"].pop("head_dim")), "manifest.target lacks the required field 'head_dim'"),
        (manifest_edit(lambda m: m["graphs"]["target"].update(selector="magic")), "graphs.target.selector must be one"),
        (manifest_edit(lambda m: m.update(dtype="int3")), "manifest.dtype must be one of"),
    ]
    for edit, msg in cases:
        with pytest.raises(DFlash2Error, match=msg):
            open_backend(broken(edit), "ort")
    with pytest.raises(DFlash2Error, match="model folder not found"):
        open_backend(tmp_path / "absent", "ort")


@pytest.mark.parametrize("case", range(len(FIELD_EDITS)))
def test_manifest_fields_agree_with_graphs(tiny_export, tmp_path, case, capsys):
    """An edited manifest whose fields no longer agree with what its graphs' inputs and outputs state (layers,
    heads, head size, feature width, capacity, vocabulary) is refused when it is read: one DFlash2Error naming the
    field and both values from the API, one line and exit 1 from the CLI -- not an ONNX Runtime error mid-decode."""
    from dflash2_trt.cli import main

    edit, msg = FIELD_EDITS[case]
    d = tmp_path / "export"
    shutil.copytree(tiny_export, d)
    m = json.loads((d / "manifest.json").read_text())
    assert (m["max_seq_len"], m["target"]["max_positions"]) == (512, 2048)
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DFlash2Error, match=msg):
        open_backend(d, "ort")
    assert main(["generate", "--model-dir", str(d), "--prompt", "Hello", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash2: error:") and "manifest.json" in err[0], err


def test_ort_failure_is_one_error(tiny_export, tmp_path):
    """What only running a graph can find (here a RoPE table shorter than an edited max_seq_len, within the
    target's max_positions) ends as one DFlash2Error naming the graph, not ONNX Runtime's exception."""
    d = tmp_path / "export"
    shutil.copytree(tiny_export, d)
    m = json.loads((d / "manifest.json").read_text())
    m["max_seq_len"] = 1024
    (d / "manifest.json").write_text(json.dumps(m))
    be, _ = open_backend(d, "ort")
    with pytest.raises(DFlash2Error, match="ONNX Runtime failed running target"):
        D.speculative_generate(be.target_runner(), be.draft_runner(), [5] * 600, req(4))


def test_tokenizer_matches_transformers(tiny_export, tiny_target):
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    tok, hf = TextTokenizer(tiny_export), tiny_target.tokenizer
    for text in ("Hello world", "def f(x):\n    return x  # ünïcode"):
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
        msgs = [{"role": "user", "content": text}]
        want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert tok.apply_chat_template(msgs) == want
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_cli_generate_model_dir_matches_reference(tiny_dir, tiny_export, acc_dir, acc_export, capsys):
    """``generate --model-dir`` (ORT) equals ``generate --target --drafter`` (PyTorch) on the accepting pair,
    drafts accepted; then the CLI's streaming and argument errors."""
    from dflash2_trt.cli import main

    common = ["--prompt", "Hello world", "--max-new-tokens", "40", "--json", "--check-lossless", "--selector", "viterbi"]
    assert main(["generate", "--target", str(acc_dir / "target"), "--drafter", str(acc_dir / "drafter"), *common]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model-dir", str(acc_export), "--backend", "auto", *common]) == 0
    cap = capsys.readouterr()
    got = json.loads(cap.out)
    assert "TensorRT not available" in cap.err and got["backend"] == "ONNX Runtime (CPUExecutionProvider)"
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"] and got["stats"] == want["stats"]
    assert got["lossless"] is True and got["stats"]["tau"] >= 2.0, got["stats"]
    # streaming prints the same text
    assert main(["generate", "--model-dir", str(tiny_export), "--prompt", "Hello world", "--max-new-tokens", "20",
                 "--stream", "--chat"]) == 0
    assert "tok/s on ONNX Runtime" in capsys.readouterr().out
    # flag combinations: one line, exit 1, as every bad input
    assert main(["generate", "--model-dir", str(tiny_export), "--prompt", "x", "--no-conv"]) == 1
    assert "baked in at export" in capsys.readouterr().err
    assert main(["generate", "--model-dir", str(tiny_export), "--prompt", "x", "--selector", "viterbi",
                 "--no-selector"]) == 1
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["generate", "--model-dir", str(tiny_export), "--target", str(tiny_dir / "target"),
                 "--prompt", "x"]) == 1


def test_no_selector_head_equals_pytorch(acc_export, acc_target, acc_drafter):
    """The selector-off ablation of a DFlash 2 export (``drafter_head_independent``, ``--no-selector``) equals
    the PyTorch drafter with the selector off on the accepting pair: tokens, metrics (oracle top-K τ included);
    lossless; drafts committed."""
    be, _ = open_backend(acc_export, "ort")
    target, drafter = be.target_runner(), be.draft_runner("independent")
    accepted = []
    for p in _prompts(3, seed=11):
        want = ref_speculative(acc_target, TorchDraftRunner(acc_drafter, "independent"), p,
                               req(MAX_NEW, eos_ids=set()), layer_ids=[0, 2])
        got = D.speculative_generate(target, drafter, p, req(MAX_NEW, eos_ids=set()),
                                     D.DecodeHooks(oracle=oracle_count))
        assert got.tokens == want.tokens and got.stats() == want.stats()
        assert got.tokens == ref_autoregressive(acc_target, p, MAX_NEW, eos_ids=set()).tokens
        accepted += got.accepted
    assert_accepts(accepted, 15, "independent head")
    with pytest.raises(DFlash2Error, match="draft mode must be one of"):
        be.draft_runner("beam")


def test_independent_draft_equals_torch_branch():
    """The NumPy no-selector drafting (runtime) == the PyTorch drafter's no-selector branch, T = 0 and T > 0."""
    import torch

    from dflash2_trt.model import DFlash2Drafter
    from dflash2_trt.runtime.protocol import independent_draft

    rng = np.random.default_rng(3)
    for trial in range(20):
        L, V = int(rng.integers(1, 8)), 16 * int(rng.integers(2, 20))
        logits = (rng.standard_normal((L, V)) * rng.uniform(0.5, 4)).astype(np.float32)
        temp = float(rng.choice([0.0, 0.7, 1.0]))
        u = rng.random((1, L), dtype=np.float32)
        got = independent_draft(logits, temp, u if temp > 0 else None, 16)
        # the torch branch, through a drafter whose LM head is the identity on these "hidden" rows
        from dflash2_trt.config import DFlash2Config

        cfg = DFlash2Config(hidden_size=V, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                            num_key_value_heads=1, head_dim=8, vocab_size=V, num_target_layers=2,
                            target_layer_ids=[0], block_size=L + 1, mask_token_id=0, use_selector=False,
                            use_conv=False, architecture="DFlashDraftModel")
        dr = DFlash2Drafter(cfg)
        dr.bind_target(torch.eye(V), torch.eye(V))
        h = torch.cat([torch.zeros(1, 1, V), torch.from_numpy(logits)[None]], 1)
        want = dr.draft_from_hidden(h, torch.tensor([0]), temperature=temp,
                                    uniforms=torch.from_numpy(u) if temp > 0 else None)
        assert got.tokens.tolist() == want.tokens[0].tolist(), trial
        assert got.cand.tolist() == want.cand[0].tolist(), trial
        full = got.vocab_proposal if got.vocab_proposal is not None else np.eye(V, dtype=np.float32)[got.tokens]
        np.testing.assert_allclose(full, want.proposal[0].numpy(), atol=1e-6)
