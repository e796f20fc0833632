"""Distillation of DFlash 2 drafters (docs/training.md): self-distilled data, block construction, trainer, ``dflash2
train``.

May import torch, ``model``, ``target``, ``config``, ``vocabulary``; never the runtime backends, export or bench.
"""
