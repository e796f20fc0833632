"""ONNX Runtime CPU thread pools (runtime/ort/backend.py): the target session's intra-op workers spin between ops,
the drafter's sleep (two spinning pools in one decode loop take the CPUs from each other); ``load(spinning=False)``
or DFLASH2_ORT_SPINNING=0 turns spinning off (the argument over the environment). Speed only: speculative decoding gives the same tokens either way."""

from __future__ import annotations

import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.ort import backend as B
from helpers import req

SPIN = "session.intra_op.allow_spinning"


def _decode(folder) -> tuple[dict[str, str], D.GenerationResult]:
    be = B.OrtBackend(folder, threads=2)
    target, drafter = be.target_runner(), be.draft_runner("greedy")
    res = D.speculative_generate(target, drafter, [1, 2, 3, 4, 5, 6],
                                 req(24, eos_ids=set(), proposer="dflash2"))
    spins = {k: s.sess.get_session_options().get_session_config_entry(SPIN) for k, s in be._sessions.items()}
    return spins, res


def test_only_the_target_session_spins_and_tokens_do_not_depend_on_it(acc_export, monkeypatch):
    monkeypatch.delenv(B.SPINNING_ENV, raising=False)
    spins, res = _decode(acc_export)
    targets = {k for k in spins if k.startswith("target")}
    assert targets and len(spins) > len(targets)  # the target and the drafter's graphs were opened
    assert {k: v for k, v in spins.items() if k in targets} == {k: "1" for k in targets}
    assert {v for k, v in spins.items() if k not in targets} == {"0"}
    monkeypatch.setenv(B.SPINNING_ENV, "0")
    spins_off, res_off = _decode(acc_export)
    assert set(spins_off.values()) == {"0"}
    assert res.tokens == res_off.tokens
    assert res.stats()["tau"] > 1.5  # drafts accepted: the verify path ran on the spinning target


def test_bad_spinning_setting_is_a_clear_error(acc_export, monkeypatch):
    monkeypatch.setenv(B.SPINNING_ENV, "yes")
    with pytest.raises(DFlash2Error, match="DFLASH2_ORT_SPINNING='yes'"):
        B.OrtBackend(acc_export, threads=2).target_runner()


def test_load_spinning_overrides_the_environment(acc_export, monkeypatch):
    import dflash2_trt

    for env, arg, want in (("0", True, "1"), ("1", False, "0"), ("yes", False, "0")):  # a bad variable is not read
        monkeypatch.setenv(B.SPINNING_ENV, env)
        with dflash2_trt.load(acc_export, backend="ort", threads=2, spinning=arg) as g:
            g.generate([1, 2, 3], 4, eos_ids=set())
            spins = {k: s.sess.get_session_options().get_session_config_entry(SPIN) for k, s in g._backend._sessions.items()}
        assert {v for k, v in spins.items() if k.startswith("target")} == {want}, (env, arg, spins)
        assert {v for k, v in spins.items() if not k.startswith("target")} == {"0"}
    with pytest.raises(DFlash2Error, match="spinning must be True, False or None"):
        dflash2_trt.load(acc_export, backend="ort", spinning="0")
