"""Review findings of issue #12, each pinned by a test that failed before its fix: τ after an accepted EOS, a
negative / NaN temperature, the generation config's EOS ids, the oracle top-K τ at T > 0."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.torch_backend import TorchDraftSource, TorchTargetRunner
from torch_ref import ref_speculative


def test_tau_stops_counting_at_an_accepted_eos(acc_target, acc_drafter):
    """EOS accepted as the 2nd draft of a multi-draft cycle: that cycle counts 2 accepted drafts (the drafts
    after the EOS are never committed), not all it verified."""
    p = np.random.default_rng(5).integers(4, 500, 20).tolist()
    full = ref_speculative(acc_target, TorchDraftSource(acc_drafter), p, 48, eos_ids=set(), measure_oracle=False,
                           layer_ids=[0, 2])
    idx = 1  # index in tokens of the current cycle's first draft
    for c, a in enumerate(full.accepted):
        eos = full.tokens[idx + 1] if a >= 3 else None
        if eos is not None and eos not in full.tokens[:idx + 1]:
            break
        idx += a + 1
    else:
        pytest.fail(f"no cycle accepted >= 3 drafts with a fresh 2nd draft: {full.accepted}")
    res = ref_speculative(acc_target, TorchDraftSource(acc_drafter), p, 48, eos_ids={eos}, measure_oracle=False,
                          layer_ids=[0, 2])
    assert res.tokens == full.tokens[:idx + 2] and res.tokens[-1] == eos
    assert res.accepted == full.accepted[:c] + [2]
    assert sum(a + 1 for a in res.accepted) - 1 == len(res.tokens) - 1  # the last cycle commits no bonus


@pytest.mark.parametrize("temp", [-0.5, float("nan"), float("inf")])
def test_bad_temperature_is_an_error(acc_target, acc_drafter, temp):
    target = TorchTargetRunner(acc_target, [0, 2])
    with pytest.raises(DFlash2Error, match="temperature must be a finite number >= 0"):
        D.speculative_generate(target, TorchDraftSource(acc_drafter), [5, 6], 4, temperature=temp)
    with pytest.raises(DFlash2Error, match="temperature must be a finite number >= 0"):
        D.target_generate(target, [5, 6], 4, temperature=temp)


def test_cli_bad_temperature_is_one_line(acc_dir, capsys):
    from dflash2_trt.cli import main

    assert main(["generate", "--target", str(acc_dir / "target"), "--drafter", str(acc_dir / "drafter"),
                 "--prompt", "x", "--temperature", "-1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash2: error: temperature must be") and "\n" not in err


def test_generation_config_eos_ids_survive_loading(acc_dir, tmp_path):
    """Llama-3 style: the stop ids [eos, eot] live only in generation_config.json; eos_ids() must see them."""
    from dflash2_trt.target import TargetModel

    d = tmp_path / "t"
    shutil.copytree(acc_dir / "target", d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 3]}))
    t = TargetModel.load(d)
    assert {0, 3} <= t.eos_ids()
    assert t.model.generation_config.eos_token_id is None  # HF generate still never stops on its own


def test_oracle_tau_at_positive_temperature_follows_its_definition(acc_target, acc_drafter):
    """bench/oracle.py: at T > 0 a cycle's oracle count is the number of leading rows whose token — the
    committed prefix (accepted drafts + the sampled bonus), then the target's argmax continuation — is among
    the row's candidates. Recomputed here from scratch with fresh target passes."""
    from dflash2_trt.bench.oracle import oracle_count

    runner = TorchTargetRunner(acc_target, [0, 2])
    src = TorchDraftSource(acc_drafter)
    seen = []

    def spy(target, cand, drafts, n_rows, acc, bonus, pos):  # noqa: ANN001
        o = oracle_count(target, cand, drafts, n_rows, acc, bonus, pos)
        seen.append((cand.copy(), list(drafts), n_rows, acc, bonus, pos, o, target.cache_length))
        return o

    p = np.random.default_rng(9).integers(4, 500, 18).tolist()
    res = D.speculative_generate(runner, src, p, 40, temperature=0.7, eos_ids=set(), seed=3, oracle=spy)
    assert res.oracle_accepted == [s[6] for s in seen] and len(seen) == len(res.accepted)
    assert any(s[3] > 0 for s in seen)  # drafts were accepted, so the committed-prefix part is exercised
    for cand, drafts, n_rows, acc, bonus, pos, o, cache_len in seen:
        assert cache_len == pos + acc + 1  # the oracle left the cache at the committed length
        seq = (p + res.tokens)[: pos + 1] + drafts[:acc] + [bonus]
        while len(seq) < pos + 1 + n_rows:  # the target's argmax continuation after the committed prefix
            acc_target.reset([])
            logits, _ = acc_target.forward(torch.tensor(seq))
            seq.append(int(logits[-1].argmax()))
        want = 0
        while want < n_rows and seq[pos + 1 + want] in cand[want].tolist():
            want += 1
        assert o == want
