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
