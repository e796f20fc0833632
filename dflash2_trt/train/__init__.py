"""Distillation of DFlash 2 drafters (docs/training.md): prompt sources (``prompts``), self-distilled data
(``make_data``: ``dflash2 make-data``; ``data``: reading it), the teacher-forced blocks (``teacher_force``), the
trainer (``trainer``), torchrun helpers (``dist``) and the subcommands' flags (``cli``).

May import torch, ``model``, ``target``, ``config``, ``vocabulary``; never the runtime backends, export or bench.
"""
