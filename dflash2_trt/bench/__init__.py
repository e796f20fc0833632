"""Evaluation (not runtime): prompt sets (``prompts``), the side-by-side speculative-vs-autoregressive
benchmark with its table and plot (``harness``), the oracle top-K count (``oracle``), ``dflash2 demo`` (``demo``),
the target's verify cost by row count (``verify_cost``), Polygraphy input sets of an export's graphs
(``polygraphy_inputs``), the subcommands' flags (``cli``) and the SmolLM2 exports that tests and benchmarks share
(``exports``: the demo's and the identity-initialised drafter's), what every result file records of the machine
(``machine``), the delta rule's unstable Neumann-series solve, a benchmark baseline and the tests' planted bug
(``unstable_delta_rule``), and the C library driven through ctypes (``capi``: its types and signatures, a driver
process).

May import the runtime (``dflash2_trt.runtime``) and ``acceptance``, and inside functions the export cache and the
model (``cli``, ``exports``); nothing in the runtime, the model or the export imports this package. No torch at
import time (``exports`` makes its drafter and exports with torch on first use).
"""
