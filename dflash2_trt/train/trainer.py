"""Distillation trainer for DFlash 2 drafters on self-distilled data (docs/training.md).

The data is a :mod:`dflash2_trt.train.make_data` folder: prompts, the target's own answers (token ids as
generated) and the tap features captured while generating — so a training step costs only the drafter.

* **Labels** are the generated tokens for every slot (block slot k of an anchor at a predicts the token
  at a + k of the target's own chain); anchors lie in response positions only; slots past a row's end
  are unlabelled. Teacher-forced rows (:mod:`dflash2_trt.train.teacher_force`): the target's greedy chain
  as far as the text stays on it, anchors only on it (:func:`dflash2_trt.train.data.chain_labels`).
  ``anchors_per_seq`` 0 takes every anchor; ``epochs`` > 0 draws every row once per epoch.
* **Provenance**: ``OUT/trained_prompts.txt`` lists the hash of every prompt of the data folders plus the
  warm start's own list, so ``make-data --exclude DRAFTER`` keeps a new stage's data apart from all earlier ones.
* **Loss** = decay-weighted CE (``w_k = exp(-(k-1)/γ)``) + optional ``kl_weight`` x CE to the target's
  renormalised top-k distribution at the same position + 1.0 x the selector's K-way CE over the backbone's
  own (detached) top-K with the predecessor teacher-forced to the true previous token.
* **Sampled softmax** (``sampled_softmax = F``): the CE runs over the F most frequent response ids of the
  training rows ∪ the step's labels (and KL ids) ∪ ``random_negatives`` fresh random ids; the selector's
  candidates are the top-K over that same set (with ``selector_full_topk``, over the full vocabulary,
  exactly as decoding does — slower on a CPU).
* **RoPE θ** is read from the target's ``rope_parameters`` (transformers 5; or ``rope_theta`` of older
  configs); a missing or non-default RoPE is a :class:`DFlash2Error`, never a silent 10000. A target whose
  attention has no position embeddings (Nemotron-H) gives none: the warm-start drafter's (``init``) is kept.
* Each step's rows, anchors and negatives come from a generator seeded by ``(seed, step)``, so ``--resume``
  replays exactly the data an uninterrupted run would see.
* **Devices, dtypes, processes** (:mod:`dflash2_trt.train.dist`): ``device`` cpu / cuda; ``dtype`` is the
  frozen target's (embedding, LM head) and the drafter's autocast, with fp32 master weights, an fp32 loss and
  a GradScaler for fp16; under torchrun each step's ``batch_seqs`` rows are split over ranks x ``grad_accum``
  parts under DDP and the update equals one process's (see :func:`train`).
* :func:`offline_tau` walks the drafter along held-out greedy rows exactly as greedy decoding would (the
  target's greedy chain *is* the stored row): τ and oracle top-K τ in seconds, no target pass.

Output folder::

    OUT/config.json, OUT/model.safetensors     the drafter (loadable by `dflash2 generate`)
    OUT/train_state/                            optimizer.safetensors + state.json (for --resume)
    OUT/train_log.jsonl                         one JSON line per logged step (+ offline τ evaluations)

Checkpoints are written to temporary files and renamed into place (a crash never leaves a torn file).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dflash2_trt.config import ARCH_V1, ARCH_V2, DFlash2Config, rope_from_hf
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.model import DFlash2Drafter
from dflash2_trt.model.checkpoint import (TOKEN_COUNTS_NAME, WEIGHTS_NAME, _read_tensors, frequent_ids,
                                         load_state_into, read_token_counts)
from dflash2_trt.train import data as D


@dataclass
class TrainConfig:
    target: str
    data: str | list[str]  # make-data folder(s)
    out: str
    block_size: int = 16
    layers: int = 1
    selector_rank: int = 64
    selector_top_k: int = 16
    use_conv: bool = True
    use_selector: bool = True
    mask_token_id: int | None = None  # default: the tokenizer's mask/unk/pad token, else the last id
    init: str = "target"  # "target" (copy target layers), "random", or a drafter folder (warm start)
    init_layers: list[int] | None = None  # target layers copied into the drafter layers (default: the last ones)
    steps: int = 500
    batch_seqs: int = 8
    anchors_per_seq: int = 32  # 0: every response position (every on-chain position of teacher-forced text)
    epochs: float = 0.0  # > 0: steps = ceil(epochs x train rows / batch_seqs), rows drawn epoch by epoch
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None
    kl_weight: float = 0.0
    sampled_softmax: int = 8192  # F most frequent response ids; 0 = full-vocab CE
    random_negatives: int = 1024
    selector_full_topk: bool = False
    heldout_shards: int = 1
    max_shards: int | None = None
    eval_rows: int = 24
    eval_every: int = 0  # 0: evaluate at the end only
    seed: int = 0
    device: str = "cpu"  # cpu | cuda | cuda:N (torchrun: dist.setup gives each rank its own)
    dtype: str = "fp32"  # the frozen target's embedding / LM head; the drafter autocasts to it (fp32 masters)
    grad_accum: int = 1  # micro-batches per process per step (the step's rows and update stay the same)
    checkpoint_every: int = 100
    log_every: int = 10


# ----------------------------------------------------------------------------------------------------
# Drafter construction
# ----------------------------------------------------------------------------------------------------


def _mask_token_id(target) -> int:  # noqa: ANN001
    tok = target.tokenizer
    for name in ("mask_token_id", "unk_token_id", "pad_token_id"):
        v = getattr(tok, name, None) if tok is not None else None
        if isinstance(v, int) and 0 <= v < target.vocab_size:
            return v
    return target.vocab_size - 1


def _drafter_rope(hf, warm: DFlash2Config | None) -> dict:  # noqa: ANN001
    """The drafter's RoPE: the target's (:func:`rope_from_hf`); a target without position embeddings (Nemotron-H's
    attention) gives none, so the warm-start drafter's own is kept, else DFlash2Error (no safe default)."""
    d = hf.to_dict()
    if d.get("rope_parameters") or d.get("rope_theta") is not None:
        return rope_from_hf(hf)
    if warm is None:
        raise DFlash2Error(f"target {d.get('model_type')!r} has no RoPE (its attention has no position embeddings): "
                           "give the drafter's with --init DRAFTER, a drafter folder whose config sets rope_theta")
    return {"rope_theta": warm.rope_theta, "rope_scaling": warm.rope_scaling}


def make_drafter_config(tc: TrainConfig, target, layer_ids: list[int]) -> DFlash2Config:  # noqa: ANN001
    """The drafter's config from the target's (a vision-language target: its language model's); a warm start keeps
    its drafter's MASK id unless one is given."""
    hf = getattr(target.model.config, "text_config", None) or target.model.config
    mask = tc.mask_token_id
    warm = DFlash2Config.from_json_file(Path(tc.init) / "config.json") if tc.init not in ("target", "random") else None
    if mask is None and warm is not None:
        mask = warm.mask_token_id
    if mask is None:
        mask = _mask_token_id(target)
    heads = int(hf.num_attention_heads)
    heads_of = getattr(target.family, "drafter_heads", None)  # a family whose layers' heads differ (Gemma 4) says
    kv_heads, head_dim = heads_of(hf) if heads_of is not None else (
        int(getattr(hf, "num_key_value_heads", None) or heads), int(getattr(hf, "head_dim", None) or
                                                                    target.hidden_size // heads))
    return DFlash2Config(
        hidden_size=target.hidden_size, intermediate_size=int(hf.intermediate_size), num_hidden_layers=tc.layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", None) or hf.layer_norm_epsilon),  # Nemotron-H: the latter
        **_drafter_rope(hf, warm),
        vocab_size=target.vocab_size, num_target_layers=target.num_layers, target_layer_ids=list(layer_ids),
        block_size=tc.block_size,
        mask_token_id=mask,
        selector_rank=tc.selector_rank, selector_top_k=tc.selector_top_k,
        architecture=ARCH_V2 if (tc.use_conv or tc.use_selector) else ARCH_V1,
        use_conv=tc.use_conv, use_selector=tc.use_selector)


def _init_pairs(layer, src) -> list[tuple]:  # noqa: ANN001
    """(drafter module, target module) pairs a drafter layer copies from target layer ``src``, by name: a decoder
    layer's attention, MLP and norms; a Nemotron-H block's mixer (attention: its projections; MLP / MoE: nothing of
    the gated MLP's shape) and its one norm as the input norm. Modules the target layer lacks are left out."""
    attn = getattr(src, "self_attn", None) or getattr(src, "mixer", None)
    mlp = getattr(src, "mlp", None)
    names = [(layer.self_attn, attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
             (layer.mlp, mlp, ("gate_proj", "up_proj", "down_proj")),
             (layer, src, ("input_layernorm", "post_attention_layernorm"))]
    pairs = [(getattr(dst, n), getattr(s, n)) for dst, s, ns in names for n in ns
             if s is not None and isinstance(getattr(s, n, None), torch.nn.Module)]
    if not hasattr(src, "input_layernorm") and isinstance(getattr(src, "norm", None), torch.nn.Module):
        pairs.append((layer.input_layernorm, src.norm))
    return [(dst, s) for dst, s in pairs if hasattr(s, "weight") and s.weight is not None]


@torch.no_grad()
def init_drafter(cfg: DFlash2Config, target, seed: int, init: str = "target",  # noqa: ANN001
                 init_layers: list[int] | None = None) -> tuple[DFlash2Drafter, dict]:
    """Normal(0, 0.02) init, identity convolutions, then per ``init``:

    * ``"target"``: drafter layer i copies target layer ``init_layers[i]`` (default: the last layers) and the
      final norm — a working attention/MLP from the start on a small CPU budget;
    * ``"random"``: nothing more;
    * a drafter folder: every tensor whose name and shape match is copied (warm start; a DFlash v1 twin takes
      the backbone of a DFlash 2 drafter). Returns (drafter, {"copied": [...], "kept_init": [...]}).
    """
    torch.manual_seed(seed)
    d = DFlash2Drafter(cfg)
    for name, p in d.named_parameters():
        if name.endswith("norm.weight") or "conv" in name:
            continue
        p.normal_(0.0, 0.02)
    d.reset_identity_convs()
    info: dict = {"init": init}
    if init == "target":
        dec = target.model.get_decoder()
        layers = dec.layers
        src_ids = init_layers or list(range(len(layers) - len(d.layers), len(layers)))
        if len(src_ids) != len(d.layers) or not all(0 <= i < len(layers) for i in src_ids):
            raise DFlash2Error(f"--init-layers {src_ids}: need {len(d.layers)} target layers in [0, {len(layers)})")
        for layer, si in zip(d.layers, src_ids):
            for dst, s in _init_pairs(layer, layers[si]):
                if dst.weight.shape == s.weight.shape:
                    dst.weight.copy_(s.weight)
        d.norm.weight.copy_((dec.norm if hasattr(dec, "norm") else dec.norm_f).weight)  # Nemotron-H: norm_f
        info["target_layers"] = src_ids
    elif init != "random":
        src = _read_tensors(Path(init))
        own = d.state_dict()
        copied = [k for k, v in src.items() if k in own and tuple(v.shape) == tuple(own[k].shape)]
        if not copied:
            raise DFlash2Error(f"--init {init}: no tensor matches this drafter's names and shapes")
        d.load_state_dict({**own, **{k: src[k].to(own[k].dtype) for k in copied}}, strict=True)
        info.update({"copied": len(copied), "kept_init": sorted(set(own) - set(copied))})
    d.bind_target(target.embed_weight, target.lm_head_weight)
    return d, info


# ----------------------------------------------------------------------------------------------------
# One step's batch and loss
# ----------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    tokens: np.ndarray  # [S, T] int64 (rows right-padded with 0; pads are never context nor label)
    feats: np.ndarray  # [S, T, nH] float32
    blk_seq: np.ndarray  # [nb] row of each block
    anchors: np.ndarray  # [nb] anchor positions (response positions)
    labels: np.ndarray  # [nb, bs] int64 (slot 0 and past-the-end = -100)
    kl_ids: np.ndarray  # [nb, bs, k] int64 target top-k ids for slot k (position a + k - 1)
    kl_logp: np.ndarray  # [nb, bs, k] float32


def gather_batch(data: D.GeneratedData, rows: np.ndarray, anchors: list[np.ndarray], block_size: int,
                 with_feats: bool = True) -> Batch:
    """``with_feats`` False: feats [S, T, 0] (the labels and top-k ids of a whole step, without its memory)."""
    rs = [data.row(int(i)) for i in rows]
    T = max(r.tokens.shape[0] for r in rs)
    Fd = rs[0].feats.shape[1] if with_feats else 0
    K = rs[0].topk_ids.shape[1]
    tokens = np.zeros((len(rs), T), np.int64)
    feats = np.zeros((len(rs), T, Fd), np.float32)
    blk_seq, anc, labels, kli, klp = [], [], [], [], []
    for j, (r, a) in enumerate(zip(rs, anchors)):
        n = r.tokens.shape[0]
        tokens[j, :n] = r.tokens
        if with_feats:
            feats[j, :n] = r.feats
        blk_seq.append(np.full(a.shape[0], j))
        anc.append(a)
        labels.append(data.labels(int(rows[j]), a, block_size))
        p = np.clip(a[:, None] + np.arange(block_size)[None, :] - 1, 0, n - 1)  # [nb_j, bs]
        kli.append(np.asarray(r.topk_ids)[p].astype(np.int64))
        klp.append(np.asarray(r.topk_logp)[p].astype(np.float32))
    z = (lambda xs, shape: np.concatenate(xs) if xs else np.zeros(shape))
    return Batch(tokens, feats, z(blk_seq, (0,)).astype(np.int64), z(anc, (0,)).astype(np.int64),
                 z(labels, (0, block_size)).astype(np.int64), z(kli, (0, block_size, K)).astype(np.int64),
                 z(klp, (0, block_size, K)).astype(np.float32))


def make_batch(step: int, seed: int, data: D.GeneratedData, train_rows: np.ndarray, block_size: int,
               batch_seqs: int, anchors_per_seq: int, by_epoch: bool = False) -> Batch:
    """Deterministic in (seed, step): the data a resumed run sees equals an uninterrupted one.

    Rows: ``batch_seqs`` random ones per step, or (``by_epoch``) the step's slice of a per-epoch permutation
    (every row once per epoch). Anchors: ``anchors_per_seq`` random ones per row (0: all of them)."""
    rows, anchors = batch_plan(step, seed, data, train_rows, batch_seqs, anchors_per_seq, by_epoch)
    return gather_batch(data, rows, anchors, block_size)


def batch_plan(step: int, seed: int, data: D.GeneratedData, train_rows: np.ndarray, batch_seqs: int,
               anchors_per_seq: int, by_epoch: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """The rows and anchors of :func:`make_batch` (every process draws the whole step's; each gathers its part)."""
    rng = np.random.default_rng([seed, step])
    if by_epoch:
        per_epoch = -(-train_rows.size // batch_seqs)
        epoch, k = divmod(step, per_epoch)
        perm = np.random.default_rng([seed, epoch, 2]).permutation(train_rows)
        rows = perm[k * batch_seqs: (k + 1) * batch_seqs]
    else:
        rows = rng.choice(train_rows, size=min(batch_seqs, train_rows.size), replace=False)
    anchors = [data.anchors(rng, int(i), anchors_per_seq if anchors_per_seq > 0 else 1 << 30) for i in rows]
    return rows, anchors


def softmax_vocab(step: int, seed: int, frequent: np.ndarray, batch_ids: np.ndarray, vocab_size: int,
                  negatives: int) -> np.ndarray:
    """Sorted ids one step's CE runs over: frequent ids ∪ the batch's label/KL ids ∪ ``negatives`` random others.

    [decision] On a CPU the frozen 49k-row LM head dominates a step. The frequent ids of the generated
    answers carry nearly all label mass, the batch ids make every label present, and fresh random ids
    (seeded by ``(seed, step)``, so ``--resume`` stays exact) keep the rest of the vocabulary pushed down.
    Inference still uses the full head.
    """
    rng = np.random.default_rng([seed, step, 1])
    base = np.union1d(frequent, batch_ids[batch_ids >= 0])
    rest = np.setdiff1d(np.arange(vocab_size), base, assume_unique=False)
    neg = rng.choice(rest, size=min(negatives, rest.size), replace=False) if rest.size else rest
    return np.union1d(base, neg).astype(np.int64)


@dataclass
class _Head:
    """The LM head over a batch's draft rows: logits over the step's vocabulary and the labels as its columns."""

    logits: torch.Tensor  # [nb, L, V'] fp32 (V' = |vocab| with a sampled softmax)
    labels: torch.Tensor  # [nb, L] label columns (0 where there is no label)
    true_ids: torch.Tensor  # [nb, L] label token ids (-100 = no label)
    valid_lab: torch.Tensor  # [nb, L] bool
    to_col: Callable[[np.ndarray], torch.Tensor] | None  # token ids -> columns (sampled softmax), None: identity
    vt: torch.Tensor | None  # [V'] the sampled vocabulary's ids


def _block_rows(d: DFlash2Drafter, b: Batch) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The drafter's forward over every block of ``b`` -> (draft rows [nb*L, H], anchor ids [nb], nb, L): the
    context of each row once, its keys / values shared by that row's blocks."""
    dev = d.fc.weight.device
    S, T = b.tokens.shape
    f = torch.from_numpy(b.feats).to(dev)  # [S, T, nH_t]
    ctx_pos = torch.arange(T, device=dev)
    kv = d.context_kv(d.fuse_context(f), ctx_pos)  # per layer [S, kvh, T, d]
    anchor_pos = torch.from_numpy(b.anchors).to(dev)
    anchor_ids = torch.from_numpy(b.tokens[b.blk_seq, b.anchors]).to(dev)  # [nb]
    counts = np.bincount(b.blk_seq, minlength=S).tolist()
    if np.any(np.diff(b.blk_seq) < 0):
        raise DFlash2Error("blocks must be grouped by row")

    def per_block(x: torch.Tensor) -> torch.Tensor:  # [S, kvh, T, d] -> [nb, kvh, T, d]
        # expand + cat: its backward is a plain sum (indexing's accumulate is not deterministic on CPU,
        # and --resume must be exact)
        return torch.cat([x[j: j + 1].expand(c, -1, -1, -1) for j, c in enumerate(counts) if c], 0)

    # context slot j holds position j (rows are right-padded; pads sit after every anchor, never seen)
    h = d.block_forward(anchor_ids, anchor_pos, [per_block(k) for k, _ in kv], [per_block(v) for _, v in kv])
    rows = h[:, 1:]  # [nb, L, H]
    nb, L, H = rows.shape
    # the head product as ONE 2-D GEMM [nb*L, H] x [H, V']: the strided 3-D view made PyTorch run a batched
    # matmul that re-streams the head slice per block (1/9 the speed on a CPU; forward + backward ≈ 10x)
    return rows.reshape(nb * L, H), anchor_ids, nb, L


def _head(d: DFlash2Drafter, b: Batch, rows2: torch.Tensor, nb: int, L: int, vocab: np.ndarray | None) -> _Head:
    """The LM head on the draft rows, over the full vocabulary or the sampled ``vocab`` (every label in it)."""
    dev = rows2.device
    true_ids = torch.from_numpy(b.labels[:, 1:]).to(dev)  # [nb, L] (-100 = no label)
    valid_lab = true_ids >= 0  # [nb, L]
    if vocab is None:
        logits = d.logits(rows2).float().view(nb, L, -1)  # [nb, L, V]
        return _Head(logits, true_ids.clamp(min=0), true_ids, valid_lab, None, None)
    vt = torch.from_numpy(vocab).to(dev)
    logits = d.logits(rows2, rows_of_head=vt).float().view(nb, L, -1)  # [nb, L, |vocab|]
    need = b.labels[:, 1:][b.labels[:, 1:] >= 0]
    pos = np.searchsorted(vocab, need)
    if not np.array_equal(vocab[np.minimum(pos, vocab.size - 1)], need):
        raise DFlash2Error("sampled softmax: a label is missing from the step's vocabulary")

    def to_col(ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.searchsorted(vocab, ids).clip(0, vocab.size - 1).astype(np.int64)).to(dev)

    return _Head(logits, to_col(np.maximum(b.labels[:, 1:], 0)), true_ids, valid_lab, to_col, vt)


def _kl_loss(hd: _Head, b: Batch, vocab: np.ndarray | None, w: torch.Tensor,
             wsum: torch.Tensor | float) -> tuple[torch.Tensor, float]:
    """CE of the drafter's rows to the target's stored top-k distribution -> (loss, its weighted sum)."""
    dev = hd.logits.device
    p_t = torch.softmax(torch.from_numpy(b.kl_logp[:, 1:]).to(dev), -1)  # [nb, L, k] renormalised top-k
    cols = torch.from_numpy(b.kl_ids[:, 1:]).to(dev) if hd.to_col is None else hd.to_col(b.kl_ids[:, 1:])
    if hd.to_col is not None and not np.array_equal(vocab[cols.cpu().numpy()], b.kl_ids[:, 1:]):
        raise DFlash2Error("sampled softmax: a KL id is missing from the step's vocabulary")
    logq = torch.log_softmax(hd.logits, -1).gather(-1, cols)  # [nb, L, k]
    kl = -(p_t * logq).sum(-1)  # [nb, L] CE to the target's top-k distribution
    return (kl * w).sum() / wsum, float((kl * w).sum().detach())


def _selector_loss(d: DFlash2Drafter, hd: _Head, rows2: torch.Tensor, anchor_ids: torch.Tensor,
                   weights: torch.Tensor, vocab: np.ndarray | None, selector_full_topk: bool,
                   lm_norm: float | None) -> tuple[torch.Tensor, dict, dict]:
    """The candidate selector's CE over the top-K candidates of each row, teacher-forced on the true predecessor
    (its inputs detached: only the selector learns from it) -> (loss, metrics, sums)."""
    nb, L = hd.true_ids.shape
    K = d.config.selector_top_k
    if selector_full_topk and vocab is not None:
        with torch.no_grad():
            full = d.logits(rows2.detach()).float().view(nb, L, -1)  # [nb, L, V]
            unary, cand = torch.topk(full, K, dim=-1)  # [nb, L, K] full vocab
    else:
        unary, cand = torch.topk(hd.logits.detach(), K, dim=-1)  # [nb, L, K]
        if hd.vt is not None:
            cand = hd.vt[cand]  # back to token ids
    hit = cand == hd.true_ids.unsqueeze(-1)  # [nb, L, K]
    valid = hit.any(-1) & hd.valid_lab  # [nb, L] true token among the top-K
    prev = torch.cat([anchor_ids.view(nb, 1), hd.true_ids[:, :-1].clamp(min=0)], dim=1)  # teacher-forced
    cs = d.candidate_selector
    g = cs.hidden_projection(rows2.detach()).view(nb, L, -1)  # [nb, L, r]
    # F.embedding: its CPU backward is deterministic (indexing's accumulate is not), so --resume is exact
    a = F.embedding(prev, cs.predecessor_codebook)  # [nb, L, r]
    bq = F.embedding(cand, cs.successor_codebook)  # [nb, L, K, r]
    scores = unary + torch.einsum("nlr,nlkr->nlk", a * g, bq)  # [nb, L, K]
    tgt = hit.float().argmax(-1)  # [nb, L]
    ce_s = F.cross_entropy(scores.reshape(-1, K), tgt.reshape(-1), reduction="none").view(nb, L)
    ws = weights[1:].view(1, L) * valid.float()
    loss_sel = (ce_s * ws).sum() / (ws.sum().clamp(min=1e-6) if lm_norm is None else 1.0)
    with torch.no_grad():
        sel_acc = ((scores.argmax(-1) == tgt) & valid).float().sum() / valid.float().sum().clamp(min=1)
    metrics = {"loss_sel": float(loss_sel.detach()),
               "topk_recall": float(valid.float().sum() / hd.valid_lab.float().sum().clamp(min=1)),
               "selector_acc": float(sel_acc)}
    sums = {"sel": float((ce_s * ws).sum().detach()), "sel_w": float(ws.sum()), "in_topk": float(valid.float().sum()),
            "sel_hit": float(((scores.argmax(-1) == tgt) & valid).float().sum())}
    return loss_sel, metrics, sums


def compute_loss(d: DFlash2Drafter, b: Batch, weights: torch.Tensor, vocab: np.ndarray | None = None,
                 kl_weight: float = 0.0, selector_full_topk: bool = False,
                 lm_norm: float | None = None) -> tuple[torch.Tensor, dict]:
    """Returns (loss, metrics). weights [bs] (slot 0 = 0). ``vocab``: the sorted ids the CE runs over
    (None = the full vocabulary); every label (and KL id when ``kl_weight`` > 0) must be in it. Runs on the
    drafter's device. The steps: the drafter's rows (:func:`_block_rows`), the LM head (:func:`_head`), the
    weighted CE to the labels, the KL term (:func:`_kl_loss`), the selector's term (:func:`_selector_loss`).

    ``lm_norm`` (one part of a step split over processes / micro-batches): the CE and KL sums are divided by
    this, the whole step's label weight, and the selector's loss is left a *sum* — its normaliser (the weight
    of slots whose label is in the top-K) depends on every part's forward, so the caller divides the selector's
    gradients by the step's total afterwards (they come from this term alone: its inputs are detached).
    ``metrics["sums"]`` then holds the raw sums the caller adds up over the parts."""
    rows2, anchor_ids, nb, L = _block_rows(d, b)
    hd = _head(d, b, rows2, nb, L, vocab)
    V = hd.logits.shape[-1]
    w = weights[1:].view(1, L) * hd.valid_lab.float()  # [nb, L]
    wsum = w.sum().clamp(min=1e-6) if lm_norm is None else lm_norm
    ce = F.cross_entropy(hd.logits.reshape(-1, V), hd.labels.reshape(-1), reduction="none").view(nb, L)
    loss_lm = (ce * w).sum() / wsum
    hit1 = (hd.logits.argmax(-1) == hd.labels) & hd.valid_lab
    nv = hd.valid_lab.float().sum(0).clamp(min=1)
    metrics = {"loss_lm": float(loss_lm.detach()), "slot_acc": (hit1.float().sum(0) / nv).tolist()}
    sums = {"lm": float((ce * w).sum().detach()), "hit1": hit1.float().sum(0).tolist(),
            "labelled": hd.valid_lab.float().sum(0).tolist()}
    loss = loss_lm
    if kl_weight > 0:
        loss_kl, sums["kl"] = _kl_loss(hd, b, vocab, w, wsum)
        loss = loss + kl_weight * loss_kl
        metrics["loss_kl"] = float(loss_kl.detach())
    if d.use_selector:
        loss_sel, sel_metrics, sel_sums = _selector_loss(d, hd, rows2, anchor_ids, weights, vocab,
                                                         selector_full_topk, lm_norm)
        loss = loss + 1.0 * loss_sel
        metrics.update(sel_metrics)
        sums.update(sel_sums)
    metrics["loss"] = float(loss.detach())
    if lm_norm is not None:
        metrics["sums"] = sums
    return loss, metrics


def lr_at(step: int, total: int, base: float, warmup: float) -> float:
    """Linear warm-up over ``warmup`` x total steps, then cosine to 0."""
    w = max(1, int(round(warmup * total)))
    if step < w:
        return base * (step + 1) / w
    p = (step - w) / max(1, total - w)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, p)))


# ----------------------------------------------------------------------------------------------------
# Offline τ: greedy decoding replayed on held-out generated rows
# ----------------------------------------------------------------------------------------------------


def accepted_prefix(draft: np.ndarray, truth: np.ndarray) -> int:
    """Leading slots where draft == truth (truth -100 = past the end: stops acceptance)."""
    m = 0
    for x, y in zip(draft.tolist(), truth.tolist()):
        if y < 0 or x != y:
            break
        m += 1
    return m


@torch.no_grad()
def offline_tau(d: DFlash2Drafter, data: D.GeneratedData, rows: np.ndarray, max_new_tokens: int | None = None,
                mode: str = "greedy") -> dict:
    """Replay greedy speculative decoding on generated greedy rows: returns τ, oracle top-K τ, per-slot
    cumulative acceptance and the number of cycles, averaged as docs/design.md says (over cycles, then rows).

    The stored row *is* the target's greedy chain and its features are the ones verification would
    commit, so each cycle's acceptance is exact up to floating-point differences between batched
    generation and one-request decoding. Rows sampled at T = 1 and teacher-forced rows are skipped (their tokens are not the
    greedy chain). The walk is lock-step across rows: one block per active row per iteration.
    """
    d = d.eval()
    cfg = d.config
    bs, L = cfg.block_size, cfg.num_draft_rows
    keep = [int(i) for i in rows
            if data.row(int(i)).temperature == 0.0 and not data.row(int(i)).teacher_forced
            and data.row(int(i)).tokens.shape[0] - data.row(int(i)).prompt_len >= 2]
    if not keep:
        raise DFlash2Error("offline τ: no greedy held-out row")
    rs = [data.row(i) for i in keep]
    ends = [r.tokens.shape[0] if max_new_tokens is None else min(r.tokens.shape[0], r.prompt_len + max_new_tokens)
            for r in rs]
    b = gather_batch(data, np.asarray(keep), [np.zeros(0, np.int64)] * len(rs), bs)
    S, T = b.tokens.shape
    dev = d.fc.weight.device
    kv = d.context_kv(d.fuse_context(torch.from_numpy(b.feats).to(dev)),
                      torch.arange(T, device=dev))  # per layer [S, kvh, T, d]
    cursor = np.asarray([r.prompt_len for r in rs])  # anchor = first generated token
    cycles: list[list[int]] = [[] for _ in rs]
    oracle: list[list[int]] = [[] for _ in rs]
    while True:
        act = np.asarray([j for j in range(len(rs)) if cursor[j] <= ends[j] - 2])
        if act.size == 0:
            break
        sel = torch.from_numpy(act).to(dev)
        anchors = torch.from_numpy(cursor[act].astype(np.int64)).to(dev)
        aid = torch.from_numpy(b.tokens[act, cursor[act]]).to(dev)
        h = d.block_forward(aid, anchors, [k[sel] for k, _ in kv], [v[sel] for _, v in kv])
        dr = d.draft_from_hidden(h, aid, mode=mode)
        toks, cand = dr.tokens.cpu().numpy(), dr.cand.cpu().numpy()  # [na, L], [na, L, K]
        for n_, j in enumerate(act):
            idx = cursor[j] + 1 + np.arange(L)
            truth = np.where(idx < ends[j], b.tokens[j, np.minimum(idx, T - 1)], -100)  # [L]
            m = accepted_prefix(toks[n_], truth)
            o = 0
            while o < L and truth[o] >= 0 and truth[o] in cand[n_, o]:
                o += 1
            cycles[j].append(m)
            oracle[j].append(o)
            cursor[j] += m + 1
    per_row = [1 + np.mean(c) for c in cycles if c]
    per_row_o = [1 + np.mean(c) for c in oracle if c]
    allc = np.concatenate([np.asarray(c) for c in cycles if c])
    return {"tau": float(np.mean(per_row)), "oracle_tau": float(np.mean(per_row_o)),
            "cum_accept": [float(np.mean(allc >= k)) for k in range(1, L + 1)],
            "rows": len(per_row), "cycles": int(allc.size)}


# ----------------------------------------------------------------------------------------------------
# Checkpoints (safetensors + json; no pickle)
# ----------------------------------------------------------------------------------------------------


def _atomic_save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(d: DFlash2Drafter, opt: torch.optim.Optimizer, step: int, tc: TrainConfig,
                    extra: dict | None = None) -> None:
    out = Path(tc.out)
    st = out / "train_state"
    st.mkdir(parents=True, exist_ok=True)
    sd = opt.state_dict()
    tensors = {}
    for idx, s in sd["state"].items():
        for k, v in s.items():
            tensors[f"{idx}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    _atomic_save_tensors(tensors, st / "optimizer.safetensors")
    _atomic_save_tensors(dict(d.state_dict()), st / WEIGHTS_NAME)
    # the state file is written last: it names the step the other two files belong to
    _atomic_write_text(json.dumps({"step": step, "param_groups": sd["param_groups"], "train_config": asdict(tc),
                                   **(extra or {})}, indent=1), st / "state.json")
    d.config.save(out)
    _atomic_save_tensors(dict(d.state_dict()), out / WEIGHTS_NAME)


def load_checkpoint(d: DFlash2Drafter, opt: torch.optim.Optimizer, tc: TrainConfig) -> int:
    from safetensors.torch import load_file

    st = Path(tc.out) / "train_state"
    if not (st / "state.json").is_file():
        raise DFlash2Error(f"--resume: no checkpoint in {st}")
    state = json.loads((st / "state.json").read_text())
    load_state_into(d, _read_tensors_file(st / WEIGHTS_NAME), str(st))
    flat = load_file(str(st / "optimizer.safetensors"))
    per: dict[int, dict] = {}
    for k, v in flat.items():
        idx, name = k.split(".", 1)
        per.setdefault(int(idx), {})[name] = v
    opt.load_state_dict({"state": per, "param_groups": state["param_groups"]})
    return int(state["step"])


def _read_tensors_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types
        raise DFlash2Error(f"cannot read checkpoint {path}: {e}") from None


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------


def write_trained_prompts(out: Path, data: D.GeneratedData, init_dir: Path | None) -> None:
    """OUT/trained_prompts.txt: the hashes of every prompt (or teacher-forced text) of the data folders — held-out
    shards included — and of the warm start's own list, so a drafter's folder names everything any of its
    stages saw (``make-data --exclude DRAFTER`` keeps it out of new data; the shards themselves are too
    big to keep)."""
    from dflash2_trt.train.make_data import TRAINED_PROMPTS
    from dflash2_trt.train.prompts import prompt_hash, read_hash_list

    hashes = {prompt_hash(t) for t in data.prompt_texts()}
    inherited = set()
    if init_dir is not None and (init_dir / TRAINED_PROMPTS).is_file():
        inherited = read_hash_list(init_dir / TRAINED_PROMPTS)
    head = (f"# prompt hashes (sha1[:16] of the text) of every prompt this drafter was trained on: "
            f"{len(hashes)} in {', '.join(str(r) for r in data.roots)}; {len(inherited)} inherited from "
            f"{init_dir}\n")
    _atomic_write_text(head + "".join(h + "\n" for h in sorted(hashes | inherited)), out / TRAINED_PROMPTS)


def prepare(tc: TrainConfig):  # noqa: ANN201
    """Load the target (frozen embedding / LM head / config) and the data. Returns (target, cfg, data)."""
    from dflash2_trt.targets.adapter import TargetModel

    from dflash2_trt.train.dist import torch_dtype

    target = TargetModel.load(tc.target, torch_dtype(tc.dtype))
    data = D.GeneratedData(tc.data, tc.max_shards)
    if int(data.meta.get("hidden_size", target.hidden_size)) != target.hidden_size:
        raise DFlash2Error(f"{data.roots[0]} was made by a target of hidden size {data.meta['hidden_size']}, "
                           f"not {target.hidden_size}")
    cfg = make_drafter_config(tc, target, data.layer_ids)
    target.check_drafter(cfg)
    return target, cfg, data


def _on_device(d: DFlash2Drafter, target, dev: torch.device) -> None:  # noqa: ANN001
    """The drafter (fp32 master weights) on ``dev``, bound to one copy there of the target's embedding and LM
    head (one tensor when they are tied); the rest of the target stays on the host."""
    emb, head = target.embed_weight, target.lm_head_weight
    d.embed_weight, d.lm_head_weight = torch.zeros(0), torch.zeros(0)  # not copied twice by .to
    d.to(dev)
    e = emb.detach().to(dev)
    d.bind_target(e, e if head is emb else head.detach().to(dev))


class _StepLoss(torch.nn.Module):
    """:func:`compute_loss` of one part of a step as a module's forward, for DDP (it hooks its gradient all-reduce
    on forward). A part without a block (its rows' answers too short for an anchor) gives a zero loss that
    still touches every parameter, so its rank joins the all-reduce like the others."""

    def __init__(self, d: DFlash2Drafter) -> None:
        super().__init__()
        self.d = d

    def forward(self, b: Batch, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        if b.labels.shape[0] == 0:
            L = self.d.config.num_draft_rows
            zero = sum(p.sum() for p in self.d.parameters() if p.requires_grad) * 0.0
            return zero, {"sums": {"lm": 0.0, "hit1": [0.0] * L, "labelled": [0.0] * L}}
        return compute_loss(self.d, b, *args, **kwargs)


def _ddp(d: DFlash2Drafter, dev: torch.device):  # noqa: ANN201
    from torch.nn.parallel import DistributedDataParallel as DDP

    w = _StepLoss(d)
    # buffers (the frozen target embedding / LM head among them) are DDP's business neither in gradients nor in
    # broadcasts: every rank bound its own copy of the same target
    DDP._set_params_and_buffers_to_ignore_for_model(w, [f"d.{n}" for n, _ in d.named_buffers()])
    # an ablated part (no convolutions / no selector) keeps its parameters but gives them no gradient
    unused = any(n.startswith("candidate_selector.") for n, _ in d.named_parameters()) and not d.use_selector
    unused |= any("conv" in n for n, _ in d.named_parameters()) and not d.use_conv
    return DDP(w, device_ids=[dev] if dev.type == "cuda" else None, broadcast_buffers=False,
               find_unused_parameters=unused)


def _no_rows(block_size: int) -> Batch:
    """The part of a step that got no row (its rank still joins the all-reduce: :class:`_StepLoss`)."""
    z = np.zeros
    return Batch(z((0, 0), np.int64), z((0, 0, 0), np.float32), z(0, np.int64), z(0, np.int64),
                 z((0, block_size), np.int64), z((0, block_size, 0), np.int64), z((0, block_size, 0), np.float32))


#: the raw sums of :func:`compute_loss` (``lm_norm`` given) that one step adds up over its parts
_SUM_KEYS = ("lm", "kl", "sel", "sel_w", "in_topk", "sel_hit")


def _step_metrics(tot: np.ndarray, L: int, lm_norm: float, kl_weight: float, use_selector: bool) -> dict:
    """The metrics a one-process step logs, from the step's summed parts (layout: _SUM_KEYS, hit1 [L],
    labelled [L])."""
    v = dict(zip(_SUM_KEYS, tot[: len(_SUM_KEYS)].tolist()))
    hit1, lab = tot[len(_SUM_KEYS): len(_SUM_KEYS) + L], tot[len(_SUM_KEYS) + L:]
    m = {"loss_lm": v["lm"] / lm_norm, "slot_acc": (hit1 / np.maximum(lab, 1)).tolist()}
    loss = m["loss_lm"]
    if kl_weight > 0:
        m["loss_kl"] = v["kl"] / lm_norm
        loss += kl_weight * m["loss_kl"]
    if use_selector:
        m.update({"loss_sel": v["sel"] / max(v["sel_w"], 1e-6), "topk_recall": v["in_topk"] / max(lab.sum(), 1),
                  "selector_acc": v["sel_hit"] / max(v["in_topk"], 1)})
        loss += m["loss_sel"]
    m["loss"] = loss
    return m


class _Steps:
    """One training run's optimizer steps: the batch of a step (one part, or the parts of a split step), its
    backward and the update. Holds the drafter, the optimizer, the gradient scaler and the data plan."""

    def __init__(self, tc: TrainConfig, cfg: DFlash2Config, d: DFlash2Drafter, data: D.GeneratedData,
                 train_rows: np.ndarray, counts: np.ndarray, dist) -> None:  # noqa: ANN001 - dist.Dist
        self.tc, self.cfg, self.d, self.data, self.train_rows, self.dist = tc, cfg, d, data, train_rows, dist
        dev = dist.device
        self.parts = dist.world * tc.grad_accum
        self.params = [p for p in d.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
        self.scaler = torch.amp.GradScaler(dev.type, enabled=tc.dtype == "fp16")  # fp16 only: bf16 / fp32 need none
        self.weights = torch.from_numpy(D.slot_weights(cfg.block_size, tc.gamma)).float().to(dev)
        self.frequent = frequent_ids(counts, tc.sampled_softmax) if tc.sampled_softmax > 0 else None
        self.ddp: Any = None
        self.loss_of: Any = None

    def resume(self, out: Path) -> int:
        """The step to start from: the checkpoint's in ``out/train_state`` (optimizer and scaler too), else 0; then
        the drafter is wrapped for DDP (several processes: after the checkpoint, as every rank loaded it)."""
        start = 0
        if (out / "train_state" / "state.json").is_file():
            start = load_checkpoint(self.d, self.opt, self.tc)
            sc = json.loads((out / "train_state" / "state.json").read_text()).get("scaler")
            if sc and self.scaler.is_enabled():
                self.scaler.load_state_dict(sc)
        self.ddp = _ddp(self.d, self.dist.device) if self.dist.world > 1 else None
        self.loss_of = self.ddp if self.ddp is not None else _StepLoss(self.d)
        return start

    def vocab_of(self, b: Batch, step: int) -> np.ndarray | None:
        """The step's sampled-softmax vocabulary (None: the full one)."""
        if self.frequent is None:
            return None
        tc = self.tc
        ids = np.concatenate([b.labels.ravel(), b.kl_ids.ravel() if tc.kl_weight > 0 else b.labels[:0].ravel()])
        return softmax_vocab(step, tc.seed, self.frequent, ids, self.cfg.vocab_size, tc.random_negatives)

    def one_part(self, step: int) -> tuple[dict, int, float | None]:
        from dflash2_trt.train import dist as DI

        tc = self.tc
        b = make_batch(step, tc.seed, self.data, self.train_rows, self.cfg.block_size, tc.batch_seqs,
                       tc.anchors_per_seq, by_epoch=tc.epochs > 0)
        with DI.autocast(self.dist.device, tc.dtype):
            loss, m = compute_loss(self.d, b, self.weights, self.vocab_of(b, step), tc.kl_weight,
                                   tc.selector_full_topk)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        return m, b.labels.shape[0], None

    def split(self, step: int) -> tuple[dict, int, float | None]:
        """A step split over processes x micro-batches -> (metrics, blocks, the selector gradients' divisor)."""
        from contextlib import nullcontext

        from dflash2_trt.train import dist as DI

        tc, cfg, dist, data, ddp = self.tc, self.cfg, self.dist, self.data, self.ddp
        L = cfg.num_draft_rows
        rows, anchors = batch_plan(step, tc.seed, data, self.train_rows, tc.batch_seqs, tc.anchors_per_seq,
                                   by_epoch=tc.epochs > 0)
        whole = gather_batch(data, rows, anchors, cfg.block_size, with_feats=False)  # labels, top-k ids
        vocab = self.vocab_of(whole, step)
        w = D.slot_weights(cfg.block_size, tc.gamma)[1:]
        lm_norm = max(float((w[None, :] * (whole.labels[:, 1:] >= 0)).sum()), 1e-6)
        mine = np.array_split(np.arange(rows.size), self.parts)[dist.rank * tc.grad_accum:
                                                                 (dist.rank + 1) * tc.grad_accum]
        self.opt.zero_grad(set_to_none=True)
        tot = np.zeros(len(_SUM_KEYS) + 2 * L)
        for k, idx in enumerate(mine):
            b = (gather_batch(data, rows[idx], [anchors[i] for i in idx], cfg.block_size) if idx.size else
                 _no_rows(cfg.block_size))  # an epoch's last, short step can leave a part without a row
            last = k == len(mine) - 1
            with ddp.no_sync() if ddp is not None and not last else nullcontext():
                with DI.autocast(dist.device, tc.dtype):
                    loss, m = self.loss_of(b, self.weights, vocab, tc.kl_weight, tc.selector_full_topk,
                                           lm_norm=lm_norm)
                # DDP averages over ranks: x world makes it the sum, the one-process gradient
                self.scaler.scale(loss * dist.world).backward()
            sm = m["sums"]
            tot += np.asarray([sm.get(key, 0.0) for key in _SUM_KEYS] + sm["hit1"] + sm["labelled"])
        tot = dist.all_reduce_sum(torch.from_numpy(tot).to(dist.device)).cpu().numpy()
        sel_norm = max(float(tot[_SUM_KEYS.index("sel_w")]), 1e-6) if self.d.use_selector else None
        return _step_metrics(tot, L, lm_norm, tc.kl_weight, self.d.use_selector), whole.labels.shape[0], sel_norm

    def run(self, step: int) -> tuple[dict, int]:
        """One optimizer step at its learning rate -> (metrics, blocks)."""
        tc = self.tc
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, tc.steps, tc.lr, tc.warmup)
        m, n_blocks, sel_norm = (self.split if self.parts > 1 else self.one_part)(step)
        self.scaler.unscale_(self.opt)  # (a no-op but with fp16)
        if sel_norm is not None:  # a split step's selector loss was a sum (compute_loss's lm_norm)
            for p in self.d.candidate_selector.parameters():
                if p.grad is not None:
                    p.grad.div_(sel_norm)
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        return m, n_blocks


def _token_counts(tc: TrainConfig, cfg: DFlash2Config, data: D.GeneratedData,
                  train_rows: np.ndarray) -> tuple[np.ndarray, Path | None]:
    """How often each id occurs in the training responses (a warm start's ancestors' counts added) and the warm
    start's folder (None: target / random)."""
    counts = data.response_token_counts(train_rows, cfg.vocab_size)
    init_dir = Path(tc.init) if tc.init not in ("target", "random") else None
    if init_dir is not None and (init_dir / TOKEN_COUNTS_NAME).is_file():  # a drafter counts its ancestors' ids too
        counts = counts + read_token_counts(init_dir / TOKEN_COUNTS_NAME, cfg.vocab_size)
    return counts, init_dir


def _write_data_record(out: Path, data: D.GeneratedData, init_dir: Path | None, counts: np.ndarray) -> None:
    """The trained prompts' hashes and the token counts (export --draft-vocab reads them), written atomically."""
    write_trained_prompts(out, data, init_dir)
    with open(out / (TOKEN_COUNTS_NAME + ".tmp"), "wb") as f:
        np.save(f, counts)
    os.replace(out / (TOKEN_COUNTS_NAME + ".tmp"), out / TOKEN_COUNTS_NAME)


def _evaluate(d: DFlash2Drafter, data: D.GeneratedData, eval_rows: np.ndarray, tc: TrainConfig, dev: torch.device,
              step: int, log) -> None:  # noqa: ANN001 - a text file
    """Offline τ on the held-out rows into the log."""
    from dflash2_trt.train import dist as DI

    t = time.perf_counter()
    try:
        with DI.autocast(dev, tc.dtype):
            r = offline_tau(d, data, eval_rows)
    except DFlash2Error as e:  # e.g. only T = 1 rows held out: training still completes
        r = {"eval_skipped": str(e)}
    d.train()
    r.update({"eval_step": step, "eval_s": round(time.perf_counter() - t, 1)})
    log.write(json.dumps(r) + "\n")
    log.flush()


def train(tc: TrainConfig, progress: bool = True, stop_after: int | None = None,
          dist=None) -> DFlash2Drafter:  # noqa: ANN001 - dist.Dist
    """Run (or resume) training; ``stop_after`` ends the process-local run early (tests of --resume).

    ``dist`` (:func:`dflash2_trt.train.dist.setup`; None = one process on ``tc.device``): with several processes
    or ``grad_accum`` > 1 a step is split into world x grad_accum parts of the same ``batch_seqs`` rows that one
    process would draw (every rank draws the whole plan and gathers only its parts' features); the CE / KL
    are normalised by the whole step's label weight and the selector's gradients by the whole step's top-K
    weight, so the update equals the one-process update (up to summation order). Gradients are all-reduced
    by DDP (the last part of each rank; the others under ``no_sync``). Rank 0 alone writes the folder: the
    log, the checkpoints (atomically), the token counts, the offline τ.

    The steps: the data and the drafter (:func:`prepare`, :func:`init_drafter`), the optimizer and a resumed
    checkpoint (:class:`_Steps`), the token counts, then per step :meth:`_Steps.run`, the log line, the checkpoint
    and the offline τ (:func:`_evaluate`).
    """
    from dflash2_trt.train import dist as DI

    dist = dist or DI.Dist(device=DI.check_device(tc.device))
    dev = dist.device
    if tc.batch_seqs < dist.world * tc.grad_accum:
        raise DFlash2Error(f"--batch-seqs {tc.batch_seqs} is less than processes x --grad-accum = "
                           f"{dist.world * tc.grad_accum}: every part of a step needs a row")
    target, cfg, data = prepare(tc)
    train_rows, held_rows = data.split(tc.heldout_shards)
    if tc.epochs > 0:
        tc.steps = max(1, math.ceil(tc.epochs * train_rows.size / tc.batch_seqs))
    d, info = init_drafter(cfg, target, tc.seed, tc.init, tc.init_layers)
    _on_device(d, target, dev)
    del target  # only its embedding and LM head are needed (bound to the drafter)
    d.train()
    counts, init_dir = _token_counts(tc, cfg, data, train_rows)
    steps = _Steps(tc, cfg, d, data, train_rows, counts, dist)
    out = Path(tc.out)
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
    start = steps.resume(out)
    d.token_counts = counts
    if dist.is_main:
        _write_data_record(out, data, init_dir, counts)
    eval_rows = held_rows[: tc.eval_rows]
    log = open(out / "train_log.jsonl", "a") if dist.is_main else None
    if start == 0 and log is not None:
        log.write(json.dumps({"init": info, "train_rows": int(train_rows.size), "heldout_rows": int(held_rows.size),
                              "rope_theta": cfg.rope_theta, "train_config": asdict(tc), "world_size": dist.world,
                              "device": dev.type, "data_target_dtype": data.meta.get("target_dtype", "fp32")}) + "\n")
    it = range(start, tc.steps)
    bar = None
    if progress and dist.is_main:
        from tqdm import tqdm

        bar = tqdm(it, desc="train", unit="step", initial=start, total=tc.steps)
        it = bar
    t0, rows_done = time.perf_counter(), 0
    try:
        for step in it:
            if stop_after is not None and step >= stop_after:
                break
            m, n_blocks = steps.run(step)
            rows_done += n_blocks * cfg.num_draft_rows
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc1=f"{m['slot_acc'][0]:.2f}")
            if log is not None and ((step + 1) % tc.log_every == 0 or step + 1 == tc.steps):
                el = time.perf_counter() - t0
                m.update({"step": step + 1, "lr": steps.opt.param_groups[0]["lr"], "rows_per_s": rows_done / el,
                          "elapsed_s": el})
                log.write(json.dumps(m) + "\n")
                log.flush()
            if dist.is_main and ((step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps):
                save_checkpoint(d, steps.opt, step + 1, tc,
                                {"scaler": steps.scaler.state_dict()} if steps.scaler.is_enabled() else None)
            if (log is not None and eval_rows.size and tc.eval_every and (step + 1) % tc.eval_every == 0
                    and step + 1 < tc.steps):
                _evaluate(d, data, eval_rows, tc, dev, step + 1, log)
        else:
            if log is not None and eval_rows.size and start < tc.steps:
                _evaluate(d, data, eval_rows, tc, dev, tc.steps, log)
    finally:
        if log is not None:
            log.close()
    dist.barrier()  # the folder is complete when any rank returns
    return d.eval()
