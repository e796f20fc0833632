#!/usr/bin/env python3
"""A long run of the server's property test: ``tests/test_serve_inputs.py::test_no_5xx_for_generated_requests``
with ``--examples`` generated requests (default 50,000) drawn afresh (not the suite's derandomized set), through
pytest so that a failure prints Hypothesis' shrunk request. Exit code: pytest's (0: no 5xx, no hang).

    python scripts/fuzz_serve.py --examples 50000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=50_000, help="generated requests (default 50000)")
    a = p.parse_args(argv)
    if a.examples < 1:
        p.error("--examples must be >= 1")
    env = dict(os.environ, DFLASH2_FUZZ_EXAMPLES=str(a.examples), DFLASH2_FUZZ_RANDOM="1")
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            "tests/test_serve_inputs.py::test_no_5xx_for_generated_requests"], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
