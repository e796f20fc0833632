"""Runtimes: the SPEC §4 decoder loop (``decoder``) over backends behind one protocol (``base.Backend``):
ONNX Runtime (``ort_backend``), TensorRT with CUDA-graph-captured steps (``trt_backend``, ``cuda_graphs``,
``device_buffers``, ``cuda_api``, ``trt_env``) and the PyTorch reference (``torch_backend``);
``backends.open_backend`` chooses. Also the tokenizer (``tokenizer``).

Importable without torch or transformers: every module but ``torch_backend`` imports only numpy, the
manifest, ``vocabulary`` and its own modules (onnxruntime / tensorrt / cuda-python lazily). Never imports
export, train, model or bench.
"""
