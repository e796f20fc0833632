"""Shared fixtures: one tiny target/drafter pair per session (made by the project's own make-tiny), the
accepting pair (``make-tiny --accepting``: drafts accepted on most cycles) and one export of each. Helpers that
are not fixtures live in tests/helpers.py."""

from __future__ import annotations

import os
import sys

import pytest

from helpers import SMOLLM2_NEW, SMOLLM2_PROMPTS, bound_drafter, export_pair, long_memory_heads, make_pair

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# tests check numbers, not speed, on machines shared with other work: no ORT session spins (tests/test_ort_pool.py
# sets the variable itself to cover the runtime's default, the target session spinning)
os.environ.setdefault("DFLASH2_ORT_SPINNING", "0")
# the suite run by a virtual environment's interpreter without activating it (.venv/bin/python -m pytest) is run as
# if activated: libdflash2 and its examples find the onnxruntime wheel's library through $VIRTUAL_ENV
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("VIRTUAL_ENV", sys.prefix)


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """A test that runs the CLI in-process may set torch's thread count (the training commands' --threads): the next
    test gets the count back. (A fuzzed --threads left every later torch test of the suite ~10x slower on 2 cores.)"""
    torch = sys.modules.get("torch")
    n = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_pair(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    from dflash2_trt.targets.adapter import TargetModel

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
    from dflash2_trt.targets.adapter import TargetModel

    return TargetModel.load(acc_dir / "target")


@pytest.fixture(scope="session")
def acc_drafter(acc_dir, acc_target):
    return bound_drafter(acc_dir, acc_target)


@pytest.fixture(scope="session")
def acc_export(acc_dir, tmp_path_factory):
    """The accepting pair exported once."""
    return export_pair(acc_dir, tmp_path_factory, "accepting")


@pytest.fixture(scope="session")
def smollm2_torch():
    """SmolLM2-135M-Instruct on the PyTorch reference (the target adapter), loaded once for the real-model tests."""
    from dflash2_trt.targets.adapter import TargetModel, smollm2_path

    return TargetModel.load(smollm2_path())


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_torch):
    """helpers.SMOLLM2_PROMPTS -> (the chat template's ids, the PyTorch target's greedy SMOLLM2_NEW tokens), decoded
    once: the reference of the PyTorch and the ONNX Runtime real-model lossless tests alike."""
    from torch_ref import ref_autoregressive

    out = []
    for text in SMOLLM2_PROMPTS:
        ids = smollm2_torch.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append((ids, ref_autoregressive(smollm2_torch, ids, SMOLLM2_NEW).tokens))
    return out


@pytest.fixture(scope="session")
def identity_export():
    """SmolLM2-135M-Instruct exported with an identity-initialised DFlash 2 drafter (block size 8, seed 0), max 1024
    positions, made once into the cache (``bench.exports.identity_export``): the real-model runtime tests."""
    from dflash2_trt.bench.exports import identity_export

    return identity_export()


def _exports_on_use(pair, tmp_path_factory, name: str, max_seq_len: int):  # noqa: ANN001, ANN202
    """Block size -> ``pair`` exported at it (each made on first use, once per session)."""
    from dflash2_trt.export.exporter import export_model

    made: dict = {}

    def export(bs: int):  # noqa: ANN202
        if bs not in made:
            made[bs] = tmp_path_factory.mktemp("export") / f"{name}_{bs}"
            export_model(pair / "target", pair / "drafter", made[bs], progress=False, max_seq_len=max_seq_len,
                         block_size=bs)
        return made[bs]

    return export


@pytest.fixture(scope="session")
def nh_pair(tmp_path_factory):
    """``make-tiny --arch nemotron_h --accepting``: Mamba-2 / MoE / attention / Mamba-2, drafts accepted."""
    return make_pair(tmp_path_factory, "nh_acc", accepting=True, arch="nemotron_h")


@pytest.fixture(scope="session")
def nh_exports(nh_pair, tmp_path_factory):
    """Block size -> the accepting Nemotron-H pair exported at it (max 512 positions): the ONNX Runtime, C library
    and TensorRT-fake tests share them."""
    return _exports_on_use(nh_pair, tmp_path_factory, "nh_acc", 512)


@pytest.fixture(scope="session")
def gemma4_exports(tmp_path_factory):
    """Block size -> ``make-tiny --arch gemma4 --accepting`` exported at it (max 256 positions; rings of window 8 +
    16 slots): the batched-loop and TensorRT-fake tests share them."""
    pair = make_pair(tmp_path_factory, "gemma4_acc", accepting=True, arch="gemma4")
    return _exports_on_use(pair, tmp_path_factory, "gemma4_acc", 256)


@pytest.fixture(scope="session")
def hybrid_exports(tmp_path_factory):
    """Block size -> ``make-tiny --arch qwen3_5 --accepting`` (layers attention, linear, linear, attention; drafts
    accepted) exported at it (max 512 positions): the ONNX Runtime, C library and TensorRT-fake tests share them."""
    pair = make_pair(tmp_path_factory, "hy_acc", accepting=True, arch="qwen3_5")
    return _exports_on_use(pair, tmp_path_factory, "hy_acc", 512)


@pytest.fixture(scope="session")
def arch_exports(tmp_path_factory):
    """(arch, accepting) -> make-tiny's pair of that family at block size 8 (``accepting``: the copying pair; else the
    random target, qwen3_5's with long-memory linear heads) exported at max 512 positions (sliding rings of window 8
    in 24 slots), made on first use: the chunked-prefill, C batch and prefix-cache tests share them."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.tiny import make_tiny

    made: dict = {}

    def get(arch: str, accepting: bool = True):  # noqa: ANN202
        if (arch, accepting) not in made:
            d = tmp_path_factory.mktemp(f"arch_{arch}")
            make_tiny(d / "pair", seed=0, block_size=8, accepting=accepting, arch=arch)
            if arch == "qwen3_5" and not accepting:
                long_memory_heads(d / "pair" / "target")
            export_model(d / "pair" / "target", d / "pair" / "drafter", d / "export", progress=False,
                         max_seq_len=512)
            made[arch, accepting] = d / "export"
        return made[arch, accepting]

    return get
