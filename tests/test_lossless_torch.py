"""The decode loop on the PyTorch reference backend: lossless greedy, distribution-preserving sampling, stopping,
metrics (τ stops at an accepted EOS), bad temperatures, the verified rows told to the drafter."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.protocol import Draft
from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner
from dflash2_trt.vocabulary import INDEPENDENT
from helpers import assert_accepts, req, with_block_size
from torch_ref import ref_autoregressive, ref_speculative

N_PROMPTS = 50
MAX_NEW = 24


def _prompts(vocab, n=N_PROMPTS, seed=1234):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(1, 24))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def ar_refs(tiny_target):
    prompts = _prompts(tiny_target.vocab_size)
    return prompts, [ref_autoregressive(tiny_target, p, MAX_NEW, eos_ids=set()).tokens for p in prompts]


GRID = list(itertools.product((2, 8, 16), ("greedy", "viterbi"), (True, False), (True, False)))


@pytest.fixture(scope="module")
def acc_refs(acc_target):
    prompts = _prompts(acc_target.vocab_size)
    return prompts, [ref_autoregressive(acc_target, p, MAX_NEW, eos_ids=set()).tokens for p in prompts]


def test_lossless_greedy_grid(acc_target, acc_drafter, acc_refs):
    """>= 50 prompts on the accepting pair; every (block size, selector mode, conv on/off, selector on/off)
    combination used, each one committing drafts (assert_accepts), each output equal to the target's own."""
    prompts, refs = acc_refs
    drafters = {}
    accepted: dict[tuple, list[int]] = {g: [] for g in GRID}
    for i, (p, want) in enumerate(zip(prompts, refs)):
        for j in range(2):  # two combinations per prompt -> each of the 24 combinations >= 4 times
            bs, mode, conv, selector = GRID[(2 * i + j) % len(GRID)]
            key = (bs, conv)
            if key not in drafters:
                drafters[key] = with_block_size(acc_drafter, bs, conv)
            d = drafters[key]
            res = ref_speculative(acc_target, TorchDraftRunner(d, mode if selector else INDEPENDENT), p,
                                  req(MAX_NEW, eos_ids=set()), layer_ids=d.config.target_layer_ids)
            assert res.tokens == want, (bs, mode, conv, selector, p)
            assert sum(a + 1 for a in res.accepted) == len(want) - 1  # every token after the first is committed by a cycle
            accepted[(bs, mode, conv, selector)] += res.accepted
    for g, acc in accepted.items():
        assert_accepts(acc, g[0] - 1, g)


class OracleSource:
    """Test drafter that knows the target's greedy continuation and proposes it for a random number of
    rows, then garbage: exercises every acceptance length, full blocks and the final partial block.
    It wraps the real drafter so the Draft objects (candidates, proposals) are real ones."""

    def __init__(self, drafter, prompt, continuation, rng):
        self.inner = TorchDraftRunner(drafter)
        self.block_size, self.num_draft_rows = drafter.config.block_size, drafter.config.num_draft_rows
        self.n_prompt = len(prompt)
        self.cont = continuation
        self.rng = rng
        self.hits = []

    def reset(self):
        self.inner.reset()

    def add_context(self, feats, start):
        self.inner.add_context(feats, start)

    def propose(self, anchor, pos, rows, temperature, uniforms):
        d = self.inner.propose(anchor, pos, rows, temperature, uniforms)
        L = self.num_draft_rows
        k = int(self.rng.integers(0, L + 1))
        off = pos - self.n_prompt + 1  # index in the continuation of the token after the anchor
        truth = self.cont[off: off + L]
        toks = d.tokens.copy()
        for t in range(L):
            if t < k and t < len(truth):
                toks[t] = truth[t]
            else:
                toks[t] = (truth[t] + 1) % 500 + 4 if t < len(truth) else 7
        self.hits.append(k)
        cand = d.cand.copy()  # keep the Draft contract: every draft is one of its row's candidates
        for t in range(L):
            if toks[t] not in cand[t]:
                cand[t, -1] = toks[t]
        return Draft(tokens=toks, proposal=d.proposal, cand=cand, vocab_proposal=d.vocab_proposal)


@pytest.mark.parametrize("bs", [2, 8, 16])
def test_lossless_with_high_acceptance(tiny_target, tiny_drafter, ar_refs, bs):
    prompts, refs = ar_refs
    d = with_block_size(tiny_drafter, bs)
    rng = np.random.default_rng(bs)
    seen_acc = set()
    for p, want in zip(prompts[:20], refs[:20]):
        src = OracleSource(d, p, want, rng)
        res = ref_speculative(tiny_target, src, p, req(MAX_NEW, eos_ids=set()),
                              layer_ids=d.config.target_layer_ids)
        assert res.tokens == want
        seen_acc.update(res.accepted)
        # the loop accepts exactly the proposed correct prefix (capped by the rows verified)
        assert res.accepted == [min(h, n) for h, n in zip(src.hits, res.proposed)]
        assert res.stats()["tau"] > 1.0
    assert max(seen_acc) == bs - 1 and 0 in seen_acc


def test_eos_and_max_tokens(tiny_target, tiny_drafter, ar_refs):
    prompts, refs = ar_refs
    p, want = prompts[0], refs[0]
    eos = {want[5]}
    stop = want.index(want[5]) + 1
    src = OracleSource(with_block_size(tiny_drafter, 8), p, want, np.random.default_rng(0))
    res = ref_speculative(tiny_target, src, p, req(MAX_NEW, eos_ids=eos), layer_ids=[0, 2])
    assert res.tokens == want[:stop]
    base = ref_autoregressive(tiny_target, p, MAX_NEW, eos_ids=eos)
    assert base.tokens == want[:stop]
    for n in (1, 2, 9, 17):
        r = ref_speculative(tiny_target, TorchDraftRunner(tiny_drafter), p, req(n, eos_ids=set()),
                            layer_ids=[0, 2])
        assert r.tokens == want[:n]


def test_metrics_consistent(tiny_target, tiny_drafter, ar_refs):
    prompts, refs = ar_refs
    src = OracleSource(with_block_size(tiny_drafter, 8), prompts[1], refs[1], np.random.default_rng(3))
    res = ref_speculative(tiny_target, src, prompts[1], req(MAX_NEW, eos_ids=set()), layer_ids=[0, 2])
    s = res.stats()
    assert s["cycles"] == len(res.accepted)
    assert s["tau"] == pytest.approx(np.mean(np.array(res.accepted) + 1))
    # oracle top-K can only be at least what was accepted
    assert all(o >= a for o, a in zip(res.oracle_accepted, res.accepted))
    assert s["oracle_tau"] >= s["tau"]
    assert res.tokens_per_s > 0


def test_bad_prompts(tiny_target, tiny_drafter):
    src = TorchDraftRunner(tiny_drafter)
    with pytest.raises(DFlash2Error, match="out of range"):
        ref_speculative(tiny_target, src, [1, tiny_target.vocab_size], req(4), layer_ids=[0, 2])
    with pytest.raises(DFlash2Error, match="empty prompt"):
        ref_speculative(tiny_target, src, [], req(4), layer_ids=[0, 2])
    with pytest.raises(DFlash2Error, match="does not fit"):
        ref_speculative(tiny_target, src, [5] * 5000, req(4), layer_ids=[0, 2])
    with pytest.raises(DFlash2Error, match="max_new_tokens"):
        ref_speculative(tiny_target, src, [5], req(0), layer_ids=[0, 2])


# ---------------------------------------------------------------------------------------------------
# Sampling preserves the target distribution
# ---------------------------------------------------------------------------------------------------

SMALL_V = 6


@pytest.fixture(scope="module")
def small_pair():
    """A target with a 6-token vocabulary (so a joint distribution over 2 tokens has 36 cells)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.model import DFlash2Drafter
    from dflash2_trt.targets.adapter import TargetModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=SMALL_V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, initializer_range=0.5, eos_token_id=None, bos_token_id=None)
    t = TargetModel(LlamaForCausalLM(cfg).eval())
    dc = DFlash2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=SMALL_V, num_target_layers=2, target_layer_ids=[0, 1],
                       block_size=4, mask_token_id=5, selector_rank=4, selector_top_k=4, conv_group_size=8)
    d = DFlash2Drafter(dc)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if not n.endswith("norm.weight"):
                p.normal_(0, 0.5)
    d.bind_target(t.embed_weight, t.lm_head_weight)
    return t, d.eval()


def _chi2_pvalue(counts, law, n):
    """Chi-square goodness of fit; cells expecting < 5 draws are pooled into one (the usual validity rule)."""
    from scipy.stats import chisquare

    exp = law.ravel() * n
    obs = counts.ravel()
    small = exp < 5
    exp_p = np.append(exp[~small], exp[small].sum())
    obs_p = np.append(obs[~small], obs[small].sum())
    return chisquare(obs_p, exp_p)[1]


def _exact_law(t, prompt, T, n=3):
    """P(first n generated tokens) under target-only sampling, by enumeration: [SMALL_V] * n."""
    from dflash2_trt.acceptance import softmax_t

    def next_p(seq):
        t.reset([])
        logits, _ = t.forward(torch.tensor(seq))
        return softmax_t(logits[-1].numpy(), T)

    law = next_p(prompt)
    for k in range(1, n):
        nxt = np.zeros(law.shape + (SMALL_V,))
        for idx in itertools.product(range(SMALL_V), repeat=k):
            nxt[idx] = law[idx] * next_p(prompt + list(idx))
        law = nxt
    return law


class _MemoTarget:
    """The small target behind the runner protocol, memoized by token sequence: the same logits / features the
    model computes (it is deterministic), without recomputing them on each of the thousand sampled runs."""

    def __init__(self, t, layer_ids):
        from dflash2_trt.runtime.torch.backend import TorchTargetRunner

        self.runner = TorchTargetRunner(t, layer_ids)
        self.vocab_size, self.max_positions, self.eos_ids = t.vocab_size, t.max_positions, set()
        self.seq: list[int] = []
        self.memo: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def reset(self):
        self.seq = []

    @property
    def cache_length(self):
        return len(self.seq)

    def forward(self, ids, last_logits=False):
        key = (tuple(self.seq), tuple(ids))
        if key not in self.memo:
            self.runner.reset()
            logits, feats = self.runner.forward(self.seq + list(ids))
            self.memo[key] = logits[len(self.seq):], feats[len(self.seq):]
        self.seq += list(ids)
        logits, feats = self.memo[key]
        return (logits[-1:] if last_logits else logits), feats

    def crop(self, length):
        self.seq = self.seq[:length]


class _MemoDraftSource(TorchDraftRunner):
    """TorchDraftRunner whose block hidden states are memoized by (context features, anchor, position); the
    head and selector (the proposal under test) run on every call with that run's uniforms."""

    memo: dict = {}
    key: tuple = ()  # the context features added so far

    def reset(self):
        super().reset()
        self.key = ()

    def add_context(self, feats, start):
        super().add_context(feats, start)
        self.key = self.key + (start, np.asarray(feats).tobytes())

    @torch.no_grad()
    def propose(self, anchor, pos, rows, temperature, uniforms):
        k = (self.key, anchor, pos)
        if k not in self.memo:
            self.memo[k] = self.drafter.block_forward(torch.tensor([anchor]), torch.tensor([pos]), self.ctx.k,
                                                      self.ctx.v)
        u = None if uniforms is None else torch.from_numpy(np.asarray(uniforms, dtype=np.float32))
        d = self.drafter.draft_from_hidden(self.memo[k], torch.tensor([anchor]), self.mode, temperature, u,
                                           verified_rows=rows)
        q = d.proposal[0]
        return Draft(tokens=d.tokens[0].numpy(), proposal=q.gather(-1, d.cand[0]).numpy(), cand=d.cand[0].numpy(),
                     vocab_proposal=q.numpy())


def _chain_counts(t, d, mode, prompt, T, N):
    """Counts of the first 3 generated tokens over N seeds. Block size 4: the prefill samples token 1 (the
    anchor), the first cycle drafts and verifies a 3-row chain, so tokens 2 and 3 are chain rows (accepted
    drafts, or the rejection sample / bonus after them). Returns (counts [V, V, V], first-cycle accepted)."""
    from dflash2_trt.runtime import decoder

    target = _MemoTarget(t, [0, 1])
    _MemoDraftSource.memo = {}
    counts = np.zeros((SMALL_V,) * 3)
    accepted = []
    for seed in range(N):
        r = decoder.speculative_generate(target, _MemoDraftSource(d, mode), prompt,
                                         req(5, temperature=T, eos_ids=set(), seed=seed))
        assert r.proposed[0] == 3
        counts[tuple(r.tokens[:3])] += 1
        accepted.append(r.accepted[0])
    return counts, np.asarray(accepted)


@pytest.mark.parametrize("mode,use_selector", [("greedy", True), ("viterbi", True), ("greedy", False)])
def test_sampling_preserves_target_distribution(small_pair, mode, use_selector):
    """Chi-square goodness of fit of the first three generated tokens (the prefill sample, then two rows of a
    3-row draft chain) against the exact target law, for greedy and Viterbi chain proposals at T > 0 and the
    no-selector drafter.

    Cells expecting fewer than 5 draws are pooled; with threshold p < 1e-3 the false-failure rate is 0.1%
    per test (seeds are fixed, so a given run is deterministic). test_sampling_test_has_power is the negative
    control: wrong acceptance rules are detected by the same statistic.
    """
    t, d = small_pair
    mode = mode if use_selector else INDEPENDENT
    prompt, T, N = [1, 2, 3], 1.0, 3000
    counts, accepted = _chain_counts(t, d, mode, prompt, T, N)
    # multi-row chains really were accepted, so the rejection rule ran past row 1
    assert (accepted >= 2).sum() > N // 20 and (accepted >= 1).sum() > N // 5, np.bincount(accepted)
    pval = _chi2_pvalue(counts, _exact_law(t, prompt, T), N)
    assert pval > 1e-3, pval


@pytest.mark.parametrize("rule", ["accept_all", "residual_is_p"])
def test_sampling_test_has_power(small_pair, monkeypatch, rule):
    """Negative controls: two wrong acceptance rules, each detected by the chi-square test on the chain law —
    accepting every draft, and resampling a rejected row from p instead of normalize(max(p - q, 0))."""
    from dflash2_trt import acceptance

    t, d = small_pair

    def accept_all(drafts, q, p, rng):  # noqa: ANN001
        return len(drafts), int(rng.choice(p.shape[1], p=p[len(drafts)]))

    def residual_is_p(drafts, q, p, rng):  # noqa: ANN001
        for i, tok in enumerate(drafts):
            if not (q[i, tok] > 0 and rng.random() < min(1.0, p[i, tok] / q[i, tok])):
                return i, int(rng.choice(p.shape[1], p=p[i]))
        return len(drafts), int(rng.choice(p.shape[1], p=p[len(drafts)]))

    wrong = {"accept_all": accept_all, "residual_is_p": residual_is_p}[rule]
    monkeypatch.setattr(acceptance, "accept_rejection", wrong)
    prompt, T, N = [1, 2, 3], 1.0, 3000
    counts, _ = _chain_counts(t, d, "greedy", prompt, T, N)
    assert _chi2_pvalue(counts, _exact_law(t, prompt, T), N) < 1e-3


# -- pinned review findings, each failed before its fix ---------------------------------------------------
def test_tau_stops_counting_at_an_accepted_eos(acc_target, acc_drafter):
    """EOS accepted as the 2nd draft of a multi-draft cycle: that cycle counts 2 accepted drafts (the drafts
    after the EOS are never committed), not all it verified."""
    p = np.random.default_rng(5).integers(4, 500, 20).tolist()
    full = D.speculative_generate(TorchTargetRunner(acc_target, [0, 2]), TorchDraftRunner(acc_drafter), p,
                                  req(48, eos_ids=set()))
    idx = 1  # index in tokens of the current cycle's first draft
    for c, a in enumerate(full.accepted):
        eos = full.tokens[idx + 1] if a >= 3 else None
        if eos is not None and eos not in full.tokens[:idx + 1]:
            break
        idx += a + 1
    else:
        pytest.fail(f"no cycle accepted >= 3 drafts with a fresh 2nd draft: {full.accepted}")
    res = D.speculative_generate(TorchTargetRunner(acc_target, [0, 2]), TorchDraftRunner(acc_drafter), p,
                                 req(48, eos_ids={eos}))
    assert res.tokens == full.tokens[:idx + 2] and res.tokens[-1] == eos
    assert res.accepted == full.accepted[:c] + [2]
    assert sum(a + 1 for a in res.accepted) - 1 == len(res.tokens) - 1  # the last cycle commits no bonus


@pytest.mark.parametrize("temp", [-0.5, float("nan"), float("inf")])
def test_bad_temperature_is_an_error(acc_target, acc_drafter, temp):
    target = TorchTargetRunner(acc_target, [0, 2])
    with pytest.raises(DFlash2Error, match="temperature must be a finite number >= 0"):
        D.speculative_generate(target, TorchDraftRunner(acc_drafter), [5, 6], req(4, temperature=temp))
    with pytest.raises(DFlash2Error, match="temperature must be a finite number >= 0"):
        D.target_generate(target, [5, 6], req(4, temperature=temp))


def test_decoder_tells_the_drafter_the_verified_rows(acc_target, acc_drafter):
    """The loop hands ``propose`` the rows it will verify: L on full blocks, fewer on the final partial one."""

    told: list[int] = []

    class Spy(TorchDraftRunner):
        def propose(self, anchor, pos, rows, temperature, uniforms):  # noqa: ANN001, ANN201
            told.append(rows)
            return super().propose(anchor, pos, rows, temperature, uniforms)

    p = np.random.default_rng(8).integers(4, 500, 20).tolist()
    res = D.speculative_generate(TorchTargetRunner(acc_target, [0, 2]), Spy(acc_drafter, "viterbi"), p,
                                 req(37, eos_ids=set()))
    assert told == res.proposed and told[-1] < acc_drafter.config.num_draft_rows and max(res.accepted) >= 3
