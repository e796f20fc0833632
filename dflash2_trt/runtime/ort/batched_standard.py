"""Batched target runner over the standard ``target.onnx`` of an export without a fused target (one with linear,
sliding-window or routed-expert layers): ``slots`` sequences, each with its own KV length, its own linear-layer state
(:class:`~dflash2_trt.runtime.linear_state.LinearStates` with one row per slot) and its own sliding layers' rings
(:class:`~dflash2_trt.runtime.kv.WindowRing`), so every slot rolls back to its own accepted length.

Buffers::

    kv[j]        [slots, kvh, C, d]          attention layer j's keys / values; slot b's first lengths[b] valid
    conv, rec    [slots, ...] per linear layer  the state after each slot's last kept row
    ring[j]      [slots, kvh, ring_slots, d]  sliding layer j's keys / values of each slot's last window

A call runs over a slot range ``lo .. hi-1`` (views of the buffers, no copy): the slots with rows right-padded to
the call's S (padding rows after a slot's own rows touch none of them: causal attention masks them as keys, and the
linear layers' recurrence runs forward), the range's other slots a dummy row whose outputs are dropped. The graph
returns the new rows' K/V (written at each slot's length, or into its ring) and every row's recurrent state (each slot
keeps the row of its own length). Slots of at most ``max_rows_per_call`` rows (a target with linear layers; else
any number) share one call; a longer prompt runs alone, in calls of that many rows, and is not recorded for
rollback.

Ownership: one runner = ``slots`` requests' state; not thread safe (the batch loop owns it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import TARGET_STATE_ROWS, TARGET_WINDOW_POSITIONS
from dflash2_trt.runtime.kv import (BatchSlots, WindowRing, check_slot_rows, grown_slot_buffers, layer_feed, put_rows,
                                    split_present, take_rows)
from dflash2_trt.runtime.linear_state import LinearStates
from dflash2_trt.runtime.prefix_cache import SlotState, restore_slot_state, slot_state
from dflash2_trt.runtime.ort.batched_target import CALL_ROWS


class OrtStandardBatchedTargetRunner(BatchSlots):
    """``slots`` sequences over the standard target graph (attention, linear and sliding layers)."""

    def __init__(self, be: Any, slots: int) -> None:  # be: OrtBackend
        if slots < 1:
            raise DFlash2Error(f"batch slots must be >= 1, got {slots}")
        m = be.manifest
        t = m.target
        self.sess = be.session("target")
        self.vocab_size, self.max_positions, self.eos_ids = t.vocab_size, m.max_seq_len, set(t.eos_token_ids)
        self.slots = slots
        self.kinds = m.layer_kinds
        self.names = m.target_kv_names()
        self.n_attention = self.kinds.count("attention")
        self.kv_heads, self.head_dim, self.dtype = t.num_key_value_heads, t.head_dim, be.dtype
        self.step = m.kv_capacity_step
        self.max_capacity = m.max_capacity
        self.capacity = 0
        self.arrays: list[np.ndarray] = []  # 2 per attention layer
        linear = [i for i, k in enumerate(self.kinds) if k == "linear"]
        self.linear = LinearStates(linear, t.linear_state, be.dtype, slots) if linear and t.linear_state else None
        n_sliding = self.kinds.count("sliding")
        self.ring = (WindowRing(n_sliding, self.kv_heads, self.head_dim, be.dtype, t.sliding_window, slots)
                     if n_sliding and t.sliding_window else None)
        self.max_rows = t.linear_state.max_rows_per_call if self.linear is not None else self.max_positions
        self.lengths = np.zeros(slots, dtype=np.int64)
        self.active = np.zeros(slots, dtype=bool)
        self._call_start = np.zeros(slots, dtype=np.int64)  # each slot's length before its last call
        self.calls = 0

    # -- slots --------------------------------------------------------------------------------------------------
    def _joined(self, slot: int) -> None:
        self._call_start[slot] = 0
        for state in (self.linear, self.ring):
            if state is not None:
                state.reset(slot)

    def crop(self, slot: int, length: int) -> None:
        """Slot ``slot`` keeps positions 0..length-1: its KV by its length, its linear state rolled back into its
        last call, its rings' cut rows dropped."""
        length = max(0, int(length))
        if length < self.lengths[slot]:
            if self.linear is not None:
                self.linear.rollback(length - int(self._call_start[slot]), slot)
            if self.ring is not None:
                self.ring.crop(slot, length)
            self.lengths[slot] = length

    # -- the prefix cache (dflash2_trt.runtime.prefix_cache) ------------------------------------------------------
    def prefix_rows(self, n: int, slot: int) -> list[np.ndarray]:
        return take_rows(self.arrays, slot, min(n, int(self.lengths[slot])))

    def prefix_state(self, slot: int) -> SlotState | None:
        return None if self.linear is None and self.ring is None else slot_state(self.linear, self.ring, slot)

    def restore_prefix(self, rows: list[np.ndarray], n: int, state: SlotState | None, slot: int) -> None:
        self.reserve(n)
        put_rows(self.arrays, slot, rows)
        restore_slot_state(self.linear, self.ring, slot, state)
        self.lengths[slot] = self._call_start[slot] = n

    def cost_units(self, rows: dict[int, int]) -> float:
        """A call's fixed cost plus its padded rows (slots of at most max_rows share one call)."""
        short = [b for b, m in rows.items() if m <= self.max_rows]
        units = CALL_ROWS + (max(short) - min(short) + 1) * max(rows[b] for b in short) if short else 0.0
        return units + sum(-(-m // self.max_rows) * (CALL_ROWS + self.max_rows) for m in rows.values()
                           if m > self.max_rows)

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, rows: dict[int, list[int]],
                last_logits: bool = False) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """rows: slot -> m_b token ids at positions lengths[slot].. -> slot -> (logits [m_b, V] fp32, or [1, V] of
        the last row with ``last_logits``, features [m_b, F]); each slot's length grows by m_b."""
        check_slot_rows(rows, self.active, self.lengths, self.vocab_size, self.max_positions)
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        short = {b: r for b, r in rows.items() if len(r) <= self.max_rows}
        if short:
            out.update(self._run(min(short), max(short) + 1, short, every_row=True))
        for b, r in rows.items():
            if b not in short:  # a long prompt: alone, in calls of max_rows rows, not recorded for rollback
                parts = [self._run(b, b + 1, {b: r[a:a + self.max_rows]}, every_row=False)[b]
                         for a in range(0, len(r), self.max_rows)]
                out[b] = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        if last_logits:
            out = {b: (lg[-1:], ft) for b, (lg, ft) in out.items()}
        return out

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions in every slot (a growth copies each slot's held rows: the batch loop reserves a
        joining request's whole length at once rather than growing chunk by chunk)."""
        self.arrays, self.capacity = grown_slot_buffers(self.arrays, self.capacity, n, self.step, self.max_capacity,
                                                        (2 * self.n_attention, self.slots, self.kv_heads,
                                                         self.head_dim), self.dtype, self.lengths)

    def _run(self, lo: int, hi: int, rows: dict[int, list[int]], every_row: bool
             ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """One graph call over slots lo..hi-1 (slots without rows run a dummy row, dropped)."""
        n, S = hi - lo, max(len(r) for r in rows.values())
        start = self.lengths[lo:hi].copy()
        self.reserve(int(start.max()) + S)
        C = self.capacity
        ids = np.zeros((n, S), dtype=np.int64)
        mask = np.zeros((n, C + S), dtype=np.int64)
        mask[:, :C] = np.arange(C)[None] < start[:, None]
        mask[:, C] = 1  # every sequence's first new row (a dummy one for slots without rows)
        for b, r in rows.items():
            ids[b - lo, : len(r)] = r
            mask[b - lo, C: C + len(r)] = 1
        pos = np.minimum(start[:, None] + np.arange(S)[None], self.max_positions - 1)
        feed = {"input_ids": ids, "position_ids": pos.astype(np.int64), "attention_mask": mask}
        states: dict[str, list[np.ndarray]] = {"attention": [a[lo:hi] for a in self.arrays]}
        if self.linear is not None:
            feed[TARGET_STATE_ROWS] = np.arange(S, dtype=np.int64) if every_row else np.array([S - 1], dtype=np.int64)
            states["linear"] = self.linear.feed(lo, hi)
        if self.ring is not None:
            states["sliding"], feed[TARGET_WINDOW_POSITIONS] = self.ring.feed(lo, hi)
        feed.update(zip(self.names, layer_feed(self.kinds, states)))
        res = self.sess.run(feed)
        self.calls += 1
        new = split_present(self.kinds, res[2:])
        m = {b: len(r) for b, r in rows.items()}
        for b, k in m.items():
            n0 = int(self.lengths[b])
            for buf, x in zip(self.arrays, new["attention"]):
                buf[b, :, n0:n0 + k] = x[b - lo, :, :k]
            if self.ring is not None:
                self.ring.write(b, n0, [x[:, :, :k] for x in new["sliding"]], b - lo)
            self._call_start[b] = n0
            self.lengths[b] = n0 + k
        if self.linear is not None:
            self.linear.update(new["linear"], lo, m, every_row)
        return {b: (res[0][b - lo, :k], res[1][b - lo, :k]) for b, k in m.items()}
