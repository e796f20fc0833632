"""DFlash2Config: HF json layouts (v2 dflash_config block, v1 top-level block_size, transformers 4/5 RoPE
fields), z-lab's reading rules, and validation (one DFlash2Error naming the field, never a traceback or a
silent default)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

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
    # z-lab's rule: as many ids as drafter layers, spread from 1 to L-3; one layer takes the middle one
    cfg = DFlash2Config(num_target_layers=30, num_hidden_layers=5, target_layer_ids=None)
    assert cfg.target_layer_ids == default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert DFlash2Config(num_target_layers=30, num_hidden_layers=2).target_layer_ids == [1, 27]
    assert DFlash2Config(num_target_layers=30, num_hidden_layers=1).target_layer_ids == [15]
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
    ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True}, "sliding_window"),
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


def _load(tmp_path, d):
    (tmp_path / "config.json").write_text(json.dumps(d))
    return DFlash2Config.from_json_file(tmp_path)


def _v2(**top):
    d = copy.deepcopy(ZLAB_V2)
    for k, v in top.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return d


_DROP = object()


def test_shipped_drafter_config_loads_and_round_trips(tmp_path):
    path = Path(__file__).parent.parent / "dflash2_trt" / "drafters" / "smollm2-135m-instruct-dflash2"
    cfg = DFlash2Config.from_json_file(path)
    assert cfg.rope_theta == 100000.0 and cfg.layer_window(0) is None and not cfg.layer_is_causal(0)  # = SmolLM2
    cfg.save(tmp_path)
    assert DFlash2Config.from_json_file(tmp_path) == cfg


def test_theta_from_rope_parameters(tmp_path):
    """transformers 5 writes θ only in rope_parameters; it must not fall back to 10000."""
    cfg = _load(tmp_path, _v2(rope_theta=_DROP, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    saved = cfg.to_dict()
    assert "rope_theta" not in saved and saved["rope_parameters"] == {"rope_theta": 500000.0, "rope_type": "default"}
    # transformers 4 layout: top-level rope_theta + rope_scaling (old "type" spelling too)
    cfg = _load(tmp_path, _v2(rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_theta == 1000000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.to_dict()["rope_parameters"] == {"rope_theta": 1000000.0, "rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("top,field", [
    ({"rope_theta": _DROP}, "rope_theta missing"),
    ({"rope_theta": _DROP, "rope_parameters": {"rope_type": "default"}}, "rope_parameters has no rope_theta"),
    ({"rope_parameters": {"rope_theta": 5.0e5}}, "disagrees"),
    ({"rope_theta": _DROP, "rope_parameters": {"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0}},
     "rope_type 'dynamic' is not supported; allowed: default, linear, yarn, llama3"),
    ({"rope_theta": _DROP, "rope_parameters": {"rope_theta": 1e4, "rope_type": "longrope"}}, "longrope"),
    ({"rope_theta": _DROP, "rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}},
     "original_max_position_embeddings"),
    ({"rope_theta": _DROP, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                               "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_theta": _DROP, "rope_parameters": 10000.0}, "rope_parameters must be an object"),
    ({"rope_theta": "big"}, "rope_theta must be a number"),
    ({"rope_theta": 0}, "rope_theta must be a number > 1"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ({"rms_norm_eps": _DROP}, "rms_norm_eps is missing"),
    ({"head_dim": _DROP}, "head_dim is missing"),
    ({"hidden_size": 128.0}, "hidden_size must be a positive integer, got 128.0"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a positive integer"),
    ({"sliding_window": 0, "use_sliding_window": True}, "sliding_window must be a positive integer"),
    ({"sliding_window": 2.5, "use_sliding_window": True}, "sliding_window must be a positive integer"),
    ({"sliding_window": 64}, "use_sliding_window is missing"),
    ({"hidden_act": "quick_gelu"}, "hidden_act 'quick_gelu' is not supported"),
    ({"attention_bias": "yes"}, "attention_bias must be true or false"),
    ({"is_causal": 1}, "is_causal must be"),
    ({"dflash_config": [1, 2]}, "dflash_config must be an object, got list"),
    ({"dflash_config": "x"}, "dflash_config must be an object, got str"),
    ({"architectures": "LlamaForCausalLM"}, "architectures"),
])
def test_malformed_fields_raise_one_line(tmp_path, top, field):
    with pytest.raises(DFlash2Error, match=field.replace("(", r"\(").replace(")", r"\)")) as e:
        _load(tmp_path, _v2(**top))
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.parametrize("dcfg,field", [
    ({"target_layer_ids": [1, "4", 7]}, "target_layer_ids entry '4' is not an integer"),
    ({"target_layer_ids": [1, 4.0, 7]}, "target_layer_ids entry 4.0 is not an integer"),
    ({"target_layer_ids": 3}, "target_layer_ids must be a list"),
    ({"block_size": 16.0}, "block_size must be an integer"),
    ({"block_size": 16.7}, "block_size must be an integer"),
    ({"selector_rank": None}, "selector_rank is missing"),
    ({"mask_token_id": None}, "mask_token_id is missing"),
    ({"mask_token_id": 5.0}, "mask_token_id"),
    ({"output_multiplier": "2"}, "output_multiplier must be a finite number"),
    ({"input_embedding_scale": float("nan")}, "input_embedding_scale must be a finite number"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping must be > 0"),
])
def test_malformed_dflash_fields_raise(tmp_path, dcfg, field):
    d = _v2()
    d["dflash_config"].update(dcfg)
    with pytest.raises(DFlash2Error, match=field):
        _load(tmp_path, d)


def test_zlab_sliding_window_rules(tmp_path):
    sliding = ["sliding_attention", "sliding_attention"]
    # released layout: window on, is_causal false -> non-causal, windowed
    cfg = _load(tmp_path, _v2(layer_types=sliding, use_sliding_window=True, sliding_window=4))
    assert [cfg.layer_window(i) for i in range(2)] == [4, 4] and not cfg.layer_is_causal(0)
    # use_sliding_window false (Qwen3Config): no window; sliding layers stay causal when is_causal is unset
    cfg = _load(tmp_path, _v2(layer_types=sliding, use_sliding_window=False, sliding_window=4, is_causal=_DROP))
    assert [cfg.layer_window(i) for i in range(2)] == [None, None] and cfg.layer_is_causal(0)
    assert cfg.to_dict()["use_sliding_window"] is False
    again = DFlash2Config.from_dict(cfg.to_dict())
    assert again.layer_window(0) is None and again.layer_is_causal(0)
    # layer_types absent: derived from max_window_layers as Qwen3Config does
    cfg = _load(tmp_path, _v2(layer_types=_DROP, use_sliding_window=True, sliding_window=4, max_window_layers=1))
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(DFlash2Error, match="max_window_layers"):
        _load(tmp_path, _v2(layer_types=_DROP, use_sliding_window=True, sliding_window=4))
    with pytest.raises(DFlash2Error, match="max_window_layers must be an integer"):
        _load(tmp_path, _v2(layer_types=_DROP, use_sliding_window=True, sliding_window=4, max_window_layers="1"))


def test_zlab_value_conventions(tmp_path):
    d = _v2(hidden_act="gelu_pytorch_tanh", attention_bias=True, num_target_layers=_DROP)
    d["dflash_config"]["final_logit_softcapping"] = 0.0  # z-lab: a cap <= 0 is no cap
    d["dflash_config"]["output_multiplier"] = 2
    cfg = _load(tmp_path, d)
    assert cfg.final_logit_softcapping is None and cfg.output_multiplier == 2
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.attention_bias and cfg.num_target_layers is None
    del d["dflash_config"]["target_layer_ids"]
    with pytest.raises(DFlash2Error, match="target_layer_ids"):  # nothing to derive them from
        _load(tmp_path, d)
    d["num_target_layers"] = 12  # z-lab default: one id per drafter layer
    assert _load(tmp_path, d).target_layer_ids == default_target_layer_ids(12, 2) == [1, 9]


def test_saved_config_has_no_nulls_and_one_theta(tmp_path):
    cfg = DFlash2Config(sliding_window=None, is_causal=None, output_multiplier=None)
    d = cfg.to_dict()
    assert d["model_type"] == "qwen3"
    assert [k for k, v in {**d, **d["dflash_config"]}.items() if v is None] == []
    assert "rope_theta" not in d and d["rope_parameters"]["rope_theta"] == 10000.0
    # unknown keys survive, a stale θ carried in extra does not come back as a second θ field
    cfg = DFlash2Config.from_dict({**_v2(), "foo": 1})
    assert cfg.to_dict()["foo"] == 1
    assert "rope_theta" not in cfg.replace(extra={**cfg.extra, "rope_theta": 1.0}).to_dict()


def test_rope_from_a_transformers_target_config():
    from transformers import LlamaConfig

    from dflash2_trt.config import rope_from_hf

    hf = LlamaConfig(rope_theta=100000.0)  # SmolLM2's θ; transformers 5 has no hf.rope_theta attribute
    assert rope_from_hf(hf) == {"rope_theta": 100000.0, "rope_scaling": None}
    hf = LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    got = rope_from_hf(hf)
    assert got["rope_theta"] == 5e5 and got["rope_scaling"]["rope_type"] == "llama3"
    assert DFlash2Config(**got).rope_type == "llama3"
    with pytest.raises(DFlash2Error, match="rope_theta missing"):
        rope_from_hf({"hidden_size": 8})
