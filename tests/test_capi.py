"""The C API runtime (runtime/): CMake builds, ctests, the C++ core against the Python reference, and the C loop
driven through ctypes with the ONNX Runtime runners behind its callbacks, token for token against
:mod:`dflash2_trt.runtime.decoder`.

Builds (each configured once per machine under ``build/``, rebuilt incrementally, ``-j2``):

* ``build/capi-tests`` — gcc, CPU parts, warnings as errors (the library the ctypes tests load); with the CUDA
  toolkit and the kernel-lens TensorRT headers it also compiles the TensorRT backend (never run here);
* ``build/capi-asan`` — clang with AddressSanitizer + UBSan (every C test) and the libFuzzer target;
* ``build/capi-aarch64`` — Debian's aarch64-linux-gnu cross compiler; the ctests run under qemu-aarch64.

The core vectors (``coreVectors.json``) are written here from the Python reference: step functions
(softmax, choice, greedy/rejection acceptance, statistics) and whole decoding loops of a toy Markov target and
drafters (selector-like and vocab-wide proposals, greedy and sampling, partial blocks, EOS, capacity),
recorded call by call with the numpy uniforms drawn; the ``coreVectors`` ctest replays them through the C++
core. Missing cmake / compilers / qemu make the build tests FAIL with the apt-get line (scripts/setup.sh
installs them).
"""

from __future__ import annotations

import ctypes as C
import importlib.util
import json
import os
import re
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from dflash2_trt import acceptance
from dflash2_trt import reference as ref
from dflash2_trt.bench.oracle import oracle_count
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.protocol import Draft, independent_draft
from dflash2_trt.runtime.request import GenerationRequest
from dflash2_trt.bench.capi import (BDA, BDP, BSLOT, BTC, BTF, DA, DONE, DP, TC, TF, TOKENS, TR, UNIFORM,
                                    BatchCallbacks, BatchInfo, Callbacks, ModelInfo, P, Request, Stats, declare)
from helpers import req

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "runtime"
BUILD = REPO / "build"
JOBS = "-j2"
APT = ("apt-get install -y cmake g++ clang libclang-rt-14-dev nlohmann-json3-dev libvalijson-dev libssl-dev "
       "g++-aarch64-linux-gnu qemu-user")


# --------------------------------------------------------------------------------------------------
# Core vectors from the Python reference
# --------------------------------------------------------------------------------------------------


_REAL_DEFAULT_RNG = np.random.default_rng


class _RecordingRng:
    """Wraps the numpy Generator the decoder creates and records each uniform it consumes, in order:
    ``random((1, L), float32)`` -> a "draft" draw, ``random()`` and ``choice(n, p=...)`` -> one "accept" draw.
    Results come from the real Generator; the uniform a ``choice`` consumed is read back from a copy of the
    bit generator's state taken before the call."""

    def __init__(self, seed: int, draws: list) -> None:
        self.g = _REAL_DEFAULT_RNG(seed)
        self.draws = draws

    def random(self, size=None, dtype=np.float64):  # noqa: ANN001, ANN201
        out = self.g.random(size, dtype=dtype)
        use = "draft" if dtype == np.float32 else "accept"
        self.draws.append({"use": use, "values": np.asarray(out, dtype=np.float64).reshape(-1).tolist()})
        return out

    def choice(self, a, p=None):  # noqa: ANN001, ANN201
        state = self.g.bit_generator.state
        out = self.g.choice(a, p=p)
        twin = np.random.Generator(type(self.g.bit_generator)())
        twin.bit_generator.state = state
        self.draws.append({"use": "accept", "values": [float(twin.random())]})
        assert twin.bit_generator.state == self.g.bit_generator.state  # choice consumed exactly one uniform
        return out


@contextmanager
def _recording_rng(draws: list):
    """While active, numpy.random.default_rng(seed) returns a recording wrapper (the decoder makes one)."""
    with mock.patch.object(np.random, "default_rng", lambda seed=None: _RecordingRng(seed, draws)):
        yield


class _ToyTarget:
    """A Markov target: logits depend on (token, position) only, so cropping the cache is exact.
    logits [m, V] fp32, features [m, 2] = (token, position)."""

    def __init__(self, V: int, max_positions: int, seed: int, calls: list) -> None:
        r = np.random.default_rng(seed)
        self.W = (r.standard_normal((V, V)) * 2).astype(np.float32)  # [V, V]
        self.P = (r.standard_normal((5, V)) * 0.5).astype(np.float32)  # [5, V]
        self.vocab_size, self.max_positions, self.eos_ids = V, max_positions, set()
        self.length = 0
        self.calls = calls

    def logits(self, tok: int, pos: int) -> np.ndarray:
        return self.W[tok] + self.P[pos % 5]  # [V] fp32

    def reset(self) -> None:
        self.calls.append({"op": "target_reset"})
        self.length = 0

    @property
    def cache_length(self) -> int:
        return self.length

    def forward(self, ids: list[int], last_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(self.length, self.length + len(ids))
        logits = np.stack([self.logits(t, int(p)) for t, p in zip(ids, pos)])  # [m, V]
        feats = np.stack([np.asarray(ids, np.float32), pos.astype(np.float32)], -1)  # [m, 2]
        self.length += len(ids)
        self.calls.append({"op": "forward", "ids": [int(t) for t in ids], "logits": logits.tolist()})
        return (logits[-1:] if last_logits else logits), feats

    def crop(self, length: int) -> None:
        self.calls.append({"op": "crop", "length": int(length)})
        self.length = min(self.length, length)


class _ToyDrafter:
    """Follows the toy target along its own drafted chain with noise growing by row (suffix decay).
    kind "selector": top-K candidates with a proposal confined to them (what a selector head returns);
    kind "vocab": :func:`independent_draft` (proposal over the whole vocabulary)."""

    def __init__(self, target: _ToyTarget, block_size: int, top_k: int, kind: str, seed: int, calls: list) -> None:
        self.t, self.block_size, self.top_k, self.kind = target, block_size, top_k, kind
        self.num_draft_rows = block_size - 1  # a hand-made runner: its L is given here
        self.noise = np.random.default_rng(seed + 1)
        self.length = 0
        self.calls = calls

    def reset(self) -> None:
        self.calls.append({"op": "drafter_reset"})
        self.length = 0

    def add_context(self, feats: np.ndarray, start: int) -> None:
        assert start == self.length and np.array_equal(feats[:, 1], np.arange(start, start + len(feats)))
        self.calls.append({"op": "add_context", "rows": int(feats.shape[0]), "start": int(start)})
        self.length += feats.shape[0]

    def propose(self, anchor: int, pos: int, n_rows: int, temperature: float, uniforms: np.ndarray | None) -> Draft:
        L, K = self.num_draft_rows, self.top_k
        prev, rows, toks, props, cands = anchor, [], [], [], []
        for r in range(L):
            row = self.t.logits(prev, pos + r) + (self.noise.standard_normal(self.t.vocab_size) * 0.4 * (r + 1)
                                                  ).astype(np.float32)  # [V]
            if self.kind == "vocab":
                rows.append(row)
                d = independent_draft(row[None], temperature, None if uniforms is None else uniforms[:, r:r + 1], K)
                prev = int(d.tokens[0])
                continue
            cand = np.argsort(-row, kind="stable")[:K]  # [K] top-K, lower id first among ties
            vals = row[cand]  # [K]
            if temperature > 0:
                q = ref._softmax(vals.astype(np.float64) / temperature)
                j = ref._sample_index(q, float(uniforms[0, r]))
            else:
                j = 0
                q = np.eye(K)[0]
            toks.append(int(cand[j]))
            props.append(q.astype(np.float32))
            cands.append(cand)
            prev = toks[-1]
        if self.kind == "vocab":
            draft = independent_draft(np.stack(rows), temperature, uniforms, K)
        else:
            draft = Draft(tokens=np.asarray(toks, np.int64), proposal=np.stack(props), cand=np.stack(cands))
        self.calls.append({
            "op": "propose", "anchor": int(anchor), "pos": int(pos), "rows": int(n_rows),
            "temperature": float(temperature),
            "uniforms": None if uniforms is None else uniforms.reshape(-1).astype(np.float64).tolist(),
            "tokens": draft.tokens.tolist(), "proposal": draft.proposal.astype(np.float64).tolist(),
            "cand": draft.cand.tolist(),
            "vocab_proposal": None if draft.vocab_proposal is None else draft.vocab_proposal.astype(np.float64).tolist(),
        })  # fmt: skip
        return draft


def _loop_case(name: str, speculative: bool, kind: str, temperature: float, max_new: int, eos: list[int],
               oracle: bool, max_positions: int = 200, bs: int = 5, V: int = 24, K: int = 6, seed: int = 0,
               proposer: str = "dflash2", ngram_rows: int = 0, sampling: dict | None = None) -> dict:
    calls: list = []
    draws: list = []
    target = _ToyTarget(V, max_positions, seed, calls)
    prompt = np.random.default_rng(seed + 7).integers(0, V, size=3 + seed % 5).tolist()
    drafter = _ToyDrafter(target, bs, K, kind, seed, calls)
    with _recording_rng(draws):
        if speculative:
            res = D.speculative_generate(target, drafter, prompt,
                                         req(max_new, temperature=temperature, eos_ids=set(eos), seed=seed,
                                             proposer=proposer, ngram_rows=ngram_rows or None, **(sampling or {})),
                                         D.DecodeHooks(oracle=oracle_count if oracle else None))
        else:
            res = D.target_generate(target, prompt, req(max_new, temperature=temperature, eos_ids=set(eos), seed=seed,
                                                        **(sampling or {})))
    stats = res.stats()
    return {
        "name": name, "speculative": speculative, "prompt": prompt, "max_new_tokens": max_new,
        "temperature": temperature, "eos_ids": eos, "measure_oracle": oracle, "vocab_size": V, "block_size": bs,
        "top_k": K, "max_positions": max_positions, "calls": calls, "uniforms": draws, "tokens": res.tokens,
        "accepted": res.accepted, "proposed": res.proposed, "oracle_accepted": res.oracle_accepted,
        "stats": stats, "proposer": proposer, "ngram_rows": ngram_rows,
        "proposers": [_PROPOSER_IDS[w] for w in res.proposers], "plain_steps": res.plain_steps,
        "sampling": sampling, "logprobs": _logprob_json(res.logprobs),
    }  # fmt: skip


_LOOP_SAMPLING = (  # the transforms of the loop vectors: all of them, then truncation, then penalties and bias
    {"logit_bias": [[3, 2.5], [7, -4.0]], "repetition_penalty": 1.3, "presence_penalty": 0.4,
     "frequency_penalty": 0.3, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "logprobs": True, "top_logprobs": 3},
    {"top_k": 6, "top_p": 0.8, "min_p": 0.02, "logprobs": True, "top_logprobs": 2},
    {"logit_bias": [[1, 3.0]], "presence_penalty": 0.5, "frequency_penalty": 0.2, "top_p": 0.85, "logprobs": True},
)

_PROPOSER_IDS = {"dflash2": 0, "ngram": 1}  # dfl2_proposer
_PROPOSER_NAMES = {i: w for w, i in _PROPOSER_IDS.items()}


def _lookup_cases(rng: np.random.Generator) -> list[dict]:
    """ngram.lookup on random token arrays (small vocabularies: repeats, overlapping matches, none; edge sizes)."""
    from dflash2_trt.runtime.ngram import lookup

    cases = []
    for i in range(80):
        T = int(rng.integers(0, 40)) if i % 8 else int(rng.integers(0, 4))
        tokens = rng.integers(0, int(rng.integers(1, 6)), T)  # [T] int64
        rows, max_n = int(rng.integers(0, 7)), int(rng.integers(1, 6))
        min_n = int(rng.integers(1, max_n + 1))
        cases.append({"tokens": tokens.tolist(), "rows": rows, "max_n": max_n, "min_n": min_n,
                      "want": lookup(tokens, rows, max_n, min_n)})
    return cases


def _proposer_choice_cases(rng: np.random.Generator) -> list[dict]:
    """ngram.ProposerChoice through random call sequences (every mode; measured and unmeasured times; with and
    without the drafter): each call's answer and both rates after it."""
    from dflash2_trt.runtime.ngram import PROPOSERS, ProposerChoice

    cases = []
    for i in range(30):
        mode = PROPOSERS[i % 3]
        prompt = rng.integers(0, 4, int(rng.integers(1, 12))).tolist()
        rows = int(rng.integers(1, 6))
        choice, ops = ProposerChoice(mode, prompt, rows), []
        for _ in range(40):
            kind = ["ngram", "pick", "preferred", "settle", "record", "extend", "pays"][int(rng.integers(7))]
            drafts = rng.integers(0, 4, int(rng.integers(0, 4))).tolist()
            t_plain = None if rng.random() < 0.3 else float(rng.uniform(0.001, 0.02))
            op: dict = {"op": kind}
            if kind == "ngram":
                op.update(rows=int(rng.integers(-1, 7)))
                op["want"] = choice.ngram(op["rows"])
            elif kind in ("pick", "preferred"):
                drafter = bool(rng.random() < 0.7)
                op.update(drafts=drafts, t_plain=t_plain, drafter=drafter)
                op["want"] = getattr(choice, kind)(drafts, t_plain, drafter)
            elif kind == "settle":
                op.update(drafts=drafts, who=[None, "dflash2", "ngram"][int(rng.integers(3))])
                choice.settle(drafts, op["who"])
            elif kind == "record":
                seconds = None if rng.random() < 0.3 else float(rng.uniform(0.001, 0.03))
                op.update(who=["dflash2", "ngram"][int(rng.integers(2))], committed=int(rng.integers(1, 7)),
                          seconds=seconds)
                choice.record(op["who"], op["committed"], seconds)
            elif kind == "extend":
                op.update(tokens=rng.integers(0, 4, int(rng.integers(1, 4))).tolist())
                choice.extend(op["tokens"])
            else:
                op.update(t_plain=t_plain, want=choice.lookup_pays(t_plain))
            op["rate"] = [choice.rate["dflash2"], choice.rate["ngram"]]
            ops.append(op)
        cases.append({"mode": mode, "prompt": prompt, "rows": rows, "ops": ops})
    return cases


def _rule_lookup_cases(rng: np.random.Generator) -> list[dict]:
    """batch.SpeculationRule.choose with prompt lookups: free keys and fallbacks (keys as the C core makes them,
    id * 2 + (1 for a lookup)), over fixed costs or measured ones (some unknown: the exploring branches)."""
    from dflash2_trt.runtime import batch as BT

    cases = []
    for i in range(80):
        n_active = int(rng.integers(1, 9))
        cands, free, fallbacks = {}, [], {}
        for sid in range(int(rng.integers(0, n_active + 1))):
            if rng.random() < 0.4:  # a lookup preferred
                key = sid * 2 + 1
                cands[key] = float(rng.uniform(1.0, 5.0))
                free.append(key)
            else:
                cands[sid * 2] = float(rng.uniform(1.0, 4.0))
                if rng.random() < 0.5:  # its lookup as the fallback
                    fallbacks[sid * 2] = (sid * 2 + 1, float(rng.uniform(1.0, 5.0)))
        records: list = []
        fixed: list = []
        if i % 4:
            a, b = float(rng.uniform(0.005, 0.03)), float(rng.uniform(0.0, 0.004))
            fixed = [a, b, float(rng.uniform(0.0, 0.03)), float(rng.uniform(-0.002, 0.01)) if i % 7 else 0.0]
            costs = BT.FixedCosts(plain_fn=lambda n, a=a, b=b: a + b * n, draft_s=fixed[2], verify_s=fixed[3])
        else:
            costs = BT.MeasuredCosts()
            for _ in range(int(rng.integers(0, 6))):
                kind = ["plain", "draft", "verify"][int(rng.integers(3))]
                rec = {"kind": kind, "n": int(rng.integers(1, 9)), "s": float(rng.uniform(0.001, 0.03))}
                {"plain": lambda r: costs.record_plain(r["n"], r["s"]), "draft": lambda r: costs.record_draft(r["s"]),
                 "verify": lambda r: costs.record_verify(r["s"])}[kind](rec)
                records.append(rec)
        rule = BT.SpeculationRule(costs=costs, adaptive=bool(i % 9))
        chosen = rule.choose(n_active, cands, free=free, fallbacks=fallbacks)
        cases.append({"adaptive": rule.adaptive, "costs": fixed, "records": records, "n_active": n_active,
                      "candidates": [[k, t] for k, t in cands.items()], "free": free,
                      "fallbacks": [[k, fk, t] for k, (fk, t) in fallbacks.items()], "chosen": sorted(chosen)})
    return cases


def _rule_cases(rng: np.random.Generator) -> list[dict]:
    """batch.SpeculationRule over batch.MeasuredCosts: random recorded step costs (none, some, many; below and above
    16 samples), prefill chunks and whole steps, priors and windows, candidates' committed tokens -> t_plain(n) for
    n = 0..10, a chunked prompt row's and a whole step's seconds (the prefill budget's), the chosen set, and the
    realized check's answers to a run of questions (holds_plain: probes counted)."""
    from collections import deque

    from dflash2_trt.runtime import batch as BT

    cases = []
    steps_rng = np.random.default_rng(2468)  # the realized check's records: their own stream
    prefill_rng = np.random.default_rng(1357)  # the prefill chunks': theirs
    for i in range(60):
        costs = BT.MeasuredCosts()
        records = []
        for _ in range(int(rng.integers(0, 40)) if i % 6 else 0):
            kind, n = ["plain", "draft", "verify"][int(rng.integers(3))], int(rng.integers(1, 9))
            sec = float(rng.uniform(0.001, 0.05)) * (1.0 if kind == "plain" else 0.3 if kind == "draft"
                                                     else float(rng.uniform(-0.2, 1.0)))  # a verify may be < 0 (noise)
            if kind == "plain":
                costs.record_plain(n, sec)
            elif kind == "draft":
                costs.record_draft(sec)
            else:
                costs.record_verify(sec)
            records.append({"kind": kind, "n": n, "s": sec})
        for _ in range(int(prefill_rng.integers(0, 24)) if i % 3 else 0):  # prefill chunks of 1..64 rows
            rec = {"kind": "prefill", "n": int(prefill_rng.integers(1, 65)),
                   "s": float(prefill_rng.uniform(0.001, 0.1))}
            costs.record_prefill(rec["n"], rec["s"])
            records.append(rec)
        # whole steps at few batch sizes (each gets compared) and the check's answers between them (a held step
        # counts toward the next probe; a weighed one starts the count again)
        for _ in range(int(steps_rng.integers(0, 60)) if i % 6 else 0):
            kind, n = ["step", "step", "ask"][int(steps_rng.integers(3))], int(steps_rng.integers(1, 4))
            if kind == "ask":
                records.append({"kind": kind, "n": n, "s": 0.0, "holds": costs.holds_plain(n)})
                continue
            drafted = bool(steps_rng.integers(2))  # a drafting step makes n + 0..2n tokens in 1-3x the time
            tokens = n + (int(steps_rng.integers(0, 2 * n + 1)) if drafted else 0)
            sec = float(steps_rng.uniform(0.001, 0.05)) * (float(steps_rng.uniform(1, 3)) if drafted else 1.0)
            weighed = drafted or bool(steps_rng.integers(2))
            costs.record_step(n, drafted, tokens, sec, weighed)
            records.append({"kind": kind, "n": n, "s": sec, "drafted": drafted, "tokens": tokens, "weighed": weighed})
        holds_n = steps_rng.integers(1, 4, 40).tolist()
        holds = [costs.holds_plain(n) for n in holds_n]
        rule = BT.SpeculationRule(prior_tau=float(rng.uniform(1, 5)), prior_weight=float(rng.uniform(0.5, 4)),
                                  window=int(rng.integers(1, 8)), adaptive=bool(i % 10), costs=costs)
        n_active = int(rng.integers(1, 9))
        committed = [deque(rng.integers(1, 9, int(rng.integers(0, 10))).tolist(), maxlen=rule.window)
                     for _ in range(int(rng.integers(0, n_active + 1)))]
        cands = {10 + j: rule.tau(c) for j, c in enumerate(committed)}
        cases.append({
            "records": records, "prior_tau": rule.prior_tau, "prior_weight": rule.prior_weight,
            "window": rule.window, "adaptive": rule.adaptive, "n_active": n_active,
            "committed": [list(c) for c in committed], "tau": list(cands.values()),
            "plain": [costs.plain(n) for n in range(11)], "chosen": sorted(rule.choose(n_active, cands)),
            "prefill_row": costs.prefill_row(), "step": costs.step(),
            "holds_n": holds_n, "holds": holds,
        })  # fmt: skip
    return cases


def _guard_state(g) -> dict:  # noqa: ANN001
    """Every field of an AcceptanceGuard the C twin keeps, after a call."""
    return {"t_step": g.t_step, "break_even": g.break_even(), "plain_next": g.plain_next(), "plain_left": g.plain_left,
            "backoff": g.backoff, "need": g.need, "calibrating": g.calibrating, "switches": g.switches,
            "probes": g.probes}


GUARD_BAD_CONFIGS = ({"window": 0}, {"probe_window": 0}, {"window": 2, "probe_window": 3}, {"backoff": 0},
                     {"backoff": 9, "max_backoff": 8}, {"cost_ratio": 0.0}, {"min_cycles": 0},
                     {"window": 2, "min_cycles": 3}, {"z": -1.0}, {"min_spread": -0.1})


def _guard_cases(rng: np.random.Generator) -> list[dict]:
    """guard.AcceptanceGuard driven as the decoder drives it (plain_next() before each step, then record_step or
    record_cycle; now and then a plain step the guard did not ask for, as a prompt lookup without a match makes):
    step and cycle times varying with outliers (20x slower, 20x faster), drafters that pay, that do not, and that
    change along the request; measured and fixed cost ratios, small and default windows, z = 0, no spread floor.
    Every field after every call (t_step and break_even as float64 bits)."""
    from dflash2_trt.runtime.guard import AcceptanceGuard, GuardConfig

    cases = []
    for i in range(40):
        if i % 4 == 0:
            kw: dict = {}  # the defaults, measured cost
        else:
            window = int(rng.integers(1, 9))
            kw = {"window": window, "min_cycles": int(rng.integers(1, window + 1)),
                  "probe_window": int(rng.integers(1, window + 1)), "z": [0.0, 1.0, 1.7][i % 3],
                  "min_spread": [0.5, 0.0, 0.3][(i // 3) % 3], "backoff": int(rng.integers(1, 5))}
            kw["max_backoff"] = kw["backoff"] * int(rng.integers(1, 5))
            if i % 5 == 1:
                kw["cost_ratio"] = float(rng.uniform(1.1, 3.0))
        g = AcceptanceGuard(GuardConfig(**kw))
        t_step, t_cycle = float(rng.uniform(0.005, 0.03)), float(rng.uniform(1.2, 3.5))  # seconds; cycle / step
        good = [float(rng.uniform(0.5, 6.0)) for _ in range(3)]  # mean drafts accepted in each third of the request
        n_ops = 200 if i % 4 == 0 else 80
        ops = []
        for k in range(n_ops):
            jitter = float(rng.uniform(0.7, 1.3)) * (20.0 if rng.random() < 0.04 else 0.05 if rng.random() < 0.04
                                                     else 1.0)
            if g.plain_next() or (k and rng.random() < 0.05):
                op = {"op": "step", "seconds": t_step * jitter}
                g.record_step(op["seconds"])
            else:
                drafts = 7 if i % 2 else 15
                acc = int(min(drafts, rng.poisson(good[3 * k // n_ops])))
                op = {"op": "cycle", "tokens": acc + 1, "seconds": t_step * t_cycle * jitter}
                g.record_cycle(op["tokens"], op["seconds"])
            op["want"] = _guard_state(g)
            ops.append(op)
        cases.append({"config": {k: v for k, v in GuardConfig(**kw).__dict__.items()}, "ops": ops})
    return cases


def _independent_cases(rng: np.random.Generator) -> list[dict]:
    """protocol.independent_draft (drafts of a head without a selector): rows of random logits, some with values
    tied (the argmax's first index; the top-K order, index ascending among equal values), vocabularies across the
    pairwise-summation block boundaries, T = 0 (argmax, one-hot proposal) and T > 0 (inverse-CDF samples of the
    float32 softmax by the rows' uniforms) -> tokens, proposals over the candidates, candidates (compared where no
    value ties at the K-th place: numpy's argpartition picks any of them), the vocabulary proposal."""
    from dflash2_trt.runtime.protocol import independent_draft

    cases = []
    for i in range(40):
        L, V = int(rng.integers(1, 9)), int(rng.choice([1, 5, 8, 9, 100, 129, 300, 1000]))
        logits = (rng.standard_normal((L, V)) * 3).astype(np.float32)
        if i % 3 == 0:
            logits = np.round(logits * 2) / 2  # ties
        T = 0.0 if i % 2 == 0 else float(rng.choice([0.3, 0.8, 1.0, 1.7]))
        K = int(rng.integers(1, 12))
        u = rng.random(L).astype(np.float32)
        d = independent_draft(logits, T, u[None] if T > 0 else None, K)
        k = d.cand.shape[1]
        kth = np.sort(logits, -1)[:, ::-1][:, k - 1] if k < V else None
        unique = kth is None or bool(all((logits[r] == kth[r]).sum() == 1 for r in range(L)))
        cases.append({"logits": logits.ravel().tolist(), "L": L, "V": V, "temperature": T, "top_k": K,
                      "uniforms": u.tolist(), "tokens": d.tokens.tolist(), "proposal": d.proposal.ravel().tolist(),
                      "cand": d.cand.ravel().tolist(), "cand_unique": unique,
                      "vocab_proposal": None if d.vocab_proposal is None else d.vocab_proposal.ravel().tolist()})
    return cases


def _sampling_config(rng: np.random.Generator, V: int, i: int) -> dict:
    """One random set of runtime/sampling.py transforms over a vocabulary of V (each transform on in some cases, all
    neutral in one, logprobs with a random top_logprobs count)."""
    on = [bool(b) for b in rng.integers(0, 2, 6)] if i % 7 else [False] * 6
    bias = [(int(t), float(np.round(rng.uniform(-5, 5), 2))) for t in rng.integers(0, V, int(rng.integers(1, 4)))]
    return {"logit_bias": bias if on[0] else [],
            "repetition_penalty": float(rng.choice([0.7, 1.3, 2.0])) if on[1] else 1.0,
            "presence_penalty": float(rng.uniform(-2, 2)) if on[2] else 0.0,
            "frequency_penalty": float(rng.uniform(-2, 2)) if on[2] and i % 2 else 0.0,
            "top_k": int(rng.integers(1, V + 2)) if on[3] else 0,
            "top_p": float(rng.choice([0.05, 0.5, 0.9, 0.99])) if on[4] else 1.0,
            "min_p": float(rng.choice([0.01, 0.1, 0.5])) if on[5] else 0.0,
            "logprobs": True, "top_logprobs": int(rng.integers(0, 6))}


def _finite(x: np.ndarray) -> list:
    """float64 values as JSON (-inf as null)."""
    return [None if not np.isfinite(v) else float(v) for v in np.asarray(x, dtype=np.float64).ravel()]


def _logprob_json(lps: list) -> list[dict]:  # noqa: ANN001
    return [{"token": t.token, "logprob": None if not np.isfinite(t.logprob) else t.logprob,
             "top_ids": [i for i, _ in t.top], "top_logprobs": [x for _, x in t.top]} for t in lps]


def _sampling_cases(rng: np.random.Generator) -> list[dict]:
    """runtime/sampling.py's Sampler on the same logits: rows [m, V] of random target logits (some with tied values,
    vocabularies across the pairwise-summation block boundaries, top_k past V), a random set of transforms, the
    prompt the penalties count and the drafts a verify's rows see -> the transformed logits, the law at T (greedy:
    none) and the logprobs of the m tokens the rows emit (with their top ones); and Sampler.redraw of an independent
    draft under them (its tokens, proposals and vocabulary proposal)."""
    from dflash2_trt.runtime.sampling import Sampler

    cases = []
    for i in range(48):
        m, V = int(rng.integers(1, 6)), int(rng.choice([2, 5, 8, 9, 100, 129, 300]))
        rows = (rng.standard_normal((m, V)) * 3).astype(np.float32)
        if i % 3 == 0:
            rows = np.round(rows * 2) / 2  # ties
        T = 0.0 if i % 4 == 0 else float(rng.choice([0.3, 0.8, 1.0, 1.7]))
        cfg = _sampling_config(rng, V, i)
        prompt = rng.integers(0, V, int(rng.integers(1, 12))).tolist()
        drafts = rng.integers(0, V, m - 1).tolist()
        r = GenerationRequest(max_new_tokens=8, temperature=T, **cfg)
        sampler = Sampler(r, prompt, V)
        x = sampler.logits(rows, drafts)
        law = sampler.law(x, T) if T > 0 else None
        tokens = drafts + [int(rng.integers(0, V))]
        sampler.commit(tokens)
        case = {"V": V, "m": m, "temperature": T, "sampling": cfg, "prompt": prompt, "rows": rows.ravel().tolist(),
                "drafts": drafts, "tokens": tokens, "logits": _finite(x), "law": None if law is None else _finite(law),
                "logprobs": _logprob_json(sampler.logprobs)}
        if T > 0:  # an independent draft of L rows drawn again under the transforms
            L, K = int(rng.integers(1, 5)), int(rng.integers(1, 6))
            d = independent_draft((rng.standard_normal((L, V)) * 3).astype(np.float32), T,
                                  rng.random((1, L)).astype(np.float32), K)
            u = rng.random((1, L)).astype(np.float32)
            n_rows = int(rng.integers(1, L + 1))
            redrawn = sampler.redraw(d, u, n_rows)
            case["redraw"] = {"L": L, "K": d.cand.shape[1], "n_rows": n_rows, "uniforms": u.ravel().tolist(),
                              "tokens": d.tokens.tolist(), "proposal": d.proposal.ravel().tolist(),
                              "cand": d.cand.ravel().tolist(), "vocab_proposal": d.vocab_proposal.ravel().tolist(),
                              "want_tokens": redrawn.tokens.tolist(),
                              "want_proposal": redrawn.proposal.ravel().astype(np.float64).tolist(),
                              "want_vocab_proposal": redrawn.vocab_proposal.ravel().astype(np.float64).tolist()}
        cases.append(case)
    return cases


def write_core_vectors(path: Path) -> dict:
    """Reference vectors for the coreVectors ctest (fresh random inputs from a fixed seed)."""
    rng = np.random.default_rng(1234)
    v: dict = {"softmax": [], "choice": [], "accept_greedy": [], "accept_rejection": [], "stats": [], "loops": []}
    for n in (1, 7, 8, 100, 129, 1000, 4097):  # the pairwise-summation block boundaries
        logits = (rng.standard_normal(n) * 3).astype(np.float32)
        T = float(rng.choice([0.3, 1.0, 1.7]))
        v["softmax"].append({"logits": logits.tolist(), "temperature": T,
                             "probs": acceptance.softmax_t(logits, T).tolist()})
    for _ in range(40):
        p = acceptance.softmax_t((rng.standard_normal(50) * 2).astype(np.float32), 1.0)
        g = np.random.default_rng(int(rng.integers(1 << 30)))
        state = g.bit_generator.state
        idx = int(g.choice(50, p=p))
        twin = np.random.default_rng()
        twin.bit_generator.state = state
        v["choice"].append({"p": p.tolist(), "u": float(twin.random()), "index": idx})
    for _ in range(30):
        n, V = int(rng.integers(0, 6)), 16
        logits = rng.integers(-3, 4, size=(n + 1, V)).astype(np.float32)  # small integers: ties on purpose
        target = logits.argmax(-1)
        drafts = np.where(rng.random(n) < 0.7, target[:n], rng.integers(0, V, n))
        a, b = acceptance.accept_greedy(drafts, logits)
        v["accept_greedy"].append({"drafts": drafts.tolist(), "logits": logits.tolist(), "accepted": a, "bonus": b})
    for _ in range(60):
        n, V = int(rng.integers(0, 6)), 20
        p = acceptance.softmax_t((rng.standard_normal((n + 1, V)) * 2).astype(np.float32), 1.0)
        q = acceptance.softmax_t((rng.standard_normal((n, V)) * 2).astype(np.float32), 1.0)
        if n and rng.random() < 0.3:
            q[0] = p[0]  # resid sums to 0: the fallback to p
        if n and rng.random() < 0.3:
            q[-1, :] = 0.0  # q(d) = 0: rejected without a uniform
            q[-1, 0] = 1.0
        drafts = np.array([int(np.argmax(r)) if rng.random() < 0.6 else int(rng.integers(V)) for r in q], np.int64)
        draws: list = []
        rec = _RecordingRng(int(rng.integers(1 << 30)), draws)
        a, b = acceptance.accept_rejection(drafts, q, p, rec)
        v["accept_rejection"].append({"drafts": drafts.tolist(), "q": q.tolist(), "p": p.tolist(), "uniforms": draws,
                                      "accepted": a, "bonus": b})
    for _ in range(20):
        c = int(rng.integers(0, 8))
        proposed = rng.integers(1, 6, size=c)
        accepted = [int(rng.integers(0, k + 1)) for k in proposed]
        v["stats"].append({"accepted": accepted, "proposed": proposed.tolist(),
                           "want": acceptance.acceptance_stats(accepted, proposed.tolist())})
    v["rule"] = _rule_cases(rng)
    lookup_rng = np.random.default_rng(4321)  # its own stream: the vectors above stay as they were
    v["lookup"] = _lookup_cases(lookup_rng)
    v["proposer_choice"] = _proposer_choice_cases(lookup_rng)
    v["rule_lookup"] = _rule_lookup_cases(lookup_rng)
    v["guard"] = _guard_cases(np.random.default_rng(5678))  # its own stream
    v["independent"] = _independent_cases(np.random.default_rng(8765))  # its own stream
    v["guard_bad_configs"] = list(GUARD_BAD_CONFIGS)
    v["sampling"] = _sampling_cases(np.random.default_rng(9876))  # its own stream
    v["loops"] = [
        _loop_case("greedy-selector-oracle", True, "selector", 0.0, 40, [], True, seed=1),
        _loop_case("greedy-vocab", True, "vocab", 0.0, 33, [], False, seed=2),
        _loop_case("sample-selector", True, "selector", 0.9, 40, [], False, seed=3),
        _loop_case("sample-vocab", True, "vocab", 0.7, 37, [], True, seed=4),
        _loop_case("greedy-eos", True, "selector", 0.0, 60, [5, 11], False, seed=5),
        _loop_case("capacity-partial", True, "selector", 0.0, 500, [], False, max_positions=30, bs=8, seed=6),
        _loop_case("bs2", True, "vocab", 0.5, 20, [], False, bs=2, seed=7),
        _loop_case("ar-greedy", False, "selector", 0.0, 25, [], False, seed=8),
        _loop_case("ar-sample", False, "selector", 1.1, 25, [3], False, seed=9),
        # prompt lookup: lookup cycles accepted, the drafter's pending context joining in one pass (auto), plain
        # steps where a lookup has no match (ngram), one-hot rejection sampling at T > 0
        _loop_case("ngram-greedy", True, "selector", 0.0, 70, [], True, seed=10, proposer="ngram"),
        _loop_case("auto-greedy", True, "selector", 0.0, 70, [], False, bs=3, seed=11, proposer="auto"),
        _loop_case("auto-sample", True, "vocab", 0.3, 70, [], False, bs=2, seed=16, proposer="auto", ngram_rows=3),
        _loop_case("ngram-sample", True, "selector", 0.3, 60, [], False, seed=13, proposer="ngram"),
        # the sampling transforms at every row (runtime/sampling.py) and the logprobs of the chosen tokens
        _loop_case("transforms-greedy", True, "selector", 0.0, 40, [], False, seed=17, sampling=_LOOP_SAMPLING[0]),
        _loop_case("transforms-sample", True, "selector", 0.8, 40, [], False, seed=18, sampling=_LOOP_SAMPLING[1]),
        _loop_case("transforms-vocab", True, "vocab", 0.9, 40, [], False, seed=19, sampling=_LOOP_SAMPLING[2]),
        _loop_case("transforms-ar", False, "selector", 0.7, 25, [], False, seed=20, sampling=_LOOP_SAMPLING[1]),
        _loop_case("transforms-auto", True, "selector", 0.5, 50, [], False, bs=3, seed=21, proposer="auto",
                   sampling=_LOOP_SAMPLING[0]),
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(v))
    tmp.replace(path)
    return v


# --------------------------------------------------------------------------------------------------
# Builds
# --------------------------------------------------------------------------------------------------


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({' '.join(map(str, cmd))}):\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}")
    return proc


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} not found: {APT} (scripts/setup.sh does this)")
    return path


def _cmake_build(build: Path, args: list[str]) -> Path:
    cmake = _need("cmake")
    if not (build / "CMakeCache.txt").exists():
        # -O1 without a build type: half the compile time of Release on 2 cores; the tests need no speed
        _run([cmake, "-S", str(RUNTIME), "-B", str(build), "-DCMAKE_BUILD_TYPE=None", "-DCMAKE_C_FLAGS=-O1",
              "-DCMAKE_CXX_FLAGS=-O1", "-DDFLASH2_WERROR=ON", *args], f"cmake configure {build.name}")
    _run([cmake, "--build", str(build), JOBS], f"cmake build {build.name}")
    return build


def _trt_args() -> list[str]:
    """Compile the TensorRT backend when the CUDA toolkit and the kernel-lens headers are here."""
    spec = importlib.util.find_spec("kernel_lens")
    inc = Path(spec.submodule_search_locations[0]) / "include" / "tensorrt" if spec else None
    cuda = Path("/usr/local/cuda/include/cuda_runtime_api.h")
    if inc is None or not (inc / "NvInferRuntime.h").exists() or not cuda.exists():
        return []
    return ["-DDFLASH2_RUNTIME_TENSORRT=ON", f"-DTensorRT_INCLUDE_DIR={inc}", "-DCUDAToolkit_ROOT=/usr/local/cuda"]


@pytest.fixture(scope="session")
def vectors_path() -> Path:
    path = BUILD / "capi-vectors" / "coreVectors.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_core_vectors(path)
    return path


@pytest.fixture(scope="session")
def capi_build(vectors_path) -> Path:
    return _cmake_build(BUILD / "capi-tests", [f"-DDFLASH2_CORE_VECTORS={vectors_path}", "-DDFLASH2_RUNTIME_STATIC=ON",
                                               *_trt_args()])


def _ctest(build: Path, env: dict | None = None) -> str:
    proc = subprocess.run(["ctest", "--test-dir", str(build), "--output-on-failure"], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        pytest.fail(f"ctest in {build.name} failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


# --------------------------------------------------------------------------------------------------
# ctests: header as C99 / C++17, error paths, core vectors, example
# --------------------------------------------------------------------------------------------------


def test_ctest_native(capi_build):
    """Header compiles as C99 and C++17 with -Wall -Wextra -Werror; capiC (every error path + toy runs);
    coreVectors (the C++ core equals the Python reference); the example fails cleanly without TensorRT."""
    out = _ctest(capi_build)
    for name in ("headerC99", "headerCxx17", "capiC", "coreVectors", "exampleUnavailable"):
        assert re.search(rf"{name} \.+\s+Passed", out), out


def test_shared_and_static_libraries(capi_build):
    """libdflash2.so exports only the dfl2_* C API (hidden C++ internals); libdflash2.a holds the same API."""
    so = _run(["nm", "-D", "--defined-only", str(capi_build / "lib" / "libdflash2.so")], "nm").stdout
    exported = {line.split()[-1] for line in so.splitlines() if " T " in line}
    assert "dfl2_session_generate" in exported and all(n.startswith("dfl2_") for n in exported), exported
    header = (RUNTIME / "include" / "dflash2" / "dflash2.h").read_text()
    assert exported == set(re.findall(r"DFL2_API [^;]*?\b(dfl2_\w+)\(", header))  # every declared function, no more
    static = _run(["nm", "--defined-only", str(capi_build / "lib" / "libdflash2.a")], "nm").stdout
    assert " T dfl2_session_generate" in static


def test_core_vectors_exercise_every_branch(vectors_path):
    """The vectors the ctest replays cover what they claim: acceptance and rejection, the resid fallback,
    q(d) = 0, partial blocks, EOS cuts, capacity limits, vocab-wide proposals."""
    v = json.loads(vectors_path.read_text())
    rej = v["accept_rejection"]
    assert any(c["accepted"] == len(c["drafts"]) > 0 for c in rej)
    assert any(c["accepted"] < len(c["drafts"]) for c in rej)
    loops = {c["name"]: c for c in v["loops"]}
    for name, c in loops.items():
        if c["speculative"]:
            assert sum(c["accepted"]) > 0, name  # drafts were accepted ...
            assert any(a < p for a, p in zip(c["accepted"], c["proposed"])), name  # ... and rejected
    assert loops["capacity-partial"]["proposed"][-1] < 7  # a final partial block
    assert len(loops["capacity-partial"]["tokens"]) == 30 - len(loops["capacity-partial"]["prompt"])
    assert loops["greedy-eos"]["tokens"][-1] in (5, 11) and len(loops["greedy-eos"]["tokens"]) < 60
    assert any(c["op"] == "propose" and c["vocab_proposal"] for c in loops["sample-vocab"]["calls"])
    assert any(d["use"] == "draft" for d in loops["sample-selector"]["uniforms"])
    rule = v["rule"]  # the speculation rule: every outcome, measured costs interpolated
    assert any(c["tau"] and not c["records"] and not c["chosen"] for c in rule)  # explore: plain first
    assert any(len(c["tau"]) > 1 and c["records"] and len(c["chosen"]) == len(c["tau"]) and c["adaptive"] for c in rule)
    assert any(len(c["tau"]) > 1 and c["adaptive"] and None not in c["plain"] and len(c["chosen"]) == 1
               and {"draft", "verify"} - {r["kind"] for r in c["records"]} for c in rule)  # explore: one drafts
    assert any(c["records"] and 0 < len(c["chosen"]) < len(c["tau"]) for c in rule)  # some draft, some not
    assert any(c["records"] and c["tau"] and not c["chosen"] and None not in c["plain"] for c in rule)
    assert any(not c["adaptive"] and c["tau"] for c in rule)
    ind = v["independent"]  # independent drafts: argmax and samples, ties at the K-th place and none
    assert {c["temperature"] > 0 for c in ind} == {True, False} and {c["cand_unique"] for c in ind} == {True, False}
    # the realized check: plain first, steps held, a probe (a False inside a run of Trues), steps weighed
    assert any(all(c["holds"]) for c in rule) and any("False, False, False, False" in str(c["holds"]) for c in rule)
    assert any("True, False, True" in str(c["holds"]) for c in rule)
    # the prefill budget's costs: measured and not
    assert any(c["prefill_row"] is not None and c["step"] is not None for c in rule)
    assert any(c["prefill_row"] is None and c["step"] is not None for c in rule)
    # prompt lookup: matches and none; every answer of the choice; the rule's free keys and fallbacks taken
    assert any(c["want"] for c in v["lookup"]) and any(not c["want"] and len(c["tokens"]) > 2 for c in v["lookup"])
    ops = [o for c in v["proposer_choice"] for o in c["ops"]]
    assert {o["op"] for o in ops} == {"ngram", "pick", "preferred", "settle", "record", "extend", "pays"}
    assert {o["want"] for o in ops if o["op"] == "pick"} == {"dflash2", "ngram", None}
    assert {o["want"] for o in ops if o["op"] == "pays"} == {True, False}
    rl = v["rule_lookup"]
    assert any(set(c["free"]) & set(c["chosen"]) and {k for k in c["chosen"] if k % 2 == 0} for c in rl)
    assert any({fk for _, fk, _ in c["fallbacks"]} & set(c["chosen"]) for c in rl)
    assert any(c["records"] and c["candidates"] and len(c["chosen"]) == 1 for c in rl)  # exploring with lookups
    for name in ("ngram-greedy", "ngram-sample", "auto-greedy", "auto-sample"):
        c = loops[name]
        looked = [a for a, w in zip(c["accepted"], c["proposers"]) if w == 1]
        assert looked and sum(looked) > 0, name  # lookup cycles, drafts accepted
        assert (c["plain_steps"] > 0) == name.startswith("ngram"), name  # ngram: no match = a plain step
    calls = loops["auto-sample"]["calls"]  # lookup cycles' features join the drafter's context in one later call
    assert max(x["rows"] for x in calls if x["op"] == "add_context") > loops["auto-sample"]["block_size"]
    assert not any(x["op"] in ("add_context", "propose") for x in loops["ngram-greedy"]["calls"])


def test_guard_vectors_exercise_the_rule(vectors_path):
    """The guard vectors the ctest replays (every field after every call) take every branch: switches and probes,
    the backoff doubled to its cap and reset, calibration, fixed and measured break-evens, plain steps the guard did
    not ask for; the step times vary with outliers, so a guard keeping the last step's time in place of the running
    mean makes other decisions on them (the C twin with that bug fails coreVectors on 40 of 40 cases)."""
    from dflash2_trt.runtime.guard import AcceptanceGuard, GuardConfig

    cases = json.loads(vectors_path.read_text())["guard"]
    last = [o["want"] for c in cases for o in c["ops"][-1:]]
    assert sum(w["switches"] > 0 for w in last) > 10 and sum(w["probes"] > 0 for w in last) > 10
    assert any(w["switches"] == 0 for w in last)  # drafters that pay stay on
    wants = [(c, o["want"]) for c in cases for o in c["ops"]]
    assert any(w["backoff"] == c["config"]["max_backoff"] > c["config"]["backoff"] for c, w in wants)
    assert any(w["plain_left"] < 0 for _, w in wants)  # a plain step the guard did not ask for
    assert any(c["config"]["cost_ratio"] for c in cases) and any(c["config"]["cost_ratio"] is None for c in cases)
    steps = [o["seconds"] for c in cases for o in c["ops"] if o["op"] == "step"]
    assert max(steps) > 10 * np.median(steps) > 100 * min(steps)  # outliers both ways

    class LastStepGuard(AcceptanceGuard):
        def record_step(self, seconds: float) -> None:
            super().record_step(seconds)
            self.t_step = seconds

    flipped = 0
    for c in cases:
        g = LastStepGuard(GuardConfig(**c["config"]))
        for o in c["ops"]:
            g.record_step(o["seconds"]) if o["op"] == "step" else g.record_cycle(o["tokens"], o["seconds"])
        flipped += (g.switches, g.probes) != (c["ops"][-1]["want"]["switches"], c["ops"][-1]["want"]["probes"])
    assert flipped >= 5, flipped


def test_core_vectors_detect_a_wrong_core(capi_build, vectors_path, tmp_path):
    """The replay is strict: a vector with one changed expected token fails the ctest binary."""
    v = json.loads(vectors_path.read_text())
    v["loops"] = [v["loops"][0]]
    v["loops"][0]["tokens"][5] = (v["loops"][0]["tokens"][5] + 1) % v["loops"][0]["vocab_size"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(v))
    proc = subprocess.run([str(capi_build / "tests" / "coreVectors"), str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1 and "tokens" in proc.stderr


def test_sampling_vectors_exercise_every_transform(vectors_path):
    """The sampling vectors reach every transform and edge: each transform on and off, ties, top_k past V, -inf
    logprobs (cut tokens), a greedy row, redrawn drafts that changed; the transform loops sample and ask logprobs."""
    v = json.loads(vectors_path.read_text())
    cases = v["sampling"]
    cfgs = [c["sampling"] for c in cases]
    assert any(c["logit_bias"] for c in cfgs) and any(c["repetition_penalty"] != 1 for c in cfgs)
    assert any(c["presence_penalty"] for c in cfgs) and any(c["frequency_penalty"] for c in cfgs)
    assert any(0 < c["top_k"] < cs["V"] for c, cs in zip(cfgs, cases)) and any(c["top_k"] > cs["V"]
                                                                                for c, cs in zip(cfgs, cases))
    assert any(c["top_p"] < 1 for c in cfgs) and any(c["min_p"] > 0 for c in cfgs)
    assert any(all(c[k] in (0, 1.0, [], 0.0) for k in ("logit_bias", "top_k", "top_p", "min_p", "presence_penalty"))
               for c in cfgs)
    assert any(c["temperature"] == 0 for c in cases) and any(None in (c["law"] or []) or 0.0 in (c["law"] or [])
                                                             for c in cases)
    assert any(lp["logprob"] is None for c in cases for lp in c["logprobs"])
    assert any(lp["top_ids"] for c in cases for lp in c["logprobs"])
    assert any("redraw" in c and c["redraw"]["want_tokens"] != c["redraw"]["tokens"] for c in cases)
    loops = [c for c in v["loops"] if c.get("sampling")]
    assert len(loops) == 5 and all(len(c["logprobs"]) == len(c["tokens"]) for c in loops)
    assert any(c["temperature"] > 0 and sum(c["accepted"]) > 0 for c in loops)


def test_core_vectors_catch_the_planted_redraw_bug(capi_build, vectors_path):
    """Negative control: with $DFLASH2_PLANT_REDRAW_RAW_PROPOSAL=1 (an independent draft drawn from the transformed law,
    the untransformed proposal fed to the acceptance ratio) the coreVectors binary fails on the redrawn proposals and
    on the transforms loop of independent drafts."""
    proc = subprocess.run([str(capi_build / "tests" / "coreVectors"), str(vectors_path)], capture_output=True,
                          text=True, env={**os.environ, "DFLASH2_PLANT_REDRAW_RAW_PROPOSAL": "1"})
    assert proc.returncode == 1 and "redrawn proposals" in proc.stderr and "loop transforms-vocab" in proc.stderr


# --------------------------------------------------------------------------------------------------
# ctypes: the C loop with the ORT runners behind the callbacks
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def lib(capi_build):
    return declare(C.CDLL(str(capi_build / "lib" / "libdflash2.so")))


class CapiError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code, self.message = code, message


def _check(lib, status) -> None:  # noqa: ANN001
    if status:
        code, msg = lib.dfl2_status_code(status), lib.dfl2_status_message(status).decode()
        lib.dfl2_status_free(status)
        raise CapiError(code, msg)


def _c_options(lib, options: dict):  # noqa: ANN001, ANN202
    """A dfl2_options from a dict (lists as comma-separated ids, bools as true/false); the caller frees it."""
    opts = C.c_void_p()
    _check(lib, lib.dfl2_options_create(C.byref(opts)))
    try:
        for k, v in options.items():
            v = ",".join(map(str, v)) if isinstance(v, (list, set)) else str(v).lower() if isinstance(v, bool) else v
            _check(lib, lib.dfl2_options_parse(opts, f"{k}={v}".encode()))
    except BaseException:
        lib.dfl2_options_free(opts)
        raise
    return opts


def _numpy_uniforms(rng: np.random.Generator, use: int, out, n: int) -> None:  # noqa: ANN001
    """A dfl2_uniform_fn request served from numpy's generator as the Python runtime draws: DRAFT (use 0) as
    ``random((1, n), float32)``, ACCEPT as ``random()``."""
    vals = rng.random((1, n), dtype=np.float32).reshape(-1) if use == 0 else np.array([rng.random()])
    np.ctypeslib.as_array(out, (n,))[:] = vals


def _write_draft(d: Draft, L: int, K: int, V: int, tokens, proposal, cand, vocab, used) -> None:  # noqa: ANN001
    """A Python Draft into drafter_propose's output buffers."""
    np.ctypeslib.as_array(tokens, (L,))[:] = d.tokens[:L]
    np.ctypeslib.as_array(proposal, (L, K))[:] = d.proposal[:L]
    np.ctypeslib.as_array(cand, (L, K))[:] = d.cand[:L]
    if d.vocab_proposal is not None and vocab:
        np.ctypeslib.as_array(vocab, (L, V))[:] = d.vocab_proposal[:L]
        used[0] = 1


class _CallbackHost:
    """Python callbacks handed to the library: an exception becomes a non-zero return, kept in ``errors``."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def _guard(self, fn):  # noqa: ANN001, ANN202
        def call(*a):  # noqa: ANN002, ANN202
            try:
                fn(*a)
                return 0
            except BaseException as e:  # noqa: BLE001 - reported to the C loop as a non-zero return
                self.errors.append(e)
                return 1
        return call


class CRuntime(_CallbackHost):
    """The C loop over Python runners (TargetRunner / DraftRunner protocol) through dfl2_callbacks."""

    def __init__(self, lib, target, drafter, feature_dim: int, top_k: int) -> None:  # noqa: ANN001
        super().__init__()
        self.lib, self.target, self.drafter = lib, target, drafter
        self.V, self.F, self.K, self.L = target.vocab_size, feature_dim, top_k, drafter.num_draft_rows
        self.calls = {"forward": 0, "propose": 0, "add_context": 0}
        self._fns = [  # kept alive as long as the model
            TR(self._guard(lambda u: target.reset())),
            TF(self._guard(self._forward)),
            TC(self._guard(lambda u, n: target.crop(n))),
            TR(self._guard(lambda u: drafter.reset())),
            DA(self._guard(self._add_context)),
            DP(self._guard(self._propose)),
        ]
        cb = Callbacks(C.sizeof(Callbacks), None, self.V, self.F, drafter.block_size, top_k, target.max_positions,
                        None, 0, *self._fns)
        self.model = C.c_void_p()
        _check(lib, lib.dfl2_model_create_callbacks(C.byref(cb), None, C.byref(self.model)))

    def _forward(self, u, ids, n, logits, feats) -> None:  # noqa: ANN001
        self.calls["forward"] += 1
        lg, ft = self.target.forward([ids[i] for i in range(n)])  # [n, V], [n, F]
        assert ft.shape == (n, self.F), ft.shape
        np.ctypeslib.as_array(logits, (n, self.V))[:] = lg
        if self.F:
            np.ctypeslib.as_array(feats, (n, self.F))[:] = ft

    def _add_context(self, u, feats, m, start) -> None:  # noqa: ANN001
        self.calls["add_context"] += 1
        f = np.ctypeslib.as_array(feats, (m, self.F)).copy() if self.F else np.zeros((m, 0), np.float32)
        self.drafter.add_context(f, start)

    def _propose(self, u, anchor, pos, rows, temperature, uniforms, tokens, proposal, cand, vocab, used) -> None:  # noqa: ANN001
        self.calls["propose"] += 1
        un = np.ctypeslib.as_array(uniforms, (1, self.L)).copy() if uniforms else None
        d = self.drafter.propose(anchor, pos, rows, temperature, un)
        _write_draft(d, self.L, self.K, self.V, tokens, proposal, cand, vocab, used)

    def generate(self, prompt: list[int], options: dict, numpy_seed: int | None = None, cancel_after: int = 0):  # noqa: ANN201
        """-> (tokens, stats dict, streamed chunks). numpy_seed: uniforms from numpy.random.default_rng(seed).
        The proposer is speculative_generate's default (the drafter) unless ``options`` name one (the C default is
        auto, the API's)."""
        lib = self.lib
        opts, sess = _c_options(lib, {"proposer": "dflash2", **options}), C.c_void_p()
        try:
            _check(lib, lib.dfl2_session_create(self.model, opts, C.byref(sess)))
        finally:
            lib.dfl2_options_free(opts)
        chunks: list[list[int]] = []

        def on_tokens(u, toks, n):  # noqa: ANN001, ANN202
            chunks.append([toks[i] for i in range(n)])
            return 1 if cancel_after and len(chunks) >= cancel_after else 0

        rng = np.random.default_rng(numpy_seed) if numpy_seed is not None else None

        def uniforms(u, use, out, n):  # noqa: ANN001, ANN202
            _numpy_uniforms(rng, use, out, n)
            return 0

        tok_cb, uni_cb = TOKENS(on_tokens), UNIFORM(uniforms)
        try:
            if rng is not None:
                _check(lib, lib.dfl2_session_set_uniform_source(sess, uni_cb, None))
            ids = (C.c_int32 * len(prompt))(*prompt)
            _check(lib, lib.dfl2_session_generate(sess, ids, len(prompt), tok_cb, None))
            ptr, n = P(C.c_int32)(), C.c_size_t()
            _check(lib, lib.dfl2_session_get_tokens(sess, C.byref(ptr), C.byref(n)))
            tokens = [ptr[i] for i in range(n.value)]
            st = Stats()
            _check(lib, lib.dfl2_session_get_stats(sess, C.byref(st)))
            stats = {
                "tau": st.tau, "cycles": st.cycles, "finish": st.finish_reason,
                "accepted": [st.accepted[i] for i in range(st.cycles)],
                "proposed": [st.proposed[i] for i in range(st.cycles)],
                "oracle_accepted": [st.oracle_accepted[i] for i in range(st.cycles)] if st.oracle_accepted else [],
                "per_position_cumulative": [st.per_position_cumulative[i] for i in range(st.n_positions)],
                "per_position_conditional": [st.per_position_conditional[i] for i in range(st.n_positions)],
                "oracle_tau": st.oracle_tau if st.oracle_tau >= 0 else None,
            }  # fmt: skip
            _check(lib, lib.dfl2_session_get_proposers(sess, C.byref(ptr), C.byref(n)))
            stats["proposers"] = [_PROPOSER_NAMES[ptr[i]] for i in range(n.value)]
        finally:
            lib.dfl2_session_free(sess)
        return tokens, stats, chunks

    def close(self) -> None:
        self.lib.dfl2_model_free(self.model)


def _feature_dim(be) -> int:  # noqa: ANN001
    t = be.manifest.target
    return len(t.layer_ids) * t.hidden_size


def _assert_same(c_tokens, c_stats, py) -> None:  # noqa: ANN001
    assert c_tokens == py.tokens  # token for token
    assert (c_stats["accepted"], c_stats["proposed"]) == (py.accepted, py.proposed)
    assert c_stats["oracle_accepted"] == py.oracle_accepted
    assert c_stats["proposers"] == py.proposers  # who proposed, cycle for cycle
    want = py.stats()
    assert c_stats["tau"] == pytest.approx(want["tau"], abs=1e-12)
    assert c_stats["per_position_cumulative"] == pytest.approx(want["per_position_cumulative"], abs=1e-12)
    assert c_stats["per_position_conditional"] == pytest.approx(want["per_position_conditional"], abs=1e-12)
    assert c_stats["oracle_tau"] == (None if want["oracle_tau"] is None else pytest.approx(want["oracle_tau"]))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 500, size=int(rng.integers(1, 30))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def ort(tiny_export):
    from dflash2_trt.runtime.backends import open_backend

    return open_backend(tiny_export, "ort")[0]


@pytest.fixture(scope="module")
def acc_ort(acc_export):
    """ONNX Runtime runners of the accepting pair (block size 16): the C loop commits drafts every cycle."""
    from dflash2_trt.runtime.backends import open_backend

    return open_backend(acc_export, "ort")[0]


@pytest.mark.parametrize("mode", ["greedy", "viterbi"])
def test_c_loop_equals_python_runtime_greedy(lib, acc_ort, mode):
    """Greedy, both selector modes, oracle τ measured, on the accepting pair: identical tokens, counts and
    metrics, drafts accepted (final partial blocks included: 40 tokens at block size 16)."""
    from helpers import assert_accepts

    dr = acc_ort.draft_runner(mode)
    c = CRuntime(lib, acc_ort.target_runner(), dr, _feature_dim(acc_ort), dr.top_k)
    accepted = []
    try:
        for p in _prompts(3, seed=21):
            py = D.speculative_generate(acc_ort.target_runner(), acc_ort.draft_runner(mode), p,
                                        req(40, eos_ids=set()), D.DecodeHooks(oracle=oracle_count))
            toks, st, chunks = c.generate(p, {"max_new_tokens": 40, "eos_ids": [], "measure_oracle": True})
            _assert_same(toks, st, py)
            assert sum(chunks, []) == toks and len(chunks) == st["cycles"] + 1
            accepted += st["accepted"]
        assert not c.errors and c.calls["propose"] > 0
        assert_accepts(accepted, acc_ort.manifest.num_draft_rows, ("C loop", mode))
    finally:
        c.close()


@pytest.fixture(scope="module")
def hybrid_export(hybrid_exports):
    """The accepting qwen3_5 (Gated DeltaNet) pair exported at block size 8 (manifest version 3): conftest's, which
    the modules importing this fixture share."""
    return hybrid_exports(8)


def test_model_load_refuses_a_sliding_layer_without_its_ring_in_one_line(lib, capi_build, hybrid_export, tmp_path):
    """The library runs version 3 exports of attention, linear and sliding layers (tests/test_capi_ort.py); one whose
    layer kinds name a sliding layer but give no target.sliding_window (the hybrid export's first attention layer
    marked sliding) is refused by its manifest reader in one status naming the field, and the example exits 1 with
    one line."""
    bad = tmp_path / "sliding"
    shutil.copytree(hybrid_export, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    kinds = manifest["target"]["layer_kinds"]
    kinds[kinds.index("attention")] = "sliding"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    handle = C.c_void_p()
    with pytest.raises(CapiError) as e:
        _check(lib, lib.dfl2_model_load(str(bad).encode(), None, C.byref(handle)))
    assert e.value.code == 6 and "target.sliding_window must be given" in e.value.message  # DFL2_ERR_CORRUPT
    assert "\n" not in e.value.message
    out = subprocess.run([str(capi_build / "bin" / "generate"), str(bad), "1", "2"], capture_output=True, text=True)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and "sliding_window" in out.stderr


def _muse_glimmer_pair(out: Path) -> tuple[Path, Path]:
    """A scaled-down Muse Glimmer target (8 layers, hidden 64, windows of 8, make-tiny's tokenizer) and the z-lab
    DFlash 2 fixture drafter made for Muse Glimmer (tests/data/zlab/dflash2-config.json: five sliding layers, block
    size 16, selector rank 256, K 16, soft-capped logits with the output multiplier) scaled to it, random weights."""
    import shutil

    import torch
    import transformers

    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.model import DFlash2Drafter, save_drafter
    from dflash2_trt.tiny import make_tiny

    make_tiny(out / "tiny", seed=0, block_size=4)
    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
    target = transformers.MuseGlimmerForConditionalGeneration(transformers.MuseGlimmerConfig(
        text_config=dict(sliding_window=8, bos_token_id=1, eos_token_id=0, **common),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))
    target.eval().save_pretrained(str(out / "target"))
    for f in (out / "tiny" / "target").glob("tokenizer*"):
        shutil.copy(f, out / "target" / f.name)
    cfg = json.loads((REPO / "tests" / "data" / "zlab" / "dflash2-config.json").read_text())
    cfg.update({k: common[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "max_position_embeddings")},
               num_target_layers=8, sliding_window=8, bos_token_id=1, eos_token_id=0, pad_token_id=2)
    cfg["dflash_config"].update(mask_token_id=3, target_layer_ids=[1, 3, 5, 6, 7])
    drafter = DFlash2Drafter(DFlash2Config.from_dict(cfg))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.2 if "kernel_projection" not in name else 0.02)
    save_drafter(drafter, out / "drafter")
    return out / "target", out / "drafter"


def test_zlab_muse_glimmer_drafter_end_to_end(lib, tmp_path_factory):
    """The z-lab DFlash 2 fixture drafter (Muse Glimmer's), scaled down, against a scaled-down Muse Glimmer target:
    export -> ONNX Runtime -> the C loop over its runners; tokens and per-cycle counts equal the PyTorch reference
    loop's on 3 prompts of up to 30 tokens (longer than the windows)."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.model import load_drafter
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner
    from dflash2_trt.targets.adapter import TargetModel

    work = tmp_path_factory.mktemp("muse")
    target_dir, drafter_dir = _muse_glimmer_pair(work)
    export_model(target_dir, drafter_dir, work / "export", progress=False, max_seq_len=256)
    be = OrtBackend(work / "export")
    cfg = be.manifest.drafter_config
    assert be.manifest.target.model_type == "muse_glimmer" and cfg.num_hidden_layers == 5
    assert (cfg.block_size, cfg.selector_rank, cfg.selector_top_k) == (16, 256, 16)
    t = TargetModel.load(target_dir)
    ref = load_drafter(drafter_dir)
    ref.bind_target(t.embed_weight, t.lm_head_weight)
    dr = be.draft_runner("greedy")
    c = CRuntime(lib, be.target_runner(), dr, _feature_dim(be), dr.top_k)
    try:
        for p in _prompts(3, seed=9):
            want = D.speculative_generate(TorchTargetRunner(t, cfg.target_layer_ids), TorchDraftRunner(ref), p,
                                          req(16, eos_ids=set()))
            py = D.speculative_generate(be.target_runner(), be.draft_runner("greedy"), p,
                                        req(16, eos_ids=set()))
            assert (py.tokens, py.accepted) == (want.tokens, want.accepted)
            toks, st, _ = c.generate(p, {"max_new_tokens": 16, "eos_ids": []})
            _assert_same(toks, st, py)
        assert not c.errors
    finally:
        c.close()


def test_c_loop_over_a_hybrid_target_equals_python_runtime(lib, hybrid_export):
    """A hybrid (Gated DeltaNet) export: the C loop with the ONNX Runtime runners behind its callbacks (whose crop
    rolls the linear layers' states back) gives the Python runtime's tokens, counts and metrics, drafts accepted."""
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from helpers import assert_accepts

    be = OrtBackend(hybrid_export)
    assert "linear" in be.manifest.layer_kinds
    dr = be.draft_runner("greedy")
    c = CRuntime(lib, be.target_runner(), dr, _feature_dim(be), dr.top_k)
    accepted = []
    try:
        for p in _prompts(8, seed=5):
            py = D.speculative_generate(be.target_runner(), be.draft_runner("greedy"), p,
                                        req(32, eos_ids=set()))
            toks, st, _ = c.generate(p, {"max_new_tokens": 32, "eos_ids": []})
            _assert_same(toks, st, py)
            accepted += st["accepted"]
        assert not c.errors
        assert_accepts(accepted, 7, "C loop, hybrid target")
        assert any(0 < a < 7 for a in accepted)  # partial acceptances: the callbacks rolled states back
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["greedy", "viterbi", "independent"])
def test_c_loop_equals_python_runtime_sampling(lib, acc_ort, mode):
    """T > 0 with numpy's uniforms in the Python runtime's order: the same samples, token for token, with
    drafts accepted by the rejection rule."""
    dr = acc_ort.draft_runner(mode)
    c = CRuntime(lib, acc_ort.target_runner(), dr, _feature_dim(acc_ort), dr.top_k)
    accepted = []
    try:
        for seed, p in enumerate(_prompts(3, seed=5)):
            py = D.speculative_generate(acc_ort.target_runner(), acc_ort.draft_runner(mode), p,
                                        req(24, temperature=0.8, eos_ids=set(), seed=seed))
            toks, st, _ = c.generate(p, {"max_new_tokens": 24, "temperature": 0.8, "eos_ids": []}, numpy_seed=seed)
            _assert_same(toks, st, py)
            accepted += st["accepted"]
        assert not c.errors and max(accepted) >= 3, accepted
        ar = D.target_generate(acc_ort.target_runner(), p, req(16, temperature=0.8, eos_ids=set(), seed=3))
        toks, _, _ = c.generate(p, {"max_new_tokens": 16, "temperature": 0.8, "eos_ids": [], "speculative": False},
                                numpy_seed=3)
        assert toks == ar.tokens
    finally:
        c.close()


class _OracleDrafter:
    """A drafter that proposes the target's own greedy continuation (from a plain AR run), wrong at every
    fifth position so that cycles both accept and reject. Candidates: the draft first, then neighbours."""

    def __init__(self, greedy: list[int], block_size: int, vocab: int, top_k: int = 4) -> None:
        self.seq, self.block_size, self.V, self.top_k = greedy, block_size, vocab, top_k
        self.num_draft_rows = block_size - 1  # a hand-made runner: its L is given here

    def reset(self) -> None:
        self.length = 0

    def add_context(self, feats: np.ndarray, start: int) -> None:
        assert start == self.length
        self.length += feats.shape[0]

    def propose(self, anchor: int, pos: int, rows: int, temperature: float, uniforms) -> Draft:  # noqa: ANN001
        L = self.num_draft_rows
        toks = [self.seq[p + 1] if p + 1 < len(self.seq) else 0 for p in range(pos, pos + L)]
        toks = [(t + 1) % self.V if (pos + i) % 5 == 4 else t for i, t in enumerate(toks)]
        cand = np.array([[(t + k) % self.V for k in range(self.top_k)] for t in toks], np.int64)  # [L, K]
        prop = np.zeros((L, self.top_k), np.float32)
        prop[:, 0] = 1.0
        return Draft(tokens=np.asarray(toks, np.int64), proposal=prop, cand=cand)


def test_c_loop_with_accepting_drafter(lib, ort):
    """A drafter that gets drafts accepted (the tiny random drafter rarely does): equal to the Python runtime
    at T = 0 and T > 0, and acceptance happened (τ > 1, some cycles accept several drafts, some reject)."""
    p = _prompts(1, seed=77)[0]
    n = 40
    greedy = list(p) + D.target_generate(ort.target_runner(), p, req(n, eos_ids=set())).tokens
    make = lambda: _OracleDrafter(greedy, ort.manifest.block_size, ort.manifest.target.vocab_size)  # noqa: E731
    c = CRuntime(lib, ort.target_runner(), make(), _feature_dim(ort), 4)
    try:
        py = D.speculative_generate(ort.target_runner(), make(), p, req(n, eos_ids=set()),
                                    D.DecodeHooks(oracle=oracle_count))
        toks, st, _ = c.generate(p, {"max_new_tokens": n, "eos_ids": [], "measure_oracle": True})
        _assert_same(toks, st, py)
        assert toks == greedy[len(p):]  # lossless
        assert st["tau"] > 2.0 and max(st["accepted"]) >= 3  # drafts were accepted ...
        assert any(a < r for a, r in zip(st["accepted"], st["proposed"]))  # ... and rejected
        py = D.speculative_generate(ort.target_runner(), make(), p,
                                    req(n, temperature=0.1, eos_ids=set(), seed=11))
        toks, st, _ = c.generate(p, {"max_new_tokens": n, "temperature": 0.1, "eos_ids": []}, numpy_seed=11)
        _assert_same(toks, st, py)
        assert sum(st["accepted"]) > 0  # a low temperature keeps the samples near the drafted greedy chain
    finally:
        c.close()


@pytest.mark.parametrize("proposer", ["ngram", "auto"])
def test_c_loop_with_prompt_lookup_equals_python_runtime(lib, acc_ort, proposer):
    """proposer ngram / auto (C option "proposer") on repetitive prompts, greedy and T > 0 with numpy's uniforms:
    the C loop equals decoder.speculative_generate token for token and cycle for cycle (who proposed each cycle,
    accepted and verified drafts, the drafter's calls: with auto the features of lookup cycles join the drafter's
    context in one call when it runs again); lookups were made and accepted."""
    dr = acc_ort.draft_runner("greedy")
    c = CRuntime(lib, acc_ort.target_runner(), dr, _feature_dim(acc_ort), dr.top_k)
    rng = np.random.default_rng(17)
    lookups: list[int] = []
    joins = 0  # auto: a drafter cycle right after lookup cycles (their features join its context in one call)
    try:
        for i in range(4):
            base = rng.integers(4, acc_ort.manifest.target.vocab_size, int(rng.integers(3, 9))).tolist()
            p, T = base * 3, [0.0, 0.8][i % 2]
            py = D.speculative_generate(acc_ort.target_runner(), acc_ort.draft_runner("greedy"), p,
                                        req(40, temperature=T, eos_ids=set(), seed=i, proposer=proposer, ngram_rows=6))
            before = dict(c.calls)
            toks, st, _ = c.generate(p, {"max_new_tokens": 40, "temperature": T, "eos_ids": [], "proposer": proposer,
                                         "ngram_rows": 6}, numpy_seed=i)
            _assert_same(toks, st, py)
            drafted = py.proposers.count("dflash2")
            assert c.calls["propose"] - before["propose"] == drafted  # a lookup cycle never calls the drafter
            if proposer == "ngram":
                assert c.calls["add_context"] == before["add_context"]  # nor feeds it
            lookups += [a for a, w in zip(st["accepted"], st["proposers"]) if w == "ngram"]
            joins += sum(a == "ngram" and b == "dflash2" for a, b in zip(st["proposers"], st["proposers"][1:]))
        assert not c.errors and len(lookups) >= 4 and sum(lookups) > 0, lookups
        assert joins > 0 if proposer == "auto" else joins == 0
    finally:
        c.close()


def test_c_loop_counts_no_drafts_after_an_accepted_eos(lib, ort, monkeypatch):
    """An EOS accepted mid-block with accepted drafts after it: the request ends there and the cycle counts
    only the drafts up to the EOS — in the C loop as in the Python runtime (the C loop used to count all)."""
    from dflash2_trt import acceptance

    p = _prompts(1, seed=77)[0]
    n = 40
    cont = D.target_generate(ort.target_runner(), p, req(n, eos_ids=set())).tokens
    greedy = list(p) + cont
    make = lambda: _OracleDrafter(greedy, ort.manifest.block_size, ort.manifest.target.vocab_size)  # noqa: E731
    raw: list[int] = []  # acceptance counts before the EOS cut
    real = acceptance.accept_greedy

    def recording(drafts, logits):  # noqa: ANN001, ANN202
        acc, bonus = real(drafts, logits)
        raw.append(acc)
        return acc, bonus

    monkeypatch.setattr(acceptance, "accept_greedy", recording)
    c = CRuntime(lib, ort.target_runner(), make(), _feature_dim(ort), 4)
    try:
        cases = 0
        for i, eos in enumerate(cont[1:-1], 1):
            if eos in cont[:i]:
                continue  # the first occurrence ends the request
            raw.clear()
            py = D.speculative_generate(ort.target_runner(), make(), p, req(n, eos_ids={eos}))
            if raw[-1] <= py.accepted[-1]:
                continue  # the EOS was the bonus or the last accepted draft: nothing to cut
            toks, st, _ = c.generate(p, {"max_new_tokens": n, "eos_ids": [eos]})
            _assert_same(toks, st, py)
            assert toks == cont[: i + 1] and st["finish"] == 1
            cases += 1
        assert cases >= 3, cases
    finally:
        c.close()


def test_c_loop_streaming_cancel_and_errors(lib, ort):
    """Cancellation from the token callback; a Python exception in a callback and an out-of-range prompt come
    back as status codes with messages (nothing crashes)."""
    target, drafter = ort.target_runner(), ort.draft_runner("greedy")
    c = CRuntime(lib, target, drafter, _feature_dim(ort), drafter.top_k)
    try:
        p = _prompts(1, seed=3)[0]
        toks, st, chunks = c.generate(p, {"max_new_tokens": 30, "eos_ids": []}, cancel_after=2)
        assert st["finish"] == 3 and len(chunks) == 2 and sum(chunks, []) == toks
        with pytest.raises(CapiError) as e:
            c.generate([ort.manifest.target.vocab_size], {})
        assert e.value.code == 9 and "out of range" in e.value.message
        with pytest.raises(CapiError) as e:
            c.generate([5] * 600, {})
        assert e.value.code == 10 and "does not fit" in e.value.message
        c.drafter = None  # the next drafter call raises inside the callback
        with pytest.raises(CapiError) as e:
            c.generate(p, {"max_new_tokens": 8})
        assert e.value.code == 11 and "callback drafter_add_context returned 1" in e.value.message
        assert isinstance(c.errors[-1], AttributeError)
    finally:
        c.close()


# --------------------------------------------------------------------------------------------------
# Batched decoding: the C core (dfl2_batch) against the Python BatchDecoder on the same runners
# --------------------------------------------------------------------------------------------------


def _features_sum(feats) -> float:  # noqa: ANN001
    return float(np.asarray(feats, np.float64).sum())


class _LoggedTarget:
    """A batched target runner whose calls are logged the way :class:`CBatch` logs the C core's callbacks."""

    def __init__(self, run, log: list) -> None:  # noqa: ANN001
        self.run, self.log = run, log

    def __getattr__(self, name: str):  # noqa: ANN204 - vocab_size, max_positions, eos_ids, free_slots, ...
        return getattr(self.run, name)

    def join(self) -> int:
        b = self.run.join()
        self.log.append(("reset", b))
        return b

    def leave(self, slot: int) -> None:
        self.log.append(("release", slot))
        self.run.leave(slot)

    def crop(self, slot: int, length: int) -> None:
        self.log.append(("crop", slot, length))
        self.run.crop(slot, length)

    def forward(self, rows: dict, last_logits: bool = False) -> dict:
        self.log.append(("forward", [(b, list(r), int(self.run.lengths[b])) for b, r in rows.items()], last_logits))
        return self.run.forward(rows, last_logits=last_logits)


class _LoggedDrafter:
    def __init__(self, d, log: list) -> None:  # noqa: ANN001
        self.d, self.log = d, log

    def __getattr__(self, name: str):  # noqa: ANN204 - block_size, top_k
        return getattr(self.d, name)

    def reset(self) -> None:
        self.log.append(("drafter_reset",))
        self.d.reset()

    def add_context(self, feats: np.ndarray, start: int) -> None:
        self.log.append(("add_context", len(feats), start, _features_sum(feats)))
        self.d.add_context(feats, start)

    def propose(self, anchor: int, pos: int, rows: int, temperature: float, uniforms):  # noqa: ANN001, ANN201
        self.log.append(("propose", anchor, pos, rows))
        return self.d.propose(anchor, pos, rows, temperature, uniforms)


class CBatch(_CallbackHost):
    """dfl2_batch over Python runners through the batched callbacks: a batched target runner (slots chosen by the C
    core: each batch_target_reset must be the runner's next join) and one drafter per slot; every call logged as
    :class:`_LoggedTarget` / :class:`_LoggedDrafter` log the Python BatchDecoder's."""

    def __init__(self, lib, target, make_drafter, feature_dim: int, options: dict) -> None:  # noqa: ANN001
        super().__init__()
        self.lib, self.target, self.make_drafter = lib, target, make_drafter
        self.V, self.F = target.vocab_size, feature_dim
        d0 = make_drafter()
        self.K, self.L, self.bs = d0.top_k, d0.num_draft_rows, d0.block_size
        self.drafters: dict = {}
        self.log: list = []
        self.chunks: dict[int, list[list[int]]] = {}
        self.done: dict[int, tuple[int, int]] = {}  # request id -> (finish reason, error code)
        self.rngs: dict[int, np.random.Generator] = {}
        g = self._guard
        unused = g(self._unused)
        self._fns = [TR(unused), TF(unused), TC(unused), TR(unused), DA(unused), DP(unused),
                     BSLOT(g(self._reset)), BSLOT(g(self._release)), BTF(g(self._forward)), BTC(g(self._crop)),
                     BSLOT(g(self._drafter_reset)), BDA(g(self._add_context)), BDP(g(self._propose)),
                     TOKENS(self._on_tokens), DONE(self._on_done), UNIFORM(self._uniforms)]
        cb = BatchCallbacks(C.sizeof(BatchCallbacks), None, self.V, self.F, self.bs, self.K, target.max_positions,
                             None, 0, *self._fns[:6], target.slots, *self._fns[6:13])
        self.model, self.batch = C.c_void_p(), C.c_void_p()
        _check(lib, lib.dfl2_model_create_callbacks(C.byref(cb), None, C.byref(self.model)))
        opts = _c_options(lib, options)
        try:
            _check(lib, lib.dfl2_batch_create(self.model, opts, C.byref(self.batch)))
        finally:
            lib.dfl2_options_free(opts)

    def _unused(self, *a) -> None:  # noqa: ANN002
        raise AssertionError("a B = 1 callback ran in batched decoding")

    def _drafter(self, slot: int):  # noqa: ANN202
        if slot not in self.drafters:
            self.drafters[slot] = self.make_drafter()
        return self.drafters[slot]

    def _reset(self, u, slot) -> None:  # noqa: ANN001
        assert self.target.join() == slot  # the C core gives the lowest free slot, as the runner does
        self.log.append(("reset", slot))

    def _release(self, u, slot) -> None:  # noqa: ANN001
        self.log.append(("release", slot))
        self.target.leave(slot)

    def _forward(self, u, n, slots, lengths, rows, ids, last, logits, feats) -> None:  # noqa: ANN001
        batch, off = {}, 0
        for i in range(n):
            assert lengths[i] == self.target.lengths[slots[i]], "cache length differs from the runner's"
            batch[slots[i]] = [ids[off + j] for j in range(rows[i])]
            off += rows[i]
        self.log.append(("forward", [(b, r, int(self.target.lengths[b])) for b, r in batch.items()], bool(last)))
        out = self.target.forward(batch, last_logits=bool(last))
        lg = np.ctypeslib.as_array(logits, (n if last else off, self.V))
        ft = np.ctypeslib.as_array(feats, (off, self.F))
        row = 0
        for i, (b, r) in enumerate(batch.items()):
            if last:
                lg[i] = out[b][0][-1]
            else:
                lg[row:row + len(r)] = out[b][0]
            ft[row:row + len(r)] = out[b][1]
            row += len(r)

    def _crop(self, u, slot, length) -> None:  # noqa: ANN001
        self.log.append(("crop", slot, length))
        self.target.crop(slot, length)

    def _drafter_reset(self, u, slot) -> None:  # noqa: ANN001
        self.log.append(("drafter_reset",))
        self._drafter(slot).reset()

    def _add_context(self, u, slot, feats, m, start) -> None:  # noqa: ANN001
        f = np.ctypeslib.as_array(feats, (m, self.F)).copy()
        self.log.append(("add_context", m, start, _features_sum(f)))
        self._drafter(slot).add_context(f, start)

    def _propose(self, u, slot, anchor, pos, rows, temperature, uniforms, tokens, proposal, cand, vocab, used) -> None:  # noqa: ANN001
        self.log.append(("propose", anchor, pos, rows))
        un = np.ctypeslib.as_array(uniforms, (1, self.L)).copy() if uniforms else None
        d = self._drafter(slot).propose(anchor, pos, rows, temperature, un)
        _write_draft(d, self.L, self.K, self.V, tokens, proposal, cand, vocab, used)

    def _on_tokens(self, u, toks, n) -> int:  # noqa: ANN001
        self.chunks.setdefault(u or 0, []).append([toks[i] for i in range(n)])
        return 0

    def _on_done(self, u, request, reason, error) -> None:  # noqa: ANN001
        self.done[request] = (reason, self.lib.dfl2_status_code(error) if error else 0)

    def _uniforms(self, u, use, out, n) -> int:  # noqa: ANN001
        _numpy_uniforms(self.rngs[u or 0], use, out, n)
        return 0

    def submit(self, key: int, prompt: list[int], max_new: int, temperature: float, seed: int, eos: list[int],
               speculative: bool, proposer: str = "dflash2", ngram_rows: int = 0) -> int:
        """-> the request id; ``key`` names the request in chunks / uniforms (numpy's generator for ``seed``)."""
        self.rngs[key] = np.random.default_rng(seed)
        opts = _c_options(self.lib, {"max_new_tokens": max_new, "temperature": temperature, "eos_ids": eos,
                                     "speculative": speculative, "proposer": proposer, "ngram_rows": ngram_rows})
        ids = (C.c_int32 * len(prompt))(*prompt)
        req = Request(C.sizeof(Request), C.cast(ids, P(C.c_int32)), len(prompt), opts, self._fns[13],
                       self._fns[14], key, self._fns[15], key)
        rid = C.c_uint64()
        try:
            _check(self.lib, self.lib.dfl2_batch_submit(self.batch, C.byref(req), C.byref(rid)))
        finally:
            self.lib.dfl2_options_free(opts)
        return rid.value

    def step(self) -> int:
        pending = C.c_size_t()
        _check(self.lib, self.lib.dfl2_batch_step(self.batch, C.byref(pending)))
        return pending.value

    def cancel(self, rid: int) -> None:
        _check(self.lib, self.lib.dfl2_batch_cancel(self.batch, rid))

    def result(self, rid: int) -> dict:
        ptr, n, st, plain = P(C.c_int32)(), C.c_size_t(), Stats(), C.c_int32()
        _check(self.lib, self.lib.dfl2_batch_get_result(self.batch, rid, C.byref(ptr), C.byref(n), C.byref(st),
                                                        C.byref(plain)))
        who, m = P(C.c_int32)(), C.c_size_t()
        _check(self.lib, self.lib.dfl2_batch_get_proposers(self.batch, rid, C.byref(who), C.byref(m)))
        return {"tokens": [ptr[i] for i in range(n.value)], "accepted": [st.accepted[i] for i in range(st.cycles)],
                "proposed": [st.proposed[i] for i in range(st.cycles)], "plain_steps": plain.value,
                "finish": st.finish_reason, "proposers": [_PROPOSER_NAMES[who[i]] for i in range(m.value)]}

    def info(self) -> BatchInfo:
        out = BatchInfo()
        _check(self.lib, self.lib.dfl2_batch_get_info(self.batch, C.byref(out)))
        return out

    def close(self) -> None:
        self.lib.dfl2_batch_free(self.batch)
        self.lib.dfl2_model_free(self.model)


@pytest.fixture(scope="module")
def batch_be(acc_export):
    from dflash2_trt.runtime.ort.backend import OrtBackend

    with OrtBackend(acc_export, attention="gqa", threads=1) as b:
        yield b


def _batch_scenario(be) -> list[dict]:  # noqa: ANN001
    """7 requests: different prompt lengths and max tokens, greedy and sampling, one with an EOS it reaches, one that
    never speculates; the first 6 submitted at once into 3 slots, the 7th after step 4; request 0 cancelled after
    step 6 (active then)."""
    rng = np.random.default_rng(29)
    V = be.manifest.target.vocab_size
    lengths, max_new = [5, 13, 8, 21, 9, 6, 11], [120, 12, 33, 25, 30, 20, 60]
    temps, seeds = [0.0, 0.0, 0.8, 0.0, 1.0, 0.0, 0.0], [0, 0, 11, 0, 12, 0, 0]
    reqs = [{"prompt": rng.integers(0, V, n).tolist(), "max_new": m, "temperature": t, "seed": sd, "eos": [],
             "speculative": i != 5} for i, (n, m, t, sd) in enumerate(zip(lengths, max_new, temps, seeds))]
    b1 = D.target_generate(be.target_runner(), reqs[3]["prompt"], req(reqs[3]["max_new"], eos_ids=set())).tokens
    reqs[3]["eos"] = [b1[9]]  # an EOS it reaches
    return reqs


_JOIN_AFTER, _CANCEL_AFTER = {4: [6]}, {6: 0}


def _run_python_batch(be, rule, reqs: list[dict], prefill_chunk: int | str | None = "default",  # noqa: ANN001, ANN202
                      prefill_share: float | str | None = "default"):
    """The scenario through the Python BatchDecoder; ``prefill_chunk`` / ``prefill_share`` "default": the
    Generator's and the C options' defaults (batch.DEFAULT_PREFILL_CHUNK / DEFAULT_PREFILL_SHARE), which the C batch
    takes when its options do not name them."""
    from dflash2_trt.runtime import batch as BT
    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

    prefill_chunk = BT.DEFAULT_PREFILL_CHUNK if prefill_chunk == "default" else prefill_chunk
    prefill_share = BT.DEFAULT_PREFILL_SHARE if prefill_share == "default" else prefill_share
    log: list = []
    dec = BT.BatchDecoder(_LoggedTarget(OrtBatchedTargetRunner.from_backend(be, 3), log),
                          lambda: _LoggedDrafter(be.draft_runner("greedy"), log), rule, prefill_chunk=prefill_chunk,
                          prefill_share=prefill_share)

    def submit(i: int) -> int:
        r = reqs[i]
        return dec.submit(r["prompt"], GenerationRequest(
            max_new_tokens=r["max_new"], temperature=r["temperature"], seed=r["seed"], eos_ids=set(r["eos"]),
            speculative=r["speculative"], proposer=r.get("proposer", "dflash2"),
            ngram_rows=r.get("ngram_rows") or None))

    ids = {i: submit(i) for i in range(6)}
    k = 0
    while dec.busy or k < max(_JOIN_AFTER):
        dec.step()
        k += 1
        ids.update({i: submit(i) for i in _JOIN_AFTER.get(k, [])})
        if k in _CANCEL_AFTER:
            dec.cancel(ids[_CANCEL_AFTER[k]])
    return [dec.results[ids[i]] for i in range(len(reqs))], dec, log


def _run_c_batch(lib, be, options: dict, reqs: list[dict]) -> tuple[list[dict], CBatch]:  # noqa: ANN001
    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

    c = CBatch(lib, OrtBatchedTargetRunner.from_backend(be, 3), lambda: be.draft_runner("greedy"), _feature_dim(be),
               options)

    def submit(i: int) -> int:
        r = reqs[i]
        return c.submit(i, r["prompt"], r["max_new"], r["temperature"], r["seed"], r["eos"], r["speculative"],
                        r.get("proposer", "dflash2"), r.get("ngram_rows") or 0)

    ids = {i: submit(i) for i in range(6)}
    k, pending = 0, 1
    while pending or k < max(_JOIN_AFTER):
        pending = c.step()
        k += 1
        for i in _JOIN_AFTER.get(k, []):
            ids[i] = submit(i)
            pending += 1
        if k in _CANCEL_AFTER:
            c.cancel(ids[_CANCEL_AFTER[k]])
    out = []
    for i in range(len(reqs)):
        r = c.result(ids[i])
        r["chunks"], r["done"] = c.chunks.get(i, []), c.done[ids[i]]
        out.append(r)
    return out, c


def _assert_c_batch_equals_python(c, got: list[dict], py: list, dec, py_log: list):  # noqa: ANN001, ANN202
    """The C batch run (_run_c_batch) = the Python one (_run_python_batch): no errors, the same runner calls in the
    same order, per request the same tokens, accepted / verified drafts, plain steps and proposers (its chunks the
    tokens, its end its finish), the same step counts -> the C batch's info."""
    assert not c.errors, c.errors
    assert c.log == py_log  # call for call
    for i, (r, p) in enumerate(zip(got, py)):
        assert (r["tokens"], r["accepted"], r["proposed"], r["plain_steps"], r["proposers"]) == (
            p.tokens, p.accepted, p.proposed, p.plain_steps, p.proposers), f"request {i}"
        assert sum(r["chunks"], []) == r["tokens"] and r["done"] == (r["finish"], 0)
    info = c.info()
    assert (info.steps, info.drafting_steps) == (dec.steps, dec.drafting_steps)
    return info


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "always-draft"])
def test_c_batch_equals_python_batch_decoder(lib, batch_be, adaptive):
    """The C batched core (dfl2_batch through the batched callbacks) against the Python BatchDecoder on the same
    runners (the accepting pair's batched ONNX Runtime target, one drafter per slot): the same runner calls in the
    same order (slots, ragged rows, cache lengths, crops, drafter context and its features, proposals), the same
    tokens, accepted / verified drafts and plain steps per request, the same step counts — with the load-adaptive
    rule (fixed costs: a request drafts while its measured acceptance pays, one whose drafts fail steps plain beside
    the drafting ones) and with every request drafting. Every greedy request equals its own B = 1 output; a T > 0
    request draws numpy's uniforms in the Python order; the batched path was taken (3 requests per target call,
    plain steps and verifies in the same call, drafted and plain steps, drafts accepted)."""
    from helpers import assert_accepts

    from dflash2_trt.runtime import batch as BT

    reqs = _batch_scenario(batch_be)
    costs = BT.FixedCosts(plain_fn=lambda n: 1.0 + 0.05 * n, draft_s=0.1, verify_s=0.2)
    # the scenario's prior (2.0, not the rule's default 1.5): with it the rule drafts, then sends request 5 plain
    py, dec, py_log = _run_python_batch(batch_be, BT.SpeculationRule(costs=costs, adaptive=adaptive, prior_tau=2.0),
                                        reqs)
    got, c = _run_c_batch(lib, batch_be, {"fixed_costs": "1.0,0.05,0.1,0.2", "adaptive": adaptive, "prior_tau": 2.0},
                          reqs)
    try:
        info = _assert_c_batch_equals_python(c, got, py, dec, py_log)
        # the scenario did what it claims
        finish = [r["finish"] for r in got]
        assert finish[0] == 3 and finish[3] == 1 and all(f == 2 for i, f in enumerate(finish) if i not in (0, 3))
        tgt = batch_be.target_runner()
        for i, r in enumerate(reqs):
            if r["temperature"] == 0 and i != 0:
                want = D.target_generate(tgt, r["prompt"], req(r["max_new"], eos_ids=set(r["eos"]))).tokens
                assert got[i]["tokens"] == want, f"request {i} differs from its B = 1 output"
        assert 5 <= len(got[0]["tokens"]) < reqs[0]["max_new"]
        assert info.largest_step == 3 and info.cycles > 0 and 0 < info.drafting_steps
        assert sum(r["plain_steps"] for r in got) > 0 and got[5]["accepted"] == []
        mixed = [e for e in c.log if e[0] == "forward" and {len(ids) > 1 for _, ids, _ in e[1]} == {True, False}
                 and not e[2]]
        assert mixed  # plain steps and verifies in one target call
        if adaptive:
            assert info.drafting_steps < info.steps and info.largest_plain >= 2
        assert_accepts([a for r, q in zip(got, reqs) if q["temperature"] == 0 for a in r["accepted"]], c.L,
                       ("C batch", adaptive))
    finally:
        c.close()


@pytest.mark.parametrize("chunk, share, costs, rows", [(4, None, "", 4), (9, None, "", 9),
                                                       (512, 1.5, ",0.2,0.1", 3), (512, 1.5, "", 8), (2, 1.5, "", 2)],
                         ids=["4-rows", "9-rows", "share-3-rows", "share-unmeasured-8-rows", "share-capped-2-rows"])
def test_c_batch_chunked_prefill_equals_python_batch_decoder(lib, batch_be, chunk, share, costs, rows):
    """Chunked prefill ("prefill_chunk", "prefill_share") in the C batched core against the Python BatchDecoder's
    (prefill_chunk, prefill_share): ``rows`` = ``chunk`` without a time budget; with one, the rows whose forward
    takes share × a step by the given costs (a step 0.2 s, a row 0.1 s: 3 rows), 8 while a time is not given, at
    most ``chunk``. The scenario's requests that join while others decode prefill ``rows`` rows a step over all
    joining prompts — the
    same runner calls in the same order (each chunk a prefill forward at its slot's cache length, the chunks'
    features reaching the drafter in one add_context), the same tokens, drafts and step counts; the path asserted
    (prompts split into chunks, the info's prefill calls and rows = the prefill forwards logged). Every request's
    tokens equal those of whole-prompt prefill ("prefill_chunk" 0; every request drafting, so the T > 0 requests'
    draws do not depend on when the others start)."""
    from dflash2_trt.runtime import batch as BT

    reqs = _batch_scenario(batch_be)
    given = [float(x) for x in costs.split(",")[1:]] or [None, None]
    costs = BT.FixedCosts(plain_fn=lambda n: 1.0 + 0.05 * n, draft_s=0.1, verify_s=0.2, step_s=given[0],
                          prefill_row_s=given[1])
    opts = {"fixed_costs": "1.0,0.05,0.1,0.2" + (f",{given[0]},{given[1]}" if given[0] else ""), "prior_tau": 2.0,
            "prefill_share": share or 0}
    for adaptive in (True, False):
        rule = BT.SpeculationRule(costs=costs, adaptive=adaptive, prior_tau=2.0)
        py, dec, py_log = _run_python_batch(batch_be, rule, reqs, prefill_chunk=chunk, prefill_share=share)
        got, c = _run_c_batch(lib, batch_be, {**opts, "adaptive": adaptive, "prefill_chunk": chunk}, reqs)
        try:
            info = _assert_c_batch_equals_python(c, got, py, dec, py_log)
            prefills = [e[1] for e in c.log if e[0] == "forward" and e[2]]
            assert (info.prefill_calls, info.prefill_rows) == (len(prefills), sum(len(r) for p in prefills
                                                                                    for _, r, _ in p))
            assert info.prefill_rows == sum(len(r["prompt"]) for r in reqs)
            # prompts cut into chunks of ``rows`` (while nobody decodes: whole) and continued at a cache length past 0
            assert any(sum(len(r) for _, r, _ in p) == rows for p in prefills)
            assert any(n > 0 for p in prefills for _, _, n in p)
        finally:
            c.close()
    whole, cw = _run_c_batch(lib, batch_be, {**opts, "adaptive": False, "prefill_chunk": 0, "prefill_share": 0},
                             reqs)
    try:
        assert [r["tokens"] for r in got] == [r["tokens"] for r in whole]
        assert cw.info().prefill_calls < info.prefill_calls
    finally:
        cw.close()


def test_c_batch_planted_prefill_share_is_caught(lib, batch_be, monkeypatch):
    """Negative control: with $DFLASH2_PLANT_PREFILL_SHARE=1 (the budget ignores the costs: "prefill_chunk" rows a
    step) the C batch's prefill calls differ from the Python BatchDecoder's under a time budget."""
    monkeypatch.setenv("DFLASH2_PLANT_PREFILL_SHARE", "1")
    with pytest.raises(AssertionError, match=r"diff: \(.forward.*True\) != \(.forward"):  # a prefill call differs
        test_c_batch_chunked_prefill_equals_python_batch_decoder(lib, batch_be, 512, 1.5, ",0.2,0.1", 3)


def test_c_batch_planted_chunk_shift_is_caught(lib, batch_be, monkeypatch):
    """Negative control: with $DFLASH2_PLANT_PREFILL_CHUNK_SHIFT=1 (a prompt chunk after the first takes its ids one
    position early) the chunked batch's greedy tokens differ from whole-prompt prefill's."""
    reqs = [dict(r, temperature=0.0) for r in _batch_scenario(batch_be)]
    opts = {"fixed_costs": "1.0,0.05,0.1,0.2", "adaptive": False}
    whole, cw = _run_c_batch(lib, batch_be, {**opts, "prefill_chunk": 0, "prefill_share": 0}, reqs)
    cw.close()
    monkeypatch.setenv("DFLASH2_PLANT_PREFILL_CHUNK_SHIFT", "1")  # (the library reads it at each prefill)
    got, c = _run_c_batch(lib, batch_be, {**opts, "prefill_chunk": 4, "prefill_share": 0}, reqs)
    c.close()
    assert [r["tokens"] for r in got] != [r["tokens"] for r in whole]


def _lookup_scenario(be) -> list[dict]:  # noqa: ANN001
    """7 requests on repetitive prompts (lookups find matches): auto, ngram (with its own rows) and dflash2, greedy
    and sampling, one that never speculates; joins and the cancel as :func:`_batch_scenario`."""
    rng = np.random.default_rng(31)
    V = be.manifest.target.vocab_size
    proposers = ["auto", "ngram", "auto", "ngram", "dflash2", "auto", "auto"]
    temps, max_new = [0.0, 0.0, 0.8, 0.7, 0.0, 0.0, 0.0], [60, 30, 30, 28, 24, 20, 40]
    reqs = []
    for i, (who, t, m) in enumerate(zip(proposers, temps, max_new)):
        base = rng.integers(4, V, int(rng.integers(3, 8))).tolist()
        reqs.append({"prompt": base * 3, "max_new": m, "temperature": t, "seed": 40 + i, "eos": [],
                     "speculative": i != 5, "proposer": who, "ngram_rows": 5 if i == 1 else 0})
    return reqs


@pytest.mark.parametrize(("adaptive", "draft_s"), [(True, 0.1), (True, 0.6), (False, 0.1)],
                         ids=["adaptive", "costly-drafter", "always-draft"])
def test_c_batch_with_prompt_lookup_equals_python_batch_decoder(lib, batch_be, adaptive, draft_s):
    """Per-request proposers (dfl2_request options "proposer" / "ngram_rows") in the C batched core against the Python
    BatchDecoder: the same runner calls (a lookup cycle calls no drafter; its verified rows' features join the
    drafter's context with the plain steps' when the drafter runs next), tokens, accepted / verified drafts, plain
    steps and the proposer of every cycle (dfl2_batch_get_proposers), with the rule weighing lookups as free
    proposals, with a drafter whose proposals mostly do not pay (the rule's fallbacks: a request's lookup verifies
    where its preferred drafter proposal was left out) and with every request drafting; lookups were made and
    accepted, greedy and at T > 0."""
    from dflash2_trt.runtime import batch as BT

    reqs = _lookup_scenario(batch_be)
    costs = BT.FixedCosts(plain_fn=lambda n: 1.0 + 0.05 * n, draft_s=draft_s, verify_s=0.2)
    rule = BT.SpeculationRule(costs=costs, adaptive=adaptive, prior_tau=2.0)
    fallbacks_taken = []
    choose = rule.choose

    def counting(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = choose(*a, **k)
        fallbacks_taken.extend(fk for fk, _ in (k.get("fallbacks") or {}).values() if fk in out)
        return out

    rule.choose = counting
    py, dec, py_log = _run_python_batch(batch_be, rule, reqs)
    got, c = _run_c_batch(lib, batch_be, {"fixed_costs": f"1.0,0.05,{draft_s},0.2", "adaptive": adaptive,
                                          "prior_tau": 2.0}, reqs)
    try:
        _assert_c_batch_equals_python(c, got, py, dec, py_log)
        tgt = batch_be.target_runner()
        for i, r in enumerate(reqs):
            if r["temperature"] == 0 and i != 0:  # lossless: each greedy request is its own B = 1 output
                want = D.target_generate(tgt, r["prompt"], req(r["max_new"], eos_ids=set())).tokens
                assert got[i]["tokens"] == want, f"request {i} differs from its B = 1 output"
        lookups = {i: [a for a, w in zip(r["accepted"], r["proposers"]) if w == "ngram"] for i, r in enumerate(got)}
        assert sum(map(sum, lookups.values())) > 0 and lookups[1] and lookups[3] and not lookups[4], lookups
        assert sum(lookups[2] + lookups[3]) > 0  # accepted by rejection sampling at T > 0
        if draft_s <= 0.1:  # auto used both (the costly drafter mostly loses to lookups: its fallbacks, below)
            assert any("dflash2" in r["proposers"] and "ngram" in r["proposers"] for r in got)
        assert all(w == "ngram" for i in (1, 3) for w in got[i]["proposers"]) and got[5]["accepted"] == []
        assert bool(fallbacks_taken) == (draft_s > 0.1), fallbacks_taken
    finally:
        c.close()


@pytest.fixture(scope="module")
def poor_batch_be(tiny_export):
    """The tiny random pair's ONNX Runtime backend: its drafter's proposals are nearly all rejected."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    with OrtBackend(tiny_export, attention="gqa", threads=1) as b:
        yield b


def _held_not_counted(BT):  # noqa: ANN001, ANN202
    """Planted bug: BatchDecoder._choose whose held branch no longer counts the step toward probe_after."""
    import inspect
    import textwrap

    src = textwrap.dedent(inspect.getsource(BT.BatchDecoder._choose))
    held = "        for s in cands:\n            s.plain_run += 1\n        return {}"
    assert src.count(held) == 1
    scope: dict = {}
    exec(src.replace(held, "        return {}"), vars(BT), scope)  # noqa: S102
    return scope["_choose"]


_PROBE_AFTER = 3


@pytest.mark.parametrize(("pair", "plant"), [("accepting", None), ("random", None), ("random", "c_weighed_kept"),
                                             ("random", "python_held_uncounted")])
def test_c_batch_equals_python_batch_decoder_on_measured_costs(lib, batch_be, poor_batch_be, monkeypatch, pair,
                                                               plant):
    """Both batch loops on measured costs (their default) with one deterministic clock -- the test's: a target
    forward takes 10 ms and 0.5 ms per verify row, everything else nothing; Python's batch.COST_CLOCK and the C
    core's clock (its test hook dflash2TestCostClock, set through ctypes) read it -- and the runner's cost plan
    hidden (the C core has none), over the accepting pair and the random one (drafts nearly all rejected): the same runner calls, tokens, accepted
    drafts, plain steps and step counts. The realized check runs both ways: held steps (plain first, then after the
    rule chose plain: every 16th left to it) and weighed ones, drafting steps among them; on the random pair held
    steps count toward probe_after (3), so a request drafts again after a run of held steps (its estimate back at
    the prior of 6). The prefill's time budget (the default prefill_share) reads the same clock: chunks of the rows
    its measured costs allow. Negative controls, each failing the comparison: the C core leaving mWeighed set on a
    held step ($DFLASH2_PLANT_HELD_STEP_WEIGHED), Python's _choose not counting a held step toward probe_after (in
    the scenario with fixed chunks, where the held steps reach it)."""
    import ctypes

    from dflash2_trt.runtime import batch as BT
    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

    be = batch_be if pair == "accepting" else poor_batch_be
    now = ctypes.c_double(0.0)
    monkeypatch.setattr(BT, "COST_CLOCK", lambda: now.value)
    monkeypatch.setattr(ctypes.c_void_p.in_dll(lib, "dflash2TestCostClock"), "value", ctypes.addressof(now))
    monkeypatch.delattr(OrtBatchedTargetRunner, "cost_units")  # the rule without a plan, as the C core's
    forward = OrtBatchedTargetRunner.forward

    def timed(self, rows, **kw):  # noqa: ANN001, ANN003, ANN202
        now.value += 0.010 + 0.0005 * sum(len(r) - 1 for r in rows.values())
        return forward(self, rows, **kw)

    monkeypatch.setattr(OrtBatchedTargetRunner, "forward", timed)
    steps: list[tuple[bool, bool]] = []  # (weighed, drafted) per step
    record = BT.MeasuredCosts.record_step

    def counted(self, n, drafted, tokens, s, weighed):  # noqa: ANN001, ANN202
        steps.append((weighed, drafted))
        return record(self, n, drafted, tokens, s, weighed)

    monkeypatch.setattr(BT.MeasuredCosts, "record_step", counted)
    reqs = _batch_scenario(be)
    share = 0 if plant == "python_held_uncounted" else BT.DEFAULT_PREFILL_SHARE

    def python_run():  # noqa: ANN202
        rule = BT.SpeculationRule(costs=BT.MeasuredCosts(), adaptive=True, prior_tau=6.0, probe_after=_PROBE_AFTER)
        return _run_python_batch(be, rule, reqs, prefill_share=share or None)

    py, dec, py_log = python_run()
    weighed = [w for w, _ in steps]
    assert dec.drafting_steps > 0 and 0 < sum(weighed) < len(weighed), (dec.drafting_steps, steps)
    if pair == "random":  # a request probed: drafting again after more held steps than probe_after
        assert any(d and not any(w for w, _ in steps[i - _PROBE_AFTER:i]) for i, (_, d) in enumerate(steps)
                   if i >= _PROBE_AFTER and any(d0 for _, d0 in steps[:i])), steps
    if plant == "c_weighed_kept":
        monkeypatch.setenv("DFLASH2_PLANT_HELD_STEP_WEIGHED", "1")
    if plant == "python_held_uncounted":
        monkeypatch.setattr(BT.BatchDecoder, "_choose", _held_not_counted(BT))
        py, dec, py_log = python_run()
    now.value = 0.0
    got, c = _run_c_batch(lib, be, {"adaptive": True, "prior_tau": 6.0, "probe_after": _PROBE_AFTER,
                                    "prefill_share": share}, reqs)
    try:
        if plant is None:
            _assert_c_batch_equals_python(c, got, py, dec, py_log)
        else:
            with pytest.raises(AssertionError):
                _assert_c_batch_equals_python(c, got, py, dec, py_log)
    finally:
        c.close()


def test_option_table_matches_header(lib):
    """The header's OPTIONS list and the library's table (listed in the unknown-key message) are the same keys."""
    from dflash2_trt.vocabulary import DEFAULT_PROPOSER, PROPOSERS

    header = (RUNTIME / "include" / "dflash2" / "dflash2.h").read_text()
    documented = re.findall(r'^ \*\s+"([a-z_]+)"\s+(?:int|double|bool|string|int\[\])\s', header, re.M)
    opts = C.c_void_p()
    _check(lib, lib.dfl2_options_create(C.byref(opts)))
    with pytest.raises(CapiError) as e:
        _check(lib, lib.dfl2_options_parse(opts, b"nope=1"))
    known = re.search(r"known: ([a-z_, ]+)\)", e.value.message).group(1).split(", ")
    assert documented == known and len(known) >= 10
    with pytest.raises(CapiError) as e:  # the proposers are the Python vocabulary's, the default its default
        _check(lib, lib.dfl2_options_parse(opts, b"proposer=nope"))
    assert e.value.code == 4 and "|".join(PROPOSERS) in e.value.message
    assert re.search(rf'"proposer"\s+string "{DEFAULT_PROPOSER}"', header)
    lib.dfl2_options_free(opts)


@pytest.mark.parametrize(("option", "why"), [
    ("top_p=0", "(0, 1]"), ("top_p=1.5", "(0, 1]"), ("min_p=-0.1", "[0, 1]"), ("top_k=-2", ">= 0"),
    ("presence_penalty=2.5", "[-2, 2]"), ("frequency_penalty=-3", "[-2, 2]"), ("repetition_penalty=0", "> 0"),
    ("top_logprobs=21", "[0, 20]"), ("logit_bias=5", "id:bias"), ("logit_bias=5:101", "id:bias"),
    ("logit_bias=-1:2", "id:bias"), ("logit_bias=5:2,", "comma")])
def test_sampling_options_refused_in_one_status(lib, option, why):
    """A sampling option out of request.GenerationRequest's range is refused by its setter (DFL2_ERR_OPTION_VALUE,
    the key and the allowed values named)."""
    opts = C.c_void_p()
    _check(lib, lib.dfl2_options_create(C.byref(opts)))
    try:
        with pytest.raises(CapiError) as e:
            _check(lib, lib.dfl2_options_parse(opts, option.encode()))
        assert e.value.code == 4 and option.split("=")[0] in e.value.message and why in e.value.message
    finally:
        lib.dfl2_options_free(opts)


def test_sampling_options_checked_against_the_model(lib, tiny_export, monkeypatch):
    """top_logprobs without logprobs, and a logit_bias id past the vocabulary, refuse the session in one status
    (DFL2_ERR_OPTION_VALUE naming the option); the vocabulary's last id is taken."""
    import onnxruntime

    monkeypatch.setenv("VIRTUAL_ENV", str(Path(onnxruntime.__file__).parents[4]))
    monkeypatch.delenv("ORT_LIBRARY", raising=False)
    monkeypatch.delenv("DFLASH2_ORT_OPS", raising=False)
    m, info = C.c_void_p(), ModelInfo()
    load = _c_options(lib, {"backend": "ort"})
    _check(lib, lib.dfl2_model_load(str(tiny_export).encode(), load, C.byref(m)))
    lib.dfl2_options_free(load)
    try:
        _check(lib, lib.dfl2_model_get_info(m, C.byref(info)))
        V = info.vocab_size
        for options, what in (({"top_logprobs": 2}, "top_logprobs"), ({"logit_bias": f"{V}:1.5"}, "logit_bias"),
                              ({"logit_bias": f"{V - 1}:1.5", "logprobs": True, "top_logprobs": 2}, None)):
            opts, sess = _c_options(lib, options), C.c_void_p()
            try:
                if what is None:
                    _check(lib, lib.dfl2_session_create(m, opts, C.byref(sess)))
                    lib.dfl2_session_free(sess)
                    continue
                with pytest.raises(CapiError) as e:
                    _check(lib, lib.dfl2_session_create(m, opts, C.byref(sess)))
                assert e.value.code == 4 and what in e.value.message and not sess.value
            finally:
                lib.dfl2_options_free(opts)
    finally:
        lib.dfl2_model_free(m)


def test_model_load_falls_back_to_onnxruntime(lib, tiny_export, monkeypatch):
    """A real export folder passes the C manifest check (format, version, entries, files, sha256); "tensorrt" then
    reports that TensorRT cannot run here, and "auto" takes ONNX Runtime (the wheel's library in $VIRTUAL_ENV),
    saying why in the model's note."""
    m = C.c_void_p()
    opts = _c_options(lib, {"backend": "tensorrt"})
    with pytest.raises(CapiError) as e:
        _check(lib, lib.dfl2_model_load(str(tiny_export).encode(), opts, C.byref(m)))
    lib.dfl2_options_free(opts)
    assert e.value.code == 8 and "TensorRT" in e.value.message and not m.value
    import onnxruntime

    monkeypatch.setenv("VIRTUAL_ENV", str(Path(onnxruntime.__file__).parents[4]))  # .venv/lib/python3.X/site-packages
    monkeypatch.delenv("ORT_LIBRARY", raising=False)
    monkeypatch.delenv("DFLASH2_ORT_OPS", raising=False)  # no op library in this process (test_capi_ort says why)
    _check(lib, lib.dfl2_model_load(str(tiny_export).encode(), None, C.byref(m)))
    try:
        note, info = C.c_char_p(), ModelInfo()
        _check(lib, lib.dfl2_model_get_note(m, C.byref(note)))
        _check(lib, lib.dfl2_model_get_info(m, C.byref(info)))
        assert info.backend == b"onnxruntime"
        assert re.match(r"TensorRT not available \(.*TensorRT.*\), using ONNX Runtime 1\.\d+", note.value.decode())
        assert "the onnxruntime wheel in $VIRTUAL_ENV" in note.value.decode()
    finally:
        lib.dfl2_model_free(m)


def test_model_load_checks_manifest_fields_against_graphs(lib, tiny_export, tmp_path):
    """The C manifest reader applies the Python reader's rules (dflash2_trt/manifest.py check_graph_fields): every
    edit of test_runtime's table is refused at dfl2_model_load with DFL2_ERR_CORRUPT naming the field and both
    values, before any backend is opened; the unedited export reaches the backend check."""
    from helpers import FIELD_EDITS

    for i, (edit, msg) in enumerate(FIELD_EDITS):
        d = tmp_path / f"e{i}"
        shutil.copytree(tiny_export, d)
        m = json.loads((d / "manifest.json").read_text())
        edit(m)
        (d / "manifest.json").write_text(json.dumps(m))
        handle = C.c_void_p()
        with pytest.raises(CapiError) as e:
            _check(lib, lib.dfl2_model_load(str(d).encode(), None, C.byref(handle)))
        assert e.value.code == 6 and re.search(msg, e.value.message), (i, e.value.message)


def test_example_refuses_bad_arguments_before_loading(capi_build, tiny_export):
    """The C example's bad arguments end in one line and exit 1 before the model is opened: a negative id, a
    negative seed (the library's option check), an empty request of a -b batch (between two ',' or after the
    last)."""
    exe = str(capi_build / "bin" / "generate")
    for args, msg in ((["-1"], "'-1' is not a token id"), (["1", "-o", "seed=-1"], "option 'seed' must be >= 0"),
                      (["-b", "1", ",", ",", "2"], "an empty request"), (["-b", "1", ","], "an empty request"),
                      (["-b", ",", "1"], "an empty request")):
        out = subprocess.run([exe, str(tiny_export), *args], capture_output=True, text=True)
        assert out.returncode == 1 and msg in out.stderr and len(out.stderr.strip().splitlines()) == 1, (args, out)


def test_tensorrt_backend_compiles(capi_build):
    """The TensorRT backend (C++, runtime/src/backends/trtBackend.cpp) is compiled with -Werror against the
    kernel-lens TensorRT headers and the CUDA runtime headers. It is never run here (no GPU, no libnvinfer):
    libnvinfer is dlopen'ed, so the library loads without it and model loading reports UNAVAILABLE."""
    if not _trt_args():
        pytest.fail("the TensorRT backend needs the CUDA toolkit (/usr/local/cuda) and kernel-lens headers "
                    "(pip install kernel-lens) to compile")
    assert "DFLASH2_RUNTIME_TENSORRT:BOOL=ON" in (capi_build / "CMakeCache.txt").read_text()
    obj = capi_build / "CMakeFiles" / "dflash2_objects.dir" / "src" / "backends" / "trtBackend.cpp.o"
    syms = _run(["nm", "-C", str(obj)], "nm").stdout
    assert "TrtRunners::drafterPropose" in syms and "TrtModel::TrtModel" in syms
    assert "TrtBatchRunners::targetForward" in syms  # dfl2_batch over TensorRT (never run here either)
    needed = _run(["readelf", "-d", str(capi_build / "lib" / "libdflash2.so")], "readelf").stdout
    assert "nvinfer" not in needed and "libcudart" not in needed, needed
    out = subprocess.run([str(capi_build / "bin" / "generate"), str(capi_build / "tests" / "capi-scratch" / "valid"),
                          "1", "-o", "verify_checksums=false", "-o", "backend=tensorrt"], capture_output=True, text=True)
    assert out.returncode == 1 and "libnvinfer.so.10 not found" in out.stderr
    assert re.search(r"trtParts \.+\s+Passed", _ctest(capi_build)), "trtParts ctest"


@pytest.fixture(scope="module")
def engines_export(tiny_export, tmp_path_factory) -> Path:
    """The tiny export with FakeTrt "engines" recorded in its manifest (built with TensorRT "10.13.0.35")."""
    from dflash2_trt.export import engines as E
    from trt_fakes import FakeCuda, FakeTrt

    d = tmp_path_factory.mktemp("capi-trt") / "exp"
    shutil.copytree(tiny_export, d)
    cuda = FakeCuda()
    E.build_engines(d, selector="decomposed", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    return d


def test_tensorrt_backend_opens_only_its_libnvinfer_major(capi_build, engines_export, tmp_path):
    """The TensorRT backend opens libnvinfer.so.<its headers' major> only (a fake libnvinfer on LD_LIBRARY_PATH):
    an unversioned libnvinfer.so is never opened; a library reporting another major is refused as UNAVAILABLE
    before any TensorRT object is made; the engines' full version (major.minor.patch.build) must equal the
    library's; a library that passes both gets as far as CUDA (none here)."""
    if not _trt_args():
        pytest.fail("needs the TensorRT backend compiled (CUDA toolkit + kernel-lens headers)")
    fake = next((capi_build / "fake-nvinfer").glob("libnvinfer.so.*"))
    major = fake.name.rsplit(".", 1)[-1]
    unversioned = tmp_path / "unversioned"
    unversioned.mkdir()
    shutil.copy(fake, unversioned / "libnvinfer.so")

    def run(libdir: Path, version: str, build: str = "35") -> str:
        env = dict(os.environ, LD_LIBRARY_PATH=str(libdir), DFLASH2_FAKE_NVINFER_VERSION=version,
                   DFLASH2_FAKE_NVINFER_BUILD=build)
        out = subprocess.run([str(capi_build / "bin" / "generate"), str(engines_export), "1", "2", "-o",
                              "backend=tensorrt"], capture_output=True, text=True, env=env)
        assert out.returncode == 1, out
        return out.stderr

    assert f"libnvinfer.so.{major} not found" in run(unversioned, "101300")
    other = int(major) + 1
    err = run(fake.parent, f"{other}0400")
    assert f"libnvinfer reports TensorRT {other}.4, this libdflash2 was built against TensorRT {major} headers" in err
    assert "engines were built with TensorRT 10.13.0.35, this is TensorRT 10.3.0.35" in run(fake.parent, "100300")
    assert "engines were built with TensorRT 10.13.0.35, this is TensorRT 10.13.0.36" in run(fake.parent, "101300", "36")
    assert "no CUDA device 0 here" in run(fake.parent, "101300")  # past every library check


def test_tensorrt_backend_takes_a_sliding_export(capi_build, tmp_path_factory):
    """The TensorRT backend no longer refuses sliding-window exports: a gpt-oss export with FakeTrt engines gets past
    every check of the model load that precedes CUDA (none here), where it used to be refused. What runs them —
    each sliding layer's K/V in a device ring, trtParts.h DeviceWindowRing — is tested by the trtParts ctest against
    a host twin; the binding of the rings to engines needs CUDA and has never run."""
    if not _trt_args():
        pytest.fail("needs the TensorRT backend compiled (CUDA toolkit + kernel-lens headers)")
    from dflash2_trt.export import engines as E
    from dflash2_trt.export.exporter import export_model
    from helpers import make_pair
    from trt_fakes import FakeCuda, FakeTrt

    pair = make_pair(tmp_path_factory, "capi_trt_sw", accepting=True, arch="gpt_oss")
    d = tmp_path_factory.mktemp("capi-trt-sw") / "exp"
    export_model(pair / "target", pair / "drafter", d, progress=False, max_seq_len=256, block_size=8)
    cuda = FakeCuda()
    E.build_engines(d, selector="decomposed", progress=False, trt_module=FakeTrt(cuda), api=cuda)
    assert json.loads((d / "manifest.json").read_text())["target"]["sliding_window"]
    fake = next((capi_build / "fake-nvinfer").glob("libnvinfer.so.*"))
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake.parent), DFLASH2_FAKE_NVINFER_VERSION="101300",
               DFLASH2_FAKE_NVINFER_BUILD="35")
    out = subprocess.run([str(capi_build / "bin" / "generate"), str(d), "1", "2", "-o", "backend=tensorrt"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "no CUDA device 0 here" in out.stderr, out
    # engines whose profiles do not fix the ring at the manifest's size are refused first, in one line
    manifest = json.loads((d / "manifest.json").read_text())
    ring = manifest["target"]["sliding_window"]["ring_slots"]
    for prof in manifest["engines"]["plans"]["target"]["profiles"]:
        assert prof["dims"]["ring_slots"] == [ring] * 3
        prof["dims"]["ring_slots"] = [1, ring, ring]
    (d / "manifest.json").write_text(json.dumps(manifest))
    out = subprocess.run([str(capi_build / "bin" / "generate"), str(d), "1", "2", "-o", "backend=tensorrt"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 1 and f"does not fix ring_slots at the manifest's ring of {ring} slots" in out.stderr, out


# --------------------------------------------------------------------------------------------------
# Sanitizers + fuzzing (clang), and the aarch64 cross build under qemu
# --------------------------------------------------------------------------------------------------


def test_asan_ubsan_ctests_and_fuzz(vectors_path, tmp_path):
    """The C tests under AddressSanitizer + UBSan (clang), then libFuzzer for a bounded time each
    (DFLASH2_FUZZ_SECONDS, default 5): over manifest + option parsing, and over the generation entry points
    (dfl2_session_generate, dfl2_batch_submit / step / cancel / get_result with fuzzed model sizes, prompt ids,
    lengths and options). The planted bug of the second (a prompt id one past the vocabulary let through) is found
    by it from an empty corpus."""
    _need("clang")
    secs = os.environ.get("DFLASH2_FUZZ_SECONDS", "5")
    build = _cmake_build(BUILD / "capi-asan", [
        "-DCMAKE_C_COMPILER=clang", "-DCMAKE_CXX_COMPILER=clang++", "-DDFLASH2_SANITIZE=address,undefined",
        "-DDFLASH2_FUZZ=ON", f"-DDFLASH2_CORE_VECTORS={vectors_path}", f"-DDFL2_FUZZ_SECONDS={secs}",
    ])  # fmt: skip
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    out = _ctest(build, env)
    for name in ("capiC", "coreVectors", "fuzzManifestOptions", "fuzzGenerate"):
        assert re.search(rf"{name} \.+\s+Passed", out), out
    (tmp_path / "corpus").mkdir()  # empty; the crash file goes to the working folder
    planted = subprocess.run([str(build / "tests" / "fuzzGenerate"), "-seed=1", "-max_total_time=60", "-max_len=2048",
                              str(tmp_path / "corpus")], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                             env=dict(env, DFLASH2_PLANT_PROMPT_ID_PAST_VOCAB="1"))
    assert planted.returncode != 0 and "a target call with an id outside the vocabulary" in planted.stderr, \
        planted.stderr[-2000:]


def test_aarch64_cross_build_under_qemu(vectors_path):
    """The CPU parts (core, callbacks backend, example, C tests) cross-compiled with aarch64-linux-gnu-g++ pass
    their ctests under qemu-aarch64 — the Jetson build is checked, not assumed."""
    _need("aarch64-linux-gnu-g++")
    qemu = _need("qemu-aarch64")
    build = _cmake_build(BUILD / "capi-aarch64", [
        f"-DCMAKE_TOOLCHAIN_FILE={RUNTIME / 'cmake' / 'aarch64-linux-gnu.cmake'}",
        f"-DCMAKE_CROSSCOMPILING_EMULATOR={qemu};-L;/usr/aarch64-linux-gnu",
        f"-DDFLASH2_CORE_VECTORS={vectors_path}",
    ])  # fmt: skip
    lib = build / "lib" / "libdflash2.so"
    assert "AArch64" in _run(["readelf", "-h", str(lib)], "readelf").stdout
    # the ONNX Runtime backend is compiled in (the headers are architecture-independent); capiC under qemu, with no
    # libonnxruntime for aarch64, checks its one-status refusal
    objects = build / "CMakeFiles" / "dflash2_objects.dir" / "src" / "backends"
    assert all((objects / f"{name}.cpp.o").is_file() for name in ("ortApi", "ortBackend", "onnxRewrite"))
    out = _ctest(build)
    for name in ("headerC99", "capiC", "coreVectors", "exampleUnavailable"):
        assert re.search(rf"{name} \.+\s+Passed", out), out
