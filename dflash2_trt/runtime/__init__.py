"""Runtimes: the SPEC §4 decoder loop over backends (ONNX Runtime here; TensorRT next).

Importable without torch or transformers: the ONNX Runtime path needs numpy, onnxruntime, tokenizers and
jinja2 only. Heavy modules are imported lazily by the functions that need them.
"""
