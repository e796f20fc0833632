"""The ONNX Runtime backend: sessions over an export's graphs (``backend``) and the fused target flavour with
in-place KV (``fused_target``).

May import onnxruntime (lazily), numpy, the manifest, ``vocabulary`` and ``runtime.protocol`` / ``runtime.kv``;
never torch, export, train, model or bench.
"""
