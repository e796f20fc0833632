"""Batched target runner over ``target_ort.onnx`` (the fused ONNX Runtime flavour): ``slots`` sequences in one
fixed-capacity KV buffer per layer, each with its own length, bound in place with IOBinding.

Buffers (per layer, key and value)::

    kv[j]      [slots, kvh, C, d] fp32     slot b's positions 0..lengths[b]-1 valid, the rest stale
    lengths    [slots] int                 valid positions per slot (0: free or just joined)

A graph call runs over a slot range ``lo .. hi-1`` (one contiguous view of each buffer, bound without a copy).
:meth:`forward` takes ragged rows (slot -> m_b new tokens: 1 for a plain step, 1 + drafts for a verify, the
prompt for a prefill) and runs them in as few calls as pays, two ways:

* **ragged** (the backend swapped in ``dflash2.DecodeAttention``: the graph takes ``past_seqlens``): any slots
  with any row counts share one call, each slot right-padded to the call's S::

      input_ids     [hi-lo, S] int64   slot b's m_b tokens, then token 0 (padding)
      past_seqlens  [hi-lo] int32      lengths[b]                (the slot's cached length P_b)
      seqlens_k     [hi-lo] int32      lengths[b] + m_b - 1      (GroupQueryAttention's "total length - 1")
      total_sequence_length = max_b (lengths[b] + m_b)
      logits_index  [hi-lo, R, 1] int64  rows 0..S-1 (R = S), or each slot's last row m_b - 1 (R = 1: a prefill,
                                         ``forward(..., last_logits=True)``: the LM head skips the other rows)

  Padding rows and slots of the range that take no part (m_b = 0) cost MatMul rows but no attention, and write no
  cache slot (the op's contract). Which slots share a call is a small optimisation (:func:`plan_calls`): a call
  costs about ``call_rows`` rows of fixed cost (weight reads) plus its padded rows, so a 3-row verify shares the
  plain steps' call while a 100-token prefill does not pad every plain step to 100 rows.
* **GroupQueryAttention** (the op is not built, or ``attention='gqa'``): ONNX Runtime 1.32's GroupQueryAttention
  takes per-sequence ``seqlens_k`` for B > 1 only with ONE new row per sequence (with past context and S > 1 it
  refuses B > 1: "batch_size must be 1 when sequence_length > 1 and past context is given"). So every one-row slot
  shares one call, slots of the range not in it running a dummy row (token 0) at their own ``lengths[b]``, i.e. into
  a stale slot that the next call overwrites — the B = 1 runner's crop invariant — and every multi-row slot runs
  alone (B = 1 on its slot's view).

Every slot's rows are exact either way: tests/test_batch.py checks every slot against a B = 1 runner fed the same
rows, with crops, idle and free slots, growth and joins into freed slots, and counts the calls of each kind.

Ownership: one runner = ``slots`` requests' caches; not thread safe (the batch loop owns it). Growing the
capacity reallocates every buffer (copying it) and drops the cached bindings.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import (TARGET_LOGITS_INDEX, TARGET_ORT, TARGET_PAST_SEQLENS, target_kv_names,
                                  target_present_names)
from dflash2_trt.runtime.kv import BatchSlots, check_slot_rows, grown_slot_buffers, put_rows, take_rows
from dflash2_trt.runtime.ort.failures import ort_failures

CALL_ROWS = 12  # a graph call's fixed cost in rows (SmolLM2 fp32, 2 threads: ~29 ms a call + ~2.3 ms a row)
MAX_CALL_ROWS = 1024  # padded rows a call of several slots may hold (its logits: rows x vocabulary x 4 bytes)


def plan_calls(rows: dict[int, int], call_rows: float = CALL_ROWS, max_rows: int = MAX_CALL_ROWS) -> list[list[int]]:
    """slot -> rows (>= 1) -> the slots of each call, minimising sum over calls of ``call_rows`` + (hi - lo) x S
    (a call binds the slot range lo..hi-1 and pads every slot in it to S = its longest row count); a call of
    several slots holds at most ``max_rows`` padded rows. Exact over groups that are contiguous in row-count order
    (dynamic programming; slots <= a few dozen). Plans are remembered by their rows: the load-adaptive rule asks
    for the same few dozen patterns step after step (at 16 sequences, unremembered, they cost 10 % of a step)."""
    return [list(g) for g in _plan(tuple(sorted(rows.items())), call_rows, max_rows)]


@functools.lru_cache(maxsize=4096)
def _plan(items: tuple[tuple[int, int], ...], call_rows: float, max_rows: int) -> tuple[tuple[int, ...], ...]:
    rows = dict(items)
    order = sorted(rows, key=lambda b: (rows[b], b))
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[i]: cost of the first i slots in order
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        lo = hi = order[i - 1]
        for j in range(i - 1, -1, -1):  # the group order[j:i]; its S is rows[order[i-1]] (sorted)
            lo, hi = min(lo, order[j]), max(hi, order[j])
            padded = (hi - lo + 1) * rows[order[i - 1]]
            if padded > max_rows and i - j > 1:
                break  # a longer group only grows
            c = best[j] + call_rows + padded
            if c < best[i]:
                best[i], cut[i] = c, j
    groups: list[tuple[int, ...]] = []
    i = n
    while i:
        groups.append(tuple(sorted(order[cut[i]:i])))
        i = cut[i]
    return tuple(groups[::-1])


class OrtBatchedTargetRunner(BatchSlots):
    """``slots`` sequences over the fused target graph (CPU provider)."""

    def __init__(self, sess: Any, ort: Any, n_layers: int, kv_heads: int, head_dim: int, vocab_size: int,
                 max_positions: int, eos_ids: set[int], slots: int, step: int = 256,
                 call_rows: float = CALL_ROWS) -> None:
        if slots < 1:
            raise DFlash2Error(f"batch slots must be >= 1, got {slots}")
        self.ort = ort
        self.sess = sess  # onnxruntime.InferenceSession of target_ort.onnx
        # ragged calls: the graph runs dflash2.DecodeAttention with each sequence's cached length as an input
        self.ragged = TARGET_PAST_SEQLENS in {i.name for i in sess.get_inputs()}
        self.call_rows = call_rows
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.eos_ids = set(eos_ids)
        self.slots = slots
        self.kv_heads, self.head_dim, self.n_layers = kv_heads, head_dim, n_layers
        self.step = max(1, int(step))
        self.max_capacity = -(-max_positions // self.step) * self.step
        self.capacity = 0
        self.arrays: list[np.ndarray] = []  # 2 per layer: [slots, kvh, C, d] fp32
        self.lengths = np.zeros(slots, dtype=np.int64)  # [slots]
        self.active = np.zeros(slots, dtype=bool)  # [slots]
        self.past = target_kv_names(n_layers)
        self.present = target_present_names(n_layers)
        self._io: dict[tuple[int, int], Any] = {}  # (first slot, slots bound) -> IOBinding
        # graph calls by the slots taking part: several with one row each (plain steps); several of which at
        # least two have more than one row (batched verifies / prefills: ragged calls only); one slot alone
        self.batched_calls = 0
        self.multirow_calls = 0
        self.single_calls = 0

    @classmethod
    def from_backend(cls, be: Any, slots: int) -> OrtBatchedTargetRunner:  # be: OrtBackend (fused)
        """Over ``be``'s fused target session (ragged calls when it runs ``dflash2.DecodeAttention``)."""
        m = be.manifest
        t = m.target
        if not getattr(be, "fused", False):
            raise DFlash2Error("batched decoding needs the fused ONNX Runtime target (target_ort.onnx on the CPU "
                               "provider)")
        return cls(be.session(TARGET_ORT).sess, be.ort, t.num_layers, t.num_key_value_heads, t.head_dim,
                   t.vocab_size, m.max_seq_len, set(t.eos_token_ids), slots, m.kv_capacity_step)

    # -- slots --------------------------------------------------------------------------------------------------
    def crop(self, slot: int, length: int) -> None:
        """Slot ``slot`` keeps positions 0..length-1 (no copy: the stale slots are hidden, then overwritten)."""
        self.lengths[slot] = min(int(self.lengths[slot]), max(0, int(length)))

    # -- the prefix cache (dflash2_trt.runtime.prefix_cache): attention K/V only ----------------------------------
    def prefix_rows(self, n: int, slot: int) -> list[np.ndarray]:
        return take_rows(self.arrays, slot, min(n, int(self.lengths[slot])))

    def prefix_state(self, slot: int) -> None:
        return None

    def restore_prefix(self, rows: list[np.ndarray], n: int, state: None, slot: int) -> None:
        self.reserve(n)
        put_rows(self.arrays, slot, rows)
        self.lengths[slot] = n

    # -- buffers ------------------------------------------------------------------------------------------------
    def reserve(self, n: int) -> None:
        """Room for ``n`` positions in every slot (a growth copies each slot's held rows: the batch loop reserves a
        joining request's whole length at once rather than growing chunk by chunk)."""
        old = self.capacity
        self.arrays, self.capacity = grown_slot_buffers(self.arrays, old, n, self.step, self.max_capacity,
                                                        (2 * self.n_layers, self.slots, self.kv_heads, self.head_dim),
                                                        np.float32, self.lengths)
        if self.capacity != old:
            self._io.clear()

    def _binding(self, lo: int, hi: int) -> Any:
        """IOBinding over slots lo..hi-1: each buffer's contiguous view bound as past AND present (in place)."""
        key = (lo, hi)
        io = self._io.get(key)
        if io is None:
            io = self.sess.io_binding()
            # logits / features first: get_outputs() returns outputs in binding order
            io.bind_output("logits")
            io.bind_output("context_features")
            for a, past, present in zip(self.arrays, self.past, self.present):
                v = self.ort.OrtValue.ortvalue_from_numpy(a[lo:hi])  # a view of the buffer, no copy
                io.bind_ortvalue_input(past, v)
                io.bind_ortvalue_output(present, v)
            self._io[key] = io
        return io

    def _run(self, lo: int, hi: int, rows: dict[int, list[int]], last: bool) -> tuple[np.ndarray, np.ndarray]:
        """One graph call over slots lo..hi-1 -> logits [hi-lo, R, V] (ragged and ``last``: R = 1, each slot's last
        row; else R = S), features [hi-lo, S, F]. Ragged: slot b runs len(rows[b]) rows (0 when absent),
        right-padded; GroupQueryAttention: S = 1 when hi - lo > 1, absent slots run a dummy row."""
        S = max(len(r) for r in rows.values())
        assert self.ragged or S == 1 or hi - lo == 1
        ids = np.zeros((hi - lo, S), dtype=np.int64)  # [n, S] padding / idle slots: token 0
        start = self.lengths[lo:hi].copy()  # [n] where each slot's rows land
        m = np.full(hi - lo, 0 if self.ragged else S, dtype=np.int64)  # [n] rows each slot runs
        for b, r in rows.items():
            ids[b - lo, : len(r)] = r
            m[b - lo] = len(r)
        end = start + m  # [n] each slot's length after the call
        self.reserve(int(end.max()))
        io = self._binding(lo, hi)
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("seqlens_k", (end - 1).astype(np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(int(end.max()), dtype=np.int32))
        if self.ragged:
            io.bind_cpu_input(TARGET_PAST_SEQLENS, start.astype(np.int32))
            index = np.maximum(m - 1, 0)[:, None] if last else np.broadcast_to(np.arange(S), (hi - lo, S))
            io.bind_cpu_input(TARGET_LOGITS_INDEX, np.ascontiguousarray(index, dtype=np.int64)[..., None])
        io.bind_output("logits")  # rebound each call: ORT would keep the last call's shape
        io.bind_output("context_features")
        with ort_failures(f"{TARGET_ORT}.onnx"):
            self.sess.run_with_iobinding(io)
        if len(rows) == 1:
            self.single_calls += 1
        elif sum(len(r) > 1 for r in rows.values()) >= 2:
            self.multirow_calls += 1
        else:
            self.batched_calls += 1
        out = io.get_outputs()
        return out[0].numpy(), out[1].numpy()

    def _calls(self, rows: dict[int, list[int]]) -> list[list[int]]:
        """The slots of each graph call (see the module docstring)."""
        if self.ragged:
            return plan_calls({b: len(r) for b, r in rows.items()}, self.call_rows)
        ones = sorted(b for b, r in rows.items() if len(r) == 1)
        calls: list[list[int]] = []
        # an idle slot's dummy row must stay inside the RoPE table; else these slots run alone
        if len(ones) > 1 and int(self.lengths[ones[0]: ones[-1] + 1].max()) + 1 <= self.max_positions:
            calls.append(ones)
        done = {b for c in calls for b in c}
        return calls + [[b] for b in rows if b not in done]

    def cost_units(self, rows: dict[int, int]) -> float:
        """slot -> rows -> the forward's cost in units of a row (each graph call ``call_rows`` + its padded rows, as
        :func:`plan_calls` counts them; GroupQueryAttention: its one-row call over the slot range, each other slot
        alone). The load-adaptive rule scales it by measured times."""
        if self.ragged:
            groups = plan_calls(rows, self.call_rows)
            return sum(self.call_rows + (g[-1] - g[0] + 1) * max(rows[b] for b in g) for g in groups)
        ones = sorted(b for b, m in rows.items() if m == 1)
        units = self.call_rows + ones[-1] - ones[0] + 1 if ones else 0.0
        return units + sum(self.call_rows + m for m in rows.values() if m > 1)

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, rows: dict[int, list[int]],
                last_logits: bool = False) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """rows: slot -> m_b token ids at positions lengths[slot].. (m_b >= 1) -> slot -> (logits [m_b, V] fp32,
        or [1, V] of the last row with ``last_logits`` (a prefill), features [m_b, F]); each slot's length grows by
        m_b. How the slots share graph calls: the module docstring."""
        check_slot_rows(rows, self.active, self.lengths, self.vocab_size, self.max_positions)
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for call in self._calls(rows):
            lo, hi = call[0], call[-1] + 1
            lg, ft = self._run(lo, hi, {b: rows[b] for b in call}, last_logits)
            for b in call:
                m = len(rows[b])
                if not last_logits:
                    out[b] = lg[b - lo, :m], ft[b - lo, :m]
                else:  # ragged: the one row computed; else the last of the m
                    out[b] = lg[b - lo, -1:] if self.ragged else lg[b - lo, m - 1: m], ft[b - lo, :m]
                # at once: a later call's growth copies each slot's rows up to its length, and its dummy rows for
                # slots outside it land past their lengths
                self.lengths[b] += m
        return out
