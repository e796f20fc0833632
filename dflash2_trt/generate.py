"""PyTorch speculative decoding (SPEC §4) — the oracle every backend is tested against.

The loop itself (prefill → (draft → select → verify → accept → commit)*, metrics, oracle top-K τ) is
:mod:`dflash2_trt.runtime.decoder`, shared with every backend; this module supplies the PyTorch runners:
:class:`TorchTargetRunner` over a HF :class:`TargetModel` and :class:`TorchDraftSource` over the PyTorch
drafter. Greedy (T = 0) output equals the target's own greedy decode; T > 0 uses rejection sampling,
which keeps the target's distribution. All randomness comes from one ``numpy.random.Generator``
(uniforms for the drafter's sampling enter as an input, as in the exported graphs).

Oracle top-K τ (SPEC §4, :func:`dflash2_trt.reference.oracle_count`) is measured with extra target passes
excluded from the timing: a cycle's oracle count is the number of leading rows whose target continuation
token is among that row's top-K drafter candidates (K = 1, the argmax, without the selector).
"""

from __future__ import annotations

import numpy as np
import torch

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.model.drafter import DFlash2Drafter, DraftContext
from dflash2_trt.reference import GenerationResult
from dflash2_trt.runtime import decoder
from dflash2_trt.runtime.base import Draft, DraftRunner
from dflash2_trt.target import TargetModel


class TorchTargetRunner:
    """:class:`TargetModel` behind the runner protocol (NumPy in/out); taps ``layer_ids`` for the drafter."""

    def __init__(self, target: TargetModel, layer_ids: list[int] | None = None) -> None:
        self.target = target
        self.layer_ids = list(layer_ids or [])
        self.vocab_size = target.vocab_size
        self.max_positions = target.max_positions
        self.eos_ids = target.eos_ids()

    def reset(self) -> None:
        self.target.reset(self.layer_ids)

    @property
    def cache_length(self) -> int:
        return self.target.cache_length

    def forward(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """ids [m] -> logits [m, V] fp32, context features [m, F]."""
        logits, feats = self.target.forward(torch.tensor(ids, dtype=torch.long))
        return logits.numpy(), feats.numpy()

    def crop(self, length: int) -> None:
        self.target.crop(length)


class TorchDraftSource:
    """:class:`DFlash2Drafter` behind the runner protocol (holds one request's draft context cache)."""

    def __init__(self, drafter: DFlash2Drafter, mode: str = "greedy") -> None:
        self.drafter = drafter
        self.mode = mode
        self.block_size = drafter.config.block_size
        self.ctx = DraftContext()

    def reset(self) -> None:
        self.ctx = DraftContext()

    @torch.no_grad()
    def add_context(self, feats: np.ndarray, start: int) -> None:
        """feats [m, F] of positions start..start+m-1."""
        self.drafter.extend_context(self.ctx, torch.from_numpy(np.asarray(feats)).to(self.drafter.fc.weight.dtype),
                                    start)

    @torch.no_grad()
    def propose(self, anchor: int, pos: int, temperature: float, uniforms: np.ndarray | None) -> Draft:
        if self.ctx.length != pos:
            raise DFlash2Error(f"draft context holds {self.ctx.length} positions, anchor is at {pos}")
        a = torch.tensor([anchor])
        h = self.drafter.block_hidden(a, torch.tensor([pos]), self.ctx.k, self.ctx.v, torch.arange(pos))
        u = None if uniforms is None else torch.from_numpy(np.asarray(uniforms, dtype=np.float32))
        d = self.drafter.draft_from_hidden(h, a, self.mode, temperature, u)
        q = d.proposal[0]  # [L, V] proposal scattered into the vocabulary
        return Draft(tokens=d.tokens[0].numpy(), proposal=q.gather(-1, d.cand[0]).numpy(),
                     cand=d.cand[0].numpy(), vocab_proposal=q.numpy())


def target_generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: set[int] | None = None,
    seed: int = 0,
) -> GenerationResult:
    """Plain autoregressive decoding of the target (the lossless reference and the speed baseline)."""
    return decoder.target_generate(TorchTargetRunner(target), prompt_ids, max_new_tokens, temperature, eos_ids, seed)


def speculative_generate(
    target: TargetModel,
    source: DraftRunner,
    prompt_ids: list[int],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    eos_ids: set[int] | None = None,
    seed: int = 0,
    measure_oracle: bool = True,
    layer_ids: list[int] | None = None,
) -> GenerationResult:
    """Speculative decoding of one prompt. ``layer_ids``: target layers feeding the drafter."""
    return decoder.speculative_generate(TorchTargetRunner(target, layer_ids), source, prompt_ids, max_new_tokens,
                                        temperature, eos_ids, seed, measure_oracle)
