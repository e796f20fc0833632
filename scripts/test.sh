#!/usr/bin/env bash
# Set-up of the demo and the test toolchain (idempotent, one line per step: scripts/setup.sh test) + the whole
# test suite (CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh test
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q "$@"
