"""DFlash2Config: HF json layouts (v2 dflash_config block, v1 top-level block_size) and validation."""

from __future__ import annotations

import json

import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.config import ARCH_V1, ARCH_V2, DFlash2Config, default_target_layer_ids

ZLAB_V2 = {
    "architectures": ["DFlash2DraftModel"],
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "vocab_size": 1000, "layer_types": ["full_attention", "full_attention"], "sliding_window": None,
    "is_causal": False, "num_target_layers": 12, "torch_dtype": "bfloat16",
    "dflash_config": {"block_size": 16, "mask_token_id": 999, "target_layer_ids": [1, 4, 7],
                      "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 64, "selector_top_k": 16},
}


def test_v2_layout_round_trip(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ZLAB_V2))
    cfg = DFlash2Config.from_json_file(tmp_path)
    assert cfg.architecture == ARCH_V2 and cfg.use_conv and cfg.use_selector
    assert cfg.block_size == 16 and cfg.target_layer_ids == [1, 4, 7] and cfg.selector_rank == 64
    assert cfg.num_draft_rows == 15 and cfg.conv_groups == 8 and cfg.context_in_features == 3 * 128
    cfg.save(tmp_path / "again")
    again = DFlash2Config.from_json_file(tmp_path / "again")
    assert again == cfg
    d = json.loads((tmp_path / "again" / "config.json").read_text())
    assert d["dflash_config"]["mask_token_id"] == 999 and d["architectures"] == ["DFlash2DraftModel"]


def test_v1_layout_top_level_block_size(tmp_path):
    v1 = {k: v for k, v in ZLAB_V2.items() if k != "dflash_config"}
    v1["architectures"] = ["DFlashDraftModel"]
    v1["block_size"] = 8
    v1["dflash_config"] = {"mask_token_id": 5, "target_layer_ids": [2, 6]}
    (tmp_path / "config.json").write_text(json.dumps(v1))
    cfg = DFlash2Config.from_json_file(tmp_path)
    assert cfg.architecture == ARCH_V1 and cfg.block_size == 8 and not cfg.use_conv and not cfg.use_selector
    assert cfg.to_dict()["block_size"] == 8


def test_defaults_derived():
    cfg = DFlash2Config(num_target_layers=30, target_layer_ids=None)
    assert cfg.target_layer_ids == default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert cfg.head_dim == 576 // 9 and cfg.target_hidden_size == 576


@pytest.mark.parametrize("change,field", [
    ({"conv_group_size": 7}, "conv_group_size"),
    ({"target_layer_ids": [0, 30]}, "target_layer_ids"),
    ({"selector_top_k": 20}, "selector_top_k"),
    ({"vocab_size": 8, "selector_top_k": 10, "mask_token_id": 1}, "selector_top_k"),
    ({"mask_token_id": 49152}, "mask_token_id"),
    ({"block_size": 1}, "block_size"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    ({"conv_kernel_size": 3}, "conv_kernel_size"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_validation_names_the_field(change, field):
    with pytest.raises(DFlash2Error, match=field):
        DFlash2Config(**change)


def test_bad_files(tmp_path):
    with pytest.raises(DFlash2Error, match="not found"):
        DFlash2Config.from_json_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlash2Error, match="not valid JSON"):
        DFlash2Config.from_json_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**ZLAB_V2, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DFlash2Error, match="architectures"):
        DFlash2Config.from_json_file(tmp_path)
