"""``dflash2 train``: the subcommand's flags and its entry (wired into :mod:`dflash2_trt.cli`)."""

from __future__ import annotations

import argparse
import json

from dflash2_trt import validate as V
from dflash2_trt.vocabulary import DTYPES



def add_parser(sub) -> None:  # noqa: ANN001
    """Register ``train`` and ``make-data``."""
    m = sub.add_parser("make-data", help="self-distilled training data: the target answers prompts (docs/training.md)")
    m.add_argument("--target", required=True, help="HF folder, .gguf file, or 'smollm2'")
    m.add_argument("--out", required=True, help="data folder (outside the repository); rerun to resume")
    m.add_argument("--prompts", type=V.COUNT, default=2048, help="number of prompts (all sources together)")
    m.add_argument("--max-new-tokens", type=V.COUNT, default=160)
    m.add_argument("--max-prompt-tokens", type=V.COUNT, default=320)
    m.add_argument("--batch", type=V.COUNT, default=16)
    m.add_argument("--shard-size", type=V.COUNT, default=64, help="prompts per shard")
    m.add_argument("--sample-every", type=V.NON_NEGATIVE, default=4, help="every N-th batch samples at T=1 (0: all greedy)")
    m.add_argument("--mix", default="0.5,0.35,0.15", help="fractions sharegpt,code,self-written")
    m.add_argument("--self-instructions", type=V.NON_NEGATIVE, default=256, help="instructions the target writes")
    m.add_argument("--target-layer-ids", default=None, help="comma list of tapped target layers")
    m.add_argument("--topk", type=V.COUNT, default=8, help="target top-k log-probs kept per position")
    m.add_argument("--seed", type=V.SEED, default=0)
    m.add_argument("--max-shards", type=V.COUNT, default=None,
                   help="stop after the first N shards (same prompt list; rerun without it to continue)")
    m.add_argument("--prompts-only", action="store_true",
                   help="write OUT/prompts.jsonl (the prompt list, self-written instructions included) and stop: "
                        "a --prompt-file for a machine without the prompt sources; rerun without it to continue")
    m.add_argument("--exclude", nargs="+", default=(), metavar="DATA",
                   help="earlier make-data folders, or drafter folders / their trained_prompts.txt: skip those "
                        "prompts (new data beside them)")
    m.add_argument("--code-packages", action="store_true",
                   help="code prompts also from installed permissively-licensed packages (licences in meta.json)")
    m.add_argument("--teacher-forced", action="store_true",
                   help="no generation: run package functions through the target, label only where the text "
                        "stays on its greedy chain (--prompts texts, --max-prompt-tokens tokens each)")
    m.add_argument("--prompt-file", default=None, metavar="JSONL",
                   help='your own prompts instead of the built-in mix: one {"text": ..., "chat": true|false} per line '
                        "(the first --prompts of them; the benchmark filter still applies)")
    m.add_argument("--threads", type=V.THREADS, default=None, help="torch CPU threads")
    _device_flags(m)

    t = sub.add_parser("train", help="distil a DFlash 2 drafter from make-data output (docs/training.md)")
    t.add_argument("--target", required=True, help="HF folder, .gguf file, or 'smollm2'")
    t.add_argument("--data", required=True, nargs="+", metavar="DATA",
                   help="`dflash2 make-data` folders (same target and taps), trained on together")
    t.add_argument("--out", required=True, help="drafter folder (also holds train_state/ for --resume)")
    t.add_argument("--block-size", type=V.BLOCK_SIZE, default=16)
    t.add_argument("--layers", type=V.COUNT, default=1, help="drafter decoder layers")
    t.add_argument("--selector-rank", type=V.COUNT, default=64)
    t.add_argument("--no-conv", action="store_true", help="train without the dynamic convolutions")
    t.add_argument("--no-selector", action="store_true", help="train without the candidate selector")
    t.add_argument("--init", default="target",
                   help="'target' (copy target layers), 'random', or a drafter folder to warm-start from")
    t.add_argument("--init-layers", default=None, help="comma list of target layers copied by --init target")
    t.add_argument("--steps", type=V.COUNT, default=500)
    t.add_argument("--batch-seqs", type=V.COUNT, default=8)
    t.add_argument("--anchors-per-seq", type=V.NON_NEGATIVE, default=32, help="0: every response position")
    t.add_argument("--epochs", type=V.NON_NEGATIVE_NUMBER, default=0.0,
                   help="> 0: steps = epochs x train rows / batch-seqs, each row once per epoch (overrides --steps)")
    t.add_argument("--lr", type=V.POSITIVE_NUMBER, default=6e-4)
    t.add_argument("--seed", type=V.SEED, default=0)
    t.add_argument("--checkpoint-every", type=V.COUNT, default=100)
    t.add_argument("--mask-token-id", type=V.NON_NEGATIVE, default=None)
    t.add_argument("--sampled-softmax", type=V.NON_NEGATIVE, default=8192, metavar="F",
                   help="CE over the F most frequent response ids + the batch's ids + random ones (0 = full)")
    t.add_argument("--random-negatives", type=V.NON_NEGATIVE, default=1024)
    t.add_argument("--selector-full-topk", action="store_true",
                   help="selector candidates from the full-vocabulary top-K (as decoding; slower)")
    t.add_argument("--kl-weight", type=V.NON_NEGATIVE_NUMBER, default=0.0, help="weight of CE to the target's top-k distribution")
    t.add_argument("--gamma", type=V.POSITIVE_NUMBER, default=None, help="slot-weight decay (default by block size, docs/training.md)")
    t.add_argument("--heldout-shards", type=V.NON_NEGATIVE, default=1, help="last shards held out for the offline τ")
    t.add_argument("--max-shards", type=V.COUNT, default=None, help="use only the first N shards")
    t.add_argument("--eval-rows", type=V.COUNT, default=24)
    t.add_argument("--eval-every", type=V.NON_NEGATIVE, default=0, help="offline τ every N steps (0: at the end)")
    t.add_argument("--threads", type=V.THREADS, default=None, help="torch CPU threads (default: torch's choice)")
    t.add_argument("--resume", action="store_true", help="continue from OUT/train_state")
    t.add_argument("--grad-accum", type=V.COUNT, default=1, metavar="A",
                   help="split each process's share of --batch-seqs into A micro-batches (the step is the same)")
    _device_flags(t)

    e = sub.add_parser("eval-tau", help="offline τ of a drafter on held-out make-data rows (seconds)")
    e.add_argument("--target", required=True)
    e.add_argument("--drafter", required=True)
    e.add_argument("--data", required=True, nargs="+", metavar="DATA",
                   help="make-data folders; held-out rows of the first come first")
    e.add_argument("--heldout-shards", type=V.COUNT, default=1)
    e.add_argument("--rows", type=V.COUNT, default=24)
    e.add_argument("--block-size", type=V.BLOCK_SIZE, default=None, help="evaluate at another block size")
    e.add_argument("--max-new-tokens", type=V.COUNT, default=None)
    e.add_argument("--no-selector", action="store_true")
    e.add_argument("--draft-vocab", type=V.NON_NEGATIVE, default=0, metavar="N",
                   help="restrict the drafter's LM head to its N most frequent ids (as export --draft-vocab)")
    e.add_argument("--threads", type=V.THREADS, default=None)
    _device_flags(e)


def _device_flags(p) -> None:  # noqa: ANN001
    p.add_argument("--device", type=V.DEVICE, default="cpu",
                   help="cpu, cuda or cuda:N (under torchrun, cuda = cuda:LOCAL_RANK)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32",
                   help="the frozen target's dtype (make-data: its greedy chain at this dtype is the label); the "
                        "drafter trains under autocast to it with fp32 master weights and an fp32 loss")


def run(a: argparse.Namespace) -> int:
    if a.cmd == "make-data":
        return _run_make_data(a)
    if a.cmd == "eval-tau":
        return _run_eval_tau(a)
    return _run_train(a)


def _run_make_data(a: argparse.Namespace) -> int:
    from dflash2_trt.errors import DFlash2Error
    from dflash2_trt.train.make_data import MakeDataConfig, make_data

    try:
        mix = tuple(float(x) for x in a.mix.split(","))
        ids = [int(x) for x in a.target_layer_ids.split(",")] if a.target_layer_ids else None
    except ValueError:
        raise DFlash2Error(f"--mix / --target-layer-ids: comma lists of numbers expected") from None
    if len(mix) != 3 or min(mix) < 0 or abs(sum(mix) - 1) > 1e-6:
        raise DFlash2Error(f"--mix needs three non-negative fractions summing to 1, got {a.mix}")
    if a.batch < 1 or a.prompts < 1 or a.shard_size < a.batch:
        raise DFlash2Error("--batch and --prompts must be >= 1 and --shard-size >= --batch")
    if a.teacher_forced and (a.device != "cpu" or a.dtype != "fp32" or a.prompt_file or _world() > 1):
        raise DFlash2Error("--teacher-forced runs in one CPU process in fp32: drop --device / --dtype / "
                           "--prompt-file and torchrun")
    plist = _read_prompt_file(a.prompt_file, a.prompts) if a.prompt_file else None
    max_shards = 0 if a.prompts_only else a.max_shards  # 0: the prompt list alone
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if a.teacher_forced:
        from dflash2_trt.train.teacher_force import TeacherForcedConfig, make_teacher_forced

        tf = TeacherForcedConfig(target=a.target, out=a.out, n_texts=a.prompts, max_tokens=a.max_prompt_tokens,
                                 shard_size=a.shard_size, target_layer_ids=ids, topk=a.topk, seed=a.seed,
                                 max_shards=max_shards, exclude=tuple(a.exclude))
        print(json.dumps({"out": str(make_teacher_forced(tf))}))
        return 0
    cfg = MakeDataConfig(target=a.target, out=a.out, n_prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                         max_prompt_tokens=a.max_prompt_tokens, batch=a.batch, shard_size=a.shard_size,
                         sample_every=a.sample_every, mix=mix, n_self=a.self_instructions,  # type: ignore[arg-type]
                         target_layer_ids=ids, topk=a.topk, seed=a.seed, max_shards=max_shards,
                         exclude=tuple(a.exclude), code_packages=a.code_packages, device=a.device, dtype=a.dtype)
    from dflash2_trt.train.dist import setup

    dist = setup(a.device)
    try:
        out = make_data(cfg, prompts=plist, dist=dist)
    finally:
        dist.close()
    if dist.is_main:
        print(json.dumps({"out": str(out)}))
    return 0


def _world() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def _read_prompt_file(path: str, n: int) -> list[dict]:
    """--prompt-file: the first ``n`` lines' {"text", "chat" (default true), "src" (default "file")}."""
    from dflash2_trt.errors import DFlash2Error

    out = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise DFlash2Error(f"--prompt-file {path}: {e.strerror or e}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            text = item["text"]
        except (ValueError, KeyError, TypeError):
            raise DFlash2Error(f'--prompt-file {path}:{i}: expected a JSON object with "text"') from None
        if not isinstance(text, str) or not text.strip():
            raise DFlash2Error(f'--prompt-file {path}:{i}: "text" must be a non-empty string')
        out.append({"src": str(item.get("src", "file")), "chat": bool(item.get("chat", True)), "text": text})
        if len(out) >= n:
            break
    if not out:
        raise DFlash2Error(f"--prompt-file {path}: no prompt in it")
    return out


def _run_eval_tau(a: argparse.Namespace) -> int:
    import numpy as np
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from dflash2_trt.model import load_drafter
    from dflash2_trt.model.checkpoint import draft_vocabulary
    from dflash2_trt.targets.adapter import TargetModel
    from dflash2_trt.train import dist as DI
    from dflash2_trt.train.data import GeneratedData
    from dflash2_trt.train.trainer import offline_tau

    dev = DI.check_device(a.device)
    target = TargetModel.load(a.target, DI.torch_dtype(a.dtype))
    target.model.to(dev)
    d = load_drafter(a.drafter)
    if a.block_size:
        d = d.at_block_size(a.block_size)
    d = d.to(dev)
    d.bind_target(target.embed_weight, target.lm_head_weight)
    if a.draft_vocab:
        d.restrict_vocab(torch.from_numpy(draft_vocabulary(d, a.draft_vocab)))
    if a.no_selector:
        d.set_ablation(use_selector=False)
    data = GeneratedData(a.data)
    _, held = data.split(a.heldout_shards, need_train=False)
    with DI.autocast(dev, a.dtype):
        r = offline_tau(d, data, held[: a.rows], a.max_new_tokens)
    r.update({"drafter": a.drafter, "block_size": d.config.block_size, "draft_vocab": a.draft_vocab,
              "device": dev.type, "dtype": a.dtype})
    print(json.dumps({k: (np.round(v, 4).tolist() if isinstance(v, (list, float)) else v) for k, v in r.items()}))
    return 0


def _run_train(a: argparse.Namespace) -> int:
    from pathlib import Path

    from dflash2_trt.errors import DFlash2Error
    from dflash2_trt.outdir import check_entries
    from dflash2_trt.train.dist import setup
    from dflash2_trt.train.trainer import TrainConfig, train

    dist = setup(a.device)  # first: no rank may write into --out before every rank checked it
    check_entries(Path(a.out), "--out", _is_drafter_file, "a drafter folder that train writes")
    state = Path(a.out) / "train_state" / "state.json"
    if state.is_file() and not a.resume:
        raise DFlash2Error(f"{a.out} already holds a training run: pass --resume, or choose another --out")
    if a.resume and not state.is_file():
        raise DFlash2Error(f"--resume: no checkpoint in {Path(a.out) / 'train_state'}")
    if not a.resume and Path(a.out).is_dir() and any(Path(a.out).iterdir()):  # a drafter we did not train
        raise DFlash2Error(f"--out {a.out} is not empty and holds no training run to resume; refusing to write "
                           f"into it: choose another --out")
    tc = TrainConfig(target=a.target, data=a.data, out=a.out, block_size=a.block_size, layers=a.layers,
                     selector_rank=a.selector_rank, use_conv=not a.no_conv, use_selector=not a.no_selector,
                     init=a.init, init_layers=[int(x) for x in a.init_layers.split(",")] if a.init_layers else None,
                     steps=a.steps, batch_seqs=a.batch_seqs, anchors_per_seq=a.anchors_per_seq, lr=a.lr, seed=a.seed,
                     epochs=a.epochs,
                     checkpoint_every=a.checkpoint_every, mask_token_id=a.mask_token_id,
                     sampled_softmax=a.sampled_softmax, random_negatives=a.random_negatives,
                     selector_full_topk=a.selector_full_topk, kl_weight=a.kl_weight, gamma=a.gamma,
                     heldout_shards=a.heldout_shards, max_shards=a.max_shards, eval_rows=a.eval_rows,
                     eval_every=a.eval_every, device=a.device, dtype=a.dtype, grad_accum=a.grad_accum)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    dist.barrier()
    try:
        train(tc, dist=dist)
    finally:
        dist.close()
    if dist.is_main:
        last = (Path(a.out) / "train_log.jsonl").read_text().strip().splitlines()[-1]
        print(json.dumps({"out": a.out, "last_log": json.loads(last)}))
    return 0


def _is_drafter_file(name: str) -> bool:
    """What train writes into --out (a resumed run finds them there): the drafter, its token counts, the log,
    the checkpoint folder, and their temporaries."""
    from dflash2_trt.model.checkpoint import TOKEN_COUNTS_NAME, WEIGHTS_NAME
    from dflash2_trt.train.make_data import TRAINED_PROMPTS

    return name.removesuffix(".tmp") in ("config.json", ".config.json", WEIGHTS_NAME, TOKEN_COUNTS_NAME,
                                          TRAINED_PROMPTS, "train_log.jsonl", "train_state")
