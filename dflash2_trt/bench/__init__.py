"""Evaluation (not runtime): prompt sets (``prompts``), the side-by-side speculative-vs-autoregressive
benchmark with its table and plot (``harness``), and the oracle top-K count (``oracle``).

May import the runtime (``dflash2_trt.runtime``) and ``reference``; nothing in the runtime, the model or the
export imports this package. No torch.
"""
