"""dflash2_trt: DFlash 2 speculative decoding — PyTorch reference, ONNX/TensorRT export, runtimes.

The front door is :func:`load` (:mod:`dflash2_trt.api`): ``dflash2_trt.load(model_dir) -> Generator``.
Importing the package needs only the standard library; the runtime, torch, transformers and friends are
imported lazily by the modules that use them (``dflash2_trt.runtime``, ``dflash2_trt.model``, ...).
"""

from dflash2_trt.api import Chunk, Generator, Result, Stats, Stream, load
from dflash2_trt.errors import DFlash2Error

__version__ = "0.1.0"

__all__ = ["Chunk", "DFlash2Error", "Generator", "Result", "Stats", "Stream", "__version__", "load"]
