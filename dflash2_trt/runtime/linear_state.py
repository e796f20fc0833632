"""The host state of a target's linear-attention (Gated DeltaNet) layers, one row per sequence slot, and its
rollback.

A linear layer's state is overwritten by every row: the convolution keeps its last ``conv_kernel - 1`` inputs, the
delta rule one recurrent matrix per value head. The target graph takes both as inputs and returns, for a call of S
rows, the convolution's S new inputs and the recurrent state after each row the runtime asked for
(``state_rows``, :mod:`dflash2_trt.targets.hybrid`). :class:`LinearStates` keeps, per slot, the state after its last
call and what a rollback needs: the state before the call and those per-row outputs, so that
:meth:`LinearStates.rollback` to any accepted prefix of the last call is a slice, never a recomputation. A call of
more rows than ``max_rows_per_call`` runs in chunks that ask for their last row's state only and cannot be rolled
back (a prompt; the decoder never rolls one back).

Imports only numpy, the project error type and the manifest's state spec.
"""

from __future__ import annotations

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import LinearStateSpec


class LinearStates:
    """Convolution [slots, conv_dim, K - 1] and recurrent [slots, heads, dk, dv] fp32 state of each linear layer."""

    def __init__(self, layers: list[int], spec: LinearStateSpec, conv_dtype: np.dtype, slots: int = 1) -> None:
        self.layers, self.spec, self.slots = list(layers), spec, int(slots)
        s = spec
        self.conv = [np.zeros((slots, s.conv_dim, s.conv_kernel - 1), dtype=conv_dtype) for _ in self.layers]
        self.recurrent = [np.zeros((slots, s.num_heads, s.key_dim, s.value_dim), dtype=np.float32)
                          for _ in self.layers]
        self._last: dict[int, tuple] = {}  # slot -> (conv before, recurrent before, conv inputs, per-row states)

    def reset(self, slot: int | None = None) -> None:
        """Zero one slot's state (every slot's when None): a new sequence."""
        rows = slice(None) if slot is None else slice(slot, slot + 1)
        for a in (*self.conv, *self.recurrent):
            a[rows] = 0
        if slot is None:
            self._last.clear()
        else:
            self._last.pop(slot, None)

    def feed(self, lo: int = 0, hi: int | None = None) -> list[np.ndarray]:
        """The graph's state inputs for slots lo..hi-1 in layer order (conv, recurrent per linear layer): views."""
        hi = self.slots if hi is None else hi
        return [a[lo:hi] for pair in zip(self.conv, self.recurrent) for a in pair]

    def update(self, outputs: list[np.ndarray], lo: int, rows: dict[int, int], every_row: bool) -> None:
        """A call over slots lo.. returned ``outputs`` (per linear layer: conv inputs [n, conv_dim, S], recurrent
        states [n, R, heads, dk, dv] of the asked rows: every row, or the last alone). Slot b ran ``rows[b]`` rows
        (right-padded to S; other slots of the range are untouched) -> its state after them, and, when
        ``every_row``, what :meth:`rollback` needs."""
        k = self.spec.conv_kernel - 1
        for b, m in rows.items():
            i = b - lo
            conv_in = [x[i:i + 1, :, :m] for x in outputs[0::2]]
            states = [s[i:i + 1, :m] if every_row else s[i:i + 1] for s in outputs[1::2]]
            if every_row:
                self._last[b] = ([c[b:b + 1].copy() for c in self.conv], [r[b:b + 1].copy() for r in self.recurrent],
                                 conv_in, states)
            else:
                self._last.pop(b, None)
            for c, r, x, s in zip(self.conv, self.recurrent, conv_in, states):
                c[b] = np.concatenate([c[b:b + 1], x], axis=2)[0, :, -k:]
                r[b] = s[0, -1]

    def snapshot(self, slot: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Copies of slot ``slot``'s convolution and recurrent state (each layer's): what :meth:`restore` puts
        back."""
        return [c[slot].copy() for c in self.conv], [r[slot].copy() for r in self.recurrent]

    def restore(self, slot: int, snap: tuple[list[np.ndarray], list[np.ndarray]]) -> None:
        """Slot ``slot`` holds :meth:`snapshot`'s state (a new sequence: nothing to roll back into)."""
        for c, r, c0, r0 in zip(self.conv, self.recurrent, *snap):
            c[slot], r[slot] = c0, r0
        self._last.pop(slot, None)

    def rollback(self, keep: int, slot: int = 0) -> None:
        """Keep the first ``keep`` rows of slot ``slot``'s last call (0 <= keep <= its rows): the state after them."""
        last = self._last.pop(slot, None)
        if last is None:
            raise DFlash2Error("the linear layers' state can be rolled back only into the last call, and only when "
                               "it recorded every row's state")
        conv0, rec0, conv_in, states = last
        if not 0 <= keep <= conv_in[0].shape[2]:
            raise DFlash2Error(f"cannot keep {keep} rows of a call of {conv_in[0].shape[2]}")
        k = self.spec.conv_kernel - 1
        for c, r, c0, r0, x, s in zip(self.conv, self.recurrent, conv0, rec0, conv_in, states):
            c[slot] = np.concatenate([c0, x[:, :, :keep]], axis=2)[0, :, -k:]
            r[slot] = r0[0] if keep == 0 else s[0, keep - 1]
