"""Verify-cost table: one target forward over 1/4/8/16 new rows on top of 256 / 1024 cached positions, for
our ONNX Runtime graphs of SmolLM2-135M-Instruct — the standard (unfused) fp32 graph and the fused graphs
at fp32 / int8 / int4 — measured in one process, interleaved cell by cell (minimum over repeats), plus the block size each export recommends (the
``verify_cost`` entry `dflash2 export --verify-cost` stores in its manifest, timed alone, and the one from this interleaved run).

    python benchmarks/verify_cost_table.py [--block-size 4] [--threads 2] [--json OUT]

The exports are those of ``benchmarks/ort_side_by_side.py`` (same cache keys). Shared 2-core machine:
figures are noisy; compare the ratios within a row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash2_trt.bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.export.cache import cached_export
    from dflash2_trt.export.quantize import QuantSpec
    from dflash2_trt.bench import verify_cost as VC
    from dflash2_trt.runtime.ort.backend import OrtBackend

    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    drafter = ROOT / "dflash2_trt" / "drafters" / "smollm2-135m-instruct-dflash2"
    runners, recorded, recommended = {}, {}, {}
    for kind in ("none", "int8", "int4"):
        folder = cached_export("smollm2", drafter, progress=True, block_size=a.block_size, max_seq_len=2048,
                               quantization=QuantSpec(kind))
        label = "fp32" if kind == "none" else kind
        if kind == "none":
            std = OrtBackend(folder, threads=a.threads, flavour="standard")
            runners["fp32 standard ONNX"] = std.target_runner()
        be = OrtBackend(folder, threads=a.threads)
        runners[f"{label} fused"] = be.target_runner()
        recorded[f"{label} fused"] = VC.record(folder, threads=a.threads).recommended_block_size
    tables = VC.measure_many(runners, repeats=a.repeats)
    for k, t in tables.items():
        recommended[k] = VC.recommend_block_size(t)
    print(VC.markdown(tables))
    print(f"\nrecommended block size (assumed conditional acceptance {VC.DEFAULT_ALPHA}, drafter pass = "
          f"{VC.DEFAULT_DRAFT_COST} x a 1-row step): " + ", ".join(f"{k}: {v} (export recorded {recorded.get(k)})"
                                                                  for k, v in recommended.items()))
    if a.json:
        Path(a.json).write_text(json.dumps({
            "machine": describe(),
            "tables": tables, "recommended": recommended, "recorded": recorded}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
