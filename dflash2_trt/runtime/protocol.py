"""What every backend implements: the backend and runner protocols, the draft they exchange.

A :class:`Backend` (ONNX Runtime, TensorRT, PyTorch) is constructed on a model, describes what it runs on,
hands out runners and is closed (also as a context manager). A backend that cannot run here raises
:class:`BackendUnavailable` from its constructor; :func:`dflash2_trt.runtime.backends.open_backend` catches it
to fall back — nothing checks availability before constructing.

A backend gives the decoder loop two runners per request:

* :class:`TargetRunner` — ``reset()``, ``forward(ids) -> (logits [m, V] fp32, features [m, F])`` at positions
  ``cache_length ..`` (``forward(ids, last_logits=True)``: the last row's logits [1, V] alone, every row's
  features: a prefill, whose other rows' logits nobody reads; a graph that takes the rows to compute skips them),
  ``crop(length)``, ``cache_length``;
* :class:`DraftRunner` — ``reset()``, ``add_context(features [m, F], start)``,
  ``propose(anchor, pos, rows, temperature, uniforms [1, L] | None) -> Draft``: the block at positions
  ``pos ..``; ``rows`` (<= L) draft rows will be verified — fewer than L on a final partial block, where the
  drafter chooses its path over those rows alone (the rows past them get zero hidden states, docs/design.md).

Runners hold one request's state (KV caches) and are not thread safe; use one per concurrent request.

A backend that decodes many sequences per graph call says so with ``batching`` and gives the batch loop
(:class:`dflash2_trt.runtime.batch.BatchDecoder`) two more runners over ``slots`` sequences:

* :class:`BatchTargetRunner` — ``join() -> slot``, ``leave(slot)``, ``crop(slot, length)``,
  ``forward({slot: ids}) -> {slot: (logits, features)}``, ``cost_units({slot: rows})``, ``reserve(n)`` (room for n
  positions in every slot);
* :class:`BatchDraftRunner` — ``slot(b)`` (slot ``b`` as a :class:`DraftRunner`), ``add_contexts``, ``reserve(n)``
  and ``propose_batch``: every drafting sequence's proposal in one call.

Where ``batching`` is False the Generator serves submitted requests one after another on the B = 1 runners.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from dflash2_trt.errors import DFlash2Error


class BackendUnavailable(DFlash2Error):
    """The backend cannot run here (library missing, no GPU, no engines, engines built elsewhere)."""


@dataclass
class Draft:
    """One drafted block of L = bs - 1 rows (a single sequence)."""

    tokens: np.ndarray  # [L] int64 chosen drafts
    proposal: np.ndarray  # [L, K] float32 proposal q over the row's candidates (one-hot at T <= 0)
    cand: np.ndarray  # [L, K] int64 top-K candidates of each row
    # [L, V] proposal over the whole vocabulary, for drafters whose proposal is not confined to ``cand``
    # (DFlash v1 / no-selector sampling draws from the full softmax); None: ``proposal`` scattered at ``cand``
    vocab_proposal: np.ndarray | None = None
    # [L] row i's confidence before its draft is drawn (largest probability of the row's distribution given
    # rows < i), for drafters whose ``proposal`` is one-hot at T = 0; None: derived from the proposal at T > 0
    # (:func:`dflash2_trt.runtime.guard.verify_rows`)
    confidence: np.ndarray | None = None


def independent_draft(logits: np.ndarray, temperature: float, uniforms: np.ndarray | None, top_k: int) -> Draft:
    """Drafts without a selector (DFlash v1, selector-off ablation) from the rows' logits [L, V].

    T = 0: each row's argmax (first index among ties). T > 0: each row samples softmax(logits / T) by inverse
    CDF with its uniform. ``cand`` holds each row's top-K (sorted, argmax first) for the oracle top-K τ; the
    proposal used by rejection sampling is the full softmax (``vocab_proposal``). Mirrors the PyTorch
    drafter's no-selector branch.
    """
    logits = np.asarray(logits, dtype=np.float32)
    L, V = logits.shape
    K = max(1, min(int(top_k), V))
    part = np.argpartition(-logits, K - 1, axis=-1)[:, :K] if K < V else np.tile(np.arange(V), (L, 1))
    vals = np.take_along_axis(logits, part, -1)
    order = np.lexsort((part, -vals), axis=-1)  # by value desc, then index asc
    cand = np.take_along_axis(part, order, -1).astype(np.int64)  # [L, K]
    if temperature > 0:
        if uniforms is None:
            raise DFlash2Error("temperature > 0 needs uniforms [1, L]")
        z = logits / np.float32(temperature)
        e = np.exp(z - z.max(-1, keepdims=True))
        q = (e / e.sum(-1, keepdims=True)).astype(np.float32)  # [L, V]
        u = np.asarray(uniforms, dtype=np.float32).reshape(-1)[:L]
        tok = np.minimum((np.cumsum(q, -1) <= u[:, None]).sum(-1), V - 1).astype(np.int64)
        return Draft(tokens=tok, proposal=np.take_along_axis(q, cand, -1), cand=cand, vocab_proposal=q)
    tok = logits.argmax(-1).astype(np.int64)
    proposal = (cand == tok[:, None]).astype(np.float32)
    m = logits.max(-1, keepdims=True)
    conf = (1.0 / np.exp(logits - m).sum(-1)).astype(np.float32)  # [L] softmax probability of the argmax
    return Draft(tokens=tok, proposal=proposal, cand=cand, confidence=conf)


class TargetRunner(Protocol):
    vocab_size: int
    max_positions: int  # positions the exported caches can hold (--max-seq-len)
    eos_ids: set[int]  # stop tokens used when the caller passes none

    def reset(self) -> None: ...

    @property
    def cache_length(self) -> int: ...

    # ids at positions cache_length.. -> (logits [m, V] fp32, or [1, V] with last_logits; features [m, F])
    def forward(self, ids: list[int], last_logits: bool = False) -> tuple[np.ndarray, np.ndarray]: ...

    def crop(self, length: int) -> None: ...


class DraftRunner(Protocol):
    block_size: int
    num_draft_rows: int  # L = block_size - 1 (DFlash2Config.num_draft_rows)

    def reset(self) -> None: ...

    def add_context(self, feats: np.ndarray, start: int) -> None: ...

    def propose(self, anchor: int, pos: int, rows: int, temperature: float, uniforms: np.ndarray | None) -> Draft: ...


class BatchTargetRunner(Protocol):
    """The target over ``slots`` sequences, each in a slot with its own cache length."""

    slots: int
    vocab_size: int
    max_positions: int
    eos_ids: set[int]

    def join(self) -> int: ...  # the lowest free slot, now active with length 0

    def leave(self, slot: int) -> None: ...

    def free_slots(self) -> int: ...

    def crop(self, slot: int, length: int) -> None: ...

    def cost_units(self, rows: dict[int, int]) -> float: ...  # slot -> rows -> the forward's cost in row units

    def reserve(self, n: int) -> None: ...  # room for n positions in every slot

    # slot -> ids at its positions -> slot -> (logits [m, V] fp32, or [1, V] with last_logits; features [m, F])
    def forward(self, rows: dict[int, list[int]],
                last_logits: bool = False) -> dict[int, tuple[np.ndarray, np.ndarray]]: ...


class BatchDraftRunner(Protocol):
    """The drafter over ``slots`` sequences' draft contexts."""

    block_size: int
    num_draft_rows: int  # L = block_size - 1

    def slot(self, b: int) -> DraftRunner: ...

    def add_contexts(self, new: dict[int, tuple[np.ndarray, int]]) -> None: ...  # slot -> (feats [m, F], start)

    def reserve(self, n: int) -> None: ...  # room for n context positions in every slot

    def propose_batch(self, slots: Sequence[int], anchors: Sequence[int], positions: Sequence[int],
                      rows: Sequence[int], temperatures: Sequence[float],
                      uniforms: Sequence[np.ndarray | None]) -> list[Draft]: ...


class Backend(Protocol):
    """A model opened by one runtime. ``draft_runner(mode)`` takes a draft mode of
    :data:`dflash2_trt.vocabulary.DRAFT_MODES`; each runner serves one request at a time."""

    name: str  # one of dflash2_trt.vocabulary.BACKENDS

    @property
    def description(self) -> str: ...  # what it runs on, e.g. "ONNX Runtime (CPUExecutionProvider)"

    @property
    def draft_modes(self) -> tuple[str, ...]: ...  # the draft modes this model can run

    def check_draft_mode(self, mode: str) -> str: ...  # ``mode`` when it can run, else DFlash2Error naming them

    def target_runner(self) -> TargetRunner: ...

    def draft_runner(self, mode: str = "greedy") -> DraftRunner: ...

    @property
    def batching(self) -> bool: ...  # batch_target_runner / batch_draft_runner run here

    def batch_target_runner(self, slots: int) -> BatchTargetRunner: ...

    def batch_draft_runner(self, mode: str, slots: int) -> BatchDraftRunner: ...

    def panel_codes(self) -> dict[str, int]: ...  # loaded weight matrices by exact weight code; {}: none

    def op_library(self) -> str: ...  # one line: the custom-op library in use (where, its nodes) or not; "": n/a

    def close(self) -> None: ...

    def __enter__(self) -> Backend: ...

    def __exit__(self, *exc: Any) -> None: ...


class BackendBase:
    """Behaviour shared by the backends: the draft modes of an export (its ``manifest``; the PyTorch backend,
    which opens no export, overrides them), no batching, prefix cache or weight codes unless the backend has them,
    and the context manager (``with open_backend(...) as be:`` closes ``be``)."""

    name: str
    manifest: Any  # dflash2_trt.manifest.ExportManifest of the export folder

    @property
    def draft_modes(self) -> tuple[str, ...]:
        return tuple(self.manifest.draft_modes)

    def check_draft_mode(self, mode: str) -> str:
        return str(self.manifest.check_draft_mode(mode))

    @property
    def batching(self) -> bool:
        return False

    @property
    def prefix_cache(self) -> bool:
        """Whether its runners save and restore prefixes (:mod:`dflash2_trt.runtime.prefix_cache`)."""
        return False

    def batch_target_runner(self, slots: int) -> BatchTargetRunner:
        raise DFlash2Error(f"the {self.name} backend decodes one sequence at a time (no batched target)")

    def batch_draft_runner(self, mode: str, slots: int) -> BatchDraftRunner:
        raise DFlash2Error(f"the {self.name} backend decodes one sequence at a time (no batched drafter)")

    def panel_codes(self) -> dict[str, int]:
        return {}

    def op_library(self) -> str:
        """One line on the ONNX Runtime custom-op library; "" for a backend that has none to load."""
        return ""

    def close(self) -> None:
        """Free what the backend holds (sessions, engines, device memory); idempotent."""

    def __enter__(self):  # noqa: ANN204
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
