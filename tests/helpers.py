"""Helpers shared by the tests (fixtures live in conftest.py and use these): the tiny pairs made by the
project's own make-tiny and exported once, the same weights at another block size, and the acceptance check
of the lossless / equivalence tests, the check that the custom-op library is built, and speculative = autoregressive
decoding through a backend, and the batched loop's lossless bar."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dflash2_trt.runtime.request import GenerationRequest


def req(max_new_tokens: int | None, **options: Any) -> GenerationRequest:
    """A request as the tests that compare runs decode it (against the PyTorch reference, the C twin, another
    backend, plain decoding): the drafter proposes every cycle (``proposer`` 'dflash2'), no acceptance guard (its
    choices follow measured times), seed 0 — unless ``options`` say otherwise."""
    return GenerationRequest(max_new_tokens=max_new_tokens, **{"proposer": "dflash2", "guard": False, "seed": 0,
                                                               **options})


# the real-model lossless tests' chat prompts and new tokens (tests/test_smollm2.py, test_runtime_smollm2.py)
SMOLLM2_PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
                   "List three colors.")
SMOLLM2_NEW = 20


def make_pair(tmp_path_factory, name: str, accepting: bool = False, arch: str = "llama"):
    from dflash2_trt.tiny import make_tiny

    out = tmp_path_factory.mktemp(name)
    make_tiny(out, seed=0, block_size=16, accepting=accepting, arch=arch)
    return out


def long_memory_heads(target_dir) -> None:  # noqa: ANN001
    """Edit a saved tiny qwen3_5 target in place: every linear head's decay ~0.987 a row (A_log = log 0.01) and its
    update strength near 1 — long memory, the heads repeated tokens drive into cancellation and whose state moves
    the tokens."""
    import math

    import torch
    from safetensors.torch import load_file, save_file

    path = next(target_dir.glob("*.safetensors"))
    sd = load_file(str(path))
    for key in [k for k in sd if k.endswith("linear_attn.A_log")]:
        sd[key] = torch.full_like(sd[key], math.log(0.01))
        prefix = key[: -len("A_log")]
        sd[prefix + "in_proj_b.weight"] = sd[prefix + "in_proj_b.weight"] * 0.1 + 0.3
    save_file(sd, str(path), metadata={"format": "pt"})


def bound_drafter(pair_dir, target):
    from dflash2_trt.model import load_drafter

    d = load_drafter(pair_dir / "drafter")
    d.bind_target(target.embed_weight, target.lm_head_weight)
    return d


def export_pair(pair_dir, tmp_path_factory, name: str):
    """The pair exported by dflash2-export (its block size 16, max 512 positions)."""
    from dflash2_trt.export.exporter import export_model

    out = tmp_path_factory.mktemp("export") / name
    export_model(pair_dir / "target", pair_dir / "drafter", out, progress=False, max_seq_len=512)
    return out


def with_block_size(drafter, bs: int, use_conv: bool = True):
    """The same weights under another block size / convolutions-off ablation (weights do not depend on bs)."""
    d = drafter.at_block_size(bs)
    d.set_ablation(use_conv=use_conv)
    return d


def assert_accepts(accepted: list[int], draft_rows: int, what: object = "") -> None:
    """The path under test really committed drafts: at least half of the cycles accepted >= 1 draft and some
    cycle accepted >= 3 (or every row, when a block has fewer than 3). ``accepted``: per-cycle counts, pooled
    over the requests of one configuration; ``draft_rows``: L = block size - 1."""
    assert accepted, f"no cycles ran {what}"
    frac = sum(a >= 1 for a in accepted) / len(accepted)
    assert frac >= 0.5, f"only {frac:.0%} of {len(accepted)} cycles accepted a draft {what}"
    assert max(accepted) >= min(3, draft_rows), f"no cycle accepted {min(3, draft_rows)} drafts {what}: {accepted}"


def assert_batch_lossless(exports: dict, prompts: list[list[int]], want: list[list[int]], new: int) -> None:
    """The batched loop's lossless bar: for each block size -> export folder of ``exports``, generate_batch over all
    the prompts (4 slots, every request drafting every cycle) gives ``want`` (the reference's greedy continuations),
    token for token, with drafts accepted (assert_accepts) and partial acceptances (rollbacks into a verify)."""
    import dflash2_trt

    for bs, export in exports.items():
        g = dflash2_trt.load(export, backend="ort")
        try:
            batch = g.generate_batch(prompts, new, chat=False, eos_ids=set(), proposer="dflash2", max_batch=4,
                                     adaptive=False)
        finally:
            g.close()
        assert [i for i, (r, w) in enumerate(zip(batch, want)) if r.tokens != w] == [], f"block size {bs}"
        accepted = [a for r in batch for a in r.stats.accepted]
        assert_accepts(accepted, bs - 1, f"generate_batch, block size {bs}")
        assert any((0 < a or bs == 2) and a < bs - 1 for a in accepted), f"no rollback at block size {bs}"


class RecordingDrafter:
    """A draft runner that checks the draft context stays contiguous: before every proposal its context covers
    exactly positions 0 .. anchor - 1, each once (deferred features of plain steps and prompt-lookup cycles joined
    in one pass when the drafter runs again). Counts proposals and multi-row context additions."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.covered, self.batched, self.proposals = inner, [], 0, 0

    def __getattr__(self, name):  # noqa: ANN001, ANN204 - block_size, top_k
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.covered = []
        self.inner.reset()

    def add_context(self, feats, start):  # noqa: ANN001, ANN202
        self.covered += range(start, start + feats.shape[0])
        self.batched += feats.shape[0] > 1
        return self.inner.add_context(feats, start)

    def propose(self, anchor, pos, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        assert self.covered == list(range(pos)), (pos, self.covered[-8:])
        self.proposals += 1
        return self.inner.propose(anchor, pos, *a, **k)


# a tiny Gemma 4 text model (tests/test_gemma_target.py, tests/test_target_families.py): sliding and global layers with
# their own head sizes and RoPE, keys = values in the global layers, the last three layers sharing earlier layers' keys
# and values, a soft cap
GEMMA4_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                   attention_k_eq_v=True, num_kv_shared_layers=3, sliding_window=8, final_logit_softcapping=30.0,
                   hidden_size_per_layer_input=0, max_position_embeddings=512, tie_word_embeddings=False,
                   initializer_range=0.2, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": 1e6}})


class NoisyOracle:
    """A draft runner proposing the target's own greedy continuation ``full`` (prompt + autoregressive tokens) with
    each row wrong with probability 0.15 (fixed by the position), so cycles accept every length 0..L and roll back the
    rest. A subclass sets another ``block_size`` / ``num_draft_rows``."""

    block_size, num_draft_rows, top_k = 8, 7, 1

    def __init__(self, full: list[int], vocab: int = 512) -> None:
        self.full, self.vocab = full, vocab

    def reset(self) -> None:
        pass

    def add_context(self, feats, start) -> None:  # noqa: ANN001
        pass

    def propose(self, anchor, pos, rows, temperature, uniforms):  # noqa: ANN001, ANN201
        from dflash2_trt.runtime.ngram import lookup_draft

        rng = np.random.default_rng(pos)
        return lookup_draft([t if rng.random() > 0.15 else (t + 1) % self.vocab
                             for t in self.full[pos + 1: pos + 1 + rows]])


def oracle_spec_vs_ar(target, n_prompts: int, n: int) -> tuple[int, list[int]]:  # noqa: ANN001
    """(prompts whose speculative greedy output with :class:`NoisyOracle` differs from the autoregressive one,
    accepted drafts per cycle) on the PyTorch ``target`` (a TargetModel; taps layers 0 and 2), random prompts of
    3-19 tokens, ``n`` new tokens each."""
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.torch.backend import TorchTargetRunner

    rng = np.random.default_rng(3)
    bad, accepted = 0, []
    for _ in range(n_prompts):
        p = rng.integers(2, 512, int(rng.integers(3, 20))).tolist()
        want = D.target_generate(TorchTargetRunner(target), p, req(n, eos_ids=set())).tokens
        r = D.speculative_generate(TorchTargetRunner(target, [0, 2]), NoisyOracle(p + want), p, req(n, eos_ids=set()))
        bad += r.tokens != want
        accepted += r.accepted
    return bad, accepted


def two_token_law(target, prompt: list[int], temperature: float) -> dict[tuple[int, int], float]:
    """The exact joint law of a sequence's first two tokens at ``temperature``, from B = 1 forwards of ``target``
    (cells of probability above 1e-4 x 1e-6; the rest is one remainder cell for :func:`two_token_p_value`)."""
    import numpy as np

    def law_after(ids: list[int]):  # noqa: ANN202 - the target's next-token law at the temperature
        target.reset()
        z = target.forward(ids)[0][-1].astype(np.float64) / temperature
        p = np.exp(z - z.max())
        return p / p.sum()

    p1 = law_after(prompt)
    return {(int(a), int(b)): p1[a] * q
            for a in np.flatnonzero(p1 > 1e-4) for b, q in enumerate(law_after(prompt + [int(a)])) if q > 1e-6}


def two_token_p_value(law: dict[tuple[int, int], float], first_two: list[tuple[int, int]]) -> float:
    """Chi-square p-value of the observed first two tokens of n sequences against ``law`` (cells expecting fewer
    than 5 pooled into one, the usual validity rule)."""
    import numpy as np
    from scipy.stats import chisquare

    n = len(first_two)
    cells = list(law)
    counts = np.zeros(len(cells) + 1)
    index = {c: j for j, c in enumerate(cells)}
    for pair in first_two:
        counts[index.get(pair, len(cells))] += 1
    exp = np.append(np.array([law[c] for c in cells]), max(0.0, 1.0 - sum(law.values()))) * n
    small = exp < 5
    pooled_obs, pooled_exp = counts[small].sum(), exp[small].sum()
    if pooled_exp <= 0:  # a truncated law has no remainder: nothing may fall there
        return 0.0 if pooled_obs > 0 else chisquare(counts[~small], exp[~small])[1]
    return chisquare(np.append(counts[~small], pooled_obs), np.append(exp[~small], pooled_exp))[1]


# Manifest edits whose fields no longer agree with the graphs, and what the one-line error must say (the Python and
# the C readers: test_runtime.py, test_capi.py)
FIELD_EDITS = [
    (lambda m: m["target"].update(num_layers=3), "target.num_layers is 3"),
    (lambda m: m["target"].update(num_key_value_heads=4), "target.num_key_value_heads is 4"),
    (lambda m: m["target"].update(head_dim=24), "target.head_dim is 24"),
    (lambda m: m["target"].update(layer_ids=[0, 1, 2]), r"target.hidden_size x len\(target.layer_ids\) is 192"),
    (lambda m: m["target"].update(max_positions=256), "max_seq_len is 512 but the target's max_positions is 256"),
    (lambda m: m.update(max_seq_len=4096), "max_seq_len is 4096 but the target's max_positions is 2048"),
    (lambda m: m["drafter"].update(num_hidden_layers=3, layer_types=["full_attention"] * 3),
     "drafter.num_hidden_layers is 3"),
    (lambda m: m["drafter"].update(num_key_value_heads=1), "drafter.num_key_value_heads is 1"),
    (lambda m: (m["target"].update(vocab_size=500), m["drafter"].update(vocab_size=500)), "target.vocab_size is 500"),
]


@pytest.fixture(autouse=True)
def ort_ops_built() -> None:
    """The dflash2 custom-op library is built (autouse where a test module imports it), else the test fails saying
    so: a missing library is missing work, not a skip."""
    from dflash2_trt.runtime.ort import decode_attention as DA

    ok, why = DA.available()
    if not ok:
        pytest.fail(f"{why} (scripts/build_ort_ops.sh)")


def speculative_equals_autoregressive(be, seed: int, prompts: int, n: int, what: str) -> None:  # noqa: ANN001
    """Greedy speculative decoding through ``be`` = its own autoregressive tokens on random prompts, drafts accepted."""
    from dflash2_trt.runtime import decoder as D

    target, drafter = be.target_runner(), be.draft_runner("greedy")
    rng = np.random.default_rng(seed)
    accepted = []
    for _ in range(prompts):
        p = rng.integers(4, target.vocab_size, int(rng.integers(3, n))).tolist()
        spec = D.speculative_generate(target, drafter, p, req(n, eos_ids=set()))
        assert spec.tokens == D.target_generate(target, p, req(n, eos_ids=set())).tokens
        accepted += spec.accepted
    assert_accepts(accepted, drafter.num_draft_rows, what)


def transformed_logprobs(rows, seen: list[list[int]], temperature: float = 1.0, **kw: Any):
    """The reference of runtime/sampling.py: rows [m, V] of target logits, ``seen[i]`` the tokens row i's penalties
    count (with repeats) -> log of the transformed law [m, V] float64, built from transformers' logits processors
    (repetition penalty, temperature, top-k, top-p, min-p) with the logit bias and OpenAI's presence / frequency
    penalties added by hand, in vLLM's order."""
    import torch
    from transformers.generation import logits_process as LP

    x = torch.tensor(np.asarray(rows, dtype=np.float64))
    for t, b in dict(kw.get("logit_bias", {})).items():
        x[:, int(t)] += b
    out = []
    for i in range(x.shape[0]):
        row = x[i: i + 1]
        ids = torch.tensor([seen[i]], dtype=torch.long)
        if kw.get("repetition_penalty", 1.0) != 1.0 and seen[i]:
            row = LP.RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"])(ids, row)
        for t in set(seen[i]):
            row[0, t] -= kw.get("frequency_penalty", 0.0) * seen[i].count(t) + kw.get("presence_penalty", 0.0)
        row = LP.TemperatureLogitsWarper(temperature)(ids, row)
        if kw.get("top_k", 0):
            row = LP.TopKLogitsWarper(kw["top_k"])(ids, row)
        if kw.get("top_p", 1.0) < 1.0:
            row = LP.TopPLogitsWarper(kw["top_p"])(ids, row)
        if kw.get("min_p", 0.0) > 0:
            row = LP.MinPLogitsWarper(kw["min_p"])(ids, row)
        out.append(torch.log_softmax(row, -1)[0].numpy())
    return np.stack(out)


def transformed_two_token_law(target, prompt: list[int], temperature: float, **kw: Any) -> dict:
    """:func:`two_token_law` under the sampling transforms ``kw`` (:func:`transformed_logprobs`; the penalties count
    the prompt, then the first token too)."""
    def law_after(ids: list[int]):  # noqa: ANN202
        target.reset()
        return np.exp(transformed_logprobs(target.forward(ids)[0][-1:], [list(ids)], temperature, **kw)[0])

    p1 = law_after(prompt)
    return {(int(a), int(b)): p1[a] * q
            for a in np.flatnonzero(p1 > 1e-4) for b, q in enumerate(law_after(prompt + [int(a)])) if q > 1e-6}


def prefix_cache_equals_uncached(be, ort_be, seed: int = 0) -> list[int]:  # noqa: ANN001
    """``be``'s runners decode through a prefix cache: a 40-token prompt (stored), then the next turn (its whole
    sequence + 9 tokens), a branch inside its answer and the prompt again + 1 token, each = ``ort_be``'s decode of
    the same prompt from an empty cache, tokens and accepted drafts cycle for cycle, with positions restored and
    drafts accepted -> the positions each restored."""
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.prefix_cache import PrefixCache

    cache, rng = PrefixCache(), np.random.default_rng(seed)
    vocab = be.manifest.target.vocab_size
    tgt, drf = be.target_runner(), be.draft_runner("greedy")
    want_tgt, want_drf = ort_be.target_runner(), ort_be.draft_runner("greedy")
    p1 = rng.integers(4, vocab, 40).tolist()
    first = D.speculative_generate(tgt, drf, p1, req(24, eos_ids=set()), cache=cache)
    restored, accepted = [], []
    for p in (p1 + first.tokens + rng.integers(4, vocab, 9).tolist(), p1 + first.tokens[:5] + [7, 8, 9], p1 + [5]):
        got = D.speculative_generate(tgt, drf, p, req(24, eos_ids=set()), cache=cache)
        want = D.speculative_generate(want_tgt, want_drf, p, req(24, eos_ids=set()))
        assert (got.tokens, got.accepted) == (want.tokens, want.accepted)
        assert tgt.cache_length == want_tgt.cache_length
        _same_state(_held(tgt, tgt.cache_length), _held(want_tgt, want_tgt.cache_length))
        restored.append(got.cached_tokens)
        accepted += got.accepted
    assert min(restored) > 0 and cache.stats.hits == 3 and sum(accepted) > 0, (restored, accepted)
    hit = cache.lookup(p1 + [5], drafter=True)  # a restore read straight back: what the entry holds at the hit
    assert hit is not None
    cache.restore(hit, tgt, drf)
    e, n = hit.entry, hit.length
    _same_state(_held(tgt, n), ([r[:, :n] for r in e.target_rows], e.states.get(n)))
    return restored


def _held(target, n: int):  # noqa: ANN001, ANN202
    """A target runner's first n K/V rows and its state, through its prefix-cache views."""
    return target.prefix_rows(n), target.prefix_state()


def _same_state(got, want) -> None:  # noqa: ANN001
    """(K/V rows, SlotState or None) pairs equal: the rows, linear states, and the rings' positions, floor and the
    slots holding a position."""
    for a, b in zip(got[0], want[0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    s, w = got[1], want[1]
    assert (s is None) == (w is None)
    if w is None:
        return
    if w.linear is not None:
        for a, b in zip([*s.linear[0], *s.linear[1]], [*w.linear[0], *w.linear[1]], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    if w.ring is not None:
        np.testing.assert_array_equal(s.ring[1], w.ring[1])
        assert s.ring[2] == w.ring[2]
        held = w.ring[1] >= 0
        for a, b in zip(s.ring[0], w.ring[0], strict=True):
            np.testing.assert_allclose(a[:, held], b[:, held], rtol=1e-4, atol=1e-5)



# ---- targets with linear-layer state (hybrid Gated DeltaNet, Nemotron-H Mamba-2): the checks both families share -------


def assert_rolled_back(accepted: list[int], bs: int, what: object = "") -> None:
    """Drafts accepted (assert_accepts) and partial acceptances at block size ``bs``: cycles that rejected a draft,
    so the linear layers' states were rolled back (to a length inside the block where bs > 2)."""
    assert_accepts(accepted, bs - 1, what)
    assert any((0 < a or bs == 2) and a < bs - 1 for a in accepted), f"no rollback {what}"


def hf_logits(t, ids: list[int]):  # noqa: ANN001, ANN201
    """transformers' own forward of target adapter ``t``'s model over the whole sequence, no cache: logits [n, V]
    (torch fp32)."""
    import torch

    with torch.no_grad():
        return t.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def adapter_states(t) -> list:  # noqa: ANN001
    """Every tensor of the PyTorch adapter's cache that the next call reads: the KV of attention layers, the last
    conv_kernel inputs of each linear layer's convolution and its recurrent (SSM) state; stateless layers none."""
    out = []
    for layer in t.cache.layers:
        if hasattr(layer, "conv_states"):
            k = layer.conv_kernel_size[0]
            out += [layer.conv_states[0][..., -k:], layer.recurrent_states[0]]
        elif getattr(layer, "keys", None) is not None:
            out += [layer.keys, layer.values]
    return out


def check_adapter_equals_transformers(t, lengths: tuple[int, ...]) -> None:  # noqa: ANN001
    """Prompts of each length then 8 one-row calls: logits equal transformers' whole-sequence forward (1e-4 relative);
    every row of a k-row call (k = 2, 4, 8) equals k one-row calls (argmax identical; logits within 3e-5 of the
    largest: PyTorch's k-row and one-row matrix products round differently)."""
    import torch

    rng = np.random.default_rng(0)
    for n in lengths:
        ids = rng.integers(2, t.vocab_size, n + 8).tolist()
        t.reset([0, 2])
        logits = [t.forward(torch.tensor(ids[:n]))[0]]
        step = [t.forward(torch.tensor(ids[n + i: n + i + 1]))[0] for i in range(8)]
        want = hf_logits(t, ids)
        torch.testing.assert_close(torch.cat(logits + step), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        for k in (2, 4, 8):
            t.reset([0, 2])
            t.forward(torch.tensor(ids[:n]))
            rows = t.forward(torch.tensor(ids[n: n + k]))[0]
            one = torch.cat(step[:k])
            assert torch.equal(rows.argmax(-1), one.argmax(-1))
            torch.testing.assert_close(rows, one, rtol=1e-4, atol=3e-5 * float(one.abs().max()))


def check_adapter_rollback(t, cases: list[tuple[int, int]]) -> None:  # noqa: ANN001
    """For each (prompt rows n, call rows k): after the k-row call rolled back to j + 1 rows (every j < k), the
    tensors the next call reads (two per layer with state) (adapter_states: KV, convolution inputs, recurrent state) equal a fresh
    run of the prompt and the same j + 1 rows as one-row calls (1e-5 relative), and so do the next call's logits
    (1e-4: rounding differences grow through the random layers; a wrong state is off by O(1))."""
    import torch

    rng = np.random.default_rng(1)
    n_states = 2 * sum(kind != "mlp" for kind in t.family.layer_kinds(t.model.config))
    settle = t.family.before_forward  # the next call's settling of the cache, done before reading it
    for n, k in cases:
        ids = rng.integers(2, t.vocab_size, n + k + 1).tolist()
        for j in range(k):
            t.reset([0, 2])
            t.forward(torch.tensor(ids[:n]))
            t.forward(torch.tensor(ids[n: n + k]))
            t.crop(n + j + 1)
            assert t.cache_length == n + j + 1
            settle(t.cache, 1)
            got = [s.clone() for s in adapter_states(t)]
            assert len(got) == n_states
            nxt = t.forward(torch.tensor([ids[n + k]]))[0]
            t.reset([0, 2])
            t.forward(torch.tensor(ids[:n]))
            for i in range(j + 1):
                t.forward(torch.tensor([ids[n + i]]))
            settle(t.cache, 1)
            for a, b in zip(got, adapter_states(t)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
            fresh = t.forward(torch.tensor([ids[n + k]]))[0]
            torch.testing.assert_close(nxt, fresh, rtol=1e-4, atol=1e-4 * float(fresh.abs().max()))


def check_rollback_past_the_recorded_rows_is_refused(t) -> None:  # noqa: ANN001
    """A prompt longer than the family's MAX_ROLLBACK_ROWS records no rows: a crop into it is refused."""
    import torch

    from dflash2_trt import DFlash2Error

    t.reset([0, 2])
    t.forward(torch.arange(2, 2 + t.family.MAX_ROLLBACK_ROWS + 6))
    with pytest.raises(DFlash2Error, match="cannot roll back"):
        t.crop(10)


def adapter_lossless_runs(t, d, prompts: list[list[int]], refs: list[list[int]], new: int,  # noqa: ANN001, ANN201
                          block_sizes: tuple[int, ...] = (2, 4, 8)):
    """PyTorch speculative greedy decoding of every prompt (``new`` tokens) at each block size (drafter ``d`` at
    it) -> (prompts whose output differs from ``refs``, accepted drafts per cycle by block size)."""
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner

    bad, accepted = 0, {}
    for bs in block_sizes:
        db = with_block_size(d, bs)
        acc = accepted.setdefault(bs, [])
        for p, want in zip(prompts, refs):
            r = D.speculative_generate(TorchTargetRunner(t, d.config.target_layer_ids), TorchDraftRunner(db), p,
                                       req(new, eos_ids=set()))
            bad += r.tokens != want
            acc += r.accepted
    return bad, accepted


def planted_no_conv_rollback(cache, length: int) -> None:  # noqa: ANN001
    """Planted bug of a family's ``rollback``: KV and the recurrent states are rolled back, each convolution state is
    the one after all k rows."""
    remove = int(cache.get_seq_length()) - length
    if remove <= 0:
        return
    last = {i: layer.conv_states[0][..., -layer.conv_kernel_size[0]:].clone()
            for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states")}
    cache.crop(-remove)
    for i, conv in last.items():
        cache.layers[i].conv_states[0] = conv


def planted_no_ssm_rollback(cache, length: int) -> None:  # noqa: ANN001
    """Planted bug of the Nemotron-H family's ``rollback``: the attention KV and the convolutions are rolled back, each
    Mamba-2 layer's SSM state is the one after all k rows."""
    remove = int(cache.get_seq_length()) - length
    if remove <= 0:
        return
    last = {i: layer.recurrent_states[0].clone() for i, layer in enumerate(cache.layers)
            if hasattr(layer, "conv_states")}
    cache.crop(-remove)
    for i, state in last.items():
        cache.layers[i].recurrent_states[0] = state


def ort_runner_state(r) -> list[np.ndarray]:  # noqa: ANN001
    """What an ONNX Runtime target runner's next call reads: the valid KV slots and every linear layer's conv and
    recurrent state."""
    n = r.kv.length
    return [a[:, :, :n] for a in r.kv.arrays] + r.linear.conv + r.linear.recurrent


def check_graph_equals_transformers(t, be, lengths: tuple[int, ...]) -> None:  # noqa: ANN001
    """The exported target graph on ONNX Runtime: prompts of each length (fed in calls of at most the graph's rows)
    then 3 single steps: logits within 1e-4 (relative) of transformers' whole-sequence forward."""
    rng = np.random.default_rng(0)
    r = be.target_runner()
    for n in lengths:
        ids = rng.integers(2, t.vocab_size, n + 3).tolist()
        r.reset()
        got = np.concatenate([r.forward(ids[:n])[0]] + [r.forward(ids[n + i: n + i + 1])[0] for i in range(3)])
        want = hf_logits(t, ids).numpy()
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-4, (n, err)


def check_ort_verify_and_rollback(t, be, ks: tuple[int, ...]) -> None:  # noqa: ANN001
    """After a prompt, a k-row call equals k one-row calls (argmax identical, logits within 1e-5 of the largest); a
    rollback to every kept length 0..k leaves the arrays of ort_runner_state (two per layer with state) (KV, conv, recurrent) equal
    to a fresh run of the prompt and the kept rows (to fp32 rounding: k-row and one-row sums differ), and the next
    call's logits equal too."""
    rng = np.random.default_rng(1)
    n_states = 2 * sum(kind != "mlp" for kind in be.manifest.target.layer_kinds)
    r, fresh = be.target_runner(), be.target_runner()
    for k in ks:
        prompt = rng.integers(2, t.vocab_size, 9).tolist()
        rows = rng.integers(2, t.vocab_size, k).tolist()
        nxt = rng.integers(2, t.vocab_size, 1).tolist()
        fresh.reset()
        fresh.forward(prompt)
        steps = np.concatenate([fresh.forward([x])[0] for x in rows])
        for keep in range(k + 1):
            r.reset()
            r.forward(prompt)
            block = r.forward(rows)[0]
            assert (block.argmax(-1) == steps.argmax(-1)).all()
            assert np.abs(block - steps).max() <= 1e-5 * np.abs(steps).max()
            r.crop(len(prompt) + keep)
            fresh.reset()
            fresh.forward(prompt + rows[:keep])
            got, want = ort_runner_state(r), ort_runner_state(fresh)
            assert len(got) == n_states
            for a, b in zip(got, want):
                assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(b).max()), (k, keep)
            a, b = r.forward(nxt)[0], fresh.forward(nxt)[0]
            assert a.argmax() == b.argmax() and np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), (k, keep)


def check_every_node_imports_into_tensorrt(be) -> None:  # noqa: ANN001
    """Every node of the export's target graph is in TensorRT's parser table."""
    import onnx

    from dflash2_trt.export.onnx_utils import trt_parser_refusals

    model = onnx.load(str(be.dir / "target.onnx"), load_external_data=False)
    assert trt_parser_refusals(model) == []
