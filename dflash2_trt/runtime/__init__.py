"""Runtimes: the docs/design.md decoder loop (``decoder``, with the acceptance ``guard``) over backends behind one
protocol (``protocol``: ``Backend``, runners, ``Draft``; the shared KV capacity buffer in ``kv``); one subpackage per
backend — ``ort`` (ONNX Runtime), ``trt`` (TensorRT with CUDA-graph-captured steps), ``torch`` (the PyTorch
reference); ``backends`` (``open_backend``) chooses. Also the continuous-batch loop (``batch``), prompt lookup
(``ngram``), the linear layers' host state and its rollback (``linear_state``), the prefix cache of finished
sequences (``prefix_cache``) and the tokenizer (``tokenizer``). A request's options are one record (``request``),
read by both loops, which share one accept step (``accept``) deciding on the target law after the request's
sampling transforms (``sampling``) and grammar (``grammar``).

Importable without torch or transformers: every module but ``runtime.torch`` imports only numpy, the manifest,
``vocabulary`` and its own modules (onnxruntime / tensorrt / cuda-python lazily). Never imports export, train,
model or bench.
"""
