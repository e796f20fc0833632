"""The ONNX Runtime backend: sessions over an export's graphs (``backend``) and the fused target flavour with
in-place KV (``fused_target``), whose attention op can be swapped for the dflash2.DecodeAttention custom op
(``decode_attention``); the batched runners over many sequences (``batched_target``: the fused target;
``batched_standard``: the standard target graph with per-slot linear-layer states; ``batched_drafter``); ORT run
failures as one error (``failures``).

May import onnxruntime and onnx (lazily), numpy, the manifest, ``vocabulary`` and ``runtime.protocol`` / ``runtime.kv`` / ``runtime.linear_state``;
never torch, export, train, model or bench.
"""
