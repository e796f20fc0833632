"""Self-distilled training data (the folders :mod:`dflash2_trt.train.make_data` writes) and the block
construction of docs/training.md.

Every row is a prompt followed by the target's own answer, with the tap features captured while it was
generated. A block anchored at response position ``a`` sees context positions ``< a``; its slot k is
labelled with the *generated* token at ``a + k`` — the target's own chain, exactly what greedy
verification checks (for greedy rows) — and slots past the end of the row are unlabelled (-100).
Anchors lie in response positions only (the loss mask).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash2_trt.errors import DFlash2Error

IGNORE = -100


@dataclass
class Row:
    tokens: np.ndarray  # [n] int32 prompt + response
    feats: np.ndarray  # [n, nH] float16 (memmap)
    prompt_len: int
    temperature: float
    topk_ids: np.ndarray  # [n, k] int32: row p = the target's top-k for position p + 1
    topk_logp: np.ndarray  # [n, k] float16
    teacher_forced: bool = False  # existing text run through the target: labels = chain_labels (not the text)


class GeneratedData:
    """All complete shards of one or more make-data folders (same target and taps), memory-mapped. Rows are
    indexed 0..len-1 in folder, then shard order."""

    def __init__(self, roots: str | Path | Sequence[str | Path], max_shards: int | None = None) -> None:
        self.roots = [Path(roots)] if isinstance(roots, (str, Path)) else [Path(r) for r in roots]
        if not self.roots:
            raise DFlash2Error("no make-data folder given")
        metas = []
        for root in self.roots:
            mpath = root / "meta.json"
            if not mpath.is_file():
                raise DFlash2Error(f"{root} is not a make-data folder (no meta.json)")
            metas.append(json.loads(mpath.read_text()))
        self.meta = metas[0]
        self.layer_ids: list[int] = list(self.meta["target_layer_ids"])
        for root, m in zip(self.roots[1:], metas[1:]):
            for k in ("target_layer_ids", "hidden_size", "eos_ids"):
                if m.get(k) != self.meta.get(k):
                    raise DFlash2Error(f"{root} was made with {k} = {m.get(k)}, {self.roots[0]} with "
                                       f"{self.meta.get(k)}: the folders do not belong together")
            # labels are the target's chain at the dtype it ran in (folders older than --dtype: fp32)
            if m.get("target_dtype", "fp32") != self.meta.get("target_dtype", "fp32"):
                raise DFlash2Error(f"{root} holds labels of the {m.get('target_dtype', 'fp32')} target, "
                                   f"{self.roots[0]} of the {self.meta.get('target_dtype', 'fp32')} one: make the "
                                   f"data at the dtype you deploy, in every folder")
        self.shards: list[Path] = []
        self._folder: list[int] = []  # folder of each shard
        for f, root in enumerate(self.roots):
            shards = sorted(p for p in root.glob("shard-?????") if p.is_dir())[:max_shards]
            if not shards:
                raise DFlash2Error(f"{root} holds no complete shard yet")
            self.shards += shards
            self._folder += [f] * len(shards)
        self._arr: list[dict[str, np.ndarray]] = []
        self.index: list[tuple[int, int]] = []  # (shard, row in shard)
        for s, p in enumerate(self.shards):
            a = {n: np.load(p / f"{n}.npy", mmap_mode="r") for n in
                 ("tokens", "offsets", "prompt_len", "temperature", "feats", "topk_ids", "topk_logp")}
            tf_all = metas[self._folder[s]].get("mode") == "teacher_forced"
            a["teacher_forced"] = (np.load(p / "teacher_forced.npy") if (p / "teacher_forced.npy").is_file()
                                   else np.full(a["prompt_len"].shape[0], tf_all))
            self._arr.append(a)
            self.index += [(s, r) for r in range(a["prompt_len"].shape[0])]

    def __len__(self) -> int:
        return len(self.index)

    def row(self, i: int) -> Row:
        s, r = self.index[i]
        a = self._arr[s]
        lo, hi = int(a["offsets"][r]), int(a["offsets"][r + 1])
        return Row(np.asarray(a["tokens"][lo:hi]), a["feats"][lo:hi], int(a["prompt_len"][r]),
                   float(a["temperature"][r]), a["topk_ids"][lo:hi], a["topk_logp"][lo:hi],
                   bool(a["teacher_forced"][r]))

    def anchors(self, rng: np.random.Generator, i: int, k: int) -> np.ndarray:
        """Up to ``k`` anchors of row ``i``: response positions (generated rows) or on-chain positions
        (teacher-forced rows, :func:`chain_anchors`)."""
        r = self.row(i)
        if r.teacher_forced:
            return chain_anchors(rng, r.tokens, np.asarray(r.topk_ids[:, 0]), r.prompt_len, k)
        return response_anchors(rng, r.tokens.shape[0], r.prompt_len, k)

    def labels(self, i: int, anchors: np.ndarray, block_size: int) -> np.ndarray:
        """[nb, bs] labels of row ``i``'s blocks: the generated chain, or the target's greedy chain as far
        as a teacher-forced text stays on it."""
        r = self.row(i)
        if r.teacher_forced:
            return chain_labels(r.tokens, np.asarray(r.topk_ids[:, 0]), anchors, block_size)
        return block_labels(r.tokens, anchors, block_size)

    def prompt_texts(self) -> list[str]:
        """The prompt (or teacher-forced text) of every prompt in the folders' prompts.jsonl."""
        out = []
        for root in self.roots:
            path = root / "prompts.jsonl"
            if path.is_file():
                out += [json.loads(x)["text"] for x in path.read_text().splitlines() if x.strip()]
        return out

    def split(self, heldout_shards: int, need_train: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Row ids of (train, held-out): the last ``heldout_shards`` shards of each folder are held out
        (held-out rows in folder order: the first folder's come first)."""
        per = np.bincount(self._folder, minlength=len(self.roots))  # shards per folder
        if heldout_shards >= per.min() + (0 if need_train else 1):
            raise DFlash2Error(f"--heldout-shards {heldout_shards} leaves no training shard "
                               f"({per.min()} complete in {self.roots[int(per.argmin())]})")
        held_shard = np.zeros(len(self.shards), dtype=bool)
        for end in np.cumsum(per):  # each folder's shards end at its running total
            held_shard[end - heldout_shards: end] = True
        ids = np.arange(len(self.index))
        shard_of = np.asarray([s for s, _ in self.index])
        return ids[~held_shard[shard_of]], ids[held_shard[shard_of]]

    def response_token_counts(self, rows: np.ndarray, vocab_size: int) -> np.ndarray:
        """[V] int64: how often each id occurs as a response token in ``rows`` (the frequent-id set)."""
        c = np.zeros(vocab_size, np.int64)
        for i in rows:
            r = self.row(int(i))
            # a teacher-forced row's labels are the target's greedy ids, not the text's
            ids = np.asarray(r.topk_ids[r.prompt_len - 1: -1, 0]) if r.teacher_forced else r.tokens[r.prompt_len:]
            np.add.at(c, ids.astype(np.int64), 1)
        return c


def response_anchors(rng: np.random.Generator, n: int, prompt_len: int, k: int) -> np.ndarray:
    """Up to ``k`` distinct sorted anchors in the response: a in [prompt_len, n - 2] (slot 1 has a label)."""
    lo, hi = prompt_len, n - 2
    if hi < lo:
        return np.zeros(0, np.int64)
    cand = np.arange(lo, hi + 1)
    return np.sort(rng.choice(cand, size=min(k, cand.size), replace=False)).astype(np.int64)


def block_labels(tokens: np.ndarray, anchors: np.ndarray, block_size: int) -> np.ndarray:
    """[nb, bs] int64: slot 0 = -100, slot k = tokens[a + k] (the generated chain), -100 past the row end."""
    k = np.arange(block_size)
    idx = anchors[:, None] + k[None, :]  # [nb, bs]
    lab = np.where(idx < tokens.shape[0], np.asarray(tokens, np.int64)[np.minimum(idx, tokens.shape[0] - 1)], IGNORE)
    lab[:, 0] = IGNORE
    return lab


def chain_anchors(rng: np.random.Generator, tokens: np.ndarray, greedy: np.ndarray, min_pos: int, k: int
                  ) -> np.ndarray:
    """Teacher-forced rows: up to ``k`` distinct sorted anchors a in [max(1, min_pos), n - 1] where the text is
    on the target's chain (``tokens[a] == greedy[a - 1]``: a deployed anchor is always the target's token)."""
    n = tokens.shape[0]
    lo = max(1, min_pos)
    if n - 1 < lo:
        return np.zeros(0, np.int64)
    cand = np.arange(lo, n)
    cand = cand[np.asarray(tokens)[cand] == np.asarray(greedy)[cand - 1]]
    return np.sort(rng.choice(cand, size=min(k, cand.size), replace=False)).astype(np.int64)


def chain_labels(tokens: np.ndarray, greedy: np.ndarray, anchors: np.ndarray, block_size: int) -> np.ndarray:
    """[nb, bs] int64 labels of teacher-forced text: slot k = greedy[a + k - 1] (the target's greedy next token
    after position a + k - 1) while the text stays on the chain, i.e. tokens[a + j] == greedy[a + j - 1] for
    every 0 < j < k; -100 after the first disagreement (the chain is unknown past it), past the row end and
    for slot 0. Only the first disagreeing slot's label differs from the text."""
    n = tokens.shape[0]
    t = np.asarray(tokens, np.int64)
    g = np.asarray(greedy, np.int64)
    k = np.arange(block_size)
    pos = anchors[:, None] + k[None, :] - 1  # [nb, bs] position whose greedy token labels slot k
    ok_pos = (pos >= 0) & (pos < n)
    lab = np.where(ok_pos, g[np.clip(pos, 0, n - 1)], IGNORE)
    # on[j]: text token a + j agrees with the chain (j >= 1); slot k needs on[1..k-1]
    nxt = anchors[:, None] + k[None, :]  # [nb, bs]
    on = (nxt < n) & (t[np.clip(nxt, 0, n - 1)] == g[np.clip(nxt - 1, 0, n - 1)])
    on[:, 0] = True
    ok = np.cumprod(on, axis=1).astype(bool)  # ok[:, j]: slots 1..j of the text all on the chain
    keep = np.zeros_like(ok)
    keep[:, 1:] = ok[:, :-1]  # slot k is labelled when text a+1..a+k-1 agree
    lab = np.where(keep & ok_pos, lab, IGNORE)
    lab[:, 0] = IGNORE
    return lab


def slot_weights(block_size: int, gamma: float | None = None) -> np.ndarray:
    """w_k = exp(-(k - 1) / gamma) for k = 1..bs-1, slot 0 weight 0. gamma: 7 (bs 16), 5 (bs 10), 4 (bs 8)."""
    if gamma is None:
        gamma = 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0
    w = np.zeros(block_size)
    w[1:] = np.exp(-(np.arange(1, block_size) - 1) / gamma)
    return w
