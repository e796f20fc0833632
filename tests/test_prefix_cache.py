"""The prefix cache (``runtime/prefix_cache.py``): matching by token ids, what a hit may restore (all but the prompt's
last token; a stateful target only at a snapshot at or below the match; the drafter's context only as far as the
entry rebuilds it), the byte budget and least-recently-used eviction (an evicted entry is never matched: a planted
bug that keeps it fails), and — through the runtime's runners on tiny dense, hybrid, sliding and MoE exports — a
decode after a hit equal to the same decode from an empty cache, with the planted restore bugs caught."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import prefix_cache as P
from helpers import long_memory_heads


class _Target:
    """A runner stand-in holding ``per_token`` bytes of K/V per position (one array) and, when ``stateful``, a
    snapshot-able state: what the cache reads of a runner."""

    def __init__(self, n: int, per_token: int = 64, stateful: bool = False) -> None:
        self.cache_length, self.per_token, self.stateful = n, per_token, stateful
        self.restored: tuple | None = None

    def prefix_rows(self, n: int, slot: int = 0) -> list[np.ndarray]:
        return [np.zeros((1, n, self.per_token // 4), np.float32)]

    def prefix_state(self, slot: int = 0) -> P.SlotState | None:
        return P.SlotState(linear=([np.full(3, float(self.cache_length), np.float32)], [])) if self.stateful else None

    def restore_prefix(self, rows, n, state, slot=0) -> None:  # noqa: ANN001
        self.restored = (rows[0].shape[1], n, state)


def _store(cache: P.PrefixCache, ids: list[int], stateful: bool = False, states=None) -> None:  # noqa: ANN001
    cache.store(ids, _Target(len(ids), stateful=stateful), None, None, states or {})


def test_a_hit_is_the_longest_common_prefix_and_leaves_the_last_token():
    cache = P.PrefixCache(1 << 20)
    _store(cache, [1, 2, 3, 4, 5, 6])
    assert cache.lookup([9, 9, 9], drafter=False) is None
    assert cache.lookup([1, 2, 3, 7, 8], drafter=False).length == 3  # diverges at the 4th token
    assert cache.lookup([1, 2, 3, 4, 5, 6], drafter=False).length == 5  # the whole entry: the last token recomputed
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8], drafter=False).length == 6
    # the drafter's context: none kept, so a request that drafts gets nothing
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7], drafter=True) is None
    s = cache.stats
    assert (s.lookups, s.hits, s.hit_tokens) == (5, 3, 14)


def test_a_stateful_target_restores_the_longest_snapshot_at_or_below_the_match():
    cache = P.PrefixCache(1 << 20)
    ids = list(range(1, 41))
    state20 = P.SlotState(linear=([np.full(3, 20.0, np.float32)], []))
    _store(cache, ids, stateful=True, states={20: state20})  # snapshots at 20 (the prompt) and 40 (the end)
    assert cache.lookup(ids[:30] + [99], drafter=False).length == 20  # matched 30: the snapshot at 20
    assert cache.lookup(ids[:19] + [99], drafter=False) is None  # below every snapshot
    hit = cache.lookup(ids + [7], drafter=False)
    assert hit.length == 40
    t = _Target(0, stateful=True)
    cache.restore(hit, t, None)
    assert t.restored[:2] == (40, 40) and t.restored[2].linear[0][0][0] == 40.0  # the end's snapshot, not 20's
    hit = cache.lookup(ids[:25] + [99], drafter=False)
    cache.restore(hit, t, None)
    assert t.restored[:2] == (20, 20) and t.restored[2] is state20


def test_a_sequence_that_extends_an_entry_replaces_it_and_keeps_its_snapshots():
    cache = P.PrefixCache(1 << 20)
    _store(cache, [1, 2, 3, 4], stateful=True)  # a turn: snapshot at its end (4)
    _store(cache, [1, 2, 3, 4, 5, 6, 7, 8], stateful=True)  # the next turn extends it
    assert cache.stats.entries == 1
    assert cache.lookup([1, 2, 3, 4, 5, 9], drafter=False).length == 4  # the first turn's snapshot lives on
    _store(cache, [1, 2, 3, 4, 5, 6, 7, 8], stateful=True)  # the same again: nothing new kept
    assert cache.stats.entries == 1 and cache.stats.stored == 2


def _planted_evict_keeps_entries(self) -> None:  # noqa: ANN001
    """The planted bug: eviction counts the bytes as freed but leaves the entry matchable."""
    total = sum(e.nbytes for e in self._entries)
    evicted = 0
    while total > self.budget_bytes and evicted < len(self._entries):
        total -= self._entries[evicted].nbytes
        evicted += 1
        self.stats.evictions += 1
    self.stats.nbytes, self.stats.entries = total, len(self._entries)


def _evictions(cache: P.PrefixCache) -> None:
    """Within a budget of ~2.5 entries, entries stored in turn: the cache never holds more than its budget, the
    least recently used goes first, and an evicted entry is never matched again."""
    one = P.Entry(ids=np.arange(100, dtype=np.int64), target_rows=_Target(100).prefix_rows(100), states={},
                  drafter_rows=[], feats=None, stateful=False).nbytes
    cache.budget_bytes = int(2.5 * one)
    seqs = [[k] * 100 for k in range(1, 6)]
    _store(cache, seqs[0])
    _store(cache, seqs[1])
    assert cache.lookup(seqs[0] + [0], drafter=False).length == 100  # entry 0 is now the most recently used
    _store(cache, seqs[2])  # over budget: entry 1 (least recently used) goes
    assert cache.stats.nbytes <= cache.budget_bytes and cache.stats.evictions == 1
    assert cache.lookup(seqs[1] + [0], drafter=False) is None
    for s in seqs[3:]:
        _store(cache, s)
        assert cache.stats.nbytes <= cache.budget_bytes
    assert cache.lookup(seqs[0] + [0], drafter=False) is None and cache.lookup(seqs[4] + [0], drafter=False)


def test_the_budget_holds_and_evicted_entries_are_never_matched():
    _evictions(P.PrefixCache(1))


def test_the_planted_eviction_bug_is_caught(monkeypatch):
    """Negative control: an eviction that leaves the entry in place fails the test above."""
    monkeypatch.setattr(P.PrefixCache, "_evict", _planted_evict_keeps_entries)
    with pytest.raises(AssertionError):
        _evictions(P.PrefixCache(1))


def test_a_bad_budget_is_refused_in_one_line():
    for bad in (-1, 1.5, "1G", True):
        with pytest.raises(DFlash2Error, match="prefix cache budget"):
            P.PrefixCache(bad)
    cache = P.PrefixCache(0)  # 0: keeps nothing
    _store(cache, [1, 2, 3])
    assert cache.lookup([1, 2, 3, 4], drafter=False) is None and cache.stats.entries == 0


# ----------------------------------------------------------------------------------------------------
# Through the runtime: tiny accepting pairs of every target kind on ONNX Runtime
# ----------------------------------------------------------------------------------------------------

ARCHS = ("llama", "qwen3_5", "gpt_oss", "muse_glimmer", "qwen3_moe")  # dense, hybrid, sliding x2, MoE


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(arch, accepting) -> the export of its tiny pair at block size 8 (windows of 8 in rings of 24 for the sliding
    ones: a 40-token prompt wraps them), made on first use: the accepting pair (the copying target and drafter), or
    the random target, whose every layer moves its tokens (qwen3_5's with long-memory linear heads)."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.tiny import make_tiny

    made = {}

    def get(arch: str, accepting: bool = True):  # noqa: ANN202
        if (arch, accepting) not in made:
            d = tmp_path_factory.mktemp(f"pc_{arch}")
            make_tiny(d / "pair", seed=0, block_size=8, accepting=accepting, arch=arch)
            if arch == "qwen3_5" and not accepting:
                long_memory_heads(d / "pair" / "target")
            export_model(d / "pair" / "target", d / "pair" / "drafter", d / "export", progress=False,
                         max_seq_len=512)
            made[arch, accepting] = d / "export"
        return made[arch, accepting]

    return get


@pytest.fixture(params=ARCHS)
def pair_export(request, exports):
    """(arch, export) of each target kind's accepting pair."""
    return request.param, exports(request.param)


def _gens(export, **kw):  # noqa: ANN001, ANN202, ANN003
    import dflash2_trt

    return (dflash2_trt.load(export, backend="ort", threads=1, **kw),
            dflash2_trt.load(export, backend="ort", threads=1, prefix_cache_bytes=0))


def _conversation(rng: np.random.Generator, first) -> list[tuple[str, list[int], int]]:  # noqa: ANN001
    """(case, prompt, positions a hit restores: dense / stateful) after ``first`` (the result of a 40-token prompt
    whose sequence the cache holds): the next turn (the whole sequence: its end snapshot), a branch inside its answer
    (dense: there; stateful: the prompt's snapshot at 40), the prompt again with one more token (40: a snapshot)."""
    p1, out = first.prompt_tokens, first.tokens
    end = len(p1) + len(out) - 1
    return [("next turn", p1 + out + rng.integers(2, 200, 9).tolist(), (end, end)),
            ("inside the answer", p1 + out[:5] + [7, 8, 9], (len(p1) + 5, len(p1))),
            ("at the prompt's snapshot", p1 + [5], (len(p1), len(p1)))]


def _decode_both(on, off, prompt, T: float = 0.0):  # noqa: ANN001, ANN202
    return tuple(g.generate(prompt, max_new_tokens=24, eos_ids=set(), temperature=T, seed=3, guard=False)
                 for g in (on, off))


def _same_decode(on, off, prompt, want_cached, T: float = 0.0) -> None:  # noqa: ANN001
    """A decode after a hit = the decode from an empty cache: tokens (greedy, or seeded at T > 0), and the drafter
    as good right after the hit (its first three cycles' accepted drafts within 2 of the uncached run's: a
    near-tie may move one, a drafter without its context accepts nothing). ``want_cached``: the positions the
    greedy run restores (the T > 0 run of the same prompt after it may restore more: the greedy run's sequence is
    cached by then)."""
    a, b = _decode_both(on, off, prompt, T)
    assert (a.stats.cached_tokens == want_cached if T == 0 else a.stats.cached_tokens >= want_cached)
    assert b.stats.cached_tokens == 0
    assert a.tokens == b.tokens
    assert sum(b.stats.accepted) > 0
    assert sum(a.stats.accepted[:3]) >= sum(b.stats.accepted[:3]) - 2, \
        f"first cycles' accepted drafts after the hit {a.stats.accepted}, without the cache {b.stats.accepted}"


def test_a_decode_after_a_hit_equals_one_from_an_empty_cache(pair_export):
    """Every target kind, greedy and at T = 0.8 (seeded): hits ending inside a block's answer, at a snapshot and
    between snapshots; the path taken asserted (positions restored, drafts accepted)."""
    arch, export = pair_export
    on, off = _gens(export)
    rng = np.random.default_rng(0)
    with on, off:
        p1 = rng.integers(2, 200, 40).tolist()
        first = on.generate(p1, max_new_tokens=24, eos_ids=set(), guard=False)
        assert first.stats.cached_tokens == 0
        stateful = arch != "llama" and arch != "qwen3_moe"
        for case, prompt, cached in _conversation(rng, first):
            for T in (0.0, 0.8):
                _same_decode(on, off, prompt, cached[stateful], T)
        assert on.prefix_cache.stats.hits == 6


def test_batched_requests_diverging_from_a_cached_prefix(pair_export):
    """The batch loop: four requests sharing a cached prefix and diverging, decoded together (where the backend
    batches the family), each = its own uncached single run; the cache's budget held after evictions (a budget of
    two entries)."""
    arch, export = pair_export
    rng = np.random.default_rng(1)
    p1 = rng.integers(2, 200, 40).tolist()
    on, off = _gens(export)
    with on, off:
        first = on.generate(p1, max_new_tokens=16, eos_ids=set(), guard=False)
        base = p1 + first.tokens
        prompts = [base + rng.integers(2, 200, k).tolist() for k in (1, 3, 6, 9)]
        on.set_batching(max_batch=4, adaptive=False)
        got = [h.result() for h in [on.submit(p, max_new_tokens=16, eos_ids=set()) for p in prompts]]
        want = [off.generate(p, max_new_tokens=16, eos_ids=set(), guard=False) for p in prompts]
        assert [g.tokens for g in got] == [w.tokens for w in want]
        # admitted together, each restores the first sequence (a backend that does not batch a family, MoE's,
        # serves them one after another: then each also finds the one before it, a token further)
        assert all(g.stats.cached_tokens >= len(base) - 1 for g in got)
        assert sum(sum(g.stats.accepted) for g in got) > 0
        budget = 2 * max(e.nbytes for e in on.prefix_cache._entries)
        on.prefix_cache.budget_bytes = budget
        for p in prompts:
            on.submit(p + [11], max_new_tokens=4, eos_ids=set()).result()
            assert on.prefix_cache.stats.nbytes <= budget
        assert on.prefix_cache.stats.evictions > 0


# ----------------------------------------------------------------------------------------------------
# Planted restore bugs the tests above must catch
# ----------------------------------------------------------------------------------------------------

def _next_turn(export, case: str, check=_same_decode, stateful: bool = False) -> None:  # noqa: ANN001
    """The first turn (a 40-token prompt), then ``check`` on the decode of ``case``'s prompt (``stateful``: the
    target's hits stop at snapshots)."""
    on, off = _gens(export)
    rng = np.random.default_rng(0)
    with on, off:
        first = on.generate(rng.integers(2, 200, 40).tolist(), max_new_tokens=24, eos_ids=set(), guard=False)
        _, prompt, cached = next(c for c in _conversation(rng, first) if c[0] == case)
        check(on, off, prompt, cached[stateful])


def _same_tokens(on, off, prompt, want_cached) -> None:  # noqa: ANN001
    """A random target's greedy decode after a hit = the one from an empty cache (every layer moves its tokens)."""
    a, b = _decode_both(on, off, prompt)
    assert a.stats.cached_tokens == want_cached and a.tokens == b.tokens


def test_a_hit_without_the_drafters_context_is_caught(exports, monkeypatch):
    """The planted bug of engines that restore the target alone: the drafter's context left as garbage (zeros) —
    output still lossless, but the first cycles after the hit draft from nothing."""
    restore = P.PrefixCache.restore

    def planted(self, hit, target, drafter, slot=0):  # noqa: ANN001, ANN202
        restore(self, hit, target, drafter, slot)
        if drafter is not None:
            drafter.restore_context([np.zeros_like(r) for r in drafter.context_rows(hit.length)])

    monkeypatch.setattr(P.PrefixCache, "restore", planted)
    for case in ("next turn", "inside the answer", "at the prompt's snapshot"):
        with pytest.raises(AssertionError, match="accepted"):
            _next_turn(exports("llama"), case)


def test_a_hybrid_state_from_the_snapshot_after_the_hit_is_caught(exports, monkeypatch):
    """On the random qwen3_5 target: a hit between snapshots restores exactly; the planted bug — the K/V cropped
    at the hit, the linear layers' state taken from the next snapshot after it (the request's end) — changes the
    tokens."""
    _next_turn(exports("qwen3_5", False), "inside the answer", _same_tokens, True)
    restore = P.PrefixCache.restore

    def planted(self, hit, target, drafter, slot=0):  # noqa: ANN001, ANN202
        later = [k for k in hit.entry.states if k > hit.length]
        if later:
            states = dict(hit.entry.states)
            states[hit.length] = states[min(later)]
            hit = P.Hit(P.Entry(hit.entry.ids, hit.entry.target_rows, states, hit.entry.drafter_rows,
                                hit.entry.feats, hit.entry.stateful), hit.length)
        restore(self, hit, target, drafter, slot)

    monkeypatch.setattr(P.PrefixCache, "restore", planted)
    with pytest.raises(AssertionError, match="tokens"):
        _next_turn(exports("qwen3_5", False), "inside the answer", _same_tokens, True)


@pytest.mark.parametrize("arch", ["gpt_oss", "muse_glimmer"])
def test_a_ring_restored_unrotated_is_caught(exports, monkeypatch, arch):
    """On the random sliding targets: a hit restores the rings exactly; the planted bug — a ring put back with its
    oldest position in slot 0 (unrotated) while its window positions still say where each position was — changes
    the tokens."""
    from dflash2_trt.runtime.kv import WindowRing

    _next_turn(exports(arch, False), "next turn", _same_tokens, True)
    restore = WindowRing.restore

    def planted(self, slot, snap):  # noqa: ANN001, ANN202
        arrays, positions, floor = snap
        oldest = int(np.argmin(np.where(positions >= 0, positions, np.iinfo(np.int64).max)))
        restore(self, slot, ([np.roll(a, -oldest, axis=1) for a in arrays], positions, floor))

    monkeypatch.setattr(WindowRing, "restore", planted)
    with pytest.raises(AssertionError, match="tokens"):
        _next_turn(exports(arch, False), "next turn", _same_tokens, True)
