"""The TensorRT backend: engines and CUDA-graph-captured steps (``backend``, ``cuda_graphs``), device memory
(``device_buffers``), the CUDA runtime seam (``cuda_api``, cuda-python behind a protocol so tests can fake it)
and the TensorRT environment (``env``: import, plugin loading, engine identity). See README.md.

May import tensorrt and cuda-python (lazily), numpy, the manifest, ``vocabulary`` and ``runtime.protocol`` /
``runtime.kv``; never torch, export, train, model or bench. ``env`` is the one module export may import (the
engine builder shares its TensorRT import and plugin loading).
"""
