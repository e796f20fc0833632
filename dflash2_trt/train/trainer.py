"""Distillation trainer for DFlash 2 drafters (SPEC §5).

Two stages:

1. **Target features, cached.** The training text is cut into rows of ``seq_len`` tokens; the frozen
   target runs over them once in batches and the context features of the drafter's layers (fp16) plus its
   greedy next-token predictions (the self-distillation labels) are written to a memory-mapped cache.
   Every training step then costs only the drafter: on a CPU the target pass would otherwise dominate.
2. **Drafter steps.** Each step samples ``batch_seqs`` rows and ``anchors_per_seq`` anchors per row (from
   a generator seeded by ``(seed, step)``, so ``--resume`` replays exactly the data an uninterrupted run
   would see). Blocks ``[anchor, MASK...]`` see context strictly before their anchor and their own rows;
   blocks never see each other. Loss = decay-weighted full-vocab CE + 1.0 x the selector's K-way CE over
   the backbone's own (detached) top-K with the predecessor teacher-forced to the true previous token.

Output folder::

    OUT/config.json, OUT/model.safetensors     the drafter (loadable by `dflash2 generate`)
    OUT/train_state/                            optimizer.safetensors + state.json (for --resume)
    OUT/train_log.jsonl                         one JSON line per logged step

Checkpoints are written to temporary files and renamed into place (a crash never leaves a torn file).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dflash2_trt.config import ARCH_V1, ARCH_V2, DFlash2Config, default_target_layer_ids
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.model import DFlash2Drafter
from dflash2_trt.model.checkpoint import WEIGHTS_NAME, load_state_into
from dflash2_trt.train import data as D


@dataclass
class TrainConfig:
    target: str
    out: str
    block_size: int = 16
    layers: int = 1
    selector_rank: int = 64
    selector_top_k: int = 16
    use_conv: bool = True
    use_selector: bool = True
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None  # default: the tokenizer's mask/unk/pad token, else the last id
    sources: list[str] = field(default_factory=lambda: ["stdlib", "sharegpt", "pydocs"])
    max_tokens: int = 200_000
    seq_len: int = 256
    steps: int = 500
    batch_seqs: int = 4
    anchors_per_seq: int = 16
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    init_from_target: bool = True
    feature_batch: int = 8
    cache_dir: str | None = None
    sampled_softmax: int = 0  # 0 = full-vocab CE; N > 0 = corpus label vocab + N random negatives per step


# ----------------------------------------------------------------------------------------------------
# Stage 1: target features
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def build_feature_cache(target, tokens: np.ndarray, layer_ids: list[int], cache: Path, batch: int,  # noqa: ANN001
                        progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Run the target over ``tokens`` [N, T]; returns memmaps feats [N, T, n*H] fp16, preds [N, T] int32."""
    N, T = tokens.shape
    Fdim = len(layer_ids) * target.hidden_size
    key = hashlib.sha1(tokens.tobytes() + json.dumps([layer_ids, str(target.path)]).encode()).hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    fpath, ppath, done = cache / f"feats-{key}.f16", cache / f"preds-{key}.i32", cache / f"done-{key}"
    if done.is_file():
        return (np.memmap(fpath, np.float16, "r", shape=(N, T, Fdim)),
                np.memmap(ppath, np.int32, "r", shape=(N, T)))
    feats = np.memmap(fpath, np.float16, "w+", shape=(N, T, Fdim))
    preds = np.memmap(ppath, np.int32, "w+", shape=(N, T))
    it = range(0, N, batch)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="target features", unit="batch", total=math.ceil(N / batch))
    for i in it:
        ids = torch.from_numpy(tokens[i: i + batch])
        out = target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        feats[i: i + batch] = torch.cat([out.hidden_states[j + 1] for j in layer_ids], -1).to(torch.float16).numpy()
        preds[i: i + batch] = out.logits.argmax(-1).to(torch.int32).numpy()
    feats.flush()
    preds.flush()
    done.write_text("ok\n")
    return (np.memmap(fpath, np.float16, "r", shape=(N, T, Fdim)), np.memmap(ppath, np.int32, "r", shape=(N, T)))


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


def make_drafter_config(tc: TrainConfig, target) -> DFlash2Config:  # noqa: ANN001
    hf = target.model.config
    n_layers = target.num_layers
    ids = tc.target_layer_ids or default_target_layer_ids(n_layers, min(5, max(1, n_layers - 3)))
    heads = int(hf.num_attention_heads)
    return DFlash2Config(
        hidden_size=target.hidden_size, intermediate_size=int(hf.intermediate_size), num_hidden_layers=tc.layers,
        num_attention_heads=heads, num_key_value_heads=int(getattr(hf, "num_key_value_heads", heads)),
        head_dim=int(getattr(hf, "head_dim", None) or target.hidden_size // heads),
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)), rope_theta=float(getattr(hf, "rope_theta", 10000.0) or 10000.0),
        vocab_size=target.vocab_size, num_target_layers=n_layers, target_layer_ids=ids, block_size=tc.block_size,
        mask_token_id=tc.mask_token_id if tc.mask_token_id is not None else _mask_token_id(target),
        selector_rank=tc.selector_rank, selector_top_k=tc.selector_top_k,
        architecture=ARCH_V2 if (tc.use_conv or tc.use_selector) else ARCH_V1,
        use_conv=tc.use_conv, use_selector=tc.use_selector)


@torch.no_grad()
def init_drafter(cfg: DFlash2Config, target, seed: int, from_target: bool) -> DFlash2Drafter:  # noqa: ANN001
    """Normal(0, 0.02) init, identity convolutions; optionally copy the target's last decoder layers.

    [decision] Copying the last ``layers`` target layers (when shapes match) gives the drafter a working
    attention/MLP from the start — the CPU training budget is small.
    """
    torch.manual_seed(seed)
    d = DFlash2Drafter(cfg)
    for name, p in d.named_parameters():
        if name.endswith("norm.weight") or "conv" in name:
            continue
        p.normal_(0.0, 0.02)
    d.reset_identity_convs()
    if from_target:
        layers = target.model.model.layers
        for i, layer in enumerate(d.layers):
            src = layers[len(layers) - len(d.layers) + i]
            pairs = [(layer.self_attn.q_proj, src.self_attn.q_proj), (layer.self_attn.k_proj, src.self_attn.k_proj),
                     (layer.self_attn.v_proj, src.self_attn.v_proj), (layer.self_attn.o_proj, src.self_attn.o_proj),
                     (layer.mlp.gate_proj, src.mlp.gate_proj), (layer.mlp.up_proj, src.mlp.up_proj),
                     (layer.mlp.down_proj, src.mlp.down_proj), (layer.input_layernorm, src.input_layernorm),
                     (layer.post_attention_layernorm, src.post_attention_layernorm)]
            for dst, s in pairs:
                if dst.weight.shape == s.weight.shape:
                    dst.weight.copy_(s.weight)
        d.norm.weight.copy_(target.model.model.norm.weight)
    d.bind_target(target.embed_weight, target.lm_head_weight)
    return d


# ----------------------------------------------------------------------------------------------------
# One step's batch and loss
# ----------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    seq_rows: np.ndarray  # [S] rows of the token matrix
    blk_seq: np.ndarray  # [nb] index into seq_rows
    anchors: np.ndarray  # [nb] anchor positions
    labels: np.ndarray  # [nb, bs] (slot 0 = -100)


def make_batch(step: int, seed: int, preds: np.ndarray, block_size: int, batch_seqs: int, anchors_per_seq: int
               ) -> Batch:
    """Deterministic in (seed, step): the data a resumed run sees equals an uninterrupted one."""
    rng = np.random.default_rng([seed, step])
    N, T = preds.shape
    rows = rng.choice(N, size=min(batch_seqs, N), replace=False)
    blk_seq, anchors, labels = [], [], []
    for j, r in enumerate(rows):
        a = D.sample_anchors(rng, T, block_size, anchors_per_seq)
        blk_seq.append(np.full(a.shape[0], j))
        anchors.append(a)
        labels.append(D.block_labels(np.asarray(preds[r]), a, block_size))
    return Batch(rows, np.concatenate(blk_seq), np.concatenate(anchors), np.concatenate(labels))


def softmax_vocab(step: int, seed: int, label_vocab: np.ndarray, vocab_size: int, negatives: int) -> np.ndarray:
    """Sorted token ids the CE of one step runs over: every label of the corpus plus ``negatives`` other ids.

    [decision] (``--sampled-softmax N``) On a CPU the frozen 49k-row LM head dominates a step (forward and
    backward through it). The self-distillation labels of a training corpus use a few thousand distinct ids, so
    the softmax runs over those plus N ids drawn uniformly from the rest of the vocabulary, fresh each step
    (seeded by ``(seed, step)`` like the batch, so ``--resume`` stays exact). The random negatives keep the
    ids that never occur as labels pushed down; inference still uses the full head.
    """
    rng = np.random.default_rng([seed, step, 1])
    rest = np.setdiff1d(np.arange(vocab_size), label_vocab, assume_unique=True)
    neg = rng.choice(rest, size=min(negatives, rest.size), replace=False) if rest.size else rest
    return np.union1d(label_vocab, neg)


def compute_loss(d: DFlash2Drafter, tokens: np.ndarray, feats: np.ndarray, b: Batch, weights: torch.Tensor,
                 vocab: np.ndarray | None = None) -> tuple[torch.Tensor, dict]:
    """Returns (loss, metrics). weights [bs] (slot 0 = 0). ``vocab``: the sorted ids the CE runs over
    (None = the full vocabulary); every label must be in it."""
    cfg = d.config
    T = tokens.shape[1]
    f = torch.from_numpy(np.asarray(feats[b.seq_rows], dtype=np.float32))  # [S, T, n*H_t]
    ctx_pos = torch.arange(T)
    kv = d.context_kv(d.fuse_context(f), ctx_pos)  # per layer [S, kvh, T, d]
    sel = torch.from_numpy(b.blk_seq)
    ctx_k = [k[sel] for k, _ in kv]  # [nb, kvh, T, d]
    ctx_v = [v[sel] for _, v in kv]
    anchor_pos = torch.from_numpy(b.anchors)
    anchor_ids = torch.from_numpy(tokens[b.seq_rows[b.blk_seq], b.anchors])
    h = d.block_forward(anchor_ids, anchor_pos, ctx_k, ctx_v)  # [nb, bs, H]
    rows = h[:, 1:]  # [nb, L, H]
    labels = torch.from_numpy(b.labels[:, 1:])  # [nb, L]
    if vocab is None:
        logits = d.logits(rows).float()  # [nb, L, V]
    else:
        logits = d.logits(rows, rows_of_head=torch.from_numpy(vocab)).float()  # [nb, L, |vocab|]
        pos = np.searchsorted(vocab, b.labels[:, 1:])
        if not np.array_equal(vocab[np.minimum(pos, vocab.size - 1)], b.labels[:, 1:]):
            raise DFlash2Error("sampled softmax: a label is missing from the step's vocabulary")
        labels = torch.from_numpy(pos.astype(np.int64))  # labels as indices into vocab
    nb, L, V = logits.shape
    w = weights[1:].view(1, L)  # [1, L]
    ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(nb, L)
    loss_lm = (ce * w).sum() / (w.sum() * nb)
    metrics = {"loss_lm": float(loss_lm.detach()), "slot_loss": ce.detach().mean(0).tolist(),
               "slot_acc": (logits.argmax(-1) == labels).float().mean(0).tolist()}
    loss = loss_lm
    if d.use_selector:
        K = cfg.selector_top_k
        unary, cand = torch.topk(logits.detach(), K, dim=-1)  # [nb, L, K]
        hit = cand == labels.unsqueeze(-1)  # [nb, L, K]
        valid = hit.any(-1)  # [nb, L] true token among the top-K
        if vocab is not None:
            cand = torch.from_numpy(vocab)[cand]  # back to token ids for the codebooks
        true_ids = torch.from_numpy(b.labels[:, 1:])
        prev = torch.cat([anchor_ids.view(nb, 1), true_ids[:, :-1]], dim=1)  # teacher-forced predecessor
        cs = d.candidate_selector
        g = cs.hidden_projection(rows.detach())  # [nb, L, r]
        # F.embedding: its CPU backward is deterministic (indexing's accumulate is not), so --resume is exact
        a = F.embedding(prev, cs.predecessor_codebook)  # [nb, L, r]
        bq = F.embedding(cand, cs.successor_codebook)  # [nb, L, K, r]
        scores = unary + torch.einsum("nlr,nlkr->nlk", a * g, bq)  # [nb, L, K]
        tgt = hit.float().argmax(-1)  # [nb, L]
        ce_s = F.cross_entropy(scores.reshape(-1, K), tgt.reshape(-1), reduction="none").view(nb, L)
        ws = w * valid.float()
        loss_sel = (ce_s * ws).sum() / ws.sum().clamp(min=1e-6)
        loss = loss + 1.0 * loss_sel
        with torch.no_grad():
            sel_acc = ((scores.argmax(-1) == tgt) & valid).float().sum() / valid.float().sum().clamp(min=1)
        metrics.update({"loss_sel": float(loss_sel.detach()), "topk_recall": float(valid.float().mean()),
                        "selector_acc": float(sel_acc)})
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def lr_at(step: int, total: int, base: float, warmup: float) -> float:
    """Linear warm-up over ``warmup`` x total steps, then cosine to 0."""
    w = max(1, int(round(warmup * total)))
    if step < w:
        return base * (step + 1) / w
    p = (step - w) / max(1, total - w)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, p)))


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


def save_checkpoint(d: DFlash2Drafter, opt: torch.optim.Optimizer, step: int, tc: TrainConfig) -> None:
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
    _atomic_write_text(json.dumps({"step": step, "param_groups": sd["param_groups"], "train_config": asdict(tc)},
                                  indent=1), st / "state.json")
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


def prepare(tc: TrainConfig, progress: bool = True):  # noqa: ANN201
    """Load the target, the text and the feature cache. Returns (target, drafter config, tokens, feats, preds)."""
    from dflash2_trt.target import TargetModel, cache_dir

    target = TargetModel.load(tc.target)
    if target.tokenizer is None:
        raise DFlash2Error("the target has no tokenizer; training needs one")
    cfg = make_drafter_config(tc, target)
    target.check_drafter(cfg)
    texts = D.iter_texts(tc.sources, target.tokenizer, target)
    tokens = D.pack_sequences(texts, lambda t: target.tokenizer(t, add_special_tokens=False)["input_ids"],
                              tc.seq_len, tc.max_tokens)
    cache = Path(tc.cache_dir) if tc.cache_dir else cache_dir() / "features"
    assert cfg.target_layer_ids is not None
    feats, preds = build_feature_cache(target, tokens, cfg.target_layer_ids, cache, tc.feature_batch, progress)
    return target, cfg, tokens, feats, preds


def train(tc: TrainConfig, progress: bool = True, stop_after: int | None = None) -> DFlash2Drafter:
    """Run (or resume) training; ``stop_after`` ends the process-local run early (tests of --resume)."""
    target, cfg, tokens, feats, preds = prepare(tc, progress)
    d = init_drafter(cfg, target, tc.seed, tc.init_from_target).train()
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    out = Path(tc.out)
    out.mkdir(parents=True, exist_ok=True)
    start = 0
    resume = (out / "train_state" / "state.json").is_file()
    if resume:
        start = load_checkpoint(d, opt, tc)
    weights = torch.from_numpy(D.slot_weights(cfg.block_size, tc.gamma)).float()
    label_vocab = np.unique(np.asarray(preds)).astype(np.int64) if tc.sampled_softmax > 0 else None
    log = open(out / "train_log.jsonl", "a")
    it = range(start, tc.steps)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(it, desc="train", unit="step", initial=start, total=tc.steps)
        it = bar
    t0, rows_done = time.perf_counter(), 0
    try:
        for step in it:
            if stop_after is not None and step >= stop_after:
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(step, tc.steps, tc.lr, tc.warmup)
            b = make_batch(step, tc.seed, preds, cfg.block_size, tc.batch_seqs, tc.anchors_per_seq)
            vocab = (softmax_vocab(step, tc.seed, label_vocab, cfg.vocab_size, tc.sampled_softmax)
                     if label_vocab is not None else None)
            loss, m = compute_loss(d, tokens, feats, b, weights, vocab)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            rows_done += b.labels.shape[0] * (cfg.block_size - 1)
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc1=f"{m['slot_acc'][0]:.2f}")
            if (step + 1) % tc.log_every == 0 or step + 1 == tc.steps:
                el = time.perf_counter() - t0
                m.update({"step": step + 1, "lr": opt.param_groups[0]["lr"], "rows_per_s": rows_done / el})
                log.write(json.dumps(m) + "\n")
                log.flush()
            if (step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps:
                save_checkpoint(d, opt, step + 1, tc)
    finally:
        log.close()
    return d.eval()
