"""Where the project keeps files outside the repository (standard library only: the CLI, the runtime and the
Triton tools import it without torch)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models, cached exports and the Triton backend folder live: $DFLASH2_CACHE or
    ~/.cache/dflash2_trt."""
    return Path(os.environ.get("DFLASH2_CACHE", Path.home() / ".cache" / "dflash2_trt"))
