"""Batched drafter over an export's drafter graphs (``drafter_context``, and the block and head graphs
:meth:`~dflash2_trt.runtime.ort.backend.OrtBackend.block_key` / ``head_key`` pick; their ``_ort`` variants where the
backend runs them): the draft context caches of ``slots`` sequences in one fixed-capacity buffer per layer, each with
its own length, and one block call + one head call for every sequence that drafts in a step (the B = 1
:class:`~dflash2_trt.runtime.ort.backend.OrtDraftRunner` makes both calls per sequence: at several drafting sequences
their fixed per-call cost is what batching saves).

The exported drafter graphs already take a batch axis (traced at batch 2, dimension ``batch`` in the manifest,
every export since the first): ragged context lengths are the block graph's ``context_mask``, so no graph or
manifest changes. Buffers (per drafter layer, key and value)::

    ctx[j]     [slots, kvh, C, d]    slot b's positions 0..lengths[b]-1 valid, the rest stale (masked)
    lengths    [slots] int           positions in slot b's draft context (0: free or reset)

* :meth:`add_contexts` (and :meth:`add_context` for one slot): the context graph is row-wise (fc, hidden_norm,
  k/v projections, k_norm, RoPE at each row's own position), so the new rows of every slot go into ONE call as one
  sequence of rows ``[1, sum m_b, F]`` with each row's own position, no padding; each slot's K/V rows are then
  written into its buffer slots (ragged: m_b rows per slot).
* :meth:`propose_batch`: ONE block call over the drafting slots, then ONE head call over their hidden states::

      anchor_ids [n] int64, anchor_position [n] int64, context_mask [n, C] int64, ctx[j] [n, kvh, C, d]
      -> hidden [n, bs, H]; rows past a sequence's verified rows zeroed (a final partial block, as B = 1)
      -> head (hidden, anchor_ids int32, temperature [n], uniforms [n, L]) -> cand, path, proposal per sequence

  The n block rows are either the slot range lo..hi-1 of the buffers, bound in place as views (no copy; slots of
  the range that do not draft run a dummy block whose output is dropped), or, when the range holds more idle than
  drafting slots, a gathered copy of the drafting slots' caches (:data:`GATHER_RATIO`).

Every sequence's draft equals what its own B = 1 runner proposes on the same context (tokens identical,
proposals within float rounding): tests/test_batched_drafter.py checks it on fresh random features, ragged
context lengths, capacity growth, slots reset and re-joined, every draft mode and both call layouts.

Ownership: one runner = ``slots`` sequences' draft caches over the backend's sessions; not thread safe (the batch
loop owns it). Growing the capacity reallocates every buffer (copying it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.kv import grown_slot_buffers, put_rows, take_rows
from dflash2_trt.runtime.ort.failures import ort_failures
from dflash2_trt.runtime.protocol import Draft, independent_draft
from dflash2_trt.vocabulary import INDEPENDENT

#: a block call gathers (copies) the drafting slots' caches when their slot range is more than this many times
#: their count; else the range is bound in place and its idle slots run dummy blocks (a dummy block costs about
#: what a drafting one does; a copy costs a fraction of one)
GATHER_RATIO = 2


class OrtBatchedDraftRunner:
    """``slots`` sequences' draft context caches over one backend's drafter graphs (see the module docstring)."""

    def __init__(self, be: Any, mode: str, slots: int, step: int | None = None) -> None:
        """be: an :class:`~dflash2_trt.runtime.ort.backend.OrtBackend`; mode: a draft mode of its export;
        step: capacity granularity in positions (default: the export's)."""
        if slots < 1:
            raise DFlash2Error(f"batch slots must be >= 1, got {slots}")
        m = be.manifest
        cfg = m.drafter_config
        assert cfg.head_dim is not None
        self.mode = m.check_draft_mode(mode)
        self.block_size = cfg.block_size
        self.num_draft_rows = cfg.num_draft_rows
        self.top_k = cfg.selector_top_k
        self.slots = slots
        self.dtype = be.dtype
        self.names = m.drafter_context_names()
        # plain InferenceSession.run on every provider: the head's B = 1 CUDA-graph binding has fixed shapes
        self._ctx = be.session("drafter_context")
        self._block = be.session(be.block_key())
        self._head = be.session(be.head_key(self.mode))
        self.ort = be.ort
        self.n_layers, self.kv_heads, self.head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.step = max(1, int(step if step is not None else m.kv_capacity_step))
        self.max_capacity = -(-m.max_seq_len // self.step) * self.step
        self.capacity = 0
        self.arrays: list[np.ndarray] = []  # 2 per layer: [slots, kvh, C, d]
        self.lengths = np.zeros(slots, dtype=np.int64)  # [slots]
        # graph calls made (tests count them: one block and one head call per propose_batch)
        self.context_calls = 0
        self.block_calls = 0
        self.head_calls = 0
        self.gathered_calls = 0  # block calls over a gathered copy instead of a slot range

    @classmethod
    def from_backend(cls, be: Any, mode: str, slots: int) -> OrtBatchedDraftRunner:
        return cls(be, mode, slots)

    def slot(self, b: int) -> SlotDraftRunner:
        """Slot ``b`` as a B = 1 :class:`~dflash2_trt.runtime.protocol.DraftRunner` (its calls are batches of one)."""
        self._check_slot(b)
        return SlotDraftRunner(self, b)

    # -- context --------------------------------------------------------------------------------------------------
    def reset(self, b: int) -> None:
        """Slot ``b`` starts a new sequence (its draft context empty)."""
        self._check_slot(b)
        self.lengths[b] = 0

    def context_rows(self, b: int, n: int) -> list[np.ndarray]:
        """Copies of slot ``b``'s draft context K/V of positions 0..n-1 (the prefix cache's)."""
        return take_rows(self.arrays, b, min(n, int(self.lengths[b])))

    def restore_context(self, b: int, rows: list[np.ndarray]) -> None:
        """Slot ``b``'s draft context holds exactly :meth:`context_rows`' copies."""
        n = rows[0].shape[1] if rows else 0
        self.reserve(n)
        put_rows(self.arrays, b, rows)
        self.lengths[b] = n

    def add_context(self, b: int, feats: np.ndarray, start: int) -> None:
        """feats [m, F] of positions start..start+m-1 -> slot b's draft context."""
        self.add_contexts({b: (feats, start)})

    def add_contexts(self, new: dict[int, tuple[np.ndarray, int]]) -> None:
        """slot -> (feats [m_b, F], start) of positions start..start+m_b-1 -> each slot's draft context, in ONE
        context call (rows of every slot concatenated, each at its own position)."""
        items = [(b, np.asarray(f), int(start)) for b, (f, start) in new.items() if np.asarray(f).shape[0] > 0]
        for b, f, start in items:
            self._check_slot(b)
            if start != self.lengths[b]:
                raise DFlash2Error(f"slot {b}: draft context is at length {int(self.lengths[b])}, got features for "
                                   f"position {start}")
        if not items:
            return
        self.reserve(max(start + f.shape[0] for _, f, start in items))
        feats = np.concatenate([f for _, f, _ in items])[None].astype(self.dtype, copy=False)  # [1, M, F]
        pos = np.concatenate([np.arange(s, s + f.shape[0], dtype=np.int64) for _, f, s in items])[None]  # [1, M]
        with ort_failures(self._ctx.path):
            out = self._ctx.sess.run(self._ctx.outputs, {"context_features": np.ascontiguousarray(feats),
                                                         "position_ids": pos})  # 2 per layer [1, kvh, M, d]
        self.context_calls += 1
        off = 0
        for b, f, start in items:
            m = f.shape[0]
            for buf, x in zip(self.arrays, out):
                buf[b, :, start: start + m] = x[0, :, off: off + m]
            self.lengths[b] = start + m
            off += m

    # -- propose ---------------------------------------------------------------------------------------------------
    def propose_batch(self, slots: Sequence[int], anchors: Sequence[int], positions: Sequence[int],
                      rows: Sequence[int], temperatures: Sequence[float],
                      uniforms: Sequence[np.ndarray | None]) -> list[Draft]:
        """One block call and one head call for sequences ``slots`` (distinct): sequence i's block
        ``[anchors[i], MASK ...]`` at positions ``positions[i]..`` (= its context length), ``rows[i]`` (<= L) draft
        rows verified, its temperature and uniforms ([1, L]; None at T <= 0) -> one :class:`Draft` per sequence, each
        what a B = 1 runner proposes (:meth:`OrtDraftRunner.propose`)."""
        n = len(slots)
        if not (len(anchors) == len(positions) == len(rows) == len(temperatures) == len(uniforms) == n):
            raise DFlash2Error("propose_batch: slots, anchors, positions, rows, temperatures and uniforms differ in "
                               "length")
        if not n:
            return []
        if len(set(slots)) != n:
            raise DFlash2Error(f"propose_batch: a slot appears twice in {list(slots)}")
        L = self.num_draft_rows
        for b, pos in zip(slots, positions):
            self._check_slot(b)
            if self.lengths[b] != pos:
                raise DFlash2Error(f"slot {b}: draft context holds {int(self.lengths[b])} positions, anchor is at "
                                   f"{pos}")
        self.reserve(max(1, max(int(p) for p in positions)))
        hidden = self._block_call(list(slots), [int(a) for a in anchors])  # [n, bs, H]
        for i, r in enumerate(rows):
            hidden[i, 1 + int(r):] = 0  # a final partial block: the path over the verified rows alone
        self.head_calls += 1
        if self.mode == INDEPENDENT:
            with ort_failures(self._head.path):
                logits = self._head.sess.run(self._head.outputs, {"hidden": hidden})[0]  # [n, L, V] fp32
            return [independent_draft(logits[i], float(t), u, self.top_k)
                    for i, (t, u) in enumerate(zip(temperatures, uniforms))]
        u = np.zeros((n, L), dtype=np.float32)  # [n, L]
        for i, x in enumerate(uniforms):
            if x is not None:
                u[i] = np.asarray(x, dtype=np.float32).reshape(-1)[:L]
        with ort_failures(self._head.path):
            cand, path, q = self._head.sess.run(self._head.outputs, {
                "hidden": hidden, "anchor_ids": np.asarray(anchors, dtype=np.int32),
                "temperature": np.asarray(temperatures, dtype=np.float32), "uniforms": u})
        return [Draft(tokens=path[i].astype(np.int64), proposal=q[i], cand=cand[i].astype(np.int64)) for i in range(n)]

    def _block_call(self, slots: list[int], anchors: list[int]) -> np.ndarray:
        """The block graph over the drafting slots -> hidden [n, bs, H] in ``slots`` order (a fresh array)."""
        lo, hi = min(slots), max(slots) + 1
        gather = hi - lo > GATHER_RATIO * len(slots)
        idx = np.asarray(slots, dtype=np.int64) if gather else np.arange(lo, hi)  # [nb] buffer slots in the call
        where = {b: i for i, b in enumerate(idx.tolist())}
        ids = np.zeros(len(idx), dtype=np.int64)  # [nb] idle slots of a range: token 0 at their own length
        ids[[where[b] for b in slots]] = anchors
        lengths = self.lengths[idx]  # [nb]
        mask = (np.arange(self.capacity)[None, :] < lengths[:, None]).astype(np.int64)  # [nb, C]
        feed: dict[str, Any] = {"anchor_ids": ids, "anchor_position": lengths.copy(), "context_mask": mask}
        for name, a in zip(self.names, self.arrays):
            x = np.take(a, idx, axis=0) if gather else a[lo:hi]  # a copy, or a contiguous view
            feed[name] = self.ort.OrtValue.ortvalue_from_numpy(x)  # a CPU OrtValue over x's memory: no copy
        with ort_failures(self._block.path):
            hidden = self._block.sess.run(self._block.outputs, feed)[0]  # [nb, bs, H]
        self.block_calls += 1
        self.gathered_calls += int(gather)
        return hidden if gather else hidden[[where[b] for b in slots]]

    # -- buffers ---------------------------------------------------------------------------------------------------
    def _check_slot(self, b: int) -> None:
        if not 0 <= int(b) < self.slots:
            raise DFlash2Error(f"batch slot {b} is out of range [0, {self.slots})")

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions in every slot (a growth copies each slot's held rows: the batch loop reserves a
        joining request's whole length at once rather than growing chunk by chunk)."""
        self.arrays, self.capacity = grown_slot_buffers(self.arrays, self.capacity, n, self.step, self.max_capacity,
                                                        (2 * self.n_layers, self.slots, self.kv_heads, self.head_dim),
                                                        self.dtype, self.lengths)


class SlotDraftRunner:
    """One slot of an :class:`OrtBatchedDraftRunner` as a B = 1 DraftRunner (``reset``, ``add_context``,
    ``propose``): code written for one drafter per sequence runs on the shared buffers unchanged."""

    def __init__(self, runner: OrtBatchedDraftRunner, b: int) -> None:
        self.runner, self.b = runner, b
        self.block_size, self.num_draft_rows = runner.block_size, runner.num_draft_rows

    def reset(self) -> None:
        self.runner.reset(self.b)

    def add_context(self, feats: np.ndarray, start: int) -> None:
        self.runner.add_context(self.b, feats, start)

    def context_length(self) -> int:
        return int(self.runner.lengths[self.b])

    def context_rows(self, n: int) -> list[np.ndarray]:
        return self.runner.context_rows(self.b, n)

    def restore_context(self, rows: list[np.ndarray]) -> None:
        self.runner.restore_context(self.b, rows)

    def propose(self, anchor: int, pos: int, rows: int, temperature: float, uniforms: np.ndarray | None) -> Draft:
        return self.runner.propose_batch([self.b], [anchor], [pos], [rows], [temperature], [uniforms])[0]
