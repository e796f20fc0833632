"""dflash2_trt: DFlash 2 speculative decoding — PyTorch reference, ONNX/TensorRT export, runtimes.

Importing the package needs only the standard library; torch, transformers and friends are imported
lazily by the modules that use them (``dflash2_trt.model``, ``dflash2_trt.target``, ...).
"""

from dflash2_trt.errors import DFlash2Error

__version__ = "0.1.0"

__all__ = ["DFlash2Error", "__version__"]
