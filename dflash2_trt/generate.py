"""PyTorch speculative decoding (SPEC §4) — the oracle every backend is tested against.

One request, a flat loop of named steps: prefill → (draft → select → verify → accept → commit)*.
Greedy (T = 0) output equals the target's own greedy decode; T > 0 uses rejection sampling, which keeps
the target's distribution. All randomness comes from one ``numpy.random.Generator`` (uniforms for the
drafter's sampling enter as an input, as in the exported graphs).

Oracle top-K τ (SPEC §4) is measured with extra target passes that are excluded from the timing: a
cycle's oracle count is the number of leading rows whose target continuation token is among that row's
top-K drafter candidates. The continuation is the committed prefix (accepted drafts + bonus) followed by
the target's argmax tokens (at T > 0 the sampled prefix is kept and only the rest is greedy).
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import torch

from dflash2_trt import reference as ref
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.model.drafter import DFlash2Drafter, Draft, DraftContext
from dflash2_trt.reference import GenerationResult
from dflash2_trt.target import TargetModel


class DraftSource(Protocol):
    """What the loop needs from a drafter (the PyTorch drafter, or a test's oracle)."""

    block_size: int

    def reset(self) -> None: ...

    def add_context(self, feats: torch.Tensor, start: int) -> None: ...

    def propose(self, anchor: int, pos: int, temperature: float, uniforms: torch.Tensor | None) -> Draft: ...


class TorchDraftSource:
    """Adapter from :class:`DFlash2Drafter` to the loop (holds one request's draft context cache)."""

    def __init__(self, drafter: DFlash2Drafter, mode: str = "greedy") -> None:
        self.drafter = drafter
        self.mode = mode
        self.block_size = drafter.config.block_size
        self.ctx = DraftContext()

    def reset(self) -> None:
        self.ctx = DraftContext()

    @torch.no_grad()
    def add_context(self, feats: torch.Tensor, start: int) -> None:
        self.drafter.extend_context(self.ctx, feats.to(self.drafter.fc.weight.dtype), start)

    @torch.no_grad()
    def propose(self, anchor: int, pos: int, temperature: float, uniforms: torch.Tensor | None) -> Draft:
        if self.ctx.length != pos:
            raise DFlash2Error(f"draft context holds {self.ctx.length} positions, anchor is at {pos}")
        a = torch.tensor([anchor])
        h = self.drafter.block_hidden(a, torch.tensor([pos]), self.ctx.k, self.ctx.v, torch.arange(pos))
        return self.drafter.draft_from_hidden(h, a, self.mode, temperature, uniforms)


def _sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(probs.shape[-1], p=probs))


def _first_token(logits: torch.Tensor, temperature: float, rng: np.random.Generator) -> int:
    """logits [V] -> the next token (argmax at T = 0, else a sample of softmax(logits / T))."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    return _sample(ref.softmax_t(logits.numpy(), temperature), rng)


def _check_prompt(prompt_ids: list[int], target: TargetModel, max_new_tokens: int) -> None:
    if not prompt_ids:
        raise DFlash2Error("empty prompt")
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise DFlash2Error(f"prompt token id {bad[0]} out of range [0, {target.vocab_size})")
    if len(prompt_ids) + 1 > target.max_positions:
        raise DFlash2Error(f"prompt of {len(prompt_ids)} tokens does not fit the target's "
                           f"{target.max_positions} positions")
    if max_new_tokens < 1:
        raise DFlash2Error(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def target_generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: set[int] | None = None,
    seed: int = 0,
) -> GenerationResult:
    """Plain autoregressive decoding of the target (the lossless reference and the speed baseline)."""
    _check_prompt(prompt_ids, target, max_new_tokens)
    rng = np.random.default_rng(seed)
    eos = target.eos_ids() if eos_ids is None else eos_ids
    res = GenerationResult(prompt_tokens=list(prompt_ids))
    t0 = time.perf_counter()
    target.reset([])
    logits, _ = target.forward(torch.tensor(prompt_ids))
    tok = _first_token(logits[-1], temperature, rng)
    res.tokens.append(tok)
    limit = min(max_new_tokens, target.max_positions - len(prompt_ids))
    while len(res.tokens) < limit and tok not in eos:
        logits, _ = target.forward(torch.tensor([tok]))
        tok = _first_token(logits[-1], temperature, rng)
        res.tokens.append(tok)
    res.elapsed_s = time.perf_counter() - t0
    return res


def speculative_generate(
    target: TargetModel,
    source: DraftSource,
    prompt_ids: list[int],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    eos_ids: set[int] | None = None,
    seed: int = 0,
    measure_oracle: bool = True,
    layer_ids: list[int] | None = None,
) -> GenerationResult:
    """Speculative decoding of one prompt. ``layer_ids``: target layers feeding the drafter."""
    _check_prompt(prompt_ids, target, max_new_tokens)
    rng = np.random.default_rng(seed)
    eos = target.eos_ids() if eos_ids is None else eos_ids
    L = source.block_size - 1
    res = GenerationResult(prompt_tokens=list(prompt_ids))
    oracle_s = 0.0
    t0 = time.perf_counter()

    # prefill: target KV cache + context features of every prompt position; first anchor
    target.reset(layer_ids if layer_ids is not None else [])
    source.reset()
    logits, feats = target.forward(torch.tensor(prompt_ids))  # [n, V], [n, F]
    anchor = _first_token(logits[-1], temperature, rng)
    res.tokens.append(anchor)
    source.add_context(feats, 0)
    pos = len(prompt_ids)  # anchor position
    limit = min(max_new_tokens, target.max_positions - len(prompt_ids))

    while len(res.tokens) < limit and anchor not in eos:
        n_rows = min(L, limit - len(res.tokens) - 1)  # final partial block verifies fewer rows
        # draft + select (all bs rows always run, as in training)
        uniforms = torch.from_numpy(rng.random((1, L), dtype=np.float32)) if temperature > 0 else None
        draft = source.propose(anchor, pos, temperature, uniforms)
        drafts = draft.tokens[0, :n_rows].tolist()
        # verify [anchor, d_1..d_n] at positions pos..pos+n
        v_logits, v_feats = target.forward(torch.tensor([anchor] + drafts))  # [n+1, V], [n+1, F]
        # accept
        if temperature <= 0:
            acc, bonus = ref.accept_greedy(np.asarray(drafts, dtype=np.int64), v_logits.numpy())
        else:
            p = ref.softmax_t(v_logits.numpy(), temperature)  # [n+1, V]
            q = draft.proposal[0, :n_rows].double().numpy()  # [n, V]
            acc, bonus = ref.accept_rejection(np.asarray(drafts, dtype=np.int64), q, p, rng)
        # commit: crop the target cache; committed positions become draft context
        target.crop(pos + acc + 1)
        source.add_context(v_feats[: acc + 1], pos)
        res.accepted.append(acc)
        res.proposed.append(n_rows)
        if measure_oracle:
            t_o = time.perf_counter()
            res.oracle_accepted.append(ref.oracle_count(
                lambda ids: target.forward(torch.tensor(ids))[0].numpy(), target.crop, draft.cand[0].numpy(),
                drafts, n_rows, acc, bonus, pos))
            oracle_s += time.perf_counter() - t_o
        new = drafts[:acc] + [bonus]
        for i, t in enumerate(new):
            if t in eos:
                new = new[: i + 1]
                break
        res.tokens.extend(new)
        pos += acc + 1
        anchor = new[-1]

    res.elapsed_s = time.perf_counter() - t0 - oracle_s
    return res
