"""Batched target runner over ``target_ort.onnx`` (the fused ONNX Runtime flavour): ``slots`` sequences in one
fixed-capacity KV buffer per layer, each with its own length, bound in place with IOBinding.

Buffers (per layer, key and value)::

    kv[j]      [slots, kvh, C, d] fp32     slot b's positions 0..lengths[b]-1 valid, the rest stale
    lengths    [slots] int                 valid positions per slot (0: free or just joined)

What ONNX Runtime's GroupQueryAttention allows (CPU, onnxruntime 1.32, checked): per-sequence ``seqlens_k`` for
B > 1 only with ONE new row per sequence — with past context and S > 1 it refuses B > 1 ("batch_size must be 1
when sequence_length > 1 and past context is given"). So a call of :meth:`forward` runs:

* every slot with one new row (plain steps) in ONE call over slots ``lo .. hi-1`` (a slot range is one
  contiguous view of each buffer, bound without a copy)::

      input_ids  [hi-lo, 1] int64    seqlens_k [hi-lo] int32 = lengths (the new row lands at slot lengths[b])
      total_sequence_length = max(lengths) + 1

  Slots of the range that are not in the call (free, or active but idle this step) run a dummy row (token 0) at
  their own ``lengths[b]``, i.e. into a stale slot past their valid length that the next call overwrites — the
  B = 1 runner's crop invariant; their outputs are dropped.
* every slot with several rows (a prefill, a verify) in its own B = 1 call bound to its slot's view of the
  buffers (still in place; no padding: a prefill or verify of m rows padded into every slot's call would cost
  m rows per slot anyway). When the backend swapped in ``dflash2.DecodeAttention`` (batch 1 only; k rows cost k
  x one row) these one-slot calls run on that session, the batched calls on a GroupQueryAttention session of
  the same file.

Ragged rows are therefore exact by construction; tests/test_batch.py checks every slot against a B = 1 runner
fed the same rows, with crops, idle and free slots, growth and joins into freed slots.

Ownership: one runner = ``slots`` requests' caches; not thread safe (the batch loop owns it). Growing the
capacity reallocates every buffer (copying it) and drops the cached bindings.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import TARGET_ORT, target_kv_names, target_present_names
from dflash2_trt.runtime.kv import grown_capacity


class OrtBatchedTargetRunner:
    """``slots`` sequences over the fused target graph (CPU provider, GroupQueryAttention)."""

    def __init__(self, sess: Any, ort: Any, n_layers: int, kv_heads: int, head_dim: int, vocab_size: int,
                 max_positions: int, eos_ids: set[int], slots: int, step: int = 256, single_sess: Any = None) -> None:
        if slots < 1:
            raise DFlash2Error(f"batch slots must be >= 1, got {slots}")
        self.ort = ort
        self.sess = sess  # onnxruntime.InferenceSession of target_ort.onnx (GroupQueryAttention, any batch)
        # the same graph with dflash2.DecodeAttention (batch 1 only, cheaper multi-row verifies) for the one-slot
        # calls; None: those run on ``sess`` too
        self.single_sess = single_sess
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
        self.batched_calls = 0  # graph calls over several slots (plain steps)
        self.single_calls = 0  # B = 1 calls on one slot's view (prefills, verifies, lone steps)

    @classmethod
    def from_backend(cls, be: Any, slots: int) -> OrtBatchedTargetRunner:  # be: OrtBackend (fused)
        """Over ``be``'s fused target. When the backend swapped in ``dflash2.DecodeAttention`` (batch 1 only) this
        opens its own GroupQueryAttention session of the same file."""
        m = be.manifest
        t = m.target
        if not getattr(be, "fused", False):
            raise DFlash2Error("batched decoding needs the fused ONNX Runtime target (target_ort.onnx on the CPU "
                               "provider)")
        main = be.session(TARGET_ORT)
        s, single = main, None
        if main.decode_attention:
            from dflash2_trt.runtime.ort.backend import _Session

            key = TARGET_ORT + "#gqa"  # kept (and closed) with the backend's sessions
            if key not in be._sessions:
                be._sessions[key] = _Session(be.ort, be.dir / m.graphs[TARGET_ORT].file, be.provider, be.threads,
                                             decode_attention=False)
            s, single = be._sessions[key], main.sess
        return cls(s.sess, be.ort, t.num_layers, t.num_key_value_heads, t.head_dim, t.vocab_size, m.max_seq_len,
                   set(t.eos_token_ids), slots, m.kv_capacity_step, single)

    # -- slots --------------------------------------------------------------------------------------------------
    def join(self) -> int:
        """The lowest free slot, now active with length 0 (lowest: keeps the bound range ``0 .. hi-1`` short)."""
        free = np.flatnonzero(~self.active)
        if not free.size:
            raise DFlash2Error(f"all {self.slots} batch slots are in use")
        b = int(free[0])
        self.active[b], self.lengths[b] = True, 0
        return b

    def leave(self, slot: int) -> None:
        self.active[slot], self.lengths[slot] = False, 0

    @property
    def free_slots(self) -> int:
        return int((~self.active).sum())

    def crop(self, slot: int, length: int) -> None:
        """Slot ``slot`` keeps positions 0..length-1 (no copy: the stale slots are hidden, then overwritten)."""
        self.lengths[slot] = min(int(self.lengths[slot]), max(0, int(length)))

    # -- buffers ------------------------------------------------------------------------------------------------
    def _reserve(self, n: int) -> None:
        cap = grown_capacity(n, self.capacity, self.step, self.max_capacity)
        if cap == self.capacity:
            return
        new = [np.zeros((self.slots, self.kv_heads, cap, self.head_dim), dtype=np.float32)
               for _ in range(2 * self.n_layers)]
        for a, b in zip(new, self.arrays):
            a[:, :, : self.capacity] = b  # stale slots copied too: cheaper than per-slot slicing, same result
        self.arrays, self.capacity = new, cap
        self._io.clear()

    def _binding(self, lo: int, hi: int) -> Any:
        """IOBinding over slots lo..hi-1: each buffer's contiguous view bound as past AND present (in place)."""
        single = hi - lo == 1 and self.single_sess is not None
        key = (lo, hi)
        io = self._io.get(key)
        if io is None:
            io = (self.single_sess if single else self.sess).io_binding()
            # logits / features first: get_outputs() returns outputs in binding order
            io.bind_output("logits")
            io.bind_output("context_features")
            for a, past, present in zip(self.arrays, self.past, self.present):
                v = self.ort.OrtValue.ortvalue_from_numpy(a[lo:hi])  # a view of the buffer, no copy
                io.bind_ortvalue_input(past, v)
                io.bind_ortvalue_output(present, v)
            self._io[key] = io
        return io

    def _run(self, lo: int, hi: int, rows: dict[int, list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """One graph call over slots lo..hi-1 (S = 1 when hi - lo > 1) -> logits [hi-lo, S, V], features
        [hi-lo, S, F]."""
        S = max(len(r) for r in rows.values())
        assert S == 1 or hi - lo == 1
        ids = np.zeros((hi - lo, S), dtype=np.int64)  # [n, S] idle slots: token 0
        start = self.lengths[lo:hi].copy()  # [n] where each slot's rows land
        for b, r in rows.items():
            ids[b - lo, : len(r)] = r
        self._reserve(int(start.max()) + S)
        io = self._binding(lo, hi)
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("seqlens_k", (start + S - 1).astype(np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(int(start.max()) + S, dtype=np.int32))
        io.bind_output("logits")  # rebound each call: ORT would keep the last call's shape
        io.bind_output("context_features")
        single = hi - lo == 1 and self.single_sess is not None
        (self.single_sess if single else self.sess).run_with_iobinding(io)
        if hi - lo > 1:
            self.batched_calls += 1
        else:
            self.single_calls += 1
        out = io.get_outputs()
        return out[0].numpy(), out[1].numpy()

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, rows: dict[int, list[int]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """rows: slot -> m_b token ids at positions lengths[slot].. (m_b >= 1) -> slot -> (logits [m_b, V] fp32,
        features [m_b, F]); each slot's length grows by m_b. The one-row slots share one call, each other slot
        runs alone (see the module docstring)."""
        for b, r in rows.items():
            if not self.active[b]:
                raise DFlash2Error(f"batch slot {b} is not active")
            if not r:
                raise DFlash2Error(f"batch slot {b}: no rows")
            arr = np.asarray(r)
            if arr.min() < 0 or arr.max() >= self.vocab_size:
                raise DFlash2Error(f"token id out of range [0, {self.vocab_size}) in target input")
            if int(self.lengths[b]) + len(r) > self.max_positions:
                raise DFlash2Error(f"sequence of {int(self.lengths[b]) + len(r)} positions exceeds the exported "
                                   f"cache capacity {self.max_positions} (re-export with a larger --max-seq-len)")
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        ones = {b: r for b, r in rows.items() if len(r) == 1}
        if len(ones) > 1:
            lo, hi = min(ones), max(ones) + 1
            # an idle slot's dummy row must stay inside the RoPE table; else these slots run alone
            if int(self.lengths[lo:hi].max()) + 1 <= self.max_positions:
                lg, ft = self._run(lo, hi, ones)
                for b in ones:
                    out[b] = lg[b - lo, :1], ft[b - lo, :1]
        for b, r in rows.items():
            if b not in out:
                lg, ft = self._run(b, b + 1, {b: r})
                out[b] = lg[0], ft[0]
            self.lengths[b] += len(r)
        return out
