"""Drafter checkpoints: ``config.json`` + ``model.safetensors`` (or sharded ``model-*.safetensors``).

Safetensors only — pickle files are refused. Tensor names are z-lab's (docs/zlab-compatibility.md), so z-lab-format DFlash 2
and DFlash v1 checkpoints load; the codebooks are also accepted as ``candidate_selector.*_codebook.weight``
(what a fresh z-lab ``save_pretrained`` writes: their codebooks are ``nn.Embedding`` modules, and their
``from_pretrained`` maps the released bare names onto ``.weight``). Missing, unexpected or mis-shaped
tensors raise :class:`DFlash2Error` naming the tensor (and both shapes). Saving writes the bare names of
the released checkpoints.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from dflash2_trt.config import DFlash2Config
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.model.drafter import DFlash2Drafter

WEIGHTS_NAME = "model.safetensors"
# optional: how often each token id occurs in the drafter's training responses ([V] int64, written by
# ``dflash2 train``); ``dflash2 export --draft-vocab N`` keeps the N most frequent ids in the drafter's LM head
TOKEN_COUNTS_NAME = "token_counts.npy"
# prefixes some exporters put in front of the tensor names; stripped on load
_STRIP_PREFIXES = ("model.", "drafter.")
# z-lab's nn.Embedding names -> the released (and our) bare parameter names
_ALIASES = {f"candidate_selector.{n}_codebook.weight": f"candidate_selector.{n}_codebook"
            for n in ("predecessor", "successor")}


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are not loaded; convert to safetensors)" \
            if pickles else ""
        raise DFlash2Error(f"no .safetensors weights in {directory}{hint}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise DFlash2Error(f"cannot read {f} (corrupt or truncated safetensors file): {e}") from None
        for k, v in tensors.items():
            for p in _STRIP_PREFIXES:
                if k.startswith(p):
                    k = k[len(p):]
            k = _ALIASES.get(k, k)
            if k in out:
                raise DFlash2Error(f"{f}: tensor {k!r} appears twice (under two names or in two shards)")
            out[k] = v
    return out


def load_state_into(model: DFlash2Drafter, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Strictly load the named tensors into ``model`` (errors name the tensor and both shapes)."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing:
        raise DFlash2Error(f"{source}: missing tensor {missing[0]!r} (shape {tuple(expected[missing[0]].shape)})"
                           + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    if unexpected:
        raise DFlash2Error(f"{source}: unexpected tensor {unexpected[0]!r} (shape {tuple(tensors[unexpected[0]].shape)})"
                           + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
    for k, v in expected.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            raise DFlash2Error(f"{source}: tensor {k!r} has shape {tuple(tensors[k].shape)}, "
                               f"the config expects {tuple(v.shape)}")
    with torch.no_grad():
        model.load_state_dict({k: t.to(expected[k].dtype) for k, t in tensors.items()}, strict=True)


def load_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> DFlash2Drafter:
    """Load a drafter folder (config.json + safetensors)."""
    directory = Path(path)
    if not directory.is_dir():
        raise DFlash2Error(f"drafter folder not found: {directory}")
    cfg = DFlash2Config.from_json_file(directory / "config.json")
    model = DFlash2Drafter(cfg).to(dtype)
    load_state_into(model, _read_tensors(directory), str(directory))
    if (directory / TOKEN_COUNTS_NAME).is_file():
        model.token_counts = read_token_counts(directory / TOKEN_COUNTS_NAME, cfg.vocab_size)
    model.eval()
    return model


def read_token_counts(path: Path, vocab_size: int) -> np.ndarray:
    try:
        counts = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DFlash2Error(f"{path}: not a NumPy array file ({e})") from None
    if counts.shape != (vocab_size,) or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise DFlash2Error(f"{path}: expected [{vocab_size}] non-negative integer counts, got {counts.dtype} "
                           f"{list(counts.shape)}")
    return counts.astype(np.int64)


def frequent_ids(counts: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` most frequent ids (ties: lower id first), sorted: [min(n, V)] int64."""
    order = np.lexsort((np.arange(counts.size), -counts))
    return np.sort(order[:n]).astype(np.int64)


def draft_vocabulary(model: DFlash2Drafter, n: int) -> np.ndarray:
    """The ``n`` ids a restricted drafter head keeps (``export --draft-vocab``): the most frequent ones of the
    drafter's training responses."""
    V = model.config.vocab_size
    if not model.config.selector_top_k <= n <= V:
        raise DFlash2Error(f"--draft-vocab must be in [{model.config.selector_top_k}, {V}] (the selector's top-K "
                           f".. the vocabulary size), got {n}")
    if model.token_counts is None:
        raise DFlash2Error(f"--draft-vocab needs the drafter's {TOKEN_COUNTS_NAME} (token frequencies of its "
                           "training responses, written by `dflash2 train`)")
    return frequent_ids(model.token_counts, n)


def save_drafter(model: DFlash2Drafter, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors atomically (temp folder, then rename into place).

    ``dtype`` (e.g. torch.float16) stores the weights in that type; loading upcasts to the model's dtype.
    """
    from safetensors.torch import save_file

    directory = Path(path)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        model.config.save(tmp)
        tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "producer": "dflash2_trt"})
        if model.token_counts is not None:
            np.save(tmp / TOKEN_COUNTS_NAME, model.token_counts)
        if directory.exists():
            old = directory.with_name(directory.name + ".old")
            directory.rename(old)
            tmp.rename(directory)
            import shutil

            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(directory)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
