"""`dflash2 demo`: the packaged DFlash 2 drafter for SmolLM2-135M-Instruct (size, dtype, config, loads against
the real target), the demo's default run (text + the keys of `dflash2 bench --json`, lossless) and its
bench-style options; errors are one line."""

from __future__ import annotations

import json

import pytest

from test_bench import KEYS

pytestmark = pytest.mark.slow


def test_packaged_drafter_is_small_fp16_and_fits_smollm2(smollm2_torch):
    from safetensors import safe_open

    from dflash2_trt.bench.demo import demo_drafter_path
    from dflash2_trt.config import DFlash2Config

    p = demo_drafter_path()
    assert (p / "model.safetensors").stat().st_size <= 40 * 2**20
    with safe_open(str(p / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F16"}
    cfg = DFlash2Config.from_json_file(p)
    assert cfg.use_conv and cfg.use_selector
    smollm2_torch.check_drafter(cfg)  # conftest's SmolLM2 target, loaded once a session
    assert (p / "README.md").is_file()  # how it was trained: the exact command


def test_demo_default_and_bench_options(capsys):
    from dflash2_trt.cli import main

    # --no-guard: this checks the drafter's acceptance, which the (timing-driven) guard may cut short
    assert main(["demo", "--max-new-tokens", "16", "--backend", "ort", "--json", "--no-guard"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert KEYS <= set(r) and r["n_prompts"] == 1 and r["lossless"] is True and isinstance(r["text"], str)
    # the packaged drafter gets drafts accepted on the default prompt, and tau is consistent with the
    # per-position rates and the oracle ceiling
    assert r["selector"] == "greedy" and r["tau"] > 1.0 and r["per_position_cumulative"][0] > 0
    assert r["oracle_tau"] >= r["tau"]
    from dflash2_trt.runtime.ort import decode_attention as DA

    if DA.panels_wanted():  # SmolLM2 from its Q4_1 GGUF: every fp32 matrix read as its exact code (panelCodes.h)
        assert r["weight_codes"] == {"none": 0, "affine4": 150, "scaled8": 2, "bf16": 0, "fp16": 13}
    else:  # the target on ORT's MatMul (AVX2 kernels: panels_wanted), the drafter's layers still coded
        assert r["weight_codes"]["affine4"] == r["weight_codes"]["scaled8"] == 0 < r["weight_codes"]["fp16"]
    assert main(["demo", "--prompts", "mtbench", "--limit", "1", "--max-new-tokens", "8", "--no-selector",
                 "--temperature", "1", "--no-oracle", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert KEYS <= set(r) and "text" not in r and r["selector"] == "independent" and r["lossless"] is None
    assert main(["demo", "--max-new-tokens", "8", "--selector", "viterbi"]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "tau" in out
    assert main(["demo", "--prompt", "x", "--prompts", "mtbench"]) == 1  # a flag combination: one line, exit 1
    assert "not allowed with argument --prompt" in capsys.readouterr().err
