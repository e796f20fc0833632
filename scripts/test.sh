#!/usr/bin/env bash
# Set-up (idempotent) + the whole test suite (CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q "$@"
