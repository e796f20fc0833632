"""Export: ONNX graphs (``onnx_graphs``: the target with explicit KV capacity buffers, wrappers of the
drafter's own forward, the decomposed selector), ``exporter`` (``dflash2 export``), ``verify`` (ONNX Runtime vs
PyTorch at export time), the fused ONNX Runtime target graph (``ort_graph``), the plugin contract (``selector_contract``), TensorRT engines (``engines``:
``dflash2 build-engines``), weight quantization (``quantize``), tracing, shared weights and graph checks
(``onnx_utils``), cached exports (``cache``) and the subcommands' flags (``cli``; ``--triton-repo`` hands the
folder to :mod:`dflash2_trt.serving.triton`). The target graphs are the families' (:mod:`dflash2_trt.targets`).

May import ``model``, ``target``, ``manifest``, ``vocabulary`` and the TensorRT environment helpers
(``runtime.trt.env``, ``runtime.trt.cuda_api``); never a runtime backend or bench. Importing this package needs only
the standard library.
"""
