"""The host state of a target's linear-attention (Gated DeltaNet) layers for one sequence, and its rollback.

A linear layer's state is overwritten by every row: the convolution keeps its last ``conv_kernel - 1`` inputs, the
delta rule one recurrent matrix per value head. The target graph takes both as inputs and returns, for a call of S
rows, the convolution's S new inputs and the recurrent state after each row the runtime asked for
(``state_rows``, :mod:`dflash2_trt.targets.hybrid`). :class:`LinearStates` keeps the state after the whole call and
what a rollback needs: the state before the call and those per-row outputs, so that :meth:`LinearStates.rollback`
to any accepted prefix of the last call is a slice, never a recomputation. A call of more rows than
``max_rows_per_call`` runs in chunks that ask for their last row's state only and cannot be rolled back (a
prompt; the decoder never rolls one back).

Imports only numpy, the project error type and the manifest's state spec.
"""

from __future__ import annotations

import numpy as np

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import LinearStateSpec


class LinearStates:
    """Convolution [1, conv_dim, K - 1] and recurrent [1, heads, dk, dv] fp32 state of each linear layer."""

    def __init__(self, layers: list[int], spec: LinearStateSpec, conv_dtype: np.dtype) -> None:
        self.layers, self.spec = list(layers), spec
        self.conv_dtype = np.dtype(conv_dtype)
        self.reset()

    def reset(self) -> None:
        s = self.spec
        self.conv = [np.zeros((1, s.conv_dim, s.conv_kernel - 1), dtype=self.conv_dtype) for _ in self.layers]
        self.recurrent = [np.zeros((1, s.num_heads, s.key_dim, s.value_dim), dtype=np.float32) for _ in self.layers]
        self._last: tuple | None = None  # (conv before, recurrent before, conv inputs, per-row states) of the last call

    def feed(self) -> list[np.ndarray]:
        """The graph's state inputs in layer order: conv, recurrent per linear layer."""
        return [a for pair in zip(self.conv, self.recurrent) for a in pair]

    def update(self, outputs: list[np.ndarray], rows: int, every_row: bool) -> None:
        """A call of ``rows`` rows returned ``outputs`` (per linear layer: conv inputs [1, conv_dim, rows], recurrent
        states [1, R, heads, dk, dv] of the asked rows: every row, or the last alone) -> the state after the call,
        and, when ``every_row``, what :meth:`rollback` needs."""
        conv_in, states = outputs[0::2], outputs[1::2]
        before = (self.conv, self.recurrent)
        k = self.spec.conv_kernel - 1
        self.conv = [np.concatenate([c, x], axis=2)[:, :, -k:] for c, x in zip(self.conv, conv_in)]
        self.recurrent = [s[:, -1] for s in states]
        self._last = (*before, conv_in, states) if every_row else None

    def rollback(self, keep: int) -> None:
        """Keep the first ``keep`` rows of the last call (0 <= keep <= its rows): the state after exactly those."""
        if self._last is None:
            raise DFlash2Error("the linear layers' state can be rolled back only into the last call, and only when "
                               "it recorded every row's state")
        conv0, rec0, conv_in, states = self._last
        if not 0 <= keep <= conv_in[0].shape[2]:
            raise DFlash2Error(f"cannot keep {keep} rows of a call of {conv_in[0].shape[2]}")
        k = self.spec.conv_kernel - 1
        self.conv = [np.concatenate([c, x[:, :, :keep]], axis=2)[:, :, -k:] for c, x in zip(conv0, conv_in)]
        self.recurrent = list(rec0) if keep == 0 else [np.ascontiguousarray(s[:, keep - 1]) for s in states]
        self._last = None
