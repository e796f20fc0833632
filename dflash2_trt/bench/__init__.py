"""Evaluation (not runtime): prompt sets (``prompts``), the side-by-side speculative-vs-autoregressive
benchmark with its table and plot (``harness``), the oracle top-K count (``oracle``), ``dflash2 demo`` (``demo``),
the target's verify cost by row count (``verify_cost``), Polygraphy input sets of an export's graphs
(``polygraphy_inputs``) and the subcommands' flags (``cli``).

May import the runtime (``dflash2_trt.runtime``) and ``reference``; nothing in the runtime, the model or the
export imports this package. No torch.
"""
