"""Target adapter: feature taps (+1 offset), KV crop, drafter compatibility, Llama and Qwen2/Qwen3 families."""

from __future__ import annotations

import shutil

import json

import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.config import DFlash2Config
from dflash2_trt.runtime.torch.backend import TorchDraftRunner
from torch_ref import ref_autoregressive, ref_speculative
from dflash2_trt.model import DFlash2Drafter
from dflash2_trt.targets.adapter import TargetModel
from helpers import req


def test_features_are_decoder_layer_outputs(tiny_target):
    """Layer id i is the output of decoder layer i (HF hidden_states[i + 1]), read with a forward hook."""
    captured = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
             for i, layer in enumerate(tiny_target.model.model.layers)]
    try:
        tiny_target.reset([0, 2])
        _, feats = tiny_target.forward(torch.tensor([5, 6, 7, 8]))
    finally:
        for h in hooks:
            h.remove()
    H = tiny_target.hidden_size
    torch.testing.assert_close(feats[:, :H], captured[0].reshape(4, H))
    torch.testing.assert_close(feats[:, H:], captured[2].reshape(4, H))


def test_crop_then_continue_equals_fresh(tiny_target):
    ids = [9, 8, 7, 6, 5, 4, 3]
    tiny_target.reset([1])
    tiny_target.forward(torch.tensor(ids[:4]))
    tiny_target.forward(torch.tensor([100, 101, 102]))  # rejected drafts
    tiny_target.crop(4)
    assert tiny_target.cache_length == 4
    logits, feats = tiny_target.forward(torch.tensor(ids[4:]))
    tiny_target.reset([1])
    ref_logits, ref_feats = tiny_target.forward(torch.tensor(ids))
    torch.testing.assert_close(logits, ref_logits[4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats, ref_feats[4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,msg", [
    ({"hidden_size": 32, "target_hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1},
     "hidden size 64"),
    ({"vocab_size": 600}, "vocab_size 600 != target vocab"),
    ({"num_target_layers": 8, "target_layer_ids": [6]}, r"target_layer_ids \[6\] outside"),
    ({"target_hidden_size": 32}, "target_hidden_size 32"),
])
def test_refuses_mismatched_drafter(tiny_target, tiny_drafter, change, msg):
    cfg = tiny_drafter.config.replace(**change)
    with pytest.raises(DFlash2Error, match=msg):
        tiny_target.check_drafter(cfg)


def test_mask_id_outside_target_vocab(tiny_target, tiny_drafter):
    cfg = tiny_drafter.config.replace(vocab_size=10_000, mask_token_id=9000)
    with pytest.raises(DFlash2Error, match="mask_token_id 9000 outside the target vocab"):
        tiny_target.check_drafter(cfg)


def test_bad_target_paths(tmp_path):
    with pytest.raises(DFlash2Error, match="target not found"):
        TargetModel.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlash2Error, match="no config.json"):
        TargetModel.load(tmp_path / "empty")


def _family(name):
    import transformers as tf

    common = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  initializer_range=0.3, eos_token_id=None, bos_token_id=None)
    if name == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=8, **common))
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_lossless(family, tmp_path):
    torch.manual_seed(0)
    hf = _family(family)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    target = TargetModel.load(tmp_path)  # through the folder loader
    assert type(target.model).__name__.lower().startswith(family)
    cfg = DFlash2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=300, num_target_layers=3, target_layer_ids=[0, 1],
                        block_size=4, mask_token_id=299, selector_rank=8, conv_group_size=8)
    target.check_drafter(cfg)
    d = DFlash2Drafter(cfg)
    d.bind_target(target.embed_weight, target.lm_head_weight)
    for prompt in ([5, 6, 7], [100] * 9, [1]):
        want = ref_autoregressive(target, prompt, 12, eos_ids=set()).tokens
        got = ref_speculative(target, TorchDraftRunner(d.eval()), prompt, req(12, eos_ids=set()),
                              layer_ids=[0, 1])
        assert got.tokens == want


# -- pinned review findings, each failed before its fix ---------------------------------------------------
def test_generation_config_eos_ids_survive_loading(acc_dir, tmp_path):
    """Llama-3 style: the stop ids [eos, eot] live only in generation_config.json; eos_ids() must see them."""
    from dflash2_trt.targets.adapter import TargetModel

    d = tmp_path / "t"
    shutil.copytree(acc_dir / "target", d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 3]}))
    t = TargetModel.load(d)
    assert {0, 3} <= t.eos_ids()
    assert t.model.generation_config.eos_token_id is None  # HF generate still never stops on its own
