"""Target runner over ``target_ort.onnx`` (the fused ONNX Runtime flavour, see
:mod:`dflash2_trt.export.ort_graph`): one shared past/present KV buffer per layer, bound once with IOBinding.

GroupQueryAttention writes the K/V of the new rows straight into the bound capacity buffers (past and
present are the same OrtValue), so a call copies no cache, and ``crop`` only lowers the length: the next
call's ``seqlens_k`` / ``total_sequence_length`` hide the rejected rows, which it then overwrites.

Ownership: one runner = one request's caches; not thread safe. The numpy arrays of the
:class:`~dflash2_trt.runtime.protocol.KVBuffer` back the bound OrtValues (no copy); growing the buffer
reallocates them and rebinds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash2_trt.manifest import (TARGET_LOGITS_INDEX, TARGET_ORT, TARGET_PAST_SEQLENS, target_kv_names,
                                  target_present_names)
from dflash2_trt.runtime.kv import KVBuffer, target_ids
from dflash2_trt.runtime.ort.failures import ort_failures


def logits_rows(S: int, last_logits: bool) -> np.ndarray:
    """Of a call's S new rows, those whose logits the rewritten graph computes -> [R] int64: every row (R = S), or
    the last alone (R = 1: a prefill, whose first token reads that row; the LM head skips the others)."""
    return np.arange(S - 1 if last_logits else 0, S, dtype=np.int64)


class OrtFusedTargetRunner:
    """TargetRunner over the fused target graph (CPU provider)."""

    def __init__(self, sess: Any, ort: Any, n_layers: int, kv_heads: int, head_dim: int, vocab_size: int,
                 max_positions: int, eos_ids: set[int], step: int = 256) -> None:
        self.ort = ort
        self.sess = sess  # onnxruntime.InferenceSession of target_ort.onnx
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.eos_ids = set(eos_ids)
        self.n_layers = n_layers
        self.kv = KVBuffer(n_layers, kv_heads, head_dim, np.float32, step, max_positions)
        self.past = target_kv_names(n_layers)
        self.present = target_present_names(n_layers)
        self._io: Any = None
        self._bound_capacity = -1
        # the graph rewritten at load (dflash2.DecodeAttention swapped in) takes each sequence's cached length and
        # the rows whose logits to compute (all, or a prefill's last)
        self._rewritten = TARGET_PAST_SEQLENS in {i.name for i in sess.get_inputs()}

    @classmethod
    def from_backend(cls, be: Any) -> "OrtFusedTargetRunner":  # be: OrtBackend
        m = be.manifest
        t = m.target
        return cls(be.session(TARGET_ORT).sess, be.ort, t.num_layers, t.num_key_value_heads, t.head_dim,
                   t.vocab_size, m.max_seq_len, set(t.eos_token_ids), m.kv_capacity_step)

    def reset(self) -> None:
        self.kv.reset()

    @property
    def cache_length(self) -> int:
        return self.kv.length

    def _binding(self):  # noqa: ANN202
        """One IOBinding per buffer generation: every KV buffer is bound as input AND output."""
        if self._io is None or self._bound_capacity != self.kv.capacity:
            io = self.sess.io_binding()
            # logits / features first: get_outputs() returns outputs in binding order
            io.bind_output("logits")
            io.bind_output("context_features")
            for a, past, present in zip(self.kv.arrays, self.past, self.present):
                v = self.ort.OrtValue.ortvalue_from_numpy(a)  # wraps the array, no copy
                io.bind_ortvalue_input(past, v)
                io.bind_ortvalue_output(present, v)
            self._io, self._bound_capacity = io, self.kv.capacity
        return self._io

    def forward(self, ids: list[int], last_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """ids [m] at positions cache_length.. -> logits [m, V] fp32 (``last_logits``: [1, V], the last row's; the
        rewritten graph's LM head computes that row alone), context features [m, F]."""
        arr = target_ids(ids, self.vocab_size)  # [1, m]
        n, S = self.kv.length, arr.shape[1]
        self.kv.reserve(n + S)
        io = self._binding()
        io.bind_cpu_input("input_ids", arr)
        io.bind_cpu_input("seqlens_k", np.array([n + S - 1], dtype=np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(n + S, dtype=np.int32))
        if self._rewritten:
            io.bind_cpu_input(TARGET_PAST_SEQLENS, np.array([n], dtype=np.int32))
            io.bind_cpu_input(TARGET_LOGITS_INDEX, logits_rows(S, last_logits).reshape(1, -1, 1))
        io.bind_output("logits")  # rebound each call: ORT would keep last call's [1, S, V] buffer
        io.bind_output("context_features")
        self.kv.wrote(n)  # the graph writes the new rows' K/V into slots n..n+S-1 of the bound buffers
        with ort_failures(f"{TARGET_ORT}.onnx"):
            self.sess.run_with_iobinding(io)
        out = io.get_outputs()
        self.kv.length = n + S
        logits = out[0].numpy()[0]  # [R, V]: R = S, or 1 (rewritten, last_logits)
        return (logits[-1:] if last_logits else logits), out[1].numpy()[0]

    def crop(self, length: int) -> None:
        self.kv.crop(length)

    # -- the prefix cache (dflash2_trt.runtime.prefix_cache): attention K/V only ----------------------------------
    def prefix_rows(self, n: int, slot: int = 0) -> list[np.ndarray]:
        return self.kv.rows(n)

    def prefix_state(self, slot: int = 0) -> None:
        return None

    def restore_prefix(self, rows: list[np.ndarray], n: int, state: None, slot: int = 0) -> None:
        self.kv.load(rows, n)  # in place (the bound OrtValues stay valid) unless the capacity grows
