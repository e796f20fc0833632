"""The prefix cache: what a finished request leaves behind so that the next one starting with the same tokens
computes only the rest — an agent's system prompt, tool definitions and history resent on every turn.

An :class:`Entry` holds one sequence's state, matched **by token ids**:

* the target's attention K/V rows of its ``n`` positions (any shorter prefix is a crop of them);
* for targets whose other layers cannot be cropped — linear (Gated DeltaNet) convolution and recurrent states,
  sliding-window rings — :class:`SlotState` snapshots at chosen lengths: the end of the prompt's prefill and the
  end of the request (the next turn of a conversation resends both); a hit restores the longest snapshot at or
  below the matched length, never one past it;
* the drafter's context: its K/V rows for the positions it had taken in, plus the target's context features of
  the positions it had not yet (a plain step's, a prompt lookup's) — so the first cycle after a hit drafts from
  exactly the context it would have had without the cache.

:meth:`PrefixCache.lookup` finds the entry sharing the longest usable prefix with a prompt, leaving at least the
prompt's last token to compute (its logits draw the first token); :meth:`PrefixCache.restore` puts that prefix into
a target runner (B = 1, or a slot of a batched one) and a B = 1 draft runner;
:meth:`PrefixCache.store` keeps a finished sequence. Entries are immutable once stored; an entry whose ids extend
another's replaces it (its snapshots kept); the least recently used entries are evicted to stay within the byte
budget. Thread safe (one lock; copies are made outside it).

The runners' side (duck-typed; a backend whose runners lack it runs without the cache): a target runner's
``prefix_rows(n, slot)``, ``prefix_state(slot)`` (None: attention only) and ``restore_prefix(rows, n, state, slot)``;
a draft runner's ``context_length()``, ``context_rows(n)`` and ``restore_context(rows)`` (a batched drafter's
slot: its B = 1 view, ``slot(b)``).

Imports only numpy and the project error type.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash2_trt.errors import DFlash2Error

DEFAULT_BUDGET_BYTES = 1 << 30  # 1 GiB of host memory (docs/design.md, the prefix cache)


@dataclass(frozen=True)
class SlotState:
    """A target's non-croppable state of one sequence at one length: each linear layer's convolution and recurrent
    state (``LinearStates.snapshot``), each sliding layer's ring with its window positions and floor
    (``WindowRing.snapshot``); None where the target has no such layers."""

    linear: tuple[list[np.ndarray], list[np.ndarray]] | None = None
    ring: tuple[list[np.ndarray], np.ndarray, int] | None = None

    @property
    def nbytes(self) -> int:
        arrays = [*(self.linear[0] + self.linear[1] if self.linear else []),
                  *(self.ring[0] + [self.ring[1]] if self.ring else [])]
        return sum(a.nbytes for a in arrays)


@dataclass(frozen=True, eq=False)  # compared by identity (the list removes this entry, not an equal one)
class Entry:
    """One cached sequence (see the module docstring)."""

    ids: np.ndarray  # [n] int64: the positions the target rows hold
    target_rows: list[np.ndarray]  # [heads, n, d] per attention K/V array
    states: dict[int, SlotState]  # length -> snapshot there (stateful targets; empty for attention-only ones)
    drafter_rows: list[np.ndarray]  # [heads, m, d] per drafter K/V array: the drafter's context of positions < m
    feats: np.ndarray | None  # [k, F] context features of positions m..m+k-1 (not yet in the drafter's context)
    stateful: bool

    @property
    def drafter_length(self) -> int:
        """Positions of drafter context a restore can rebuild (m + k)."""
        m = self.drafter_rows[0].shape[1] if self.drafter_rows else 0
        return m + (0 if self.feats is None else self.feats.shape[0])

    @property
    def nbytes(self) -> int:
        return (self.ids.nbytes + sum(a.nbytes for a in self.target_rows + self.drafter_rows)
                + sum(s.nbytes for s in self.states.values()) + (0 if self.feats is None else self.feats.nbytes))

    def usable(self, ids: Sequence[int], drafter: bool) -> int:
        """How many leading positions of ``ids`` this entry can restore: their common prefix, at most all but
        ``ids``' last token; for a stateful target the longest snapshot within that; with ``drafter``, within the
        drafter context the entry can rebuild."""
        n = min(len(self.ids), len(ids) - 1)
        if n <= 0:
            return 0
        diff = np.flatnonzero(self.ids[:n] != np.asarray(ids[:n], dtype=np.int64))
        common = int(diff[0]) if diff.size else n
        if drafter:
            common = min(common, self.drafter_length)
        if self.stateful:
            return max((s for s in self.states if s <= common), default=0)
        return common


@dataclass(frozen=True)
class Hit:
    entry: Entry
    length: int  # positions restored


@dataclass
class CacheStats:
    """Counters since the cache was made (the server's Prometheus series read them)."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt positions restored instead of computed
    computed_tokens: int = 0  # prompt positions computed by the target (after a hit: the rest)
    stored: int = 0
    evictions: int = 0
    nbytes: int = 0  # what the entries hold now
    entries: int = 0


class PrefixCache:
    """Entries of finished sequences within ``budget_bytes``, least recently used evicted first (0: keep nothing)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = check_budget(budget_bytes)
        self.stats = CacheStats()
        self._entries: list[Entry] = []  # least recently used first
        self._lock = threading.Lock()

    # -- lookup and restore -----------------------------------------------------------------------------------------
    def lookup(self, ids: Sequence[int], drafter: bool) -> Hit | None:
        """The entry restoring the most leading positions of ``ids`` (``drafter``: the request drafts with the
        DFlash 2 drafter, so its context must be rebuilt too), now the most recently used; None: no position."""
        with self._lock:
            self.stats.lookups += 1
            best, length = None, 0
            for e in self._entries:
                u = e.usable(ids, drafter)
                if u > 0 and u >= length:  # ties: the most recently used (the list's later entries)
                    best, length = e, u
            if best is None:
                return None
            self._entries.remove(best)
            self._entries.append(best)
            self.stats.hits += 1
            self.stats.hit_tokens += length
            return Hit(best, length)

    def restore(self, hit: Hit, target: Any, drafter: Any | None, slot: int = 0) -> None:
        """The target runner's ``slot`` (and the drafter, a B = 1 draft runner, when given) hold ``hit``'s positions
        0..length-1."""
        e, n = hit.entry, hit.length
        target.restore_prefix([r[:, :n] for r in e.target_rows], n, e.states[n] if e.stateful else None, slot)
        if drafter is None:
            return
        m = min(n, e.drafter_rows[0].shape[1] if e.drafter_rows else 0)
        drafter.restore_context([r[:, :m] for r in e.drafter_rows])
        if n > m:
            assert e.feats is not None
            drafter.add_context(e.feats[: n - m], m)

    def prefill_from(self, prompt: Sequence[int], target: Any, drafter: Any | None, slot: int = 0) -> int:
        """A request's prefill begins here: the longest usable prefix of ``prompt`` restored into the target's
        ``slot`` (and into ``drafter``, the request's B = 1 draft runner, None when it does not draft) -> the
        positions restored (0: none); the rest is counted as computed."""
        hit = self.lookup(prompt, drafter is not None)
        if hit is not None:
            self.restore(hit, target, drafter, slot)
        n = 0 if hit is None else hit.length
        with self._lock:
            self.stats.computed_tokens += len(prompt) - n
        return n

    # -- store ------------------------------------------------------------------------------------------------------
    @staticmethod
    def snapshot(target: Any, slot: int = 0) -> dict[int, SlotState]:
        """The target's non-croppable state at its current length, keyed by that length (empty for an
        attention-only target): taken after a prefill, passed to :meth:`store` with the request's end."""
        state = target.prefix_state(slot)
        return {} if state is None else {int(_length(target, slot)): state}

    def store(self, ids: Sequence[int], target: Any, drafter: Any | None, pending_feats: np.ndarray | None,
              states: dict[int, SlotState], slot: int = 0) -> None:
        """Keep a finished sequence: ``ids`` the tokens of the target's first cached positions (its cache length),
        ``drafter`` its draft runner (None: none ran; then no drafter context is kept), ``pending_feats`` the
        features of positions past the drafter's context, ``states`` snapshots taken earlier (:meth:`snapshot`) —
        the target's state now is added."""
        if self.budget_bytes == 0 or not len(ids):
            return
        n = len(ids)
        end = target.prefix_state(slot)
        stateful = end is not None
        snaps = {k: v for k, v in states.items() if k <= n}
        if stateful and _length(target, slot) == n:  # (a cache past an accepted EOS holds more than ids)
            snaps[n] = end
        m = drafter.context_length() if drafter is not None else 0
        feats = None if pending_feats is None or not len(pending_feats) else np.array(pending_feats[: n - m])
        e = Entry(ids=np.array(ids, dtype=np.int64), target_rows=target.prefix_rows(n, slot), states=snaps,
                  drafter_rows=drafter.context_rows(m) if drafter is not None else [], feats=feats,
                  stateful=stateful)
        if e.nbytes > self.budget_bytes:
            return
        with self._lock:
            for old in list(self._entries):
                k = len(old.ids)
                if k >= n and np.array_equal(old.ids[:n], e.ids) and old.drafter_length >= e.drafter_length \
                        and (not stateful or n in old.states):
                    self._entries.remove(old)  # it already holds this sequence: only its recency changes
                    self._entries.append(old)
                    return
                if k <= n and np.array_equal(old.ids, e.ids[:k]) and old.drafter_length <= e.drafter_length:
                    self._entries.remove(old)  # the new entry extends it: its snapshots live on in the new one
                    for length, s in old.states.items():
                        e.states.setdefault(length, s)
            self._entries.append(e)
            self.stats.stored += 1
            self._evict()

    def _evict(self) -> None:
        total = sum(e.nbytes for e in self._entries)
        while total > self.budget_bytes:
            total -= self._entries.pop(0).nbytes
            self.stats.evictions += 1
        self.stats.nbytes, self.stats.entries = total, len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stats.nbytes = self.stats.entries = 0


def check_budget(budget_bytes: Any) -> int:
    """A prefix cache budget: a whole number of bytes >= 0 (0: keep nothing), else DFlash2Error."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
        raise DFlash2Error(f"prefix cache budget must be a whole number of bytes >= 0, got {budget_bytes!r}")
    return budget_bytes


def slot_state(linear: Any, ring: Any, slot: int) -> SlotState:
    """A runner's :class:`SlotState` of ``slot`` from its ``LinearStates`` and ``WindowRing`` (either None)."""
    return SlotState(None if linear is None else linear.snapshot(slot), None if ring is None else ring.snapshot(slot))


def restore_slot_state(linear: Any, ring: Any, slot: int, state: SlotState | None) -> None:
    """:func:`slot_state`'s snapshot back into ``slot`` (None: an attention-only target, nothing to restore)."""
    if state is None:
        return
    if linear is not None:
        linear.restore(slot, state.linear)
    if ring is not None:
        ring.restore(slot, state.ring)


def _length(target: Any, slot: int) -> int:
    return int(target.lengths[slot]) if hasattr(target, "lengths") else int(target.cache_length)
