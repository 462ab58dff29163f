#!/usr/bin/env bash
# The test command: set up .venv (with the dev extras) and run the test suite.
#
#   bash scripts/test.sh              # the default suite, slow tests (marked `slow`) left out:
#                                     #   7–9 min on a 2-core machine (README, "Tests")
#   bash scripts/test.sh --all        # every test, slow ones included (CI: .ci/run runs the
#                                     #   default suite, then -m slow)
#   bash scripts/test.sh -m quick     # the core in ≈ 20 s (helpers.QUICK_CORE)
#   bash scripts/test.sh -m slow      # the slow tests alone
#   bash scripts/test.sh -k equivalence --durations=0   # other arguments go to pytest
#
# It prints the machine's load average before and after and the wall time, so that a time
# quoted from it says how busy the machine was (the suite starts many real processes; on a
# shared machine their start-up dominates).
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
for arg in "$@"; do
  if [ "$arg" = "--all" ]; then
    args+=(-m "")  # no marker filter: overrides pyproject's `-m 'not slow'`
  else
    args+=("$arg")
  fi
done
bash scripts/setup.sh dev
load() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || uptime; }
echo "tests: load average $(load) on $(nproc 2>/dev/null || echo '?') cores; started $(date -u +%FT%TZ)"
start=$(date +%s)
status=0
.venv/bin/python -m pytest "${args[@]}" || status=$?
echo "tests: exit $status after $(( $(date +%s) - start )) s; load average now $(load)"
exit $status
