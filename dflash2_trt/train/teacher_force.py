"""``dflash2 make-data --teacher-forced``: existing permissively-licensed text run through the target.

One forward pass per batch of texts (no generation) gives, at every position, the tap features and the
target's top-k next-token log-probabilities — hence its greedy next token ``g[p] = topk_ids[p, 0]``. The text
itself is *not* the label: a block anchored at ``a`` is labelled with the target's own greedy chain from ``a``
only as far as the text stays on it (docs/training.md: labels must lie on the target's chain):

    slot k label = g[a + k - 1]   while tokens[a + j] == g[a + j - 1] for every j < k, else unlabelled

(:func:`dflash2_trt.train.data.chain_labels`), and anchors sit only where the text is on the chain
(``tokens[a] == g[a - 1]``: deployed anchors are always the target's own tokens). Where ~60 % of the text
agrees with the target this yields about 3x the labels per CPU-second of generation (one parallel pass
instead of one pass per token).

The text: documented functions of installed permissively-licensed packages
(:func:`dflash2_trt.train.prompts.package_functions`, licences recorded in ``meta.json``), raw (no chat
template), at most ``max_tokens`` tokens, benchmark 8-gram filter and ``--exclude`` lists applied.

Output: the make-data folder layout (:mod:`dflash2_trt.train.make_data`) with ``meta.json["mode"] =
"teacher_forced"`` and one more array per shard, ``teacher_forced.npy [R] bool`` (all True); rows are
``temperature`` 0 and ``prompt_len`` = ``min_context`` (the first anchor). Resumable like make-data.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dflash2_trt.errors import DFlash2Error


@dataclass
class TeacherForcedConfig:
    target: str
    out: str
    n_texts: int = 4096
    max_tokens: int = 384  # a text is cut after this many tokens
    min_tokens: int = 48
    min_context: int = 8  # first anchor position (the "prompt" of a row)
    tokens_per_batch: int = 2048  # rows x padded length of one forward pass
    shard_size: int = 256
    target_layer_ids: list[int] | None = None
    topk: int = 8
    seed: int = 0
    packages: tuple[str, ...] | None = None  # default: every installed one of prompts.PERMISSIVE_PACKAGES
    max_shards: int | None = None
    exclude: tuple[str, ...] = ()  # make-data folders or trained_prompts.txt lists


def teacher_force_rows(target, texts_ids: list[list[int]], layer_ids: list[int], topk: int):  # noqa: ANN001
    """One forward over right-padded rows -> per row (ids int32 [n], feats f16 [n, nH], top-k ids int32 [n, k],
    top-k logp f16 [n, k]) — the make-data row layout, every position filled (row p predicts p + 1)."""
    import torch

    B, T = len(texts_ids), max(len(t) for t in texts_ids)
    ids = torch.zeros((B, T), dtype=torch.long)  # [B, T] right-padded: causal rows never see the pads
    mask = torch.zeros((B, T), dtype=torch.long)  # [B, T]
    for i, t in enumerate(texts_ids):
        ids[i, : len(t)] = torch.tensor(t)
        mask[i, : len(t)] = 1
    with torch.no_grad():
        o = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        f = torch.cat([o.hidden_states[j + 1] for j in layer_ids], -1).to(torch.float16).numpy()  # [B, T, nH]
        lp, li = torch.topk(torch.log_softmax(o.logits.float(), -1), topk, -1)  # [B, T, k]
    rows = []
    for i, t in enumerate(texts_ids):
        n = len(t)
        rows.append((np.asarray(t, np.int32), f[i, :n], li[i, :n].to(torch.int32).numpy(),
                     lp[i, :n].to(torch.float16).numpy()))
    return rows


def build_text_list(cfg: TeacherForcedConfig, tok) -> tuple[list[dict], dict]:  # noqa: ANN001
    """Deterministic list of {"src", "chat": False, "text", "ids"}: package functions, filtered and shuffled."""
    from dflash2_trt.train import prompts as P
    from dflash2_trt.train.make_data import previous_prompts

    pkgs = tuple(cfg.packages) if cfg.packages else tuple(P.PERMISSIVE_PACKAGES)
    bad = [p for p in pkgs if p not in P.PERMISSIVE_PACKAGES]
    if bad:
        raise DFlash2Error(f"packages {bad} are not in the permissive-licence list (prompts.PERMISSIVE_PACKAGES)")
    items = P.package_functions(pkgs, whole=True)
    seen = previous_prompts(cfg.exclude)
    kept, dropped = P.overlap_filter([t for t, _, _ in items], P.benchmark_texts())
    keep = set(kept)
    pool = [(t, src) for t, src, _ in items if t in keep and P.prompt_hash(t) not in seen]
    n_seen = sum(1 for t, _, _ in items if t in keep) - len(pool)
    random.Random(cfg.seed).shuffle(pool)
    out, short = [], 0
    for text, src in pool:
        if len(out) >= cfg.n_texts:
            break
        ids = [int(x) for x in tok(text, add_special_tokens=False)["input_ids"]][: cfg.max_tokens]
        if len(ids) < cfg.min_tokens:
            short += 1
            continue
        out.append({"src": f"pkgcode:{src}", "chat": False, "text": text, "ids": ids})
    counts = {"candidates": len(items), "dropped_benchmark_8gram": len(dropped), "excluded_seen": n_seen,
              "too_short": short, "used": len(out),
              "per_package": {p: sum(1 for x in out if x["src"] == f"pkgcode:{p}") for p in pkgs}}
    return out, counts


def make_teacher_forced(cfg: TeacherForcedConfig, progress: bool = True) -> Path:
    """Write (or resume) the folder; prints one JSON line per shard (tokens, labelled tokens, tokens/s)."""
    from dflash2_trt.targets.adapter import TargetModel
    from dflash2_trt.train import prompts as P
    from dflash2_trt.train.make_data import _default_layer_ids, _write_shard

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    target = TargetModel.load(cfg.target)
    tok = target.tokenizer
    layer_ids = cfg.target_layer_ids or _default_layer_ids(target.num_layers)
    plist, counts = build_text_list(cfg, tok)
    if not plist:
        raise DFlash2Error("teacher-forced make-data: no text left after the filters")
    key = hashlib.sha1(json.dumps([[p["ids"] for p in plist], layer_ids, cfg.topk, cfg.min_context,
                                   cfg.tokens_per_batch, cfg.shard_size]).encode()).hexdigest()[:16]
    meta = {"mode": "teacher_forced", "target": str(target.path), "target_layer_ids": layer_ids,
            "hidden_size": target.hidden_size, "config": asdict(cfg), "key": key, "prompt_counts": {"pkgcode": counts},
            "n_prompts": len(plist), "eos_ids": sorted(target.eos_ids()), "target_dtype": "fp32",  # labels' dtype
            "licences": {"pkgcode": P.package_licences(cfg.packages or P.PERMISSIVE_PACKAGES)}}
    mpath = out / "meta.json"
    if mpath.is_file() and json.loads(mpath.read_text()).get("key") != key:
        raise DFlash2Error(f"{out} holds data made with other settings (meta.json key differs): choose another --out")
    mpath.write_text(json.dumps(meta, indent=1))
    with open(out / "prompts.jsonl.tmp", "w") as f:
        for p in plist:
            f.write(json.dumps({k: p[k] for k in ("src", "chat", "text")}) + "\n")
    os.replace(out / "prompts.jsonl.tmp", out / "prompts.jsonl")
    n_shards = (len(plist) + cfg.shard_size - 1) // cfg.shard_size
    if cfg.max_shards is not None:
        n_shards = min(n_shards, cfg.max_shards)
    todo = [s for s in range(n_shards) if not (out / f"shard-{s:05d}").is_dir()]
    t0, c0, n_tok, n_lab = time.perf_counter(), time.process_time(), 0, 0
    for s in todo:
        items = plist[s * cfg.shard_size: (s + 1) * cfg.shard_size]
        order = sorted(range(len(items)), key=lambda i: len(items[i]["ids"]))  # little padding per batch
        rows = []
        b0 = 0
        while b0 < len(order):
            n_rows = max(1, cfg.tokens_per_batch // len(items[order[min(len(order) - 1, b0)]]["ids"]))
            bi = order[b0: b0 + n_rows]
            while len(bi) > 1 and len(bi) * len(items[bi[-1]]["ids"]) > cfg.tokens_per_batch:
                bi = bi[:-1]
            rows += teacher_force_rows(target, [items[i]["ids"] for i in bi], layer_ids, cfg.topk)
            b0 += len(bi)
        for r in rows:
            n_tok += r[0].shape[0]
            g = r[2][:, 0]
            n_lab += int(np.sum(r[0][1:] == g[:-1]))
        part = out / f"shard-{s:05d}.part"  # complete (with its flag) before it is renamed into place
        if part.exists():
            shutil.rmtree(part)
        _write_shard(part, rows, [cfg.min_context] * len(rows), [0.0] * len(rows))
        np.save(part / "teacher_forced.npy", np.ones(len(rows), bool))
        os.replace(part, out / f"shard-{s:05d}")
        el = time.perf_counter() - t0
        print(json.dumps({"shard": s, "tokens": n_tok, "on_chain_tokens": n_lab, "agreement": round(n_lab / max(n_tok, 1), 3),
                          "tokens_per_s": round(n_tok / el, 1),
                          "tokens_per_cpu_s": round(n_tok / max(time.process_time() - c0, 1e-9), 1)}),
              file=sys.stderr, flush=True)
    return out
