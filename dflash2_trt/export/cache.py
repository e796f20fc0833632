"""Exports cached outside the repo (``paths.cache_dir()/exports/<key>``) for ``dflash2 bench --target
--drafter`` and the real-model tests.

The key hashes the exporter's own source (export/, model/ and targets/ modules), the export options, the target
folder's files (name, size, mtime) and the drafter's files (content), so a changed exporter, model or
option re-exports; an interrupted export leaves nothing (exports are atomic).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dflash2_trt.manifest import MANIFEST_FILE


# modules under export/ that read exports but do not shape them: editing them must not invalidate the cache
_NOT_EXPORT_SOURCES: set[str] = set()


def _source_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for sub in ("export", "model", "targets"):
        for p in sorted((root / sub).glob("*.py")):
            if p.name in _NOT_EXPORT_SOURCES:
                continue
            h.update(p.name.encode())
            h.update(p.read_bytes())
    for name in ("config.py",):
        h.update((root / name).read_bytes())
    return h.hexdigest()


def export_key(target_dir: Path, drafter_dir: Path, **options) -> str:  # noqa: ANN003
    h = hashlib.sha256(_source_digest().encode())
    h.update(repr(sorted(options.items())).encode())
    for p in sorted(target_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    for p in sorted(drafter_dir.iterdir()):
        if p.is_file():
            h.update(p.name.encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:16]


def cached_export(target: str | Path, drafter: str | Path, progress: bool = True, **options) -> Path:  # noqa: ANN003
    """Export (once) and return the folder. ``options``: those of ``export_model``."""
    from dflash2_trt.errors import DFlash2Error
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.paths import cache_dir
    from dflash2_trt.targets.adapter import resolve_target_path

    target_dir = resolve_target_path(target)
    drafter_dir = Path(drafter)
    if not drafter_dir.is_dir():
        raise DFlash2Error(f"drafter folder not found: {drafter_dir}")
    out = cache_dir() / "exports" / f"{target_dir.name}-{export_key(target_dir, drafter_dir, **options)}"
    if not (out / MANIFEST_FILE).is_file():
        export_model(target_dir, drafter_dir, out, progress=progress, **options)
    return out
