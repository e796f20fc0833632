"""PyTorch backend: the reference every other backend is tested against, behind the same runner protocol.

:class:`TorchBackend` opens a HF target (folder, .gguf or ``smollm2``) and a drafter folder — not an export
folder — and hands out :class:`TorchTargetRunner` (over :class:`~dflash2_trt.targets.adapter.TargetModel`, tapping the
drafter's layers) and :class:`TorchDraftRunner` (over :class:`~dflash2_trt.model.DFlash2Drafter`, one
request's draft context cache). The loop is :mod:`dflash2_trt.runtime.decoder`, as for every backend: greedy
(T = 0) output equals the target's own greedy decode; T > 0 uses rejection sampling.

This is the one runtime module that imports torch (lazily importable: nothing else in ``runtime`` imports it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.model.drafter import DFlash2Drafter, DraftContext
from dflash2_trt.runtime.protocol import BackendBase, Draft
from dflash2_trt.targets.adapter import TargetModel
from dflash2_trt.vocabulary import DRAFT_MODES, INDEPENDENT, check_draft_mode


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

    def forward(self, ids: list[int], last_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """ids [m] -> logits [m, V] fp32 (``last_logits``: [1, V], the last row's), context features [m, F]."""
        logits, feats = self.target.forward(torch.tensor(ids, dtype=torch.long))
        return (logits[-1:] if last_logits else logits).numpy(), feats.numpy()

    def crop(self, length: int) -> None:
        self.target.crop(length)


class TorchDraftRunner:
    """:class:`DFlash2Drafter` behind the runner protocol (holds one request's draft context cache).
    ``mode``: a draft mode of :data:`~dflash2_trt.vocabulary.DRAFT_MODES` ('independent': no selector)."""

    def __init__(self, drafter: DFlash2Drafter, mode: str = "greedy") -> None:
        self.drafter = drafter
        self.mode = mode
        self.block_size, self.num_draft_rows = drafter.config.block_size, drafter.config.num_draft_rows
        self.ctx = DraftContext()

    def reset(self) -> None:
        self.ctx = DraftContext()

    @torch.no_grad()
    def add_context(self, feats: np.ndarray, start: int) -> None:
        """feats [m, F] of positions start..start+m-1."""
        self.drafter.extend_context(self.ctx, torch.from_numpy(np.asarray(feats)).to(self.drafter.fc.weight.dtype),
                                    start)

    @torch.no_grad()
    def propose(self, anchor: int, pos: int, rows: int, temperature: float, uniforms: np.ndarray | None) -> Draft:
        if self.ctx.length != pos:
            raise DFlash2Error(f"draft context holds {self.ctx.length} positions, anchor is at {pos}")
        a = torch.tensor([anchor])
        h = self.drafter.block_forward(a, torch.tensor([pos]), self.ctx.k, self.ctx.v)
        u = None if uniforms is None else torch.from_numpy(np.asarray(uniforms, dtype=np.float32))
        d = self.drafter.draft_from_hidden(h, a, self.mode, temperature, u, verified_rows=rows)
        q = d.proposal[0]  # [L, V] proposal scattered into the vocabulary
        return Draft(tokens=d.tokens[0].numpy(), proposal=q.gather(-1, d.cand[0]).numpy(),
                     cand=d.cand[0].numpy(), vocab_proposal=q.numpy())


class TorchBackend(BackendBase):
    """A target + drafter pair in PyTorch (the reference). ``use_conv=False``: the convolutions-off ablation."""

    name = "torch"

    def __init__(self, target: str | Path | TargetModel, drafter: str | Path | DFlash2Drafter,
                 use_conv: bool | None = None) -> None:
        from dflash2_trt.model import load_drafter

        self.drafter = drafter if isinstance(drafter, DFlash2Drafter) else load_drafter(drafter)
        self.target = target if isinstance(target, TargetModel) else TargetModel.load(target)
        self.target.check_drafter(self.drafter.config)
        self.drafter.bind_target(self.target.embed_weight, self.target.lm_head_weight)
        self.drafter.set_ablation(use_conv=use_conv)

    @property
    def description(self) -> str:
        return f"PyTorch {torch.__version__} (CPU)"

    @property
    def draft_modes(self) -> tuple[str, ...]:
        return DRAFT_MODES if self.drafter.use_selector else (INDEPENDENT,)

    def check_draft_mode(self, mode: str) -> str:
        return check_draft_mode(mode, self.draft_modes, "this drafter")

    def target_runner(self) -> TorchTargetRunner:
        return TorchTargetRunner(self.target, self.drafter.config.target_layer_ids)

    def draft_runner(self, mode: str = "greedy") -> TorchDraftRunner:
        return TorchDraftRunner(self.drafter, self.check_draft_mode(mode))


class HFTokenizer:
    """A transformers tokenizer behind :class:`~dflash2_trt.runtime.tokenizer.TextTokenizer`'s interface (what
    :class:`dflash2_trt.api.Generator` uses), for the PyTorch backend's HF targets."""

    def __init__(self, tok) -> None:  # noqa: ANN001 - a transformers PreTrainedTokenizer
        if tok is None:
            raise DFlash2Error("the target has no tokenizer files")
        self.tok = tok
        self.chat_template: str | None = getattr(tok, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tok(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
