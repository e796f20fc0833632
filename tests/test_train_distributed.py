"""Many processes, devices and dtypes for make-data / train, on a CPU with gloo — the checks a GPU
run under NCCL would repeat: a 2-process torchrun make-data writes the one-process folder byte for byte; a
2-process torchrun train (with gradient accumulation) ends at the one-process parameters and loss; a run
killed with SIGKILL resumes to the uninterrupted run's loss curve and weights; --device cuda without CUDA is
one line; bf16 is recorded and trains with fp32 master weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash2_trt.cli import main

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TEXTS = ["Return the sum of a list.", "Hello world!", "The quick brown fox jumps over the lazy dog again.",
         "Write a function", "os.path.join", "Explain itertools.chain with an example please.",
         "Sort a dict by value", "What is a closure?", "json dumps indent", "collections Counter most common",
         "textwrap dedent", "functools partial"]
MAKE = ["--max-new-tokens", "12", "--batch", "2", "--shard-size", "2", "--sample-every", "2",
        "--target-layer-ids", "0,2", "--topk", "4", "--threads", "1"]  # one thread in both: the same bits
TRAIN = ["--block-size", "8", "--layers", "1", "--selector-rank", "16", "--steps", "4", "--batch-seqs", "4",
         "--anchors-per-seq", "4", "--lr", "3e-3", "--checkpoint-every", "2", "--init", "random",
         "--sampled-softmax", "64", "--random-negatives", "16", "--kl-weight", "0.5", "--heldout-shards", "2"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
            "PYTHONPATH": str(REPO)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str]) -> None:
    """``torchrun --nproc_per_node 2 -m dflash2_trt.cli ARGS`` (gloo on the CPU)."""
    if not TORCHRUN.is_file():
        pytest.skip("torchrun is not installed beside this Python")
    cmd = [str(TORCHRUN), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "dflash2_trt.cli", *args]
    r = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [json.dumps({"text": t}) for t in TEXTS] + [json.dumps({"text": 'def f(x):\n    """Return x."""\n',
                                                                    "chat": False})]
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture(scope="module")
def one_proc_data(tiny_dir, prompt_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("d1") / "d"
    assert main(["make-data", "--target", str(tiny_dir / "target"), "--prompt-file", str(prompt_file),
                 "--out", str(out), *MAKE]) == 0
    return out


def test_torchrun_make_data_equals_one_process(tiny_dir, prompt_file, one_proc_data, tmp_path):
    """Two ranks deal the shards (no prompt twice): the union is the one-process folder byte for byte;
    meta.json is rank 0's, with every rank's shards merged into last_run."""
    out = tmp_path / "d2"
    _torchrun(["make-data", "--target", str(tiny_dir / "target"), "--prompt-file", str(prompt_file),
               "--out", str(out), *MAKE])
    shards = sorted(p.name for p in one_proc_data.glob("shard-*"))
    assert len(shards) == 7 and sorted(p.name for p in out.glob("shard-*")) == shards
    for s in shards:
        for f in sorted((one_proc_data / s).iterdir()):
            assert f.read_bytes() == (out / s / f.name).read_bytes(), f"{s}/{f.name}"
    assert (out / "prompts.jsonl").read_text() == (one_proc_data / "prompts.jsonl").read_text()
    m1, m2 = (json.loads((p / "meta.json").read_text()) for p in (one_proc_data, out))
    assert m1["key"] == m2["key"] and m2["world_size"] == 2 and m2["target_dtype"] == "fp32"
    ranks = m2["last_run"]["ranks"]
    assert [r["shards"] for r in ranks] == [[0, 2, 4, 6], [1, 3, 5]]
    assert m2["last_run"]["generated_tokens"] == m1["last_run"]["generated_tokens"]


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "model.safetensors"))


def test_torchrun_train_equals_one_process(tiny_dir, one_proc_data, tmp_path):
    """2 ranks x --grad-accum 2 (four parts of each step's 4 rows, DDP with no_sync on the first part) end
    at the parameters and logged losses of one process drawing the same 4 rows per step."""
    common = ["train", "--target", str(tiny_dir / "target"), "--data", str(one_proc_data), *TRAIN]
    assert main([*common, "--out", str(tmp_path / "t1")]) == 0
    _torchrun([*common, "--out", str(tmp_path / "t2"), "--grad-accum", "2"])
    a, b = _weights(tmp_path / "t1"), _weights(tmp_path / "t2")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.float32
        assert float((a[k] - b[k]).abs().max()) < 1e-5, k
    la, lb = ([json.loads(x) for x in (tmp_path / r / "train_log.jsonl").read_text().splitlines()]
              for r in ("t1", "t2"))
    sa, sb = [m for m in la if "step" in m][-1], [m for m in lb if "step" in m][-1]
    for k in ("loss", "loss_lm", "loss_kl", "loss_sel", "topk_recall", "selector_acc"):
        assert abs(sa[k] - sb[k]) < 1e-5, k
    np.testing.assert_allclose(sa["slot_acc"], sb["slot_acc"], atol=1e-6)
    assert lb[0]["world_size"] == 2 and lb[0]["train_config"]["grad_accum"] == 2
    # z-lab's checkpoint format (their loaders and vLLM's read it): the released tensor names, layer for layer
    import re

    released = json.loads((REPO / "tests" / "data" / "zlab" / "dflash2-safetensors-header.json").read_text())
    assert ({re.sub(r"^layers\.\d+\.", "layers.N.", k) for k in b} ==
            {re.sub(r"^layers\.\d+\.", "layers.N.", k) for k in released if k != "__metadata__"})
    cfg = json.loads((tmp_path / "t2" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["block_size"] == 8


_KILLER = """
import json, os, signal, sys
from dflash2_trt.train import trainer as T
calls = 0
real = T.compute_loss
def dying(*a, **k):  # SIGKILL inside the step after the checkpoint: no finally, no flush
    global calls
    calls += 1
    if calls == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
T.compute_loss = dying
T.train(T.TrainConfig(**json.loads(sys.argv[1])), progress=False)
"""


def _losses(run: Path) -> dict[int, float]:
    """step -> logged loss (a line logged again after a resume replaces the killed run's)."""
    out = {}
    for line in (run / "train_log.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "step" in m:
            out[m["step"]] = m["loss"]
    return out


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_sigkill_then_resume_continues_exactly(tiny_dir, one_proc_data, tmp_path, grad_accum):
    """A process killed (SIGKILL) during step 4 of 6, after the checkpoint of step 2 and the log of step 3,
    resumes from step 2: every logged loss and the final weights equal an uninterrupted run's, exactly."""
    from dflash2_trt.train.trainer import TrainConfig, train

    kw = dict(target=str(tiny_dir / "target"), data=str(one_proc_data), block_size=8, layers=1, selector_rank=16,
              steps=6, batch_seqs=4, anchors_per_seq=4, lr=3e-3, checkpoint_every=2, log_every=1, init="random",
              sampled_softmax=64, random_negatives=16, kl_weight=0.5, heldout_shards=2, eval_rows=2,
              grad_accum=grad_accum)
    train(TrainConfig(out=str(tmp_path / "full"), **kw), progress=False)
    run = tmp_path / "killed"
    kill_at = 3 * grad_accum + 1  # the first compute_loss of step 4
    r = subprocess.run([sys.executable, "-c", _KILLER, json.dumps({**kw, "out": str(run)}), str(kill_at)],
                       env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    assert json.loads((run / "train_state" / "state.json").read_text())["step"] == 2
    assert max(_losses(run)) == 3  # it had logged past its checkpoint
    train(TrainConfig(out=str(run), **kw), progress=False)
    assert _losses(run) == _losses(tmp_path / "full")
    a, b = _weights(tmp_path / "full"), _weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_device_cuda_refused_in_one_line(tiny_dir, one_proc_data, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    t = str(tiny_dir / "target")
    for argv in (["make-data", "--target", t, "--out", str(tmp_path / "m"), "--device", "cuda"],
                 ["train", "--target", t, "--data", str(one_proc_data), "--out", str(tmp_path / "t"),
                  "--device", "cuda:1"],
                 ["eval-tau", "--target", t, "--drafter", str(tiny_dir / "drafter"), "--data", str(one_proc_data),
                  "--device", "cuda"]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dflash2: error: --device cuda") and "CUDA is not available" in err[0]
    assert main(["train", "--target", t, "--data", str(one_proc_data), "--out", str(tmp_path / "t"),
                 "--device", "gpu"]) == 1
    assert "expected cpu, cuda or cuda:N" in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "t").exists()  # refused before any work


def test_bf16_labels_recorded_and_trained_with_fp32_masters(tiny_dir, prompt_file, one_proc_data, tmp_path, capsys):
    """--dtype bf16: make-data's meta says the labels are the bf16 target's chain (other data: another key);
    train autocasts the drafter to bf16 and saves fp32 master weights; eval-tau runs at bf16."""
    t = str(tiny_dir / "target")
    out = tmp_path / "b"
    assert main(["make-data", "--target", t, "--prompt-file", str(prompt_file), "--out", str(out), "--dtype", "bf16",
                 "--prompts", "6", *MAKE]) == 0
    m = json.loads((out / "meta.json").read_text())
    assert m["target_dtype"] == "bf16" and m["config"]["dtype"] == "bf16"
    assert m["key"] != json.loads((one_proc_data / "meta.json").read_text())["key"]
    run = tmp_path / "r"
    args = [a for a in TRAIN]
    for flag, v in (("--steps", "2"), ("--batch-seqs", "2"), ("--heldout-shards", "1")):
        args[args.index(flag) + 1] = v
    assert main(["train", "--target", t, "--data", str(out), "--out", str(run), "--dtype", "bf16", *args]) == 0
    assert all(v.dtype == torch.float32 for v in _weights(run).values())
    last = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines() if '"step"' in x][-1]
    assert np.isfinite(last["loss"])
    capsys.readouterr()
    assert main(["eval-tau", "--target", t, "--drafter", str(run), "--data", str(out), "--dtype", "bf16"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["dtype"] == "bf16" and r["tau"] >= 1.0
    # bf16 labels never mix with fp32 ones
    assert main(["train", "--target", t, "--data", str(out), str(one_proc_data), "--out", str(tmp_path / "mix")]) == 1
    assert "labels of the fp32 target" in capsys.readouterr().err


def test_a_part_without_blocks_still_joins_the_all_reduce(tiny_drafter, one_proc_data):
    """A rank whose rows give no anchor (answers of < 2 tokens) returns a zero loss over every parameter: its
    backward gives zero gradients everywhere (DDP's all-reduce then runs on every rank, nothing hangs)."""
    from dflash2_trt.train import data as D
    from dflash2_trt.train.trainer import _StepLoss, gather_batch

    data = D.GeneratedData(one_proc_data)
    d = tiny_drafter.at_block_size(8)
    d.train()
    b = gather_batch(data, np.asarray([0]), [np.zeros(0, np.int64)], 8)
    loss, m = _StepLoss(d)(b, torch.ones(8), None, 0.0, False, lm_norm=1.0)
    loss.backward()
    params = [p for p in d.parameters() if p.requires_grad]
    assert float(loss.detach()) == 0.0 and all(p.grad is not None and not p.grad.any() for p in params)
    assert m["sums"]["labelled"] == [0.0] * 7


def test_an_epochs_short_last_step_leaves_parts_without_rows(tiny_dir, one_proc_data, tmp_path):
    """--epochs: the last step of an epoch may hold fewer rows than parts (here 10 train rows, steps of 4 rows in
    4 parts: the third step has 2 rows); the empty parts join in and the run ends like one process's."""
    from dflash2_trt.train.trainer import TrainConfig, train

    kw = dict(target=str(tiny_dir / "target"), data=str(one_proc_data), block_size=8, layers=1, selector_rank=16,
              batch_seqs=4, anchors_per_seq=4, lr=3e-3, log_every=1, init="random", sampled_softmax=0,
              heldout_shards=2, eval_rows=0, epochs=1.0)
    train(TrainConfig(out=str(tmp_path / "one"), **kw), progress=False)
    train(TrainConfig(out=str(tmp_path / "four"), grad_accum=4, **kw), progress=False)
    assert max(_losses(tmp_path / "one")) == 3
    la, lb = _losses(tmp_path / "one"), _losses(tmp_path / "four")
    assert all(abs(la[k] - lb[k]) < 1e-5 for k in la)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "four")
    assert all(float((a[k] - b[k]).abs().max()) < 1e-5 for k in a)


def test_plain_cuda_takes_the_current_device(monkeypatch):
    """``--device cuda`` in one process: torch.cuda.set_device refuses a device without an index, so setup gives it
    the current device's (faked CUDA: this machine has none; the call is what a GPU run makes)."""
    import torch

    from dflash2_trt.train import dist as DI

    calls = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    d = DI.setup("cuda")
    assert d.device == torch.device("cuda", 1) and calls == [torch.device("cuda", 1)] and d.world == 1
    assert DI.setup("cuda:0").device == torch.device("cuda", 0) and calls[-1] == torch.device("cuda", 0)
