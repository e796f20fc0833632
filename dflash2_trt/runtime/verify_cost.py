"""What verifying a block costs on this machine, and the block size that pays best (numpy; no torch).

:func:`measure` times a target runner's forward over ``rows`` new tokens on top of ``cached`` positions
(then crops them away, as a rejected verification does), median of ``repeats``. :func:`recommend_block_size`
picks the block size bs maximising expected committed tokens per unit of time for a drafter whose rows
are accepted with conditional probability ``alpha`` each (expected tokens per cycle
``sum_{i<bs} alpha^i``; cost = verify(bs rows) + ``draft_cost`` x a 1-row step), interpolating the timed row
counts linearly. With a measured drafter pass ``alpha`` should come from its benchmarked per-position
acceptance; the default (0.6) is an assumption, stated wherever the recommendation is printed.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

ROWS = (1, 4, 8, 16)
CACHED = (256, 1024)
DEFAULT_ALPHA = 0.6
DEFAULT_DRAFT_COST = 1.0  # a drafter pass, in 1-row verify steps (measured ~1x for a 1-layer drafter + head)


def measure(target: Any, rows: tuple[int, ...] = ROWS, cached: tuple[int, ...] = CACHED, repeats: int = 5,
            seed: int = 0) -> list[dict]:
    """-> [{"cached", "rows", "ms", "ratio"}] (ratio = ms / ms of 1 row at the same cached length)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in cached:
        target.reset()
        ids = rng.integers(0, target.vocab_size, n).tolist()
        for s in range(0, n, 256):  # prefill in chunks, as a long prompt would be
            target.forward(ids[s:s + 256])
        base = None
        for r in rows:
            times = []
            for _ in range(repeats + 1):  # +1 warm-up
                t0 = time.perf_counter()
                target.forward(rng.integers(0, target.vocab_size, r).tolist())
                times.append(time.perf_counter() - t0)
                target.crop(n)
            ms = float(np.median(times[1:])) * 1e3
            base = ms if base is None else base
            out.append({"cached": n, "rows": r, "ms": round(ms, 3), "ratio": round(ms / base, 3)})
    return out


def recommend_block_size(table: list[dict], alpha: float = DEFAULT_ALPHA, draft_cost: float = DEFAULT_DRAFT_COST,
                         sizes: range = range(2, 17)) -> int:
    """The bs in ``sizes`` with the most expected tokens per unit time, at the longest cached length timed."""
    n = max(r["cached"] for r in table)
    pts = sorted((r["rows"], r["ms"]) for r in table if r["cached"] == n)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    one = float(np.interp(1, xs, ys))

    def rate(bs: int) -> float:
        tokens = sum(alpha ** i for i in range(bs))
        return tokens / (float(np.interp(bs, xs, ys)) + draft_cost * one)

    return max(sizes, key=rate)


def markdown(tables: dict[str, list[dict]]) -> str:
    """{label: table} -> one markdown table: ms and ratio per (label, cached) row, one column per row count."""
    rows = sorted({r["rows"] for t in tables.values() for r in t})
    lines = ["| graph | cached | " + " | ".join(f"{r} rows" for r in rows) + " |",
             "|---|---|" + "---|" * len(rows)]
    for label, t in tables.items():
        for n in sorted({r["cached"] for r in t}):
            cells = {r["rows"]: r for r in t if r["cached"] == n}
            lines.append(f"| {label} | {n} | " + " | ".join(
                f"{cells[r]['ms']:.1f} ms ({cells[r]['ratio']:.2f}x)" if r in cells else "" for r in rows) + " |")
    return "\n".join(lines)
