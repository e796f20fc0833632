"""Export: ONNX graphs, TensorRT engines and Triton repositories for DFlash 2 drafters.

``selector_contract`` holds the ONNX side of the DFlash2PathSelector TensorRT plugin contract
(op schema + node helper); importing this package needs only the standard library.
"""
