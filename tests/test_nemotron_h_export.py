"""Nemotron-H targets (Mamba-2, MoE and attention layers) exported and run with ONNX Runtime: the standard target
graph against transformers, a k-row verify against k one-row steps, the runtime's rollback of the Mamba-2 layers'
convolution and SSM states to every kept length against a fresh run, lossless speculative decoding with drafts
accepted on the copying pair (= transformers' own greedy output) in the single and the batched loop, a planted
SSM-state rollback bug the suite must catch, the manifest's layer kinds and state shapes, TensorRT's parser table for
every node of the graph; the C library (libdflash2's ONNX Runtime backend, session and batch) on the same exports:
= transformers' greedy, = the Python runtime for the same seeds, its planted SSM-state bug caught."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.linear_state import LinearStates
from dflash2_trt.tiny import COPY_PERIOD
from helpers import (assert_batch_lossless, assert_rolled_back, check_every_node_imports_into_tensorrt,
                     check_graph_equals_transformers, check_ort_verify_and_rollback, make_pair, req)
from test_capi import capi_build, vectors_path  # noqa: F401 (the C library's fixtures)


@pytest.fixture(scope="module")
def random_export(tmp_path_factory):
    """(HF target, ORT backend) of a random tiny Nemotron-H target (every layer at full strength)."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.targets.adapter import TargetModel

    pair = make_pair(tmp_path_factory, "nh_rand", arch="nemotron_h")
    out = tmp_path_factory.mktemp("export") / "nh_rand"
    export_model(pair / "target", pair / "drafter", out, progress=False, max_seq_len=512)
    return TargetModel.load(pair / "target"), OrtBackend(out)


@pytest.fixture(scope="module")
def accepting_export(nh_pair, nh_exports):
    """(HF target, ORT backend) of the accepting pair exported at block size 8 (conftest's, shared)."""
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.targets.adapter import TargetModel

    return TargetModel.load(nh_pair / "target"), OrtBackend(nh_exports(8))


@pytest.fixture(scope="module")
def small_block_exports(nh_exports):
    """Block size -> ORT backend of the same accepting pair exported at block sizes 2 and 4."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    return {bs: OrtBackend(nh_exports(bs)) for bs in (2, 4)}


def test_manifest_describes_layer_kinds_and_states(random_export):
    t, be = random_export
    m = be.manifest
    assert m.manifest_version == 3 and m.target.layer_kinds == ("linear", "mlp", "attention", "linear")
    cfg = t.model.config
    ls = m.target.linear_state
    assert (ls.conv_dim, ls.conv_kernel, ls.num_heads, ls.key_dim, ls.value_dim) == (
        cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.n_groups * cfg.ssm_state_size, cfg.conv_kernel,
        cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size)
    names = [x.name for x in m.graphs["target"].inputs]
    assert [n for n in names if n.startswith("past")] == ["past_conv.0", "past_recurrent.0", "past_key_values.2.key",
                                                           "past_key_values.2.value", "past_conv.3",
                                                           "past_recurrent.3"]  # the MoE layer: no state
    assert "target_ort" not in m.graphs and be.batching


def test_graph_equals_transformers_on_prompts_up_to_300(random_export):
    """Prompts of 1..300 tokens (calls of at most 64 rows) then single steps: logits within 1e-4 (relative) of
    transformers' (helpers.check_graph_equals_transformers)."""
    check_graph_equals_transformers(*random_export, (1, 5, 64, 65, 300))


def test_verify_rows_equal_steps_and_rollback_equals_a_fresh_run(random_export):
    """A k-row call (k = 4, 8) = k one-row calls; a rollback to every kept length 0..k leaves the KV, conv and SSM
    states (6 arrays) and the next logits equal to a fresh run (helpers.check_ort_verify_and_rollback)."""
    check_ort_verify_and_rollback(*random_export, (4, 8))


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts of COPY_PERIOD..40 tokens: the copying target has a token to copy from its first new one."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(COPY_PERIOD, 40))).tolist() for _ in range(n)]


_NEW = 20  # tokens generated per prompt


@pytest.fixture(scope="module")
def hf_greedy(accepting_export):
    """(prompts, transformers' own greedy continuation of each): the reference of the lossless tests."""
    t, be = accepting_export
    prompts = _prompts(be.manifest.target.vocab_size, 40, 7)
    with torch.no_grad():
        out = [t.model.generate(torch.tensor([p]), max_new_tokens=_NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert all(len(o) == _NEW for o in out)
    return prompts, out


def test_lossless_greedy_with_drafts_accepted_on_ort(accepting_export, small_block_exports, hf_greedy):
    """40 prompts x block sizes 2, 4, 8 (one export each): speculative greedy output on ONNX Runtime = transformers'
    own greedy output, token for token, with drafts accepted and partial blocks rolled back."""
    prompts, want = hf_greedy
    for bs, be in {**small_block_exports, 8: accepting_export[1]}.items():
        bad, accepted = 0, []
        for p, w in zip(prompts, want):
            r = D.speculative_generate(be.target_runner(), be.draft_runner("greedy"), p, req(_NEW, eos_ids=set()))
            bad += r.tokens != w
            accepted += r.accepted
        assert bad == 0, f"block size {bs}: {bad} of 40 prompts differ"
        assert_rolled_back(accepted, bs, f"at block size {bs}")


def test_generate_batch_equals_transformers(accepting_export, small_block_exports, hf_greedy):
    """generate_batch (the batched loop, per-slot Mamba-2 states) over the 40 prompts at block sizes 2, 4 and 8 =
    transformers' greedy output, token for token, with drafts accepted and rolled back."""
    exports = {**{bs: be.dir for bs, be in small_block_exports.items()}, 8: accepting_export[1].dir}
    assert_batch_lossless(exports, *hf_greedy, _NEW)


def _keep_ssm_rows(self, keep, slot=0):  # noqa: ANN001, ANN202
    """Planted bug: the convolution state is rolled back, the SSM state stays the one after all k rows."""
    rec = [r[slot].copy() for r in self.recurrent]
    LinearStates._real_rollback(self, keep, slot)
    for r, after in zip(self.recurrent, rec):
        r[slot] = after


def test_planted_ssm_rollback_bug_is_caught_on_ort(accepting_export, hf_greedy, monkeypatch):
    """The SSM state not rolled back makes speculative output differ from transformers', on the B = 1 runner and in
    the batched loop, so the lossless tests above fail on it."""
    import dflash2_trt

    _, be = accepting_export
    prompts, want = hf_greedy
    monkeypatch.setattr(LinearStates, "_real_rollback", LinearStates.rollback, raising=False)
    monkeypatch.setattr(LinearStates, "rollback", _keep_ssm_rows)
    got = [D.speculative_generate(be.target_runner(), be.draft_runner("greedy"), p, req(_NEW, eos_ids=set())).tokens
           for p in prompts[:20]]
    assert sum(g != w for g, w in zip(got, want)) > 0
    g = dflash2_trt.load(be.dir, backend="ort")
    batch = g.generate_batch(prompts[:12], _NEW, chat=False, eos_ids=set(), proposer="dflash2", max_batch=4,
                             adaptive=False)
    assert sum(r.tokens != w for r, w in zip(batch, want)) > 0


def test_every_node_imports_into_tensorrt(random_export):
    check_every_node_imports_into_tensorrt(random_export[1])


# ---- the C library (libdflash2's ONNX Runtime backend): the same exports, the same references ------------------------
# Its runs are test_capi_ort's: one process per call (dfl2_session through ctypes with numpy's uniforms, or
# examples/generate -b for a dfl2_batch), neither runtime using the op library (the target graph is the standard one).

C_OPTIONS = ("eos_ids=", "proposer=dflash2", "guard=false")  # transformers' references ignore EOS; every cycle drafts
SSM_PLANT = "DFLASH2_PLANT_KEEP_SSM_STATE"  # the library's planted bug: a crop rolls the conv state back, not the SSM


@pytest.fixture
def c_env(monkeypatch):
    """The environment test_capi_ort's C runs need: the onnxruntime wheel's venv (where libdflash2 finds ONNX
    Runtime) and no op library."""
    from dflash2_trt.bench.capi import wheel_venv
    from test_capi_ort import NO_LIBRARY

    monkeypatch.setenv("VIRTUAL_ENV", wheel_venv())
    monkeypatch.delenv("ORT_LIBRARY", raising=False)
    monkeypatch.setenv("DFLASH2_ORT_OPS", NO_LIBRARY)


def _c_runs(build, export, prompts: list[list[int]], temperature: float = 0.0,  # noqa: ANN001
            env: dict | None = None) -> list[dict]:
    """Each prompt through one dfl2_session (seeds 100 + i) -> per request {tokens, accepted, proposers}."""
    from test_capi_ort import NO_LIBRARY, _c_samples

    return _c_samples(build, export, prompts, [100 + i for i in range(len(prompts))], NO_LIBRARY, temperature, _NEW,
                      env, C_OPTIONS)


def _c_batch(build, export, prompts: list[list[int]], env: dict | None = None) -> list[list[int]]:  # noqa: ANN001
    """dfl2_batch (examples/generate -b) over the prompts, 4 slots, every request drafting -> each request's ids."""
    from test_capi_ort import _example

    ids, _ = _example(build, export, prompts, "-b", "max_batch=4", "adaptive=false", f"max_new_tokens={_NEW}",
                      *C_OPTIONS, env={**os.environ, **(env or {})})
    return ids


def test_c_library_greedy_equals_transformers(capi_build, c_env, accepting_export, small_block_exports, hf_greedy):
    """libdflash2 on the Nemotron-H exports (the Mamba-2 layers' conv and SSM states fed and rolled back to the
    accepted row; the MoE layer without state tensors): 40 prompts x block sizes 2, 4, 8 greedy = transformers'
    own greedy output, token for token, with drafts accepted and partial blocks rolled back; a dfl2_batch of 12 of
    them (4 slots, per-slot states) too."""
    prompts, want = hf_greedy
    exports = {**{bs: be.dir for bs, be in small_block_exports.items()}, 8: accepting_export[1].dir}
    for bs, export in exports.items():
        runs = _c_runs(capi_build, export, prompts)
        assert [i for i, (r, w) in enumerate(zip(runs, want)) if r["tokens"] != w] == [], f"block size {bs}"
        accepted = [a for r in runs for a in r["accepted"]]
        assert all(who == "dflash2" for r in runs for who in r["proposers"])
        assert_rolled_back(accepted, bs, f"in C at block size {bs}")
    assert _c_batch(capi_build, exports[8], prompts[:12]) == want[:12]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "T0.8"])
def test_c_library_equals_python_runtime(capi_build, c_env, accepting_export, hf_greedy, temperature):
    """The C library and the Python runtime on the block-8 export, the same seeds (numpy's uniforms): 10 prompts give
    the same ids and the same accepted drafts per cycle, greedy and at T = 0.8, with partial acceptances."""
    from test_capi_ort import _load

    prompts = hf_greedy[0][:10]
    export = accepting_export[1].dir
    py = _load(export, os.environ["DFLASH2_ORT_OPS"])
    try:
        accepted = []
        for i, (p, got) in enumerate(zip(prompts, _c_runs(capi_build, export, prompts, temperature))):
            want = py.generate(p, max_new_tokens=_NEW, temperature=temperature, seed=100 + i, guard=False,
                               chat=False, eos_ids=set(), proposer="dflash2")
            assert got["tokens"] == want.tokens and got["accepted"] == want.stats.accepted, i
            accepted += got["accepted"]
    finally:
        py.close()
    assert sum(accepted) > 0 and any(0 < a < 7 for a in accepted), accepted


def test_planted_ssm_rollback_bug_is_caught_in_the_c_library(capi_build, c_env, accepting_export, hf_greedy):
    """Negative control: with the library's planted bug (DFLASH2_PLANT_KEEP_SSM_STATE=1: a crop rolls the conv state
    back but leaves the SSM state after all the verified rows) the session's and the batch's greedy ids differ from
    transformers', so the test above catches it."""
    prompts, want = hf_greedy
    export = accepting_export[1].dir
    runs = _c_runs(capi_build, export, prompts[:20], env={SSM_PLANT: "1"})
    assert sum(r["tokens"] != w for r, w in zip(runs, want)) > 0
    assert _c_batch(capi_build, export, prompts[:12], env={SSM_PLANT: "1"}) != want[:12]
