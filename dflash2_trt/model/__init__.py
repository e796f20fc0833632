"""PyTorch DFlash 2 drafter: layers, dynamic convolutions, candidate selector, checkpoints."""

from dflash2_trt.model.checkpoint import load_drafter, save_drafter
from dflash2_trt.model.drafter import DFlash2Drafter, Draft, DraftContext

__all__ = ["DFlash2Drafter", "Draft", "DraftContext", "load_drafter", "save_drafter"]
