"""What ``./scripts/demo.sh`` prints, several times: ``dflash2 demo --json`` run ``--runs`` times in fresh processes
(each run decodes the demo's chat prompt speculatively and autoregressively, interleaved, and keeps each way's
fastest repeat), then as many runs with the kernels forced onto the AVX2 path (``DFLASH2_ORT_PANELS_AVX512=0``, a
proxy for an AVX2-only CPU), the two kinds alternating. ``--json`` writes every run with
``dflash2_trt.bench.machine.describe()``; the table gives each kind's τ, tok/s both ways and speedup.

    python benchmarks/demo_runs.py [--runs 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

KINDS = {"default": {}, "avx2_path": {"DFLASH2_ORT_PANELS_AVX512": "0"}}


def _demo(env: dict[str, str]) -> dict:
    """One ``dflash2 demo --json`` in a fresh process -> its JSON object."""
    out = subprocess.run([sys.executable, "-m", "dflash2_trt.cli", "demo", "--json"], env={**os.environ, **env},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from dflash2_trt.bench.machine import describe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None, help="write the runs and the machine to this file")
    a = p.parse_args(argv)
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    for _ in range(a.runs):
        for kind, env in KINDS.items():
            runs[kind].append(_demo(env))
    for kind, rs in runs.items():
        cells = ", ".join(f"τ {r['tau']:.2f} {r['spec_tokens_per_s']:.1f} / {r['ar_tokens_per_s']:.1f} tok/s "
                          f"{r['speedup']:.2f}x lossless={r['lossless']}" for r in rs)
        print(f"{kind:10s} {cells}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": describe(), "command": f"python benchmarks/demo_runs.py --runs {a.runs} "
                       f"--json {a.json}", "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
