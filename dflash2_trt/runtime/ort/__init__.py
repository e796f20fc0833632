"""The ONNX Runtime backend: sessions over an export's graphs (``backend``) and the fused target flavour with
in-place KV (``fused_target``), whose attention op can be swapped for the dflash2.DecodeAttention custom op
(``decode_attention``).

May import onnxruntime and onnx (lazily), numpy, the manifest, ``vocabulary`` and ``runtime.protocol`` / ``runtime.kv``;
never torch, export, train, model or bench.
"""
