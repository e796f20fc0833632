"""What verifying a block costs on this machine, and the block size that pays best (numpy; no torch).

:func:`measure` times a target runner's forward over ``rows`` new tokens on top of ``cached`` positions
(then crops them away, as a rejected verification does), minimum of ``repeats`` (:func:`measure_many` times
several runners interleaved). :func:`recommend_block_size`
picks the block size bs maximising expected committed tokens per unit of time for a drafter whose rows
are accepted with conditional probability ``alpha`` each (expected tokens per cycle
``sum_{i<bs} alpha^i``; cost = verify(bs rows) + ``draft_cost`` x a 1-row step), interpolating the timed row
counts linearly. With a measured drafter pass ``alpha`` should come from its benchmarked per-position
acceptance; the default (0.6) is an assumption, stated wherever the recommendation is printed.
:func:`record` times an export's fused target on this machine through the runtime's own runner and writes the
result into its manifest (``dflash2 export --verify-cost``: writing graphs is export, timing them here is not).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

ROWS = (1, 4, 8, 16)
CACHED = (256, 1024)
DEFAULT_ALPHA = 0.6
DEFAULT_DRAFT_COST = 1.0  # a drafter pass, in 1-row verify steps (measured ~1x for a 1-layer drafter + head)


def measure(target: Any, rows: tuple[int, ...] = ROWS, cached: tuple[int, ...] = CACHED, repeats: int = 7,
            seed: int = 0) -> list[dict]:
    """-> [{"cached", "rows", "ms", "ratio"}] (ratio = ms / ms of 1 row at the same cached length)."""
    return measure_many({"": target}, rows, cached, repeats, seed)[""]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure_many(targets: dict[str, Any], rows: tuple[int, ...] = ROWS, cached: tuple[int, ...] = CACHED,
                 repeats: int = 7, seed: int = 0, clock: str = "wall") -> dict[str, list[dict]]:
    """Several runners timed interleaved (each cell alternates between them, the order reversed every other
    round), so load changes on a shared machine hit all alike; a cell's time is the *minimum* over ``repeats`` (the least-disturbed run; the
    median moves with other processes' bursts). ``clock``: 'wall' (latency) or 'cpu' (CPU time of all the
    process's threads: the work, blind to time spent descheduled by other processes on a loaded machine; with
    ORT's non-spinning pool it is the sum of the threads' busy time)."""
    now = CLOCKS[clock]
    rng = np.random.default_rng(seed)
    out: dict[str, list[dict]] = {k: [] for k in targets}
    vocab = min(t.vocab_size for t in targets.values())
    for n in cached:
        ids = rng.integers(0, vocab, n).tolist()
        for t in targets.values():
            t.reset()
            for s in range(0, n, 256):  # prefill in chunks, as a long prompt would be
                t.forward(ids[s:s + 256])
        base: dict[str, float] = {}
        for r in rows:
            times: dict[str, list[float]] = {k: [] for k in targets}
            for rep in range(repeats + 1):  # the first round warms up
                new = rng.integers(0, vocab, r).tolist()
                # the order alternates: on a loaded machine the first runner of a round fared differently
                for k, t in (list(targets.items()) if rep % 2 else list(targets.items())[::-1]):
                    t0 = now()
                    t.forward(new)
                    if rep:
                        times[k].append(now() - t0)
                    t.crop(n)
            for k in targets:
                ms = float(np.min(times[k])) * 1e3
                base.setdefault(k, ms)
                out[k].append({"cached": n, "rows": r, "ms": round(ms, 3), "ratio": round(ms / base[k], 3)})
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


def record(model_dir: str | Path, threads: int | None = None) -> Any:
    """Time ``model_dir``'s fused target (ONNX Runtime CPU, the runtime's runner) over :data:`ROWS` rows at the
    :data:`CACHED` lengths that fit, recommend a block size, and store it as the manifest's ``verify_cost``
    (written atomically; the folder must be an export of ours). Returns the entry, a
    :class:`~dflash2_trt.manifest.VerifyCost`."""
    import dataclasses

    from dflash2_trt.errors import DFlash2Error
    from dflash2_trt.manifest import TARGET_ORT, VerifyCost, VerifyCostRow, read_manifest, write_manifest
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.ort.fused_target import OrtFusedTargetRunner

    m = read_manifest(model_dir)
    if TARGET_ORT not in m.graphs:
        raise DFlash2Error("--verify-cost times the fused ONNX Runtime target; this export has none "
                           "(exported with --no-ort-flavour or not fp32)")
    with OrtBackend(model_dir, threads=threads) as be:
        run = OrtFusedTargetRunner.from_backend(be)
        cached = tuple(n for n in CACHED if n + max(ROWS) <= m.max_seq_len) or (max(1, m.max_seq_len // 2),)
        table = measure(run, cached=cached)
    entry = VerifyCost(table=tuple(VerifyCostRow(**r) for r in table), recommended_block_size=recommend_block_size(table),
                       assumed_acceptance=DEFAULT_ALPHA, draft_cost=DEFAULT_DRAFT_COST, threads=threads or "ort default")
    write_manifest(Path(model_dir), dataclasses.replace(m, verify_cost=entry), rehash=False)
    return entry
