"""The PyTorch DFlash 2 drafter (``drafter``): its layers and dynamic convolutions (``layers``), the candidate
selector (``selector``) and checkpoints in z-lab's format (``checkpoint``) — the one forward that training runs
and ``dflash2 export`` traces.

May import torch, ``config``, ``errors``, ``vocabulary``; never the runtime, export, train or bench.
"""

from dflash2_trt.model.checkpoint import load_drafter, save_drafter
from dflash2_trt.model.drafter import DFlash2Drafter, Draft, DraftContext

__all__ = ["DFlash2Drafter", "Draft", "DraftContext", "load_drafter", "save_drafter"]
