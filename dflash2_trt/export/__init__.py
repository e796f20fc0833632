"""Export: ONNX graphs (and later TensorRT engines and Triton repositories) for DFlash 2 drafters.

``selector_contract``: the ONNX side of the DFlash2PathSelector TensorRT plugin contract (op schema + node
helper). ``graphs``: export-only PyTorch modules (target with explicit KV capacity buffers, drafter context /
block / head, decomposed selector). ``exporter`` / ``cli``: ``dflash2-export``. ``verify``: ONNX Runtime vs
PyTorch checks. ``cache``: exports cached outside the repo. Importing this package needs only the stdlib.
"""
