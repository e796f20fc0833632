"""The PyTorch backend (``backend``): the reference every other backend is tested against, over a HF target
and a drafter folder. The one runtime subpackage that may import torch (and model, target); nothing else in
``runtime`` imports it.
"""
