#!/usr/bin/env bash
# The test command: set up .venv (with the dev extras) and run the default test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` or `-k equivalence`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest "$@"
