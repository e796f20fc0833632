"""Review findings of issue #12, each pinned by a test that failed before its fix: τ after an accepted EOS, a
negative / NaN temperature, the generation config's EOS ids, the oracle top-K τ at T > 0, Viterbi on a final
partial block."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner
from torch_ref import ref_speculative


def test_tau_stops_counting_at_an_accepted_eos(acc_target, acc_drafter):
    """EOS accepted as the 2nd draft of a multi-draft cycle: that cycle counts 2 accepted drafts (the drafts
    after the EOS are never committed), not all it verified."""
    p = np.random.default_rng(5).integers(4, 500, 20).tolist()
    full = ref_speculative(acc_target, TorchDraftRunner(acc_drafter), p, 48, eos_ids=set(), measure_oracle=False,
                           layer_ids=[0, 2])
    idx = 1  # index in tokens of the current cycle's first draft
    for c, a in enumerate(full.accepted):
        eos = full.tokens[idx + 1] if a >= 3 else None
        if eos is not None and eos not in full.tokens[:idx + 1]:
            break
        idx += a + 1
    else:
        pytest.fail(f"no cycle accepted >= 3 drafts with a fresh 2nd draft: {full.accepted}")
    res = ref_speculative(acc_target, TorchDraftRunner(acc_drafter), p, 48, eos_ids={eos}, measure_oracle=False,
                          layer_ids=[0, 2])
    assert res.tokens == full.tokens[:idx + 2] and res.tokens[-1] == eos
    assert res.accepted == full.accepted[:c] + [2]
    assert sum(a + 1 for a in res.accepted) - 1 == len(res.tokens) - 1  # the last cycle commits no bonus


@pytest.mark.parametrize("temp", [-0.5, float("nan"), float("inf")])
def test_bad_temperature_is_an_error(acc_target, acc_drafter, temp):
    target = TorchTargetRunner(acc_target, [0, 2])
    with pytest.raises(DFlash2Error, match="temperature must be a finite number >= 0"):
        D.speculative_generate(target, TorchDraftRunner(acc_drafter), [5, 6], 4, temperature=temp)
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
    src = TorchDraftRunner(acc_drafter)
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


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_partial_block_walks_the_verified_rows(temp):
    """A final partial block verifies n < L rows: the drafter (``verified_rows=n``) gives the rows past n zero
    hidden states, and its first n drafts and proposals are then the reference Viterbi walk (argmax, or the
    exactly sampled chain) of the n-row lattice. Strong pair terms make the full-length path differ for some
    n, so this fails on a drafter that ignores ``verified_rows``."""
    import dflash2_trt.reference as ref
    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.model import DFlash2Drafter

    torch.manual_seed(0)
    rng = np.random.default_rng(17)
    V, H, bs, K = 64, 32, 8, 8
    L = bs - 1
    d = DFlash2Drafter(DFlash2Config(hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                     target_layer_ids=[1], selector_rank=8, selector_top_k=K, block_size=bs))
    d.bind_target(torch.randn(V, H), torch.randn(V, H))
    cs = d.candidate_selector
    with torch.no_grad():
        cs.predecessor_codebook.normal_(0, 1.0)
        cs.successor_codebook.normal_(0, 1.0)
    A, Bc = cs.predecessor_codebook.detach().numpy(), cs.successor_codebook.detach().numpy()
    differs = 0
    with torch.no_grad():
        for _ in range(12):
            h = torch.randn(1, bs, H)
            a = torch.tensor([int(rng.integers(V))])
            u = torch.from_numpy(rng.random((1, L), dtype=np.float32)) if temp > 0 else None
            full = d.draft_from_hidden(h, a, "viterbi", temp, u)
            unary, cand = torch.topk(d.logits(h[:, 1:]).float(), K, dim=-1)
            g = cs.hidden_projection(h[:, 1:]).float()
            assert torch.equal(d.draft_from_hidden(h, a, "viterbi", temp, u, verified_rows=L).tokens, full.tokens)
            for n in range(1, L):
                got = d.draft_from_hidden(h, a, "viterbi", temp, u, verified_rows=n)
                Sn = ref.lattice(cand[0, :n].numpy(), unary[0, :n].numpy(), g[0, :n].numpy(), int(a), A, Bc)
                idx, q = ref.walk_one(Sn, "viterbi", temp, None if u is None else u[0, :n].numpy())
                assert got.tokens[0, :n].tolist() == cand[0, np.arange(n), idx].tolist(), n
                np.testing.assert_allclose(got.proposal[0, :n].gather(-1, cand[0, :n]).numpy(), q, atol=1e-5)
                differs += got.tokens[0, :n].tolist() != full.tokens[0, :n].tolist()
    assert differs > 0


def test_decoder_tells_the_drafter_the_verified_rows(acc_target, acc_drafter):
    """The loop hands ``propose`` the rows it will verify: L on full blocks, fewer on the final partial one."""

    told: list[int] = []

    class Spy(TorchDraftRunner):
        def propose(self, anchor, pos, rows, temperature, uniforms):  # noqa: ANN001, ANN201
            told.append(rows)
            return super().propose(anchor, pos, rows, temperature, uniforms)

    p = np.random.default_rng(8).integers(4, 500, 20).tolist()
    res = D.speculative_generate(TorchTargetRunner(acc_target, [0, 2]), Spy(acc_drafter, "viterbi"), p, 37,
                                 eos_ids=set())
    assert told == res.proposed and told[-1] < acc_drafter.config.block_size - 1 and max(res.accepted) >= 3
