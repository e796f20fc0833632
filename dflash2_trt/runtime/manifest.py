"""``manifest.json`` of an export folder: what ``dflash2-export`` writes and every runtime reads first.

Layout (``MANIFEST_VERSION`` 1)::

    {"format": "dflash2-trt-export", "manifest_version": 1, "project_version": "0.1.0",
     "opset": 17, "dtype": "fp32", "block_size": 16, "max_seq_len": 2048, "kv_capacity_step": 256,
     "target":  {"model_type", "vocab_size", "num_layers", "hidden_size", "num_key_value_heads", "head_dim",
                 "max_positions", "eos_token_ids", "layer_ids"},
     "drafter": {... the drafter's config.json (HF layout) with the exported block_size ...},
     "plugin":  {"op_type", "domain", "plugin_version", "plugin_namespace"},
     "graphs":  {KEY: {"file", "role", "selector": "decomposed" | "plugin" | null, "mode",
                       "inputs": [{"name", "dtype", "shape"}], "outputs": [...]}},
     "tokenizer": {"files": [...], "chat_template": bool},
     "files":   {relative path: sha256 for every other file in the folder}}

Graph keys: ``target``, ``drafter_context``, ``drafter_block``, ``drafter_head_independent`` (draft-row logits,
no selector: DFlash v1 drafters and the selector-off ablation), and for drafters with a selector
``drafter_head_{greedy,viterbi}`` (selector decomposed into standard ONNX ops) and
``drafter_head_{greedy,viterbi}_plugin`` (the TensorRT plugin node).
Only the standard library is needed here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error

FORMAT = "dflash2-trt-export"
MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"
MODES = ("greedy", "viterbi")
INDEPENDENT = "independent"  # no selector: each row's argmax / sample on its own (DFlash v1, selector-off)
REQUIRED_GRAPHS = ("target", "drafter_context", "drafter_block", "drafter_head_independent")


def head_key(mode: str, plugin: bool = False) -> str:
    return f"drafter_head_{mode}" + ("_plugin" if plugin else "")


def check_draft_mode(manifest: dict[str, Any], mode: str) -> None:
    """A draft mode the export can run: 'independent' always; 'greedy' / 'viterbi' need the selector heads."""
    if mode not in (*MODES, INDEPENDENT):
        raise DFlash2Error(f"draft mode must be one of {', '.join((*MODES, INDEPENDENT))}, got {mode!r}")
    if head_key(mode) not in manifest.get("graphs", {}):
        raise DFlash2Error(f"this export has no {mode!r} draft head: the drafter has no candidate selector "
                           f"(DFlash v1); use --no-selector")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def load_manifest(model_dir: str | Path, verify_checksums: bool = True) -> dict[str, Any]:
    """Read and validate DIR/manifest.json; with ``verify_checksums`` every listed file is hashed.

    Raises :class:`DFlash2Error` for a missing folder or file, invalid JSON, another format or manifest
    version, a missing graph, or a checksum mismatch (naming the file).
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise DFlash2Error(f"model folder not found: {d}")
    mf = d / MANIFEST_FILE
    if not mf.is_file():
        raise DFlash2Error(f"{d} has no {MANIFEST_FILE}: not a dflash2-export folder (run dflash2-export)")
    try:
        m = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlash2Error(f"{mf} is not valid JSON (corrupt manifest): {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DFlash2Error(f"{mf} is not a {FORMAT} manifest")
    if m.get("manifest_version") != MANIFEST_VERSION:
        raise DFlash2Error(f"{mf} has manifest_version {m.get('manifest_version')!r} (written by dflash2-trt "
                           f"{m.get('project_version', '?')}); this runtime reads version {MANIFEST_VERSION}: "
                           f"re-export with this version's dflash2-export")
    for key in ("graphs", "files", "target", "drafter", "block_size", "max_seq_len", "dtype"):
        if key not in m:
            raise DFlash2Error(f"{mf} lacks the {key!r} entry (corrupt manifest)")
    for g in REQUIRED_GRAPHS:
        if g not in m["graphs"]:
            raise DFlash2Error(f"{mf} lists no {g!r} graph")
    files = m["files"]
    for rel in files:
        if not (d / rel).is_file():
            raise DFlash2Error(f"{d / rel} is missing (listed in the manifest)")
    for g in m["graphs"].values():
        if g["file"] not in files:
            raise DFlash2Error(f"graph file {g['file']} has no checksum in the manifest")
    if verify_checksums:
        for rel, digest in files.items():
            if sha256_file(d / rel) != digest:
                raise DFlash2Error(f"checksum mismatch for {d / rel}: the file was changed or corrupted "
                                   f"after export (re-export the model)")
    t, dr = m["target"], m["drafter"]
    if dr.get("vocab_size") != t.get("vocab_size") or dr.get("hidden_size") != t.get("hidden_size"):
        raise DFlash2Error(f"{mf}: drafter (vocab {dr.get('vocab_size')}, hidden {dr.get('hidden_size')}) does not "
                           f"fit the target (vocab {t.get('vocab_size')}, hidden {t.get('hidden_size')})")
    return m


def write_manifest(model_dir: Path, manifest: dict[str, Any]) -> None:
    """Fill ``files`` with the sha256 of every file in the folder (but the manifest) and write it."""
    files = {}
    for p in sorted(model_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST_FILE:
            files[p.relative_to(model_dir).as_posix()] = sha256_file(p)
    manifest = dict(manifest, files=files)
    (model_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
